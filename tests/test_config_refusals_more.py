"""Config refusals that name what happened and what to do: fields derived when the config was built and left
behind by a field assigned since, backend limits known from the config alone, token ids outside the vocabulary."""
import importlib.util
import re

import pytest

from falcon_fwa.models import FalconConfig, FalconForCausalLM


def _transformer(**kw):
    return FalconConfig(**{**dict(mixer="transformer", vocab_size=100, hidden_size=64, num_heads=4,
                                  num_hidden_layers=1), **kw})


def _same_fields(a: FalconConfig, b: FalconConfig) -> bool:
    skip = {"transformers_version"}
    return {k: v for k, v in a.to_dict().items() if k not in skip} == {k: v for k, v in b.to_dict().items()
                                                                      if k not in skip}


@pytest.mark.parametrize("field,value,per_head", [("num_heads", 2, 32), ("num_heads", 8, 8), ("hidden_size", 128, 32)])
def test_a_transformer_shape_assigned_after_the_config_was_built_names_the_derived_head_dims(field, value, per_head):
    """Built with hidden_size 64 and 4 heads, the config's head dims are 16 (64 / 4). Assigning num_heads or
    hidden_size afterwards leaves them at 16: the refusal says so, with the new head dim (hand-computed
    ``per_head``) and the way out, instead of telling to leave head dims unset that were never set."""
    config = _transformer()
    assert (config.head_k_dim, config.head_v_dim) == (16, 16)
    setattr(config, field, value)
    with pytest.raises(ValueError) as err:
        config.validate_fields()
    message = str(err.value)
    assert "leave them unset" not in message
    assert "'head_k_dim'" in message and "'head_v_dim'" in message and "= 16" in message
    assert f"hidden_size / num_heads = {config.hidden_size} / {config.num_heads} = {per_head}" in message
    assert "when it was built" in message
    assert f"set head_k_dim = head_v_dim = {per_head}" in message and "build the config again" in message
    with pytest.raises(ValueError, match=re.escape(f"= {per_head}")):  # the model refuses it the same way
        FalconForCausalLM(config)

    # following the message gives the config built with the new shape from the start (the MLP's width, derived
    # from hidden_size too but any width the MLP takes, kept: 8 * 64 / 3 rounded up to 64)
    config.head_k_dim = config.head_v_dim = per_head
    config.query_scale = per_head ** -0.5
    config.validate_fields()
    assert _same_fields(config, _transformer(**{field: value}, intermediate_size=192))


def test_following_the_head_dims_alone_then_names_query_scale_with_its_value():
    """Head dims set right after num_heads changed, query_scale still the old head dim's 16 ** -0.5 = 0.25: the
    refusal asks for 32 ** -0.5, not to leave a field unset on a built config."""
    config = _transformer()
    config.num_heads = 2
    config.head_k_dim = config.head_v_dim = 32
    with pytest.raises(ValueError) as err:
        config.validate_fields()
    message = str(err.value)
    assert message.startswith("config field 'query_scale' = 0.25 ")
    assert f"set it to {32 ** -0.5!r}" in message and "leave it unset" not in message


def test_one_head_dim_assigned_after_the_config_was_built_is_named_with_the_value_to_set():
    config = _transformer()
    config.head_k_dim = 8
    with pytest.raises(ValueError, match=re.escape("config field 'head_k_dim' = 8 differs from the Transformer's "
                                                   "head dim hidden_size / num_heads = 16")) as err:
        config.validate_fields()
    assert "set it to 16" in str(err.value)


def test_head_dims_given_to_the_constructor_are_still_asked_to_be_left_unset():
    """Given when the config is built, the head dims are the caller's own: the refusal says to leave them unset
    (nothing was derived)."""
    with pytest.raises(ValueError, match=re.escape("config field 'head_k_dim' = 8 differs from the Transformer's "
                                                   "head dim hidden_size / num_heads = 16")) as err:
        _transformer(head_k_dim=8, head_v_dim=8)
    assert "leave them unset" in str(err.value) and "when it was built" not in str(err.value)
    assert (_transformer(head_k_dim=16, head_v_dim=16).head_k_dim, _transformer().head_v_dim) == (16, 16)


