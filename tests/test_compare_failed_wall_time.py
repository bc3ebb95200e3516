"""A failed recipe's time: its one-line result says how long it ran, a --concurrent run records its wall_s
(from its launch to its end) whether it fails or finishes, and so does a throughput row that ran out of memory."""
import json
import subprocess
import sys

import torch

from falcon_fwa import cli
from falcon_fwa.train import compare, throughput

# a run that takes half a second, then finishes (exit 0 with its summary) or fails (exit 3, printing an error)
RUN = """
import json, os, sys, time
time.sleep(0.5)
if sys.argv[1] == "ok":
    with open(os.path.join(sys.argv[2], "summary.json"), "w") as f:
        json.dump({"steps": 4, "tokens_per_s": 100.0}, f)
    raise SystemExit(0)
print("Traceback (most recent call last):\\nRuntimeError: boom", flush=True)
raise SystemExit(3)
"""


def test_a_failed_recipes_line_says_how_long_it_ran():
    failed = {"status": "failed", "error": "RuntimeError: boom", "wall_s": 7.4}
    assert compare.summary_line("broken", failed, 2, 3) == "[2/3] broken: failed after 7 s  RuntimeError: boom"
    done = {"status": "done", "steps": 4, "planned_steps": 4, "wall_s": 7.4}
    assert compare.summary_line("fine", done, 1, 3) == "[1/3] fine: done 4/4 steps  7 s"
    # a recipe never started has no time to show
    not_run = {"status": "not_run", "error": "the deadline passed before this recipe started"}
    assert (compare.summary_line("late", not_run, 3, 3)
            == "[3/3] late: not_run  the deadline passed before this recipe started")


def test_a_concurrent_run_records_its_wall_time_failed_or_done(tmp_path, monkeypatch):
    def launch(config, run_dir, sets, log_path):
        with open(log_path, "w") as log:
            return subprocess.Popen([sys.executable, "-c", RUN, config, run_dir], stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)

    monkeypatch.setattr(compare, "_launch", launch)
    events = list(compare.run_all(["ok", "broken"], ["ok", "broken"], str(tmp_path), [], "main"))
    assert [e[:2] for e in events[:2]] == [("ok", "running"), ("broken", "running")]
    ended = {name: (status, result) for name, status, result in events[2:]}
    assert set(ended) == {"ok", "broken"}
    status, result = ended["broken"]
    assert status == "failed" and result["error"] == "exit code 3: RuntimeError: boom"
    status, done = ended["ok"]
    assert status == "done" and done["steps"] == 4
    for result in (ended["broken"][1], done):  # each slept 0.5 s; collected within the half-second poll after
        assert 0.5 <= result["wall_s"] < 30, result
    line = compare.summary_line("broken", {**ended["broken"][1], "status": "failed"}, 2, 2)
    assert line.startswith("[2/2] broken: failed after ") and line.endswith(" s  exit code 3: RuntimeError: boom")


def test_a_throughput_measurement_out_of_memory_records_its_wall_time(tmp_path, monkeypatch):
    """On a clock that measure moves on by 2.5 s (then runs out of memory) and 4 s (then measures): each row's
    wall_s is what its measurement took."""
    clock = {"now": 100.0}
    monkeypatch.setattr(throughput, "_clock", lambda: clock["now"])

    def measure(config, **kw):
        if kw["seq_len"] == 16:
            clock["now"] += 2.5
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        clock["now"] += 4.0
        return {"tokens_per_s": 10.0}

    monkeypatch.setattr(throughput, "measure", measure)
    out = tmp_path / "rows.jsonl"
    assert cli.main(["throughput", "--preset", "tiny-falcon", "--seq-len", "16", "8", "--device", "cpu",
                     "--no-progress", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["seq_len"] for r in rows] == [16, 8]
    assert rows[0]["error"].startswith("out of memory: CUDA out of memory") and rows[0]["wall_s"] == 2.5
    assert "error" not in rows[1] and rows[1]["wall_s"] == 4.0
