"""The scaling sweep records the full commit of the checkout it runs from and whether that checkout had uncommitted
changes to tracked files (``dirty``, from ``falcon_fwa.provenance.command_provenance``): in every row of
``RESULTS.json`` and in the header of ``RESULTS.md`` (with ``provenance.uncommitted_note``); a ``--commit`` that is
not the checkout's own leaves ``dirty`` unknown, and results recorded before ``dirty`` still read, with nothing
said about changes."""
import argparse
import json
import os

import pytest
from conftest import git
from test_train import recipe

from falcon_fwa import provenance
from falcon_fwa.train import scaling
from falcon_fwa.train.config import load_config

EDITED = " with uncommitted changes to tracked files"


def _sweep(tmp_path, monkeypatch, *extra, name="multigpu"):
    """``scaling.run`` of one model, one process, one seed, its launch replaced by a run that writes the summary a
    real one would (at the checkout's commit, with its uncommitted changes), into ``runs-NAME`` and ``NAME``; the
    rows of ``RESULTS.json``, the text of ``RESULTS.md`` and the runs launched."""
    launched = []

    def fake_run_group(cmd, env, log, timeout, grace=30.0, signals=None):
        cfg = load_config(cmd[cmd.index("--config") + 1], [cmd[i + 1] for i, c in enumerate(cmd) if c == "--set"])
        launched.append(os.path.basename(cfg.train.out_dir))
        os.makedirs(cfg.train.out_dir, exist_ok=True)
        summary = dict(tokens=cfg.train.steps * cfg.train.global_batch * cfg.data.seq_len, steps=cfg.train.steps,
                       tokens_per_s=100.0, val_loss=1.0, peak_mem_bytes=None,
                       commit=provenance.git_commit(short=False, cwd=provenance.source_checkout()),
                       diff_sha256=provenance.uncommitted_changes(), config=cfg.to_dict())
        with open(os.path.join(cfg.train.out_dir, "summary.json"), "w") as f:
            json.dump(summary, f)
        return 0

    monkeypatch.setattr(scaling, "_run_group", fake_run_group)
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(recipe(tmp_path)))
    results = tmp_path / name
    parser = argparse.ArgumentParser()
    scaling.add_arguments(parser)
    argv = ["--configs", str(path), "--names", "Tiny", "--gpus", "1", "--strategies", "ddp", "--noise-seeds", "0",
            "--steps", "2", "--warmup-steps", "0", "--out", str(tmp_path / f"runs-{name}"), "--results", str(results),
            "--machine", "M", *extra]
    assert scaling.run(parser.parse_args(argv)) == 0
    return json.loads((tmp_path / f"{name}.json").read_text()), (tmp_path / f"{name}.md").read_text(), launched


@pytest.mark.parametrize("edited", [False, True])
def test_a_sweep_records_the_full_commit_and_whether_its_checkout_was_edited(tmp_path, monkeypatch, checkout,
                                                                            cpu_machine, edited):
    if edited:
        (checkout / "code.py").write_text("x = 2\n")
    (checkout / "untracked.py").write_text("y = 1\n")  # an untracked file is no change to tracked files
    head = git(checkout, "rev-parse", "HEAD")
    rows, text, launched = _sweep(tmp_path, monkeypatch)
    assert launched == ["Tiny-ddp-n1-s0"]
    assert [(r["commit"], r["dirty"]) for r in rows] == [(head, edited)]
    assert text.splitlines()[2].startswith(f"Machine: M; commit `{head}`{EDITED if edited else ''}; 2 steps of ")


def test_a_given_commit_is_recorded_with_the_checkouts_changes_only_where_it_names_the_checkouts_commit(
        tmp_path, monkeypatch, checkout, cpu_machine):
    (checkout / "code.py").write_text("x = 2\n")
    head = git(checkout, "rev-parse", "HEAD")
    rows, text, _ = _sweep(tmp_path, monkeypatch, "--commit", head[:9])
    assert [(r["commit"], r["dirty"]) for r in rows] == [(head[:9], True)]
    assert f"; commit `{head[:9]}`{EDITED}; 2 steps" in text
    other = "f" * 40 if not head.startswith("f") else "e" * 40
    rows, text, _ = _sweep(tmp_path, monkeypatch, "--commit", other, name="other")  # a copied tree's: unknown
    assert [(r["commit"], r["dirty"]) for r in rows] == [(other, None)]
    assert f"; commit `{other}` (uncommitted changes unknown); 2 steps" in text


def test_outside_a_checkout_the_sweep_records_no_commit_and_no_changes(tmp_path, monkeypatch, cpu_machine):
    monkeypatch.setattr(provenance, "source_checkout", lambda: None)
    rows, text, _ = _sweep(tmp_path, monkeypatch)
    assert [(r["commit"], r["dirty"]) for r in rows] == [(None, None)]
    assert "; commit unknown (uncommitted changes unknown); 2 steps" in text


def test_results_recorded_before_dirty_still_read_with_nothing_said_about_changes(tmp_path, monkeypatch, checkout,
                                                                                 cpu_machine):
    """A header without ``dirty`` names its commit alone; a finished row of an earlier sweep that recorded neither
    commit nor dirty is kept (its run folder holds this checkout's summary) and written back as it was."""
    meta = dict(machine="M", commit="c0", steps=2, global_batch=2, micro_batch=2, seq_len=32, omp_num_threads="1")
    assert scaling.markdown([], meta).splitlines()[2].startswith("Machine: M; commit `c0`; 2 steps of ")
    (checkout / "code.py").write_text("x = 2\n")  # (the run's changes and this sweep's: it is kept)
    rows, _, _ = _sweep(tmp_path, monkeypatch)
    old = [{k: v for k, v in r.items() if k not in ("commit", "dirty")} for r in rows]
    (tmp_path / "multigpu.json").write_text(json.dumps(old))
    rows, text, launched = _sweep(tmp_path, monkeypatch)
    assert launched == [] and rows == old  # kept, as the earlier sweep wrote it
    head = git(checkout, "rev-parse", "HEAD")
    assert f"; commit `{head}`{EDITED}; 2 steps" in text and "| Tiny | ddp | 1 | 0 | 100 |" in text