def _recurrent(**kw):
    return FalconConfig(**{**dict(vocab_size=64, hidden_size=32, num_heads=1, num_hidden_layers=1), **kw})


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("rule,form", [("1", "chunk"), ("2", "chunk"), ("3", "chunk"), ("1A", "chunk"),
                                       ("1A", "recurrent"), ("1", "recurrent")])
def test_the_config_refuses_exactly_the_key_dims_the_triton_op_refuses(rule, form):
    """At the limit, the config refuses a key dim exactly where the op on its Triton kernels refuses it
    (``NotImplementedError`` naming the head dim): the regression rules' chunk kernels and the fused recurrent
    kernel hold a head's whole key dim in one tile, the inner-product rules' chunk kernels tile it. A key dim both
    take gives the outputs of the PyTorch forms (through Triton's interpreter on the CPU)."""
    import os

    import torch

    from falcon_fwa.ops import falcon_attention

    from conftest import random_inputs, rel_err

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernels need CUDA or TRITON_INTERPRET=1 set before triton was imported")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    taken = []
    for K in (256, 257, 264):
        try:
            _recurrent(backend="triton", rule=rule, form=form, head_k_dim=K)
            config_takes = True
        except ValueError as err:
            assert f"config field 'head_k_dim' = {K}: backend='triton'" in str(err), str(err)
            config_takes = False
        x = {name: t.to(device) for name, t in random_inputs(rule, B=1, T=3, H=1, K=K, V=4,
                                                             dtype=torch.float32).items()}
        args = (x["q"], x["k"], x["v"], x["beta"], x["lam"])
        try:
            o, _ = falcon_attention(*args, rule=rule, window=4, form=form, chunk_size=16, backend="triton")
        except NotImplementedError as err:
            assert f"head dim K={K}" in str(err), str(err)
            assert not config_takes, K
            continue
        assert config_takes, K
        ref, _ = falcon_attention(*args, rule=rule, window=4, form=form, chunk_size=16, backend="torch")
        assert rel_err(o, ref) < 2e-3, (K, rel_err(o, ref))
        taken.append(K)
    assert taken == ([256, 257, 264] if rule == "1A" and form == "chunk" else [256])


@pytest.mark.parametrize("rule,form", [("1", "chunk"), ("2", "chunk"), ("3", "chunk"), ("1A", "recurrent"),
                                       ("1", "recurrent")])
def test_triton_refuses_a_key_dim_its_kernels_do_not_hold_when_the_config_is_built(rule, form):
    """backend='triton' with a key dim of 264 on the regression rules' chunk kernels or on the fused recurrent
    kernel failed only in the first forward (NotImplementedError of the op); the config names head_k_dim and the
    limit. 256 itself is taken, as is 264 on backend='native' (the PyTorch forms)."""
    with pytest.raises(ValueError, match=r"config field 'head_k_dim' = 264: backend='triton'.* at most 256 wide"):
        _recurrent(backend="triton", rule=rule, form=form, head_k_dim=264)
    with pytest.raises(ValueError, match=r"config field 'head_k_dim' = 264: backend='triton'"):  # derived: 264 / 1
        _recurrent(backend="triton", rule=rule, form=form, hidden_size=264)
    assert _recurrent(backend="triton", rule=rule, form=form, head_k_dim=256).head_k_dim == 256
    assert _recurrent(backend="native", rule=rule, form=form, head_k_dim=264).head_k_dim == 264
    config = _recurrent(backend="triton", rule=rule, form=form, head_k_dim=16)
    config.head_k_dim = 264  # assigned after the config was built: the model refuses it when it is built
    with pytest.raises(ValueError, match=r"config field 'head_k_dim' = 264: backend='triton'"):
        FalconForCausalLM(config)


