"""Properties of the training reports, fits, plans and checkpoints that their docstrings and docs/training.md
promise, each worked out here by hand: ``compare_report``'s rows and table (status and planned steps of each
recipe, the verdict's percentage, the recipes left out, cell escaping), ``scaling``'s plan, shared global batch,
run settings and efficiency (tokens/s at N over N times the mean rate at the smallest count), ``throughput``'s
step timing and rows, and ``checkpoint``'s folder names, ``meta.json`` and pruning."""
import json

import pytest

from falcon_fwa.train import compare_report


# ----------------------------------------------------------------------------- compare_report
def _report(tmp_path, report):
    path = tmp_path / "compare.json"
    path.write_text(json.dumps(report))
    assert compare_report.main([str(path), str(tmp_path / "out" / "r")]) == 0
    return (json.loads((tmp_path / "out" / "r.json").read_text()),
            (tmp_path / "out" / "r_table.md").read_text())


def test_a_run_without_its_own_planned_count_is_shown_against_the_commands_steps(tmp_path):
    """A compare.json whose stopped run records no ``planned_steps`` (the command's ``steps`` is the plan of
    every run): the row says 3 of the command's 8 steps."""
    rows, table = _report(tmp_path, {"configs": ["Falcon-A"], "steps": 8, "status": {"Falcon-A": "stopped"},
                                     "runs": {"Falcon-A": {"steps": 3, "params": 5, "tokens": 96}}})
    assert rows[0]["planned_steps"] == 8
    assert "| Falcon-A | stopped: 3 of 8 steps | 5 | 96 | - | - | - |" in table


def test_a_recipe_without_a_result_or_status_is_pending_and_left_out(tmp_path):
    """A recipe listed in ``configs`` that has neither a run nor a status (the command stopped before it) is
    ``pending``, an empty row, and named among those not compared, never ``done``."""
    rows, table = _report(tmp_path, {"configs": ["Falcon-A", "Base", "Later"], "steps": 4,
                                     "status": {"Falcon-A": "done", "Base": "done"},
                                     "runs": {"Falcon-A": {"steps": 4, "tokens": 64, "val_ppl": 3.0},
                                              "Base": {"steps": 4, "tokens": 64, "val_ppl": 4.0}}})
    assert [(r["model"], r["status"]) for r in rows] == [("Falcon-A", "done"), ("Base", "done"), ("Later", "pending")]
    assert "| Later | pending | | | | | |" in table
    assert "Not in the comparison (fewer or no tokens trained): Later." in table


def test_the_commands_status_of_a_recipe_wins_over_the_status_its_result_carries(tmp_path):
    """``status`` of compare.json (the command's last word on each recipe) is the row's status, over a
    ``status`` the run's result carries: a recipe the command marks failed is left out of the verdict."""
    rows, table = _report(tmp_path, {"configs": ["Falcon-A", "Falcon-B", "Base"], "steps": 4,
                                     "status": {"Falcon-A": "failed", "Falcon-B": "done", "Base": "done"},
                                     "runs": {"Falcon-A": {"status": "done", "steps": 4, "tokens": 64, "val_ppl": 2.0},
                                              "Falcon-B": {"steps": 4, "tokens": 64, "val_ppl": 5.0},
                                              "Base": {"steps": 4, "tokens": 64, "val_ppl": 4.0}}})
    assert [r["status"] for r in rows] == ["failed", "done", "done"]
    # best finished Falcon 5.0 against the baseline 4.0: 5 / 4 - 1 = 25 %
    assert "Best Falcon (Falcon-B, 5.000) is 25.0% above the best baseline (Base, 4.000)." in table
    assert "Not in the comparison (fewer or no tokens trained): Falcon-A." in table


def test_a_bar_or_a_line_end_in_a_name_or_error_stays_inside_its_cell():
    """A ``|`` in a name or error is escaped and line ends become spaces, so every row keeps its 7 cells."""
    rows = [{"model": "a|b", "status": "done", "steps": 2, "planned_steps": 2, "params": 1, "tokens": 2,
             "val_ppl": 3.0},
            {"model": "c", "status": "failed", "error": "Traceback:\n  x | y\nValueError: bad"}]
    table = compare_report.markdown_table(rows)
    assert "| a\\|b | done | 1 | 2 | 3.000 | - | - |" in table
    assert "| c | failed: Traceback: x \\| y ValueError: bad | | | | | |" in table


