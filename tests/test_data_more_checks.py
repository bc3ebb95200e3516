"""A prepared folder reused while one of its sources is gone: the other source is still checked."""
import pytest

from falcon_fwa.data import DataSpec, prepare_dataset


def test_a_train_source_changed_is_refused_though_the_val_source_is_gone(tmp_path):
    """A reuse checks each source that is still there: the val file removed since (its tokens are in the folder)
    does not let a training file that changed since be reused as the stale shards of its old text."""
    src = tmp_path / "corpus"
    src.mkdir()
    (src / "a.txt").write_text("alpha beta")
    (tmp_path / "v.txt").write_text("held out")
    spec = DataSpec(train_source=str(src), val_source=str(tmp_path / "v.txt"))
    out = str(tmp_path / "d")
    prepare_dataset(spec, out)
    (tmp_path / "v.txt").unlink()
    (src / "a.txt").write_text("alpha beta gamma")
    with pytest.raises(ValueError, match=r"other source files \(.*a\.txt held 10 bytes, now 16\)"):
        prepare_dataset(spec, out)
    (src / "a.txt").write_text("alpha beta")  # as it was: reused, the val file still gone
    assert prepare_dataset(spec, out)["counts"]["train"] == {"n_docs": 1, "n_tokens": 11}