def test_triton_takes_wide_keys_where_its_kernels_do():
    """The inner-product rules' chunk kernels tile the key dim: a key dim of 264 there is no refusal, nor is a
    Transformer's (which reads no backend)."""
    for rule in ("1A", "2A", "3A"):
        assert _recurrent(backend="triton", rule=rule, head_k_dim=264).head_k_dim == 264
    assert _transformer(backend="triton", hidden_size=528, num_heads=2).head_k_dim == 264


def test_native_backend_runs_a_wide_regression_key_on_the_cpu():
    """backend='native' with rule 1 and head_k_dim 264 (past the kernels) builds and runs; its logits are those
    of the same weights with the PyTorch forms forced."""
    import torch

    torch.manual_seed(0)
    native = FalconForCausalLM(_recurrent(backend="native", rule="1", head_k_dim=264)).double().eval()
    forced = FalconForCausalLM(_recurrent(backend="torch", rule="1", head_k_dim=264)).double().eval()
    forced.load_state_dict(native.state_dict())
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        got, want = native(ids).logits, forced(ids).logits
    assert got.shape == (2, 7, 64) and torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=0, atol=0)


TOKEN_FIELDS = ("pad_token_id", "bos_token_id", "eos_token_id")


@pytest.mark.parametrize("field", TOKEN_FIELDS)
@pytest.mark.parametrize("bad", [64, 1000, -1])
def test_a_token_id_outside_the_vocabulary_is_refused_when_the_config_is_built(field, bad):
    """vocab_size 64 has the ids 0..63 (the embedding's rows): 64, 1000 and -1 are no token's, refused naming the
    field and vocab_size (transformers only logs a warning); 0, 63 and None are taken, stored as Python ints."""
    import numpy as np
    import torch

    with pytest.raises(ValueError, match=rf"config field '{field}' = {bad} is no token id .*vocab_size = 64 "
                                         r"\(ids 0 to 63\)"):
        _recurrent(**{field: bad})
    with pytest.raises(IndexError):  # the reason: the embedding has no row for it
        torch.nn.Embedding(64, 4)(torch.tensor([bad]))
    for good in (0, 63, np.int64(63), 63.0):
        config = _recurrent(**{field: good})
        assert getattr(config, field) == int(good) and type(getattr(config, field)) is int
    assert getattr(_recurrent(**{field: None}), field) is None
    with pytest.raises(ValueError, match=f"config field '{field}' must be an integer"):
        _recurrent(**{field: True})


def test_a_list_of_end_ids_is_checked_id_by_id():
    assert _recurrent(eos_token_id=[0, 63]).eos_token_id == [0, 63]
    with pytest.raises(ValueError, match=r"config field 'eos_token_id' = \[3, 64\] holds 64, which is no token id .*"
                                         r"vocab_size = 64"):
        _recurrent(eos_token_id=[3, 64])


def test_a_vocabulary_shrunk_after_the_config_was_built_is_refused_by_the_token_id_it_drops(tmp_path):
    """End id 50 in a vocabulary of 64, then vocab_size = 32 on the built config: the model refuses the config,
    naming eos_token_id; ids within the vocabulary save and load as they were given."""
    config = _recurrent(eos_token_id=50, pad_token_id=0, bos_token_id=1)
    config.save_pretrained(tmp_path)
    again = FalconConfig.from_pretrained(tmp_path)
    assert (again.pad_token_id, again.bos_token_id, again.eos_token_id) == (0, 1, 50)
    config.vocab_size = 32
    with pytest.raises(ValueError, match=r"config field 'eos_token_id' = 50 is no token id .*vocab_size = 32"):
        FalconForCausalLM(config)
    with pytest.raises(ValueError, match=r"config field 'eos_token_id' = 40 .*vocab_size = 32"):
        FalconConfig.from_pretrained(tmp_path, vocab_size=32, eos_token_id=40)
