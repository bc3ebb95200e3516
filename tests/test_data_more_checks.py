"""Further checks of the data package: a prepared folder reused while one of its sources is gone (the other
source is still checked), and Parquet text columns stored dictionary-encoded."""
import pytest

from falcon_fwa.data import DataSpec, prepare_dataset
from falcon_fwa.data.sources import iter_documents


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


def test_a_dictionary_encoded_parquet_text_column_gives_its_strings(tmp_path):
    """A Parquet text column stored dictionary-encoded (a pandas ``category`` column; each string stored once and
    indexed) gives the same documents as the plain column, nulls and blank strings left out as there; a dictionary
    of integers is still refused naming the column."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    texts = ["alpha beta", None, "gamma", "  ", "alpha beta", "delta é"]
    pq.write_table(pa.table({"text": pa.array(texts)}), tmp_path / "plain.parquet")
    pq.write_table(pa.table({"text": pa.array(texts).dictionary_encode()}), tmp_path / "dict.parquet")
    assert pq.ParquetFile(tmp_path / "dict.parquet").schema_arrow.field("text").type == pa.dictionary(
        pa.int32(), pa.string())
    want = ["alpha beta", "gamma", "alpha beta", "delta é"]
    assert list(iter_documents(str(tmp_path / "plain.parquet"))) == want
    assert list(iter_documents(str(tmp_path / "dict.parquet"))) == want
    pq.write_table(pa.table({"text": pa.array([1, 2, 1]).dictionary_encode()}), tmp_path / "ints.parquet")
    with pytest.raises(ValueError, match=r"column text_field .text. must hold strings, got "):
        list(iter_documents(str(tmp_path / "ints.parquet")))
