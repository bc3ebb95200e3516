"""A Ctrl-C during ``falcon-fwa throughput``: the rows measured before it stay in ``--out``, the measurement it
cut gets a row saying so (no timings), those not started get none, and the command ends with SIGINT's status."""
import json
import signal

import pytest

from falcon_fwa import cli
from falcon_fwa.train import throughput

pytestmark = pytest.mark.usefixtures("one_thread")


def _measure_until(n):
    """A stand-in for ``throughput.measure``: fixed timings for the first ``n - 1`` calls, Ctrl-C in call ``n``."""
    calls = []

    def measure(config, **kw):
        calls.append(kw["seq_len"])
        if len(calls) == n:
            raise KeyboardInterrupt
        return {"tokens_per_s": 1000.0 * len(calls), "params": 7}

    return measure, calls


@pytest.mark.parametrize("table", [[], ["--table"]])
def test_ctrl_c_in_the_second_measurement_keeps_the_first_row_and_marks_the_second(tmp_path, monkeypatch, capsys,
                                                                                   table):
    measure, calls = _measure_until(2)
    monkeypatch.setattr(throughput, "measure", measure)
    out = tmp_path / "rows.jsonl"
    status = cli.main(["throughput", "--preset", "tiny-falcon", "--seq-len", "8", "16", "32", "--device", "cpu",
                       "--no-progress", "--out", str(out), *table])
    assert status == 128 + signal.SIGINT
    assert calls == [8, 16]  # the third measurement never started
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["preset"], r["seq_len"]) for r in rows] == [("tiny-falcon", 8), ("tiny-falcon", 16)]
    first, cut = rows
    assert first["tokens_per_s"] == 1000.0 and "interrupted" not in first
    assert "interrupted" in cut and "tokens_per_s" not in cut and cut["wall_s"] >= 0
    printed = capsys.readouterr()
    assert "interrupted during tiny-falcon at seq_len 16" in printed.err
    assert "1 measurement(s) after it not run" in printed.err and str(out) in printed.err
    lines = printed.out.splitlines()  # standard output: the two rows, as JSON or as lines of the table
    assert len(lines) == 2 + bool(table)
    assert lines[-1].endswith("interrupted (Ctrl-C)") if table else json.loads(lines[-1]) == cut


def test_the_table_line_of_an_interrupted_row_says_so():
    line = throughput._table_line({"preset": "p", "seq_len": 8, "batch_size": 2, "interrupted": "Ctrl-C"}, 6)
    assert line.endswith("interrupted (Ctrl-C)") and line.startswith("p ")
