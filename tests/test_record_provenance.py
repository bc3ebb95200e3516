"""Every benchmark record and every addition record names the commit of the falcon_fwa code that wrote it as the
other commands do (``falcon_fwa.provenance.command_provenance``): the full commit of the package's checkout, with
``dirty``, whether that checkout had uncommitted changes to tracked files, in the JSON and in the markdown
(``provenance.uncommitted_note``). A ``--commit`` given for a machine without git metadata is recorded as given,
its uncommitted changes unknown (``null``) unless it names the checkout's commit."""
import json
import os
import re
import sys

import pytest
import torch
from conftest import git

from falcon_fwa import provenance

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_decode  # noqa: E402
import bench_kernels as bk  # noqa: E402
import bench_read_norm  # noqa: E402
import bench_short_prompts as bsp  # noqa: E402
import bench_wy_forward  # noqa: E402

VERSIONS = dict(gpu="GPU", torch="t", triton="tr", fla="f", cuda="c", python="p")
EDITS = [None, "README", "src/code.py"]  # clean; a tracked file changed outside src/ and in it


def _state(checkout, edit):
    """Edit ``edit`` (a tracked file) of the checkout, add an untracked file (no uncommitted change), and give its
    full commit (40 hex digits, by git itself) and the dirty flag a record must name."""
    if edit:
        (checkout / edit).write_text("changed\n")
    (checkout / "src" / "new.py").write_text("y = 1\n")
    head = git(checkout, "rev-parse", "HEAD")
    assert re.fullmatch("[0-9a-f]{40}", head)
    return head, bool(edit)


def _words(head, dirty):
    return f"commit `{head}`" + (" with uncommitted changes to tracked files" if dirty else "")


def _kernels(tmp_path, monkeypatch, *extra):
    monkeypatch.setattr(bk, "_versions", lambda: dict(VERSIONS))
    monkeypatch.setattr(bk, "autotune_picks", lambda prefix="fla": {})
    monkeypatch.setattr(bk, "measure", lambda build, shape, mode: (1.5, 2**20))
    monkeypatch.setattr(bk, "measure_paired", lambda ours, theirs, shape, rounds: dict(
        ms=1.0, fla_ms=2.0, ratio=0.5, ratio_min=0.4, ratio_max=0.6, rounds=rounds))
    bk.main(["--out", str(tmp_path), "--name", "n", "--shape", "1", "64", "2", "16", "16", "--ops", "falcon-1a",
             "fla-simple-gla", "--paired", "1", *extra])
    rows = json.loads((tmp_path / "n.json").read_text()) + json.loads((tmp_path / "n-paired.json").read_text())
    assert len(rows) == 5
    return rows, (tmp_path / "n.md").read_text()


@pytest.mark.parametrize("edit", EDITS)
def test_kernel_rows_and_table_name_the_full_commit_and_its_changes(tmp_path, checkout, monkeypatch, fake_gpu, edit):
    head, dirty = _state(checkout, edit)
    monkeypatch.chdir(tmp_path)  # the working directory plays no part
    rows, md = _kernels(tmp_path / "out", monkeypatch)
    assert all(r["commit"] == head and r["dirty"] is dirty for r in rows)
    assert f"\n{_words(head, dirty)}; torch t," in md


def test_a_given_commit_is_recorded_with_changes_unknown_unless_it_is_the_checkouts(tmp_path, checkout, monkeypatch,
                                                                                   fake_gpu):
    head, _ = _state(checkout, "src/code.py")
    rows, md = _kernels(tmp_path / "a", monkeypatch, "--commit", "abc1234")  # as on a machine without .git
    assert all(r["commit"] == "abc1234" and r["dirty"] is None for r in rows)
    assert "\ncommit `abc1234` (uncommitted changes unknown); torch t," in md
    rows, md = _kernels(tmp_path / "b", monkeypatch, "--commit", head[:7])  # the checkout's own, shortened
    assert all(r["commit"] == head[:7] and r["dirty"] is True for r in rows)
    assert f"\ncommit `{head[:7]}` with uncommitted changes to tracked files; torch t," in md


