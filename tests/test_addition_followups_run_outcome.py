"""``addition-compare`` judges a run it started by its results as well as its exit status: a run whose process
a signal ended after its complete results were written (a SIGTERM passed on, or the deadline's, coming as it
exits: status -15 from the signal itself, or 143) is finished, not failed, as a relaunch, which skips it, finds;
a run that ended so with unfinished results, or with finished results of another model, seed or setup, is
failed. Hand-made results files, and processes that stand for the runs."""
import argparse
import json
import subprocess
from pathlib import Path

from falcon_fwa.tasks.addition import cli, compare

STEPS = 2


def _args(argv):
    p = argparse.ArgumentParser()
    compare.add_arguments(p)
    return p.parse_args(["--steps", str(STEPS), "--device", "cpu", *argv])


def _preset(args):
    return cli.preset_from_args(args)


def _complete(model, seed, *, mixer, lr=None, finished=True, steps_done=STEPS, base=10, signal=None):
    """results.json of the tiny preset's run of ``model`` at 2 steps, as a finished run writes it: its settings
    (the tiny preset's fields as the file holds them: lists for tuples), the best step and the state."""
    preset = {"hidden_size": 64, "num_hidden_layers": 2, "num_heads": 2, "steps": STEPS, "batch_size": 64,
              "lr": 3e-3 if lr is None else lr, "warmup": 100, "eval_every": 250, "val_per_width": 64,
              "ood_per_width": 32, "min_lr_ratio": 0.1, "weight_decay": 0.1, "betas": [0.9, 0.95],
              "grad_clip": 1.0, "train_widths": [1, 5], "ood_widths": [6, 8], "model": {}, "fan_in_init": True,
              "cpu_threads": 1, "curriculum_steps": 0, "matmul_precision": "highest", "operand_order": "msd",
              "base": base, "abacus_offset": None}
    r = {"task": "addition", "model": model, "config_fields": {"mixer": mixer}, "preset_name": "tiny",
         "preset": preset, "operand_order": "msd", "base": base, "abacus_offset": None, "seed": seed,
         "eval_seed": 1234, "dtype": "float32", "history": [{"step": STEPS}],
         "best": {"step": STEPS, "val_acc": 50.0, "mean_acc_ood": 0.0}, "steps_done": steps_done,
         "finished": finished}
    if signal:
        r["signal"] = signal
    return r


def _write(run_dir: Path, results):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "results.json").write_text(json.dumps(results))


def test_the_hand_made_settings_are_the_tiny_presets():
    """The hand-written preset dict above is the tiny preset's at 2 steps (else every case below is moot)."""
    args = _args([])
    held = _complete("Transformer", 0, mixer="transformer")["preset"]
    assert json.loads(json.dumps(_preset(args).to_dict())) == held


def test_a_complete_results_file_of_the_run_asked_for_is_a_finished_run(tmp_path):
    args = _args([])
    preset = _preset(args)

    def judged(results, model="Transformer", seed=0):
        run_dir = tmp_path / f"case{len(list(tmp_path.iterdir()))}"
        if results is not None:
            _write(run_dir, results)
        return compare.completed_run(run_dir, model, seed, preset, 1234, "float32", "tiny")

    assert judged(_complete("Transformer", 0, mixer="transformer"))
    assert judged(_complete("Mamba-2", 3, mixer="mamba2"), model="Mamba-2", seed=3)
    assert not judged(None)  # no results at all
    assert not judged(_complete("Transformer", 0, mixer="transformer", finished=False, steps_done=1,
                                signal="SIGTERM"))  # stopped by the signal before its last step
    assert not judged(_complete("Transformer", 0, mixer="transformer", steps_done=1))  # a shorter budget's
    assert not judged(_complete("Transformer", 1, mixer="transformer"))  # another seed's
    assert not judged(_complete("Mamba-2", 0, mixer="mamba2"))  # another model's
    assert not judged(_complete("Transformer", 0, mixer="mamba2"))  # another config under the name
    assert not judged(_complete("Transformer", 0, mixer="transformer", lr=1e-2))  # another preset field
    assert not judged(_complete("Transformer", 0, mixer="transformer", base=2))  # another task
    assert not compare.completed_run(tmp_path / "case0", "Transformer", 0, preset, 99, "float32", "tiny")
    assert not compare.completed_run(tmp_path / "case0", "Transformer", 0, preset, 1234, "bfloat16", "tiny")


