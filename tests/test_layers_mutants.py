"""Properties of the layers and the LM that the exact-reference tests leave open, each against a formula
written here: the SwiGLU block with its two input projections told apart, RMSNorm at ``eps = 0``, the
gradient through several cached attention calls, and the loss of a cached continuation whose mask covers
the consumed columns too."""
import pytest
import torch

from falcon_fwa.layers import RMSNorm
from falcon_fwa.layers.mlp import SwiGLU
from falcon_fwa.models import FalconForCausalLM, count_parameters, get_preset

F64 = torch.float64

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny tensors, one torch thread


def _sigmoid(z):
    return 1.0 / (1.0 + torch.exp(-z))


def test_swiglu_gates_the_up_projection_with_silu_of_the_gate_projection():
    """``down(SiLU(W_gate x) * W_up x)``: SiLU is not odd, so exchanging ``W_gate`` and ``W_up`` changes the
    output; the weights are drawn independently, so a swap cannot hide behind equal matrices."""
    torch.manual_seed(0)
    mlp = SwiGLU(8, 12).double()
    x = torch.randn(3, 5, 8, dtype=F64)
    with torch.no_grad():
        a, b = x @ mlp.gate_proj.weight.T, x @ mlp.up_proj.weight.T
        want = (a * _sigmoid(a) * b) @ mlp.down_proj.weight.T
        torch.testing.assert_close(mlp(x), want, rtol=1e-12, atol=1e-12)
        swapped = (b * _sigmoid(b) * a) @ mlp.down_proj.weight.T
    assert float((want - swapped).abs().max()) > 1e-3  # the check above tells the two apart


def test_rmsnorm_takes_eps_zero_as_the_plain_rms():
    """``eps = 0`` is in the documented range (``>= 0``): ``y = x / sqrt(mean(x^2)) * w``."""
    torch.manual_seed(0)
    norm = RMSNorm(6, eps=0).double()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(4, 6, dtype=F64)
    want = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True)) * norm.weight
    torch.testing.assert_close(norm(x), want, rtol=1e-12, atol=1e-12)


def test_cached_attention_calls_backpropagate_as_one_uncached_pass():
    """A prefill and two decoding calls through the KV cache, with gradients on: the summed log-likelihood's
    gradient equals that of one causal pass over the whole sequence (the cache's buffers are written after
    earlier calls' attention read them, which must not corrupt their backward)."""
    torch.manual_seed(0)
    model = FalconForCausalLM(get_preset("tiny-transformer")).to(F64)
    ids = torch.randint(0, model.config.vocab_size, (2, 6))

    def loglik(logits):  # sum_t log p(ids[t + 1] | ids[:t + 1])
        return torch.log_softmax(logits, -1)[:, :-1].gather(-1, ids[:, 1:, None]).sum()

    model.zero_grad()
    full = model(ids, use_cache=False).logits
    loglik(full).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}

    model.zero_grad()
    out = model(ids[:, :4], use_cache=True)
    logits = [out.logits]
    cache = out.past_key_values
    for t in (4, 5):  # the second step writes into buffers the first step's attention saved
        out = model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
        logits.append(out.logits)
    torch.testing.assert_close(torch.cat(logits, 1), full.detach(), rtol=1e-10, atol=1e-10)
    loglik(torch.cat(logits, 1)).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-9, atol=1e-12, msg=n)


@pytest.mark.parametrize("mixer", ["falcon", "transformer"])
def test_loss_of_a_cached_continuation_reads_the_last_columns_of_the_mask(mixer):
    """A continuation's ``attention_mask`` covers the consumed columns and the new ones; the loss masks the
    targets by the new ones (its last ``T`` columns). Here the prefix is left padded and the continuation all
    real, so every continuation target is scored: the loss is the plain shifted cross-entropy of the returned
    logits, computed by hand."""
    torch.manual_seed(0)
    model = FalconForCausalLM(get_preset(f"tiny-{mixer}")).to(F64).eval()
    V = model.config.vocab_size
    ids = torch.randint(0, V, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, :3] = 0  # row 1: three left pads in the prefix
    with torch.no_grad():
        cache = model(ids[:, :5], attention_mask=mask[:, :5], use_cache=True).past_key_values
        out = model(ids[:, 5:], attention_mask=mask, labels=ids[:, 5:], past_key_values=cache, use_cache=True)
    logp = torch.log_softmax(out.logits.double(), -1)
    want = -logp[:, :-1].gather(-1, ids[:, 6:, None]).mean()
    torch.testing.assert_close(out.loss.double(), want, rtol=1e-12, atol=1e-12)


def test_a_detached_cache_ends_the_backward_at_the_chunk_boundary():
    """Truncated backpropagation: after ``cache.detach()`` the next chunk's gradient is the one it has with the
    first chunk's state given as a constant (that chunk run without gradients), for the recurrent state and the
    short-convolution buffers alike."""
    torch.manual_seed(0)
    model = FalconForCausalLM(get_preset("tiny-falcon")).to(F64).train()
    ids = torch.randint(0, model.config.vocab_size, (2, 10))
    with torch.no_grad():
        const = model(ids[:, :6], use_cache=True).past_key_values
    model.zero_grad()
    model(ids[:, 6:], past_key_values=const, use_cache=True).logits.pow(2).mean().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}

    model.zero_grad()
    cache = model(ids[:, :6], use_cache=True).past_key_values.detach()
    model(ids[:, 6:], past_key_values=cache, use_cache=True).logits.pow(2).mean().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-10, atol=1e-14, msg=n)


@pytest.mark.parametrize("tied", [True, False])
def test_parameter_groups_of_a_transformer_count_by_their_formulas(tied):
    """``count_parameters`` of an ``L``-layer Transformer of width ``d``, MLP width ``m`` and vocabulary ``V``:
    embedding ``V d`` (``2 V d`` with an untied output head), mixers ``4 L d^2``, MLPs ``3 L d m``, norms
    ``(2 L + 1) d``."""
    cfg = get_preset("tiny-transformer", tie_word_embeddings=tied)
    V, d, L, m = cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size
    want = {"embedding": (1 if tied else 2) * V * d, "mixer": 4 * L * d * d, "mlp": 3 * L * d * m,
            "norms": (2 * L + 1) * d}
    want["total"] = sum(want.values())
    assert count_parameters(cfg) == want
