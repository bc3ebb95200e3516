"""The special tokens' ids are checked once when a config is built, and again by validate_fields on a built one."""
import pytest

from falcon_fwa.models import FalconConfig
from falcon_fwa.models import configuration


def _counting(monkeypatch):
    calls = []
    check = configuration._token_ids

    def counted(field, value, vocab_size):
        calls.append((field, value, vocab_size))
        return check(field, value, vocab_size)

    monkeypatch.setattr(configuration, "_token_ids", counted)
    return calls


def _config(**kw):
    return FalconConfig(**{**dict(vocab_size=64, hidden_size=32, num_heads=1, num_hidden_layers=1), **kw})


def test_the_constructor_checks_each_token_id_once(monkeypatch):
    calls = _counting(monkeypatch)
    config = _config(pad_token_id=0, bos_token_id=1, eos_token_id=[2, 63])
    assert calls == [("pad_token_id", 0, 64), ("bos_token_id", 1, 64), ("eos_token_id", [2, 63], 64)]
    assert (config.pad_token_id, config.bos_token_id, config.eos_token_id) == (0, 1, [2, 63])
    calls.clear()
    config.validate_fields()  # a built config's ids are checked again, against its vocab_size of now
    assert [c[0] for c in calls] == ["pad_token_id", "bos_token_id", "eos_token_id"]


def test_an_id_outside_the_vocabulary_is_refused_by_one_check(monkeypatch):
    calls = _counting(monkeypatch)
    with pytest.raises(ValueError, match=r"config field 'bos_token_id' = 64 is no token id .*vocab_size = 64"):
        _config(bos_token_id=64)
    assert [c[0] for c in calls] == ["pad_token_id", "bos_token_id"]
    config = _config(eos_token_id=50)
    config.vocab_size = 32
    with pytest.raises(ValueError, match=r"config field 'eos_token_id' = 50 is no token id .*vocab_size = 32"):
        config.validate_fields()