def _row(model, status, val_ppl, steps=4):
    return {"model": model, "status": status, "steps": steps, "planned_steps": 4, "params": 10, "tokens": 16 * steps,
            "val_ppl": val_ppl}


def test_the_verdict_sets_the_lowest_finished_falcon_against_the_lowest_baseline():
    """Falcons 6.0 and 4.4 finished, one partial at 1.0 (fewer tokens: not compared); baselines 5.0 and 4.0:
    4.4 / 4.0 - 1 = 10.0 %."""
    rows = [_row("Falcon-A", "done", 6.0), _row("Falcon-B", "done", 4.4), _row("Falcon-C", "partial", 1.0, steps=2),
            _row("Base-A", "done", 5.0), _row("Base-B", "done", 4.0)]
    table = compare_report.markdown_table(rows)
    assert "Best Falcon (Falcon-B, 4.400) is 10.0% above the best baseline (Base-B, 4.000)." in table
    assert "Not in the comparison (fewer or no tokens trained): Falcon-C." in table


def test_a_falcon_as_good_as_the_baseline_is_at_or_below_it():
    """Equal perplexities: a gap of 0 reads "at or below", not "0.0% above"."""
    table = compare_report.markdown_table([_row("Falcon-A", "done", 4.0), _row("Base", "done", 4.0)])
    assert "Best Falcon (Falcon-A, 4.000) is at or below the best baseline (Base, 4.000)." in table


class _Recorder:
    """A stand-in for matplotlib's ``pyplot``, its figure and axes: records ``ax.plot`` calls, ignores the rest."""

    def __init__(self):
        self.lines = []

    def subplots(self, *args, **kwargs):
        return self, self

    def plot(self, *args, **kwargs):
        self.lines.append((args, kwargs))

    def get_legend_handles_labels(self):
        return [[]]

    def savefig(self, path, **kwargs):
        with open(path, "wb") as f:
            f.write(b"png")

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def test_validation_points_sit_at_the_tokens_of_their_step(tmp_path, monkeypatch):
    """32 tokens a step (64 at step 2, 128 at step 4): the validation loss of step 4 is drawn at 128 tokens,
    the training losses at their logged tokens."""
    recorder = _Recorder()
    monkeypatch.setattr(compare_report, "pyplot", lambda: recorder)
    log = [{"step": 2, "loss": 3.0, "tokens": 64}, {"step": 4, "loss": 2.0, "tokens": 128},
           {"step": 4, "val_loss": 2.5}]
    compare_report.plot_curves({"Falcon-A": {"status": "done", "log": log}}, str(tmp_path / "loss.png"))
    (train, _), (val, val_style) = recorder.lines
    assert train == ((64, 128), (3.0, 2.0)) and val == ((128,), (2.5,)) and val_style["marker"] == "o"
    assert (tmp_path / "loss.png").read_bytes() == b"png"


# ----------------------------------------------------------------------------- scaling
def _scaling_row(strategy, gpus, seed, val_loss):
    return {"model": "M", "strategy": strategy, "gpus": gpus, "seed": seed, "tokens_per_s": None, "efficiency": None,
            "peak_mem_bytes_per_gpu": None, "val_loss": val_loss, "status": "done", "command": "c"}


def test_the_largest_loss_difference_is_by_size_whatever_its_sign():
    """Seeds 0 and 1 at one process: 2.00 and 2.01 (spread 0.0100). DDP x2 seed 0 is 0.0500 below its
    one-process run, FSDP2 x2 0.0010 above: the largest difference is 0.0500, outside the spread."""
    from falcon_fwa.train import scaling

    rows = [_scaling_row("ddp", 1, 0, 2.00), _scaling_row("ddp", 1, 1, 2.01), _scaling_row("fsdp2", 1, 0, 2.02),
            _scaling_row("ddp", 2, 0, 1.95), _scaling_row("fsdp2", 2, 0, 2.021)]
    line = [x for x in scaling.markdown(rows, {}).splitlines() if x.startswith("- M:")][0]
    assert line == ("- M: one-process seeds 2.0000, 2.0100 (spread 0.0100); against the 1-process run of the same "
                    "strategy and seed: ddp x2 -0.0500, fsdp2 x2 +0.0010 (largest 0.0500: outside the seed spread).")


