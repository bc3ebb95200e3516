"""A run that ``falcon-fwa compare`` or ``falcon-fwa scaling`` finished before is kept (not trained again) only
when it trained with the code of the checkout now: the same commit and the same uncommitted changes to tracked
files (``diff_sha256`` in its ``summary.json``: the SHA-256 of ``git diff HEAD --binary``), or none on either
side. Any other run trains again, and the console says which and why in one line."""
import hashlib
import json
import subprocess

import pytest
from conftest import git

from falcon_fwa import provenance
from falcon_fwa.provenance import CLEAN_TREE, uncommitted_changes
from falcon_fwa.train import compare, compare_report

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIG = {"train": {"steps": 4}, "model": {"preset": "tiny-falcon"}}
EARLIER = {"status": "done", "tokens": 96, "tokens_per_s": 10.0, "val_ppl": 3.0}


def diff_digest(repo) -> str:
    """The SHA-256 of ``git diff HEAD --binary`` in ``repo``, as git writes it."""
    out = subprocess.run(["git", "-C", str(repo), "diff", "HEAD", "--binary"], check=True, capture_output=True)
    return hashlib.sha256(out.stdout).hexdigest()


def test_the_fingerprint_is_the_digest_of_the_diff_of_tracked_files(checkout):
    assert CLEAN_TREE == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"  # SHA-256 of nothing
    assert uncommitted_changes() == uncommitted_changes(str(checkout)) == CLEAN_TREE
    (checkout / "untracked.py").write_text("y = 1\n")  # untracked files do not count
    assert uncommitted_changes() == CLEAN_TREE
    (checkout / "code.py").write_text("x = 2\n")
    two = uncommitted_changes()
    assert two != CLEAN_TREE and two == diff_digest(checkout)
    (checkout / "code.py").write_text("x = 3\n")  # other content of the same file: another fingerprint
    three = uncommitted_changes()
    assert three not in (CLEAN_TREE, two) and three == diff_digest(checkout)
    git(checkout, "add", "code.py")  # staged or not, the same change
    assert uncommitted_changes() == three
    (checkout / "code.py").write_text("x = 2\n")
    assert uncommitted_changes() == two
    (checkout / "code.py").write_text("x = 1\n")  # the committed content again: clean
    assert uncommitted_changes() == CLEAN_TREE


def test_outside_a_checkout_there_is_no_fingerprint(tmp_path, monkeypatch):
    monkeypatch.setattr(provenance, "source_checkout", lambda: None)
    assert uncommitted_changes() is None
    assert uncommitted_changes(str(tmp_path)) is None  # a folder that is no repository


def _trained(checkout, run_dir, **summary) -> None:
    """The summary.json a run of ``CONFIG`` trained now, in ``checkout`` as it is, leaves in ``run_dir``."""
    run_dir.mkdir(exist_ok=True)
    dirty = uncommitted_changes() != CLEAN_TREE
    fields = {"config": CONFIG, "commit": git(checkout, "rev-parse", "HEAD"), "dirty": dirty,
              "diff_sha256": uncommitted_changes(), "tokens": 96, "tokens_per_s": 10.0, **summary}
    (run_dir / "summary.json").write_text(json.dumps({k: v for k, v in fields.items() if v is not ...}))


def _kept(checkout, run_dir):
    """:func:`compare.kept_result` of ``EARLIER`` in ``run_dir`` against ``checkout`` as it is now."""
    return compare.kept_result(EARLIER, str(run_dir), CONFIG, provenance.git_commit(short=False),
                               uncommitted_changes(), "a")


@pytest.mark.parametrize("now, kept, why", [
    ("x = 2\n", True, None),  # the same changes
    ("x = 3\n", False, "trained with other uncommitted changes to tracked files than this checkout has"),
    ("x = 1\n", False, "trained with uncommitted changes to tracked files, this checkout has none"),
])
def test_a_run_trained_with_uncommitted_changes_is_kept_only_with_the_same_changes(tmp_path, checkout, capsys, now,
                                                                                   kept, why):
    (checkout / "code.py").write_text("x = 2\n")
    _trained(checkout, tmp_path / "run")
    (checkout / "code.py").write_text(now)
    assert _kept(checkout, tmp_path / "run") == (EARLIER if kept else None)
    out = capsys.readouterr().out
    assert out == ("" if kept else f"a: trained again, not kept from the earlier launch: {why}\n")


def test_a_clean_run_is_kept_from_a_clean_checkout_only(tmp_path, checkout, capsys):
    _trained(checkout, tmp_path / "run")
    (checkout / "notes.txt").write_text("untracked\n")
    assert _kept(checkout, tmp_path / "run") == EARLIER and capsys.readouterr().out == ""
    (checkout / "README").write_text("b\n")
    assert _kept(checkout, tmp_path / "run") is None
    assert capsys.readouterr().out == ("a: trained again, not kept from the earlier launch: trained without "
                                       "uncommitted changes, this checkout has some\n")


@pytest.mark.parametrize("dirty, kept", [(False, True), (True, False), (None, False)])
def test_a_summary_without_a_fingerprint_is_kept_only_where_it_is_not_dirty(tmp_path, checkout, capsys, dirty,
                                                                            kept):
    (checkout / "code.py").write_text("x = 2\n")  # (a dirty run's changes, which its summary does not record)
    _trained(checkout, tmp_path / "run", dirty=dirty, diff_sha256=...)
    if dirty is False:
        (checkout / "code.py").write_text("x = 1\n")
    assert _kept(checkout, tmp_path / "run") == (EARLIER if kept else None)
    out = capsys.readouterr().out
    assert out == ("" if kept else "a: trained again, not kept from the earlier launch: its summary does not "
                                   "fingerprint the uncommitted changes it trained with\n")


