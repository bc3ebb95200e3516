"""``benchmarks/bench_forms_cpu.py`` records the commit of the falcon_fwa code it times as the other commands do
(``falcon_fwa.provenance.command_provenance``): the full commit of the package's checkout, whatever the working
directory, with whether that checkout had uncommitted changes to tracked files, or "unknown" outside one."""
import argparse
import json
import os
import sys

import pytest
from conftest import git

from falcon_fwa import provenance

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_forms_cpu as bf  # noqa: E402


@pytest.mark.parametrize("edit", [None, "README", "src/code.py"])
def test_the_record_names_the_packages_full_commit_and_its_uncommitted_changes(tmp_path, checkout, monkeypatch,
                                                                               edit):
    if edit:  # a tracked file changed anywhere in the checkout, in src/ or not
        (checkout / edit).write_text("changed\n")
    (checkout / "src" / "new.py").write_text("y = 1\n")  # an untracked file is no uncommitted change
    monkeypatch.chdir(tmp_path)  # the working directory plays no part
    head = git(checkout, "rev-parse", "HEAD")
    expected = head + (" with uncommitted changes to tracked files" if edit else "")
    out = tmp_path / "out"
    assert bf.main(["--seq-lens", "4", "--rules", "1", "--heads", "1", "--head-dim", "2", "--chunk-size", "2",
                    "--repeats", "1", "--out", str(out), "--name", "f"]) == 0
    assert json.loads((out / "f.json").read_text())["machine"]["commit"] == expected
    assert f"; commit {expected}.\n" in (out / "f.md").read_text()
    assert bf._machine(argparse.Namespace())["commit"] == expected


def test_outside_a_checkout_the_commit_is_unknown(monkeypatch):
    monkeypatch.setattr(provenance, "source_checkout", lambda: None)
    assert bf._machine(argparse.Namespace())["commit"] == "unknown"
