"""More checks of the command-line layer: an output file given as a folder path (ending in a separator) is
refused before any work, and compare's console line about the floor of 20 steps names the count that trains
where --max-steps caps it."""
import argparse
import os

import pytest
from test_compare_tools import recipes

from falcon_fwa import cli
from falcon_fwa.cli_options import check_output_file
from falcon_fwa.train import compare, throughput

pytestmark = pytest.mark.usefixtures("one_thread")


def test_an_output_file_ending_in_a_separator_is_refused_by_name(tmp_path):
    """``DIR/new/`` names a folder, not a file: opened for writing it fails (or pathlib writes the file ``new``)."""
    with pytest.raises(ValueError, match=r"^--out .*new/' ends in a separator, as a folder does"):
        check_output_file("--out", str(tmp_path / "new") + os.sep)


def test_throughput_refuses_an_out_folder_path_before_measuring(tmp_path, monkeypatch, capsys):
    """The rows would be lost at their first write, after the measurement."""
    calls = []
    monkeypatch.setattr(throughput, "measure", lambda config, **kw: calls.append(kw) or {"tokens_per_s": 1.0})
    status = cli.main(["throughput", "--preset", "tiny-falcon", "--seq-len", "8", "--device", "cpu",
                       "--no-progress", "--out", str(tmp_path / "rows") + os.sep])
    assert status == 2 and calls == []
    assert "error: --out " in capsys.readouterr().err


def test_the_floor_line_names_the_count_that_trains_under_max_steps(tmp_path, monkeypatch, capsys):
    """No step fits a 1 s budget: the floor of 20, capped by --max-steps 10, trains 10 steps, and the line says 10."""
    seen = {}
    monkeypatch.setattr(compare, "calibrate_sequential", lambda configs, names, sets, **kw: {
        n: dict(setup_s=0.0, eval_s=0.0, save_s=0.0, export_s=0.0, step_s=5.0) for n in names})
    monkeypatch.setattr(compare, "run_sequential", lambda configs, names, out, sets, tag, **kw: seen.update(
        sets=sets) or iter(()))
    path = recipes(tmp_path, {"a": "tiny-falcon"})[0]
    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    compare.run(parser.parse_args(["--configs", path, "--out", str(tmp_path / "cmp"), "--time-budget", "1",
                                   "--max-steps", "10"]))
    assert "train.steps=10" in seen["sets"]
    out = capsys.readouterr().out
    assert "only 0 steps fit: training 10\n" in out and "training 20" not in out
