"""The config's numbers: an integer field takes an integer of any size (numpy's too) or a float of integral
value (``64.0`` from a JSON file), a float field any finite real number; bools, text, fractions and numbers
past a float's range are errors naming the field, never an ``OverflowError`` that names none."""
import re
from fractions import Fraction

import numpy as np
import pytest

from falcon_fwa.models.configuration import FalconConfig


def _id(value):
    """A parameter's name: its repr, a huge integer by its sign and number of digits."""
    text = repr(value)
    return text if len(text) < 24 else f"{'-' if value < 0 else ''}{len(str(abs(value)))}-digit"


def _config(**fields):
    base = dict(vocab_size=64, hidden_size=32, num_heads=2, num_hidden_layers=1, rule="3")
    return FalconConfig(**{**base, **fields})


@pytest.mark.parametrize("value, want", [
    (64, 64), (np.int64(64), 64), (np.uint8(64), 64), (64.0, 64), (np.float32(64.0), 64), (Fraction(128, 2), 64),
    (10 ** 40, 10 ** 40),  # past a float's exact integers, and (below) past its range: still an integer
    (10 ** 400, 10 ** 400),
    (Fraction(10 ** 400), 10 ** 400), (Fraction(10 ** 401 + 10, 10), 10 ** 400 + 1),  # integral, past a float's range
], ids=_id)
def test_an_integer_field_takes_integers_and_integral_floats(value, want):
    cfg = _config(vocab_size=value)
    assert cfg.vocab_size == want and type(cfg.vocab_size) is int


@pytest.mark.parametrize("value", [
    True, np.bool_(True), 2.5, float("nan"), float("inf"), "64", None,
    Fraction(2 ** 61 + 1, 2),  # 2**60 + 1/2: no integer, though the float nearest to it is one
    1e400,  # (inf)
], ids=_id)
def test_an_integer_field_refuses_anything_else_naming_it(value):
    with pytest.raises(ValueError, match=re.escape(f"config field 'vocab_size' must be an integer, got {value!r}")):
        _config(vocab_size=value)


@pytest.mark.parametrize("value, want", [(1e-5, 1e-5), (2, 2.0), (np.float32(0.5), 0.5), (Fraction(1, 4), 0.25)],
                         ids=_id)
def test_a_float_field_takes_finite_real_numbers(value, want):
    cfg = _config(eps=value)
    assert cfg.eps == want and type(cfg.eps) is float


@pytest.mark.parametrize("value", [True, np.bool_(False), float("nan"), float("-inf"), "1e-5", 10 ** 400, -10 ** 400],
                         ids=_id)
def test_a_float_field_refuses_anything_else_naming_it(value):
    """An integer past a float's range is no finite float: refused as an infinity is."""
    with pytest.raises(ValueError, match=re.escape(f"config field 'eps' must be a finite number, got {value!r}")):
        _config(eps=value)


def test_fields_assigned_after_construction_are_checked_the_same_way():
    cfg = _config()
    cfg.hidden_size, cfg.rope_theta = np.int32(32), 10 ** 4
    cfg.validate_fields()
    assert (cfg.hidden_size, cfg.rope_theta) == (32, 10000.0)
    assert type(cfg.hidden_size) is int and type(cfg.rope_theta) is float
    cfg.rope_theta = 10 ** 400
    with pytest.raises(ValueError, match="config field 'rope_theta' must be a finite number"):
        cfg.validate_fields()


@pytest.mark.parametrize("value", [True, "0.5", float("nan"), -0.5, 10 ** 400], ids=_id)
def test_an_eps_attn_assigned_after_construction_is_checked_as_a_finite_number(value):
    cfg = _config(rule="1A")  # an inner-product rule: the normalized read applies
    cfg.eps_attn = np.float32(0.5)
    cfg.validate_fields()
    assert cfg.eps_attn == 0.5 and type(cfg.eps_attn) is float
    cfg.eps_attn = value
    with pytest.raises(ValueError, match=re.escape(f"config field 'eps_attn' must be None or a finite number >= 0, "
                                                   f"got {value}")):
        cfg.validate_fields()
