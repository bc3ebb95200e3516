"""Config values that used to fail outside the config's own checks: head sizes of zero or below for the
mixers whose query scale is ``head_k_dim ** -0.5``, weight dtypes that are no floating-point torch dtype,
attention weights asked for through the config rather than the forward's argument, other libraries' RoPE
scaling, which the Transformer here does not apply, and chunk sizes the Triton chunk kernels lack."""
import importlib.util
import os

import pytest
import torch

from falcon_fwa.models import FalconConfig, FalconForCausalLM, get_preset

pytestmark = pytest.mark.usefixtures("one_thread")

MIXERS = ["falcon", "transformer", "deltanet", "gated_deltanet", "mamba2", "retnet"]


@pytest.mark.parametrize("mixer", MIXERS)
@pytest.mark.parametrize("field,value", [("head_k_dim", 0), ("head_k_dim", -4), ("head_v_dim", 0),
                                         ("hidden_size", 0), ("hidden_size", -32), ("num_heads", -2)])
def test_a_size_below_one_is_named_for_every_mixer(mixer, field, value):
    """Every mixer, whatever its query scale: the sizes the head dims come from and the head dims themselves
    are refused by name (not the ``0 ** -0.5`` of the default query scale, or its complex value for a
    negative head dim)."""
    with pytest.raises(ValueError, match=f"config field '{field}' must be >= 1, got {value}"):
        get_preset(f"tiny-{mixer}", **{field: value})


@pytest.mark.parametrize("mixer", MIXERS)
def test_the_default_query_scale_follows_the_head_dim(mixer):
    """The sizes that stay allowed: ``head_k_dim ** -0.5`` for the mixers without a scale of their own."""
    config = get_preset(f"tiny-{mixer}", hidden_size=36, num_heads=3)  # heads of 12
    assert config.head_k_dim == 12
    assert config.query_scale == pytest.approx(1.0 if mixer in ("falcon", "mamba2") else 12 ** -0.5, rel=1e-15)


@pytest.mark.parametrize("field", ["dtype", "torch_dtype"])
@pytest.mark.parametrize("value", ["float77", "int64", 5, torch.int32])
def test_a_weight_dtype_that_is_no_floating_point_dtype_is_named(field, value):
    with pytest.raises(ValueError, match=f"config field '{field}' must be None or a floating-point torch dtype"):
        FalconConfig(vocab_size=64, hidden_size=32, num_heads=2, num_hidden_layers=1, **{field: value})


@pytest.mark.parametrize("value,dtype", [("bfloat16", torch.bfloat16), ("float64", torch.float64),
                                         (torch.float16, torch.float16), (None, None)])
def test_a_floating_point_weight_dtype_is_kept(value, dtype):
    config = FalconConfig(vocab_size=64, hidden_size=32, num_heads=2, num_hidden_layers=1, dtype=value)
    assert config.dtype == dtype


@pytest.mark.parametrize("mixer", ["falcon", "transformer"])
def test_attention_weights_asked_for_through_the_config_are_refused(mixer):
    """``output_attentions=None`` takes the config's value, as ``output_hidden_states`` does: a config that asks for
    attention weights is refused as the argument is, instead of a forward that silently returns none."""
    torch.manual_seed(0)
    model = FalconForCausalLM(get_preset(f"tiny-{mixer}")).eval()
    ids = torch.randint(0, 64, (1, 5))
    plain = model(ids, use_cache=False).logits
    model.config.output_attentions = True
    with pytest.raises(ValueError, match="output_attentions=True: the model returns no attention weights"):
        model(ids, use_cache=False)
    # an explicit False outranks the config, and gives the same logits
    assert torch.equal(model(ids, use_cache=False, output_attentions=False).logits, plain)
    model.config.output_attentions = False
    assert torch.equal(model(ids, use_cache=False).logits, plain)


@pytest.mark.parametrize("field,value", [
    ("rope_scaling", {"rope_type": "linear", "factor": 4.0}),  # positions / 4: a context 4 times longer
    ("rope_scaling", {"type": "dynamic", "factor": 2.0}),  # the older spelling of the type
    ("rope_parameters", {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 1024}),
    ("rope_parameters", {"rope_type": "default", "rope_theta": 500000.0}),  # another theta than rope_theta
    ("rope_scaling", 2.0),
])
def test_rope_settings_the_transformer_does_not_apply_are_named(field, value):
    """The Transformer rotates queries and keys by ``rope_theta`` alone: another library's RoPE scaling would be
    stored, saved and reloaded while the model ran plain RoPE."""
    with pytest.raises(ValueError, match=f"config field '{field}' = .*rotates by rope_theta alone"):
        FalconConfig(vocab_size=64, hidden_size=32, num_heads=2, num_hidden_layers=1, mixer="transformer",
                     **{field: value})


@pytest.mark.parametrize("value", [None, {"rope_type": "default"}, {"rope_type": "default", "rope_theta": 10000.0}])
def test_plain_rope_settings_pass(value):
    """What the model computes: no scaling, and at most the config's own theta."""
    config = FalconConfig(vocab_size=64, hidden_size=32, num_heads=2, num_hidden_layers=1, mixer="transformer",
                          rope_theta=10000.0, rope_parameters=value)
    assert config.rope_theta == 10000.0