class _Run:
    """Stands for a run's process: alive for one poll, then ended with the status and results its (model,
    seed) is given in ``plan`` (``None`` for no results written); ``terminate`` (the deadline's SIGTERM) ends
    it at once the same way."""
    plan = {}
    started = []

    def __init__(self, cmd, **kw):
        self.model, self.seed = cmd[cmd.index("--model") + 1], int(cmd[cmd.index("--seed") + 1])
        self.out, self.returncode, self.polls = Path(cmd[cmd.index("--out") + 1]), None, 0
        _Run.started.append((self.model, self.seed))

    def _end(self):
        status, results = _Run.plan[(self.model, self.seed)]
        if results is not None:
            _write(self.out, results)
        self.returncode = status

    def poll(self):
        self.polls += 1
        if self.polls > 1 and self.returncode is None:
            self._end()
        return self.returncode

    def terminate(self):
        if self.returncode is None:
            self._end()

    def send_signal(self, signum):
        self.terminate()

    def wait(self):
        if self.returncode is None:
            self._end()
        return self.returncode

    def kill(self):
        self.terminate()


def _launch(monkeypatch, plan):
    monkeypatch.setattr(_Run, "plan", plan)
    monkeypatch.setattr(_Run, "started", [])
    monkeypatch.setattr(subprocess, "Popen", _Run)
    monkeypatch.setattr(compare.time, "sleep", lambda s: None)


def test_a_run_a_signal_ended_after_its_results_were_written_is_not_failed(tmp_path, monkeypatch):
    """Four runs end with a signal's status: Transformer seed 0 (-15, killed by the SIGTERM) and Mamba-2 seed 0
    (143) wrote their complete results first; Transformer seed 1 was stopped before its last step (143, its
    results name the signal); Mamba-2 seed 1 left the finished results of another learning rate. Only the last
    two failed; a relaunch would start those two and skip the others."""
    _launch(monkeypatch, {
        ("Transformer", 0): (-15, _complete("Transformer", 0, mixer="transformer")),
        ("Mamba-2", 0): (143, _complete("Mamba-2", 0, mixer="mamba2")),
        ("Transformer", 1): (143, _complete("Transformer", 1, mixer="transformer", finished=False, steps_done=1,
                                            signal="SIGTERM")),
        ("Mamba-2", 1): (-15, _complete("Mamba-2", 1, mixer="mamba2", lr=1e-2)),
    })
    runs = tmp_path / "runs"
    args = _args(["--models", "Transformer", "Mamba-2", "--seeds", "0", "1", "--jobs", "4"])
    failed, stopped_by = compare.train_all(args, runs)
    assert stopped_by == 0 and len(_Run.started) == 4
    assert failed == [f"Transformer seed 1 (exit 143, see {compare._run_dir(runs, 'Transformer', 1)}/log.txt)",
                      f"Mamba-2 seed 1 (exit -15, see {compare._run_dir(runs, 'Mamba-2', 1)}/log.txt)"]
    assert [(m, s) for s in (0, 1) for m in ("Transformer", "Mamba-2")
            if compare._finished(compare._run_dir(runs, m, s), STEPS)] == [
        ("Transformer", 0), ("Mamba-2", 0), ("Mamba-2", 1)]  # Mamba-2 seed 1 is refused on relaunch instead


def test_a_run_that_finished_as_the_deadline_stopped_it_is_not_failed(tmp_path, monkeypatch):
    """The deadline passes while two runs are going: the deadline's SIGTERM finds Transformer seed 0 as it
    exits after writing its complete results (-15), and stops Mamba-2 seed 0 at its checkpoint (143)."""
    _launch(monkeypatch, {
        ("Transformer", 0): (-15, _complete("Transformer", 0, mixer="transformer")),
        ("Mamba-2", 0): (143, _complete("Mamba-2", 0, mixer="mamba2", finished=False, steps_done=1,
                                        signal="SIGTERM")),
    })
    clock = iter([0.0, 0.0, 10.0, 10.0, 10.0])  # start, first round, then past the deadline of 5 s
    monkeypatch.setattr(compare.time, "perf_counter", lambda: next(clock))
    args = _args(["--models", "Transformer", "Mamba-2", "--jobs", "2", "--deadline", "5"])
    failed, stopped_by = compare.train_all(args, tmp_path / "runs")
    assert stopped_by == 0 and _Run.started == [("Transformer", 0), ("Mamba-2", 0)]
    assert failed == ["Mamba-2 seed 0 (stopped at the deadline, exit 143)"]