def test_outside_a_checkout_the_kernel_rows_say_the_commit_is_unknown(tmp_path, monkeypatch, fake_gpu):
    monkeypatch.setattr(provenance, "source_checkout", lambda: None)
    rows, md = _kernels(tmp_path, monkeypatch)
    assert all(r["commit"] == "unknown" and r["dirty"] is None for r in rows)  # plot_kernels reads it as before
    assert "\ncommit unknown (outside a git checkout); torch t," in md


@pytest.mark.parametrize("edit", EDITS)
def test_decode_rows_and_table_name_the_full_commit_and_its_changes(tmp_path, checkout, monkeypatch, edit):
    head, dirty = _state(checkout, edit)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(bench_decode, "_measure", lambda model, prompt, args, preset, impl: (
        dict(preset=preset, impl=impl, batch=prompt.shape[0], tokens_per_s=10.0, ms_per_step=1.0), None, None))
    assert bench_decode.main(["--presets", "tiny-transformer", "--batch", "1", "--device", "cpu", "--dtype", "float32",
                              "--out", str(tmp_path), "--name", "d"]) == 0
    rows = json.loads((tmp_path / "d.json").read_text())
    assert len(rows) == 1 and rows[0]["commit"] == head and rows[0]["dirty"] is dirty
    assert f"\n{_words(head, dirty)}; torch " in (tmp_path / "d.md").read_text()


@pytest.mark.parametrize("edit", EDITS)
def test_short_prompt_rows_and_table_name_the_full_commit_and_its_changes(tmp_path, checkout, monkeypatch, fake_gpu,
                                                                          edit):
    import triton.testing

    import falcon_fwa
    import falcon_fwa.cli_options
    head, dirty = _state(checkout, edit)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(falcon_fwa.cli_options, "resolve_device", lambda d: torch.device("cpu"))
    monkeypatch.setattr(bsp, "_inputs", lambda rule, B, T, H, K, V, device: dict(
        q=torch.ones(B, T, H, K), k=None, v=None, beta=None, lam=None, log_gate=None))
    monkeypatch.setattr(falcon_fwa, "falcon_attention", lambda q, *a, **kw: (q, None))
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: 0.5)
    assert bsp.main(["--rules", "1A", "--batch", "1", "--lengths", "2", "--heads", "1", "--head-dim", "2",
                     "--out", str(tmp_path), "--name", "sp"]) == 0
    rows = json.loads((tmp_path / "sp.json").read_text())
    assert len(rows) == 1 and rows[0]["commit"] == head and rows[0]["dirty"] is dirty
    assert f"\n{_words(head, dirty)}; torch " in (tmp_path / "sp.md").read_text()


@pytest.mark.parametrize("edit", EDITS)
def test_read_norm_record_names_the_full_commit_and_its_changes(tmp_path, checkout, monkeypatch, fake_gpu, edit):
    head, dirty = _state(checkout, edit)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(bench_read_norm, "_versions", lambda: dict(VERSIONS))
    monkeypatch.setattr(bench_read_norm, "_build", lambda rule, eps, shape: (None, []))
    monkeypatch.setattr(bench_read_norm, "_time", lambda fn, leaves, mode: (1.0, 2**20))
    bench_read_norm.main(["--out", str(tmp_path), "--name", "rn", "--rounds", "1"])
    record = json.loads((tmp_path / "rn.json").read_text())
    assert record["commit"] == head and record["dirty"] is dirty and len(record["rows"]) == 6
    assert f"\n{_words(head, dirty)}; torch t," in (tmp_path / "rn.md").read_text()