# ----------------------------------------------------------------------------- throughput
def _measure(monkeypatch, times, **kwargs):
    """``throughput.measure`` of the tiny Falcon on the CPU (fp32, 2 rows of 8 tokens), its clock reading
    ``times`` in turn: the start, then the end of each step."""
    from falcon_fwa import get_preset
    from falcon_fwa.train import throughput

    readings = iter(times)
    monkeypatch.setattr(throughput, "_clock", lambda: next(readings))
    return throughput.measure(get_preset("tiny-falcon"), seq_len=8, batch_size=2, device="cpu", bf16=False,
                              **kwargs)


def test_step_seconds_are_the_mean_of_the_timed_steps_and_tokens_per_second_follow(monkeypatch, one_thread):
    """Warm-up steps of 10 s and 1 s, timed steps of 1, 1 and 4 s: step_s is their mean, 2 s (the median, 1 s,
    is step_s_median), and 2 x 8 tokens every 2 s is 8 tokens/s."""
    row = _measure(monkeypatch, [0, 10, 11, 12, 13, 17], steps=3, warmup=2, min_steps=3)
    assert (row["first_step_s"], row["warmup_s"], row["timed_steps"]) == (10, 11, 3)
    assert (row["step_s"], row["step_s_median"], row["tokens_per_s"], row["tokens_per_step"]) == (2, 1, 8, 16)
    assert (row["steady"], row["stopped"]) == (True, None)


def test_max_seconds_counts_timed_steps_only(monkeypatch, one_thread):
    """Warm-up of 10 s then 1-s steps, --max-seconds 2.5: timing stops after 3 timed steps (3 s), not after the
    first (whose end is 12 s from the start, warm-up included)."""
    row = _measure(monkeypatch, [0, 10, 11, 12, 13, 14, 15, 16], steps=5, warmup=2, min_steps=1, max_seconds=2.5)
    assert (row["timed_steps"], row["step_s"], row["stopped"], row["steady"]) == (3, 1, "max_seconds", True)


@pytest.mark.parametrize("triton, expected", [(4, "triton"), (2, "mixed"), (0, "torch")])
def test_the_falcon_op_is_triton_only_where_the_kernels_served_every_call(triton, expected):
    """Of 4 falcon layer calls, the Triton kernels served all (``triton``), some (``mixed``) or none (the
    PyTorch forms of a native model: ``torch``); no falcon layer is ``none``."""
    from falcon_fwa import get_preset
    from falcon_fwa.train.throughput import op_backend

    config = get_preset("tiny-falcon")
    assert op_backend({"layer": 4, "triton": triton}, config, "cuda") == expected
    assert op_backend({"layer": 0, "triton": 0}, config, "cuda") == "none"


def test_all_steps_timed_within_max_seconds_is_no_early_stop(monkeypatch, one_thread):
    """3 timed 1-s steps of --steps 3 pass --max-seconds 2.5 only at the last one: every step was timed, so
    ``stopped`` is None (it names what ended timing early)."""
    row = _measure(monkeypatch, [0, 10, 11, 12, 13], steps=3, warmup=1, min_steps=1, max_seconds=2.5)
    assert (row["timed_steps"], row["warmup_steps"], row["stopped"], row["steady"]) == (3, 1, None, True)


def _throughput_args(**kwargs):
    import argparse

    from falcon_fwa.train import throughput

    parser = argparse.ArgumentParser()
    throughput.add_arguments(parser)
    args = parser.parse_args([])
    vars(args).update(kwargs)
    return args


def test_a_preset_batch_is_batch_tokens_over_the_length_and_at_least_one_row():
    """--batch-tokens 16: 2 rows of 8 tokens, 1 row of 16, and still 1 row of 32 (16 // 32 is 0); length by
    length, every preset at a length before the next length."""
    from falcon_fwa.train import throughput

    args = _throughput_args(preset=["tiny-falcon", "tiny-transformer"], seq_len=[8, 16, 32], batch_tokens=16)
    jobs = [(name, seq_len, batch) for name, _, seq_len, batch, _, _ in throughput._jobs(args)]
    assert jobs == [("tiny-falcon", 8, 2), ("tiny-transformer", 8, 2), ("tiny-falcon", 16, 1),
                    ("tiny-transformer", 16, 1), ("tiny-falcon", 32, 1), ("tiny-transformer", 32, 1)]


