"""Pins documented behaviour of ``falcon_fwa.provenance`` and ``falcon_fwa.atomic`` against independent references.

provenance: ``uncommitted_changes`` of a throwaway repository is the SHA-256 of the bytes plain ``git diff HEAD
--binary --no-renames`` prints there (default settings), whatever diff settings the repository's own configuration sets (colour,
prefixes, an external diff, a textconv driver, rename detection, another diff algorithm); two different changes to a
binary file have different fingerprints; ``None`` where git fails. ``command_provenance``'s ``dirty`` is ``None`` (not
false) where ``git status`` fails. ``unlike_code`` gives each documented reason, and ``None`` only for the same code.

atomic: a write interrupted (``KeyboardInterrupt``) or failing inside ``atomic_path`` leaves the previous bytes of
the file and no temporary file beside it; ``write_json`` writes indented JSON with a final newline; ``replaceable``
holds only for an absent folder or one whose marker names the given value.
"""
import argparse
import hashlib
import os
import subprocess

import pytest
from conftest import git

from falcon_fwa import atomic, provenance

CLEAN_ENV = {"GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull}


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A repository of one commit (a text file, a binary file, a file to rename), with no global or system git
    configuration in effect."""
    for key, value in CLEAN_ENV.items():
        monkeypatch.setenv(key, value)
    root = tmp_path / "repo"
    root.mkdir()
    git(root, "init", "-q")
    (root / "a.txt").write_text("".join(f"line {i}\n" for i in range(40)))
    (root / "blob.bin").write_bytes(bytes(range(256)) * 4)
    (root / "old name.txt").write_text("".join(f"same {i}\n" for i in range(40)))
    git(root, "add", "a.txt", "blob.bin", "old name.txt")
    git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    return root


def _plain_diff_sha(root) -> str:
    """SHA-256 of ``git diff HEAD --binary`` with git's defaults (run before the tests set any diff setting) but
    for rename detection, which the fingerprint leaves off (a rename is a delete and an add)."""
    env = dict(os.environ, **CLEAN_ENV, GIT_CONFIG_COUNT="0")
    out = subprocess.run(["git", "-C", str(root), "--no-pager", "diff", "HEAD", "--binary", "--no-renames"], env=env,
                         capture_output=True, check=True).stdout
    assert out or not git(root, "status", "--porcelain", "--untracked-files=no")
    return hashlib.sha256(out).hexdigest()


def _edit(root):
    """Changes of every kind a diff shows: a text edit, a binary edit, a rename (a delete and an add), a new file
    with a non-ASCII name added with ``git add -N``."""
    (root / "a.txt").write_text("".join(f"line {i}\n" for i in range(40)).replace("line 7\n", "changed 7\n"))
    (root / "blob.bin").write_bytes(bytes(range(255, -1, -1)) * 4)
    git(root, "mv", "old name.txt", "new name.txt")
    (root / "naïve.txt").write_text("new\n")
    git(root, "add", "-N", "naïve.txt")


def test_the_fingerprint_is_that_of_plain_git_diff_head_binary(repo):
    assert provenance.uncommitted_changes(str(repo)) == provenance.CLEAN_TREE == _plain_diff_sha(repo)
    _edit(repo)
    fingerprint = provenance.uncommitted_changes(str(repo))
    assert fingerprint != provenance.CLEAN_TREE
    assert fingerprint == _plain_diff_sha(repo)


def test_the_repositorys_diff_settings_do_not_change_the_fingerprint(repo):
    _edit(repo)
    expected = _plain_diff_sha(repo)
    (repo / ".git" / "info" / "attributes").write_text("*.txt diff=upper\n")
    for key, value in (("color.ui", "always"), ("color.diff", "always"), ("diff.noprefix", "true"),
                       ("diff.mnemonicPrefix", "true"), ("diff.renames", "copies"), ("diff.algorithm", "patience"),
                       ("core.quotePath", "false"), ("diff.external", "echo external"),
                       ("diff.upper.textconv", "tr a-z A-Z <"), ("diff.relative", "true")):
        git(repo, "config", key, value)
    assert provenance.uncommitted_changes(str(repo)) == expected


def test_two_changes_to_a_binary_file_have_different_fingerprints(repo):
    (repo / "blob.bin").write_bytes(b"\x00\x01" * 300)
    one = provenance.uncommitted_changes(str(repo))
    (repo / "blob.bin").write_bytes(b"\x00\x02" * 300)
    two = provenance.uncommitted_changes(str(repo))
    assert provenance.CLEAN_TREE != one != two != provenance.CLEAN_TREE
    assert two == _plain_diff_sha(repo)


def test_no_fingerprint_where_git_fails(tmp_path, monkeypatch):
    for key, value in CLEAN_ENV.items():
        monkeypatch.setenv(key, value)
    assert provenance.uncommitted_changes(str(tmp_path)) is None  # no repository
    bare = tmp_path / "empty"
    bare.mkdir()
    git(bare, "init", "-q")
    assert provenance.uncommitted_changes(str(bare)) is None  # a repository without a commit: no HEAD


def test_dirty_is_unknown_where_git_status_fails(repo, monkeypatch):
    """The checkout's commit is known, but ``git status`` fails there: its ``dirty`` is ``None``, not false."""
    monkeypatch.setattr(provenance, "source_checkout", lambda: str(repo))
    head = git(repo, "rev-parse", "HEAD")
    real = provenance._git

    def failing_status(args, cwd):
        return real(["status", "--no-such-option"] if args[0] == "status" else args, cwd)

    monkeypatch.setattr(provenance, "_git", failing_status)
    record = provenance.command_provenance(argparse.Namespace(x=1))
    assert record == {"commit": head, "dirty": None, "options": {"x": 1}}


def test_unlike_code_tells_each_difference_and_only_a_difference(repo):
    """``unlike_code`` against a checkout's own commit and fingerprints (by git): the same code gives ``None``; a run
    whose summary predates ``diff_sha256`` and records a dirty checkout (or unknown ``dirty``) is of unknown
    changes, never the same code."""
    head = git(repo, "rev-parse", "HEAD")
    clean = provenance.uncommitted_changes(str(repo))
    (repo / "a.txt").write_text("other\n")
    edited = provenance.uncommitted_changes(str(repo))
    assert clean == provenance.CLEAN_TREE != edited
    unlike = provenance.unlike_code
    assert unlike({"commit": head, "dirty": False}, head, clean) is None
    assert unlike({"commit": head}, head, clean) is None
    assert unlike({"commit": head, "dirty": True, "diff_sha256": edited}, head, edited) is None
    unknown = "its summary does not fingerprint the uncommitted changes it trained with"
    for summary in ({"commit": head, "dirty": True}, {"commit": head, "dirty": None},
                    {"commit": head, "dirty": True, "diff_sha256": None}):
        assert unlike(summary, head, clean) == unknown
        assert unlike(summary, head, edited) == unknown
    assert unlike({"commit": head, "dirty": False}, head, edited) == (
        "trained without uncommitted changes, this checkout has some")
    assert unlike({"commit": head, "diff_sha256": edited}, head, clean) == (
        "trained with uncommitted changes to tracked files, this checkout has none")
    assert unlike({"commit": head, "diff_sha256": "0" * 64}, head, edited) == (
        "trained with other uncommitted changes to tracked files than this checkout has")
    assert unlike({"commit": "f" * 40, "dirty": False}, head, clean) == (
        f"trained at commit {'f' * 12}, this checkout is at {head[:12]}")
    assert unlike({"dirty": False}, head, clean) == f"trained at commit unknown, this checkout is at {head[:12]}"
    assert unlike({"commit": head, "dirty": False}, head, None) == (
        "the uncommitted changes of this checkout cannot be read (git diff HEAD failed)")
    assert unlike({"commit": head, "dirty": False}, None, clean) == (
        "this code is outside a git checkout, so the code the run trained with cannot be told from it")


@pytest.mark.parametrize("stop", [KeyboardInterrupt, SystemExit, ValueError])
def test_an_interrupted_write_leaves_the_previous_bytes_and_no_temporary_file(tmp_path, stop):
    target = tmp_path / "summary.json"
    target.write_bytes(b'{"old": 1}\n')
    with pytest.raises(stop):
        with atomic.atomic_path(target) as tmp:
            with open(tmp, "w") as f:
                f.write('{"new": ')
            raise stop()
    assert target.read_bytes() == b'{"old": 1}\n'
    assert sorted(os.listdir(tmp_path)) == ["summary.json"]
    with pytest.raises(TypeError):
        atomic.write_json(target, {"a": 1, "b": object()})  # fails midway through the encoding
    assert target.read_bytes() == b'{"old": 1}\n'
    assert sorted(os.listdir(tmp_path)) == ["summary.json"]
    atomic.write_json(target, {"new": [1, 2]})
    assert target.read_bytes() == b'{\n "new": [\n  1,\n  2\n ]\n}\n'
    assert sorted(os.listdir(tmp_path)) == ["summary.json"]


def test_a_folder_is_replaceable_only_where_its_marker_names_the_value(tmp_path):
    assert atomic.replaceable(tmp_path / "absent", "marker.json", "kind", "run")
    folder = tmp_path / "f"
    folder.mkdir()
    assert not atomic.replaceable(folder, "marker.json", "kind", "run")  # no marker
    for text, ok in (('{"kind": "run"}', True), ('{"kind": "other"}', False), ('{"kind": null}', False),
                     ('{"other": "run"}', False), ('["kind"]', False), ("not json", False)):
        (folder / "marker.json").write_text(text)
        assert atomic.replaceable(folder, "marker.json", "kind", "run") is ok, text