@pytest.mark.parametrize("edit", EDITS)
def test_wy_forward_record_names_the_full_commit_and_its_changes(tmp_path, checkout, monkeypatch, fake_gpu, edit):
    head, dirty = _state(checkout, edit)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(bench_wy_forward, "_versions", lambda: dict(VERSIONS))
    monkeypatch.setattr(bench_wy_forward, "time_forward", lambda delta, slots, key, entry, ref=None: (1.0, 0.0, None))
    monkeypatch.setattr(bench_wy_forward, "measure_graph", lambda op, shape, mode: 1.0)
    layout = next(iter(bench_wy_forward.LAYOUTS))
    bench_wy_forward.main(["--out", str(tmp_path), "--rounds", "1", "--layouts", layout, "--inverse", "64,4,2",
                           "--apply", "64,64,4,2"])
    record = json.loads((tmp_path / "wy_forward.json").read_text())
    assert record["commit"] == head and record["dirty"] is dirty
    assert (tmp_path / "wy_forward.md").read_text().startswith(f"# WY forward: one launch against two (GPU, "
                                                               f"{_words(head, dirty)})\n")


# one step of a tiny Transformer: the options that addition and addition-compare both take
ADDITION = ["--steps", "1", "--eval-every", "1", "--preset", "tiny", "--device", "cpu", "--batch-size", "2",
            "--val-per-width", "1", "--ood-per-width", "1", "--train-widths", "1", "2", "--ood-widths", "3", "3",
            "--threads", "1", "--hidden-size", "16", "--num-hidden-layers", "1", "--num-heads", "2"]


@pytest.mark.parametrize("edit", [None, "src/code.py"])
def test_an_addition_run_and_its_summary_name_the_full_commit_and_its_changes(tmp_path, checkout, monkeypatch, edit):
    from falcon_fwa.tasks.addition import cli, compare
    head, dirty = _state(checkout, edit)
    monkeypatch.chdir(tmp_path)
    runs, results = tmp_path / "runs", tmp_path / "res"
    assert cli.main(["--model", "Transformer", "--seed", "0", "--no-progress", "--out",
                     str(runs / "Transformer" / "seed0"), *ADDITION]) == 0
    run = json.loads((runs / "Transformer" / "seed0" / "results.json").read_text())
    assert run["commit"] == head and run["dirty"] is dirty
    assert compare.main(["--no-train", "--models", "Transformer", "--seeds", "0", "--runs", str(runs), "--results",
                         str(results), "--name", "t", *ADDITION]) == 0
    meta = json.loads((results / "t_meta.json").read_text())
    assert meta["commit"] == head and meta["dirty"] is dirty
    note = " with uncommitted changes to tracked files" if dirty else ""
    assert f"\n- commit: {head}{note}\n" in (results / "t.md").read_text()


def test_an_addition_summary_notes_changes_only_where_its_meta_records_them():
    from falcon_fwa.tasks.addition import compare
    from test_addition_cli import _fake_result
    rows = compare.summarize({"Transformer": [_fake_result(0, 40.0, 41.0, 39.0, 50.0, 1)]})
    meta = {"preset_name": "paper", "train_widths": [1, 32], "ood_widths": [33, 48], "size": {}, "steps": 2000,
            "batch_size": 128, "lr": 1e-3, "curriculum_steps": 0, "val_per_width": 64, "ood_per_width": 100,
            "seeds": [0], "device": "cpu", "wall_time_s": 1.0, "command": "c", "commit": "c" * 40}
    assert "\n- commit: " + "c" * 40 + "\n" in compare.markdown(rows, meta)  # a summary written before dirty was
    assert "\n- commit: " + "c" * 40 + "\n" in compare.markdown(rows, {**meta, "dirty": False})
    assert "\n- commit: " + "c" * 40 + " with uncommitted changes to tracked files\n" in compare.markdown(
        rows, {**meta, "dirty": True})
    assert "\n- commit: " + "c" * 40 + " (uncommitted changes unknown)\n" in compare.markdown(
        rows, {**meta, "dirty": None})
