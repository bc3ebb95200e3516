"""The key of a cached task index (harness._yaml_files_state) changes with the YAML files the harness's index reads
under the include folder, and not with those it leaves out: a notebook's checkpoint copies, Python's caches."""
import os
from pathlib import Path

import pytest

from falcon_fwa.eval import harness

TASK = "task: {name}\ndataset_path: json\noutput_type: multiple_choice\n"


def _write(root: Path, relative: str, name: str = "t") -> Path:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(TASK.format(name=name))
    return path


@pytest.fixture
def include(tmp_path):
    root = tmp_path / "tasks"
    _write(root, "mine.yaml", "mine")
    _write(root, "group/other.yaml", "other")
    return root


def test_a_notebook_checkpoint_or_a_cache_folder_leaves_the_key_as_it_was(include):
    before = harness._yaml_files_state(str(include))
    assert [entry[0] for entry in before] == ["group/other.yaml", "mine.yaml"]
    _write(include, ".ipynb_checkpoints/mine-checkpoint.yaml", "mine")
    _write(include, "group/.ipynb_checkpoints/other-checkpoint.yaml", "other")
    _write(include, "__pycache__/stale.yaml", "stale")
    assert harness._yaml_files_state(str(include)) == before
    edited = include / "group" / ".ipynb_checkpoints" / "other-checkpoint.yaml"
    edited.write_text(TASK.format(name="other") + "# edited\n")
    assert harness._yaml_files_state(str(include)) == before


def test_a_task_file_added_or_edited_changes_the_key(include):
    before = harness._yaml_files_state(str(include))
    _write(include, "group/new.yaml", "new")
    added = harness._yaml_files_state(str(include))
    assert [entry[0] for entry in added] == ["group/new.yaml", "group/other.yaml", "mine.yaml"]
    (include / "mine.yaml").write_text(TASK.format(name="mine") + "# a longer file\n")
    assert harness._yaml_files_state(str(include)) not in (before, added)


def test_the_key_lists_the_files_the_harness_indexes(include):
    """Against lm-evaluation-harness's own walk of the folder (where it is installed)."""
    index = pytest.importorskip("lm_eval.tasks._index")
    for relative in (".ipynb_checkpoints/mine-checkpoint.yaml", "__pycache__/stale.yaml", "group/new.yaml",
                     ".hidden/kept.yaml", "deep/.ipynb_checkpoints/x.yaml"):
        _write(include, relative)
    walked = [os.path.relpath(p, include).replace(os.sep, "/") for p in index.TaskIndex._iter_yaml_files(include)]
    assert sorted(walked) == [entry[0] for entry in harness._yaml_files_state(str(include))]
    assert ".hidden/kept.yaml" in walked  # a hidden folder of another name is indexed, so it counts