def test_a_table_line_gives_peak_memory_in_mib():
    """3.5 MiB (3 x 2**20 + 2**19 bytes) reads 3.5; parameters and tokens/s with thousands separators; a stop
    before --min-steps says so."""
    from falcon_fwa.train.throughput import _table_line

    row = {"preset": "tiny-falcon", "seq_len": 8, "batch_size": 2, "params": 1234, "tokens_per_s": 1234.6,
           "peak_mem_bytes": 3 * 2**20 + 2**19, "falcon_op": "triton", "stopped": "deadline", "steady": False,
           "timed_steps": 1}
    assert _table_line(row, 11).split() == ["tiny-falcon", "8", "2", "1,234", "1,235", "3.5", "triton", "stopped:",
                                            "deadline", "after", "1", "timed", "step(s),", "not", "steady"]


# ----------------------------------------------------------------------------- checkpoint
def test_a_folder_whose_meta_does_not_say_complete_is_no_checkpoint(tmp_path):
    """``step-00000003`` saved; beside it ``step-00000005`` written by hand with ``state.pt`` and a meta.json of
    ``"complete": false``, and ``step-00000007`` with one that says nothing of it: neither is listed, LATEST
    naming 7 falls back to 3, and loading 5 is refused."""
    import torch

    from falcon_fwa.train.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint

    folder = tmp_path / "checkpoints"
    save_checkpoint(str(folder), 3, {"step": 3})
    for step, meta in ((5, {"step": 5, "complete": False}), (7, {"step": 7})):
        (folder / f"step-{step:08d}").mkdir()
        torch.save({"step": step}, folder / f"step-{step:08d}" / "state.pt")
        (folder / f"step-{step:08d}" / "meta.json").write_text(json.dumps(meta))
    (folder / "LATEST").write_text("step-00000007")
    assert list_checkpoints(str(folder)) == [str(folder / "step-00000003")]
    assert latest_checkpoint(str(folder)) == str(folder / "step-00000003")
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        load_checkpoint(str(folder / "step-00000005"))


def test_a_checkpoint_holds_its_state_and_a_meta_json_of_its_step(tmp_path):
    """``save_checkpoint(dir, 20, state)``: ``step-00000020/`` with ``state.pt`` (the state, loaded on the CPU)
    and ``meta.json`` ``{"step": 20, "complete": true}``; ``LATEST`` names it; nothing else in the folder."""
    import torch

    from falcon_fwa.train.checkpoint import checkpoint_step, load_checkpoint, save_checkpoint

    folder = tmp_path / "checkpoints"
    state = {"model": {"w": torch.arange(3.0)}, "step": 20, "data": {"position": 7}}
    path = save_checkpoint(str(folder), 20, state)
    assert path == str(folder / "step-00000020") and checkpoint_step(path) == 20
    assert sorted(p.name for p in folder.iterdir()) == ["LATEST", "step-00000020"]
    assert sorted(p.name for p in (folder / "step-00000020").iterdir()) == ["meta.json", "state.pt"]
    assert json.loads((folder / "step-00000020" / "meta.json").read_text()) == {"step": 20, "complete": True}
    assert (folder / "LATEST").read_text() == "step-00000020"
    loaded = load_checkpoint(path)
    assert torch.equal(loaded["model"]["w"], torch.arange(3.0)) and loaded["data"] == {"position": 7}


def test_save_checkpoint_keeps_the_two_newest_by_default(tmp_path):
    """Steps 1 to 4 saved without ``keep``: steps 3 and 4 are left (``keep=2``, as ``train.keep_checkpoints``)."""
    from falcon_fwa.train.checkpoint import list_checkpoints, save_checkpoint

    folder = tmp_path / "checkpoints"
    for step in range(1, 5):
        save_checkpoint(str(folder), step, {"step": step})
    assert list_checkpoints(str(folder)) == [str(folder / "step-00000003"), str(folder / "step-00000004")]


def test_latest_names_its_checkpoint_through_a_line_end_and_stray_step_folders_are_passed_over(tmp_path):
    """Steps 3 and 5 saved, ``LATEST`` rewritten by hand to ``step-00000003`` and a line end: step 3, not the
    newest. A copy named ``step-00000005-copy`` (not a step number) is no checkpoint."""
    import shutil

    from falcon_fwa.train.checkpoint import latest_checkpoint, list_checkpoints, save_checkpoint

    folder = tmp_path / "checkpoints"
    for step in (3, 5):
        save_checkpoint(str(folder), step, {"step": step})
    shutil.copytree(folder / "step-00000005", folder / "step-00000005-copy")
    (folder / "LATEST").write_text("step-00000003\n")
    assert latest_checkpoint(str(folder)) == str(folder / "step-00000003")
    assert list_checkpoints(str(folder)) == [str(folder / "step-00000003"), str(folder / "step-00000005")]
