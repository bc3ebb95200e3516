"""addition-compare's --name is the stem of files in --results: one that is empty or holds a path
separator is refused at once, naming --name, before any run is trained or any file written."""
import pytest

from falcon_fwa.tasks.addition import compare


def _argv(tmp_path, name):
    return ["--models", "Transformer", "--seeds", "0", "--steps", "2", "--val-per-width", "1",
            "--ood-per-width", "1", "--runs", str(tmp_path / "runs"), "--results", str(tmp_path / "res"),
            "--name", name, "--no-train"]


@pytest.mark.parametrize("name", ["a/b", "../escape", "", "..", "."])
def test_bad_name_is_refused_before_anything_is_written(tmp_path, name):
    with pytest.raises(ValueError, match="--name"):
        compare.main(_argv(tmp_path, name))
    assert not (tmp_path / "res").exists() and not (tmp_path / "runs").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_plain_names_pass(tmp_path):
    import argparse
    p = argparse.ArgumentParser()
    compare.add_arguments(p)
    for name in ("paper", "paper_lsd", "x y", "t1.v2"):
        compare.check_compare_options(p.parse_args(_argv(tmp_path, name)))
