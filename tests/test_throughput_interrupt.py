"""A Ctrl-C during ``falcon-fwa throughput``: the rows measured before it stay in ``--out`` (each is written as it
is measured), the measurement it cut and those not started get no row, standard error names the cut one and counts
the others, and the command ends with SIGINT's status."""
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
def test_ctrl_c_in_the_second_measurement_keeps_the_first_row_and_names_the_second(tmp_path, monkeypatch, capsys,
                                                                                   table):
    measure, calls = _measure_until(2)
    monkeypatch.setattr(throughput, "measure", measure)
    out = tmp_path / "rows.jsonl"
    status = cli.main(["throughput", "--preset", "tiny-falcon", "--seq-len", "8", "16", "32", "--device", "cpu",
                       "--no-progress", "--out", str(out), *table])
    assert status == 128 + signal.SIGINT
    assert calls == [8, 16]  # the third measurement never started
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["preset"], r["seq_len"], r["tokens_per_s"]) for r in rows] == [("tiny-falcon", 8, 1000.0)]
    printed = capsys.readouterr()
    assert (f"interrupted during tiny-falcon at seq_len 16, which has no row; 1 measurement(s) after it not run; "
            f"the 1 row(s) before it are in {out}") in printed.err
    lines = printed.out.splitlines()  # standard output: the first row alone, as JSON or as a line of the table
    assert len(lines) == 1 + bool(table)
    if not table:
        assert json.loads(lines[0]) == rows[0]


def test_ctrl_c_in_the_first_measurement_leaves_no_row_and_says_so(tmp_path, monkeypatch, capsys):
    measure, _ = _measure_until(1)
    monkeypatch.setattr(throughput, "measure", measure)
    out = tmp_path / "rows.jsonl"
    assert cli.main(["throughput", "--preset", "tiny-falcon", "--seq-len", "8", "--device", "cpu", "--no-progress",
                     "--out", str(out)]) == 128 + signal.SIGINT
    assert not out.exists() or out.read_text() == ""
    err = capsys.readouterr().err
    assert "interrupted during tiny-falcon at seq_len 8, which has no row\n" in err