@pytest.mark.parametrize("chunk_size", [8, 24, 256])
def test_a_chunk_size_the_triton_kernels_lack_is_named_when_the_config_is_built(chunk_size):
    """``backend="triton"`` with the chunk form: a chunk size the kernels lack was the op's error at the first
    forward on a GPU; the recurrent form and the other backends take any chunk size."""
    with pytest.raises(ValueError, match=f"config field 'chunk_size' = {chunk_size}: backend='triton'"):
        get_preset("tiny-falcon", backend="triton", chunk_size=chunk_size)
    assert get_preset("tiny-falcon", backend="triton", form="recurrent", chunk_size=chunk_size).chunk_size == chunk_size
    assert get_preset("tiny-falcon", backend="native", chunk_size=chunk_size).chunk_size == chunk_size


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_the_config_takes_exactly_the_chunk_sizes_the_triton_op_takes():
    """Around and between the kernels' chunk sizes, the config refuses a chunk size exactly where the op on its
    Triton kernels refuses it (``NotImplementedError`` naming it); one it takes gives the outputs of the PyTorch
    forms (through Triton's interpreter on the CPU)."""
    from falcon_fwa.ops import falcon_attention

    from conftest import random_inputs, rel_err

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernels need CUDA or TRITON_INTERPRET=1 set before triton was imported")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = {name: t.to(device) for name, t in random_inputs("1A", B=1, T=3, H=1, K=4, V=4, dtype=torch.float32).items()}
    args = (x["q"], x["k"], x["v"], x["beta"], x["lam"])
    taken = []
    for chunk_size in (1, 8, 15, 16, 24, 32, 48, 64, 96, 128, 192, 256):
        try:
            get_preset("tiny-falcon", backend="triton", chunk_size=chunk_size)
            config_takes = True
        except ValueError as err:
            assert f"config field 'chunk_size' = {chunk_size}: backend='triton'" in str(err), str(err)
            config_takes = False
        try:
            o, _ = falcon_attention(*args, rule="1A", chunk_size=chunk_size, backend="triton")
        except NotImplementedError as err:
            assert f"chunk_size={chunk_size}" in str(err), str(err)
            assert not config_takes, chunk_size
            continue
        assert config_takes, chunk_size
        ref, _ = falcon_attention(*args, rule="1A", chunk_size=chunk_size, backend="torch")
        assert rel_err(o, ref) < 2e-3, (chunk_size, rel_err(o, ref))
        taken.append(chunk_size)
    assert taken == [16, 32, 64, 128]  # the chunk sizes the kernels are documented to take


@pytest.mark.parametrize("field,value", [
    ("rope_scaling", {"rope_type": "linear", "factor": 4.0}),
    ("rope_parameters", {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 1024}),
])
def test_rope_settings_assigned_after_the_config_was_built_are_named_when_the_model_is_built(field, value):
    """``config.rope_scaling = {...}`` after the config was built (the fields the model checks again when it is
    built): a scaling the Transformer does not apply is refused then, not a model that runs plain RoPE whose
    saved config no longer loads; plain RoPE of the config's theta still builds."""
    import warnings

    config = FalconConfig(vocab_size=64, hidden_size=32, num_heads=2, num_hidden_layers=1, mixer="transformer")
    with warnings.catch_warnings():  # (transformers 5 calls rope_scaling deprecated)
        warnings.simplefilter("ignore", FutureWarning)
        setattr(config, field, value)
    # (transformers 5 keeps both under rope_parameters, which rope_scaling reads)
    with pytest.raises(ValueError, match="config field 'rope_(scaling|parameters)' = .*rotates by rope_theta alone"):
        FalconForCausalLM(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        setattr(config, field, {"rope_type": "default"})
    assert FalconForCausalLM(config).config.rope_theta == 10000.0


@pytest.mark.parametrize("settings", [dict(chunk_size=24), dict(chunk_size=256), dict(form="parallel")],
                         ids=["chunk24", "chunk256", "parallel"])
def test_the_transformer_takes_the_recurrent_ops_triton_settings_unread(settings):
    """The Transformer keeps the recurrent op's ``backend``, ``form`` and ``chunk_size`` as given and reads none of
    them (its attention is ``scaled_dot_product_attention``): ``backend="triton"`` with a chunk size or form the
    kernels lack builds the same model, with the same logits, as ``backend="native"``."""
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    logits = []
    for backend in ("native", "triton"):
        config = get_preset("tiny-transformer", backend=backend, **settings)
        assert (config.backend, *(getattr(config, k) for k in settings)) == (backend, *settings.values())
        torch.manual_seed(0)
        with torch.no_grad():
            logits.append(FalconForCausalLM(config).eval()(ids, use_cache=False).logits)
    assert torch.equal(logits[0], logits[1])
    with pytest.raises(ValueError, match="config field '(backend|chunk_size)' = .*triton"):  # a recurrent mixer reads them
        get_preset("tiny-falcon", backend="triton", **settings)