def test_outside_a_checkout_no_run_is_kept_and_the_console_says_why(tmp_path, checkout, monkeypatch, capsys):
    _trained(checkout, tmp_path / "run")
    monkeypatch.setattr(provenance, "source_checkout", lambda: None)
    assert _kept(checkout, tmp_path / "run") is None
    assert capsys.readouterr().out == ("a: trained again, not kept from the earlier launch: this code is outside a "
                                       "git checkout, so the code the run trained with cannot be told from it\n")


def test_a_comparison_trained_with_changes_is_trained_again_once_they_differ(tmp_path, checkout, monkeypatch,
                                                                             capsys):
    """``falcon-fwa compare`` relaunched into the same folder: with the changes the runs trained with both are
    kept; with other changes, or none, both train again."""
    from test_cli_journeys import _compare
    from test_compare_stopped_records import _presets_trained

    trained = _presets_trained(monkeypatch)
    (checkout / "code.py").write_text("x = 2\n")
    assert _compare(tmp_path, "--steps", "2") == 0 and trained == ["tiny-falcon", "tiny-transformer"]
    summary = json.loads((tmp_path / "cmp" / "main" / "a" / "summary.json").read_text())
    assert (summary["dirty"], summary["diff_sha256"]) == (True, diff_digest(checkout))
    trained.clear()
    assert _compare(tmp_path, "--steps", "2") == 0 and trained == []  # the same changes: both kept
    capsys.readouterr()
    (checkout / "code.py").write_text("x = 3\n")
    assert _compare(tmp_path, "--steps", "2") == 0 and trained == ["tiny-falcon", "tiny-transformer"]
    out = capsys.readouterr().out
    for name in "ab":
        assert (f"{name}: trained again, not kept from the earlier launch: trained with other uncommitted changes "
                "to tracked files than this checkout has\n") in out
    trained.clear()
    (checkout / "code.py").write_text("x = 1\n")  # clean now
    assert _compare(tmp_path, "--steps", "2") == 0 and trained == ["tiny-falcon", "tiny-transformer"]
    report = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert not any(r.get("kept") for r in report["runs"].values())
    assert {r["diff_sha256"] for r in report["runs"].values()} == {CLEAN_TREE}
    assert [r["diff_sha256"] for r in compare_report.result_rows(report)] == [CLEAN_TREE, CLEAN_TREE]


def test_a_sweep_relaunched_with_uncommitted_changes_runs_again_what_a_clean_checkout_ran(tmp_path, checkout,
                                                                                          monkeypatch, capsys,
                                                                                          cpu_machine):
    """``falcon-fwa scaling`` relaunched: the runs of summaries of the clean commit (written before fingerprints
    were, not ``dirty``) are kept from the clean checkout and run again once it has changes, each said so."""
    from test_scaling import _fake_sweep, recipe

    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(recipe(tmp_path)))
    argv = ["--configs", str(path), "--names", "Tiny", "--gpus", "1", "2", "--strategies", "ddp",
            "--noise-seeds", "0", "--steps", "3", "--warmup-steps", "0", "--out", str(tmp_path / "runs"),
            "--results", str(tmp_path / "multigpu")]
    assert _fake_sweep(tmp_path, monkeypatch, argv) == (0, ["Tiny-ddp-n1-s0", "Tiny-ddp-n2-s0"])
    assert _fake_sweep(tmp_path, monkeypatch, argv) == (0, [])  # clean and clean: kept
    capsys.readouterr()
    (checkout / "src" / "code.py").write_text("x = 2\n")
    assert _fake_sweep(tmp_path, monkeypatch, argv) == (0, ["Tiny-ddp-n1-s0", "Tiny-ddp-n2-s0"])
    out = capsys.readouterr().out
    for i, gpus in ((1, 1), (2, 2)):
        assert (f"[{i}/2] Tiny ddp x{gpus} seed 0: trained again, not kept from the earlier launch: trained without "
                "uncommitted changes, this checkout has some\n") in out


def test_a_run_records_the_code_it_started_with_not_edits_made_while_it_trains(tmp_path, checkout):
    """The summary's commit, ``dirty`` and fingerprint are those of the checkout when the launch started: a
    tracked file edited during training (after the code was imported) is not put down to the run, which
    compare and scaling would otherwise keep for that edited code."""
    from falcon_fwa.train import Trainer, config_from_dict
    from test_train import recipe

    raw = recipe(tmp_path, steps=3, save_every=0, eval_every=0)
    trainer = Trainer(config_from_dict(raw))

    def edit_after_the_first_step(step):
        if step == 1:
            (checkout / "code.py").write_text("x = 2\n")
        return False

    summary = trainer.train(should_stop=edit_after_the_first_step)
    trainer.close()
    assert uncommitted_changes() != CLEAN_TREE  # the checkout is dirty now
    assert summary["commit"] == git(checkout, "rev-parse", "HEAD")
    assert summary["dirty"] is False and summary["diff_sha256"] == CLEAN_TREE
