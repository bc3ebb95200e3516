"""``falcon_attention(backend=...)`` routes to the Triton kernels or the PyTorch forms."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("falcon_fwa.ops.triton")  # triton, and one the kernels take
from conftest import padded_and_packed_loss

from test_triton_interpreter import FRESH_PROCESS_REASON, prepare_interpreter

from falcon_fwa import falcon_attention, falcon_step
from falcon_fwa.models import FalconForCausalLM, get_preset

KERNELS_RUN = prepare_interpreter()
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(T=21, seed=0):
    g = torch.Generator().manual_seed(seed)
    B, H, K, V = 2, 2, 16, 16
    q, k = (torch.randn(B, T, H, K, generator=g) / 4 for _ in range(2))
    v = torch.randn(B, T, H, V, generator=g)
    beta = 0.1 + 1.8 * torch.rand(B, T, H, generator=g)
    lam = torch.rand(B, T, H, generator=g)
    return [t.to(DEVICE) for t in (q, k, v, beta, lam)]


def test_backend_is_checked():
    q, k, v, beta, lam = _inputs(T=4)
    with pytest.raises(ValueError, match="backend"):
        falcon_attention(q, k, v, beta, lam, backend="cuda")
    with pytest.raises(ValueError, match="form"):  # the recurrent form has a kernel (the fused one), the parallel none
        falcon_attention(q, k, v, beta, lam, backend="triton", form="parallel")
    with pytest.raises(ValueError, match="backend"):
        falcon_step(q[:, 0], k[:, 0], v[:, 0], beta[:, 0], lam[:, 0], state=None, backend="gpu")


_CPU_SCRIPT = """
import os, sys, torch
os.environ.pop("TRITON_INTERPRET", None)
from falcon_fwa import falcon_attention, falcon_step
if sys.argv[1] == "late":  # set after the import, as the message once advised without saying when
    os.environ["TRITON_INTERPRET"] = "1"
x = torch.rand(1, 4, 1, 16)
calls = dict(chunk=lambda: falcon_attention(x, x, x, x[..., 0], x[..., 0], chunk_size=16, backend="triton"),
             recurrent=lambda: falcon_attention(x, x, x, x[..., 0], x[..., 0], form="recurrent", backend="triton"),
             step=lambda: falcon_step(x[:, 0], x[:, 0], x[:, 0], x[:, 0, :, 0], x[:, 0, :, 0], state=None,
                                      backend="triton"))
for name, call in calls.items():
    try:
        call()
    except Exception as e:
        print(name, type(e).__name__, e)
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the kernels run on CUDA tensors here")
@pytest.mark.parametrize("when", ["unset", "late"])
def test_triton_backend_on_cpu_without_the_interpreter_names_the_backend(when):
    """``backend="triton"`` on CPU tensors in a process whose kernels were not built for Triton's interpreter:
    ``NotImplementedError`` naming the backend and the way out, for the chunk kernels, the fused recurrent
    kernel and the step; also where TRITON_INTERPRET=1 is set after the import (then the kernels, built for a
    GPU, ended in Triton's 'Cannot call @triton.jit'd outside of the scope of a kernel')."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _CPU_SCRIPT, when], capture_output=True, text=True, timeout=120)
    lines = done.stdout.splitlines()
    expected = [[name, "NotImplementedError"] for name in ("chunk", "recurrent", "step")]
    assert [line.split()[:2] for line in lines] == expected, done.stdout + done.stderr
    for line in lines:
        assert "backend='triton': CUDA tensors are needed by the " in line and "q is on cpu" in line, line
        assert "set TRITON_INTERPRET=1 before importing falcon_fwa or triton" in line, line
        assert ("it was set after that import" in line) == (when == "late"), line


def test_triton_backend_refuses_what_the_kernels_do_not_cover():
    q, k, v, beta, lam = _inputs(T=4)
    with pytest.raises(NotImplementedError, match="chunk_size=24"):
        falcon_attention(q, k, v, beta, lam, rule="3", chunk_size=24, backend="triton")
    with pytest.raises(NotImplementedError, match="decay_floor=1e-08"):  # 1 - decay_floor is 1 in float32
        falcon_attention(q, k, v, beta, lam, rule="1A", decay_floor=1e-8, backend="triton")


@pytest.mark.skipif(not KERNELS_RUN, reason=FRESH_PROCESS_REASON)
@pytest.mark.parametrize("rule", ["1A", "3A"])
def test_final_state_is_fp32_on_both_backends(rule):
    """With 16-bit inputs, the final state (S, the carried key, the sliding tail) is fp32 on both backends."""
    q, k, v, beta, lam = (t.half() for t in _inputs(T=5))
    states = [falcon_attention(q, k, v, beta, lam, rule=rule, chunk_size=16, backend=backend,
                               output_final_state=True)[1] for backend in ("torch", "triton")]
    for st in states:
        held = [st.S, st.last_key] + ([st.tail_x, st.tail_y] if rule == "3A" else [])
        assert all(t.dtype == torch.float32 for t in held), [t.dtype for t in held]
    assert torch.equal(states[0].last_key, states[1].last_key)


@pytest.mark.skipif(not KERNELS_RUN, reason=FRESH_PROCESS_REASON)
@pytest.mark.parametrize("rule", ["1A", "1"])
def test_triton_backend_takes_a_hard_reset_gate(rule):
    """A gate of -inf (exp(g) = 0) reaches the kernels floored: outputs and gradients are the
    recurrent form's, finite (unfloored, the chunk-local log differences would be NaN). The
    gradients, the gate's too, are those of the recurrent form in float64 within fp32 rounding."""
    q, k, v, beta, lam = _inputs()
    g = -torch.rand(*beta.shape, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    g[:, 9] = float("-inf")
    ref, _ = falcon_attention(q, k, v, beta, lam, rule=rule, log_gate=g, form="recurrent", backend="torch")
    assert torch.isfinite(ref).all()
    leaves = [t.clone().requires_grad_() for t in (q, k, v, beta, lam, g)]
    out, _ = falcon_attention(*leaves[:5], rule=rule, log_gate=leaves[5], chunk_size=16, backend="triton")
    assert (out - ref).abs().max() <= 1e-4 * ref.abs().max()
    out.square().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in leaves)
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v, beta, lam, g)]
    ref64, _ = falcon_attention(*ref_leaves[:5], rule=rule, log_gate=ref_leaves[5], form="recurrent", backend="torch")
    ref64.square().sum().backward()
    for name, t, r in zip(("q", "k", "v", "beta", "lam", "log_gate"), leaves, ref_leaves):
        scale = r.grad.abs().max()
        assert scale > 0, name
        err = (t.grad.double() - r.grad).abs().max() / scale
        assert err <= 1e-4, (name, err.item())
    assert ref_leaves[5].grad[:, 9].abs().max() == 0  # the reset step's gate: d/dg exp(g) S = 0 at g = -inf


@pytest.mark.skipif(not KERNELS_RUN, reason=FRESH_PROCESS_REASON)
@pytest.mark.parametrize("rule", ["1A", "1"])
def test_triton_backend_matches_the_torch_forms(rule):
    q, k, v, beta, lam = _inputs()
    ref, ref_state = falcon_attention(q, k, v, beta, lam, rule=rule, chunk_size=16, backend="torch",
                                      output_final_state=True)
    out, state = falcon_attention(q, k, v, beta, lam, rule=rule, chunk_size=16, backend="triton",
                                  output_final_state=True)
    assert (out - ref).abs().max() <= 1e-4 * ref.abs().max()
    assert (state.S - ref_state.S).abs().max() <= 1e-4 * ref_state.S.abs().max()
    # "auto" picks the kernels only on CUDA: on the CPU it is the PyTorch chunk form itself.
    auto, _ = falcon_attention(q, k, v, beta, lam, rule=rule, chunk_size=16)
    if DEVICE == "cpu":
        assert torch.equal(auto, ref)


@pytest.mark.parametrize("form", ["recurrent", "parallel"])
def test_auto_backend_keeps_the_form_asked_for(form, monkeypatch):
    """Only ``form="chunk"`` may go to the chunk kernels: the recurrent form is the reference."""
    from falcon_fwa.ops import api

    def kernels(*args, **kwargs):
        raise AssertionError("the chunk kernels ran for form=" + form)

    monkeypatch.setattr(api, "_triton_chunk", lambda backend, q, rule: kernels)
    q, k, v, beta, lam = _inputs(T=5)
    out, _ = falcon_attention(q, k, v, beta, lam, form=form, backend="auto")
    ref, _ = falcon_attention(q, k, v, beta, lam, form=form, backend="torch")
    assert torch.equal(out, ref)


@pytest.fixture
def restore_matmul_precision():
    before = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(before)


def test_fp32_dots_follow_torch_matmul_precision(restore_matmul_precision):
    from falcon_fwa.ops.triton.launch import dot_precision
    torch.set_float32_matmul_precision("highest")
    assert dot_precision(torch.float32) == "ieee"
    for setting in ("high", "medium"):
        torch.set_float32_matmul_precision(setting)
        assert dot_precision(torch.float32) == "tf32"
    for dtype in (torch.bfloat16, torch.float16):  # tensor cores whatever the setting
        assert dot_precision(dtype) == "tf32"
        torch.set_float32_matmul_precision("highest")
        assert dot_precision(dtype) == "tf32"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="TF32 dots exist on CUDA only")
@pytest.mark.parametrize("rule", ["1A", "1"])
def test_fp32_kernels_under_tf32_stay_close_to_float64(rule, restore_matmul_precision):
    q, k, v, beta, lam = _inputs(T=100)
    ref, _ = falcon_attention(q.double(), k.double(), v.double(), beta.double(), lam.double(), rule=rule,
                              form="recurrent", backend="torch")
    errs = {}
    for setting in ("highest", "high"):
        torch.set_float32_matmul_precision(setting)
        o, _ = falcon_attention(q, k, v, beta, lam, rule=rule, form="chunk", chunk_size=16, backend="triton")
        errs[setting] = ((o.double() - ref).norm() / ref.norm()).item()
    assert errs["highest"] <= 1e-4 and errs["high"] <= 5e-3, errs
    assert errs["high"] > 10 * errs["highest"], errs  # the setting reached the kernels


def test_host_grid_helpers_match_triton():
    """The host-side ``cdiv`` / ``next_power_of_2`` (plain integer arithmetic) give Triton's values
    (no kernel runs: only ``triton`` itself is needed)."""
    triton = pytest.importorskip("triton")

    from falcon_fwa.ops.triton.launch import cdiv, next_power_of_2

    for n in range(1, 600):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 2, 3, 16, 64, 100):
            assert cdiv(n, d) == triton.cdiv(n, d) == -(-n // d), (n, d)
    assert [next_power_of_2(n) for n in (1, 2, 3, 64, 65, 100)] == [1, 2, 4, 64, 128, 128]


_BAD_ARGUMENTS = {  # what falcon_attention rejects on every backend, before any kernel limit applies
    "initial_state_type": dict(initial_state="not a state"),
    "initial_state_type_packed": dict(initial_state=(1, 2), cu_seqlens=torch.tensor([0, 3, 21])),
    "decay_floor_zero": dict(decay_floor=0.0),
    "decay_floor_negative": dict(decay_floor=-0.5),
    "chunk_size_zero": dict(chunk_size=0),
    "q_integer": dict(q="long"),
}


@pytest.mark.parametrize("case", list(_BAD_ARGUMENTS))
def test_triton_backend_raises_the_torch_backends_argument_errors(case):
    q, k, v, beta, lam = _inputs()
    options = dict(_BAD_ARGUMENTS[case])
    if options.pop("q", None) == "long":
        q = (q * 8).long()
    if "cu_seqlens" in options:
        q, k, v, beta, lam = (t[:1] for t in (q, k, v, beta, lam))
        options["cu_seqlens"] = options["cu_seqlens"].to(DEVICE)
    errors = {}
    for backend in ("torch", "triton"):
        with pytest.raises(Exception) as info:
            falcon_attention(q, k, v, beta, lam, backend=backend, **options)
        errors[backend] = (type(info.value), str(info.value))
    assert errors["triton"] == errors["torch"]
    named = next(iter(_BAD_ARGUMENTS[case]))  # the argument at fault, first in the message
    assert errors["torch"][0] in (TypeError, ValueError) and errors["torch"][1].startswith(f"{named} must "), errors


@pytest.mark.skipif(not KERNELS_RUN, reason=FRESH_PROCESS_REASON)
def test_compiled_caller_runs_the_kernels_between_its_graphs():
    """``torch.compile`` around ``falcon_attention(backend="triton")`` leaves the op out of the traced
    graphs (traced, the kernel launches do not compile) and traces what is around it; the loss and the
    gradients are the eager call's."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def loss(q, k, v, beta, lam):
        o, _ = falcon_attention(torch.sin(q), k, v, beta, lam, rule="1A", chunk_size=16, backend="triton")
        return (o * o).sum()

    results = []
    for fn in (loss, torch.compile(loss, backend=record)):
        leaves = [t.clone().requires_grad_() for t in _inputs(T=20)]
        value = fn(*leaves)
        value.backward()
        results.append((value.detach(), [t.grad for t in leaves]))
    (ref, ref_grads), (out, grads) = results
    assert graphs, "nothing around the op was traced"
    assert not any("triton" in str(node.target) for gm in graphs for node in gm.graph.nodes)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=0)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="inductor compiles the model around the kernels on a GPU")
@pytest.mark.parametrize("rule", ["1A", "1", "3A"])
def test_inductor_compiled_model_trains_on_the_kernels(rule):
    """A model compiled by inductor (``train.compile``) runs its Falcon layers on the kernels: its
    loss and gradients match the eager model's."""
    from falcon_fwa.models import FalconForCausalLM, get_preset

    torch.manual_seed(0)
    eager = FalconForCausalLM(get_preset("tiny-falcon", rule=rule, hidden_size=64, chunk_size=16)).cuda()
    compiled = FalconForCausalLM(eager.config).cuda()
    compiled.load_state_dict(eager.state_dict())
    compiled.compile()
    ids = torch.randint(0, eager.config.vocab_size, (2, 40), device="cuda")
    losses = []
    for model in (eager, compiled):
        out = model(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
        losses.append(out.loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-4, atol=0)
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-3, atol=1e-5, msg=name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernels under activation checkpointing, on a GPU")
@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_:FutureWarning")
@pytest.mark.parametrize("rule", ["1", "2A", "3"])
def test_activation_checkpointing_on_the_kernels_gives_the_plain_gradients(rule):
    """``gradient_checkpointing_enable()`` with the Falcon layers on the kernels: each block's kernels run
    again in the backward, and the loss and every gradient equal the plain backward's (padded and packed)."""
    from falcon_fwa.models import FalconForCausalLM, get_preset

    torch.manual_seed(0)
    model = FalconForCausalLM(get_preset("tiny-falcon", rule=rule, hidden_size=64, chunk_size=16)).cuda().train()
    ids = torch.randint(0, model.config.vocab_size, (2, 40), device="cuda")
    mask = torch.ones_like(ids)
    mask[0, :7] = 0
    packed = torch.randint(0, model.config.vocab_size, (1, 37), device="cuda")
    cu = torch.tensor([0, 20, 37], device="cuda")

    plain_loss, plain = padded_and_packed_loss(model, ids, mask, packed, cu)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    loss, grads = padded_and_packed_loss(model, ids, mask, packed, cu)
    torch.testing.assert_close(loss, plain_loss, rtol=1e-6, atol=0)
    for (name, _), g, r in zip(model.named_parameters(), grads, plain):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("name", ["k", "beta", "lam", "log_gate"])
def test_float64_beside_a_float32_query_stays_float64(name, monkeypatch):
    """float64 inputs compute in float64 whichever argument holds them: the kernels (fp32 at
    most) refuse a float64 ``k``, ``beta``, ``lam`` or ``log_gate`` as they refuse a float64
    ``q`` or ``v``, naming it, so ``backend="auto"`` gives the PyTorch forms' result bit for bit."""
    from falcon_fwa.ops import api
    from falcon_fwa.ops.triton import falcon_chunk_triton

    q, k, v, beta, lam = _inputs(T=5)
    args = dict(q=q, k=k, v=v, beta=beta, lam=lam, log_gate=-0.1 * lam)
    args[name] = args[name].double()
    with pytest.raises(NotImplementedError, match=rf"^{name}\.dtype=torch\.float64"):
        falcon_attention(**args, rule="1A", chunk_size=16, backend="triton")
    tok = {n: t[:, 0] for n, t in args.items()}
    with pytest.raises(NotImplementedError, match=rf"^{name}\.dtype=torch\.float64"):
        falcon_step(**tok, state=None, rule="1A", backend="triton")
    ref, ref_state = falcon_attention(**args, rule="1A", chunk_size=16, backend="torch", output_final_state=True)
    assert ref_state.S.dtype == torch.float64
    monkeypatch.setattr(api, "_triton_chunk", lambda backend, q, rule: falcon_chunk_triton)  # "auto" on CUDA
    out, state = falcon_attention(**args, rule="1A", chunk_size=16, output_final_state=True)
    assert torch.equal(out, ref) and torch.equal(state.S, ref_state.S)


@pytest.mark.skipif(not KERNELS_RUN, reason=FRESH_PROCESS_REASON)
@pytest.mark.parametrize("rule", ["1A", "3"])
def test_model_backend_field_forces_the_op_backend(rule, monkeypatch):
    """``FalconConfig(backend="triton")`` runs the prompt on the chunk kernels and each decoding step on
    the fused step kernel, ``"torch"`` on the PyTorch forms; the two models agree."""
    from falcon_fwa.layers import falcon_attention as layer_module
    from falcon_fwa.models import FalconForCausalLM, get_preset

    seen = []
    for name in ("falcon_attention", "falcon_step"):
        real = getattr(layer_module, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            seen.append((_name, kwargs["backend"]))
            return _real(*args, **kwargs)

        monkeypatch.setattr(layer_module, name, spy)
    ids = torch.randint(0, 64, (2, 19), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    logits = {}
    for backend in ("torch", "triton"):
        torch.manual_seed(0)
        cfg = get_preset("tiny-falcon", rule=rule, window=4, chunk_size=16, backend=backend)
        model = FalconForCausalLM(cfg).to(DEVICE).eval()
        seen.clear()
        with torch.no_grad():
            out = model(ids[:, :-1], use_cache=True)
            step = model(ids[:, -1:], past_key_values=out.past_key_values if hasattr(out, "past_key_values")
                         else out.cache)
        assert {b for _, b in seen} == {backend} and {n for n, _ in seen} == {"falcon_attention", "falcon_step"}
        logits[backend] = torch.cat([out.logits, step.logits], 1)
    assert (logits["triton"] - logits["torch"]).abs().max() <= 1e-4 * logits["torch"].abs().max()


def _spy_on_the_layer_ops(monkeypatch) -> list:
    """``(op name, backend)`` of every call the layers make to ``falcon_attention`` and ``falcon_step``."""
    from falcon_fwa.layers import falcon_attention as layer_module

    seen = []
    for name in ("falcon_attention", "falcon_step"):
        real = getattr(layer_module, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            seen.append((_name, kwargs["backend"]))
            return _real(*args, **kwargs)

        monkeypatch.setattr(layer_module, name, spy)
    return seen


@pytest.mark.skipif(not KERNELS_RUN, reason=FRESH_PROCESS_REASON)
@pytest.mark.parametrize("shape", [dict(rule="3A", window=17), dict(rule="1A", head_k_dim=264)],
                         ids=["3A-window-17", "1A-keys-264"])
def test_a_triton_model_the_fused_step_kernel_does_not_hold_decodes_on_the_pytorch_step(shape, monkeypatch):
    """Rule 3A's window of 17 (the chunk kernels take up to 65, the fused step kernel unrolls 16 slots) and rule
    1A's key dim of 264 (the inner-product chunk kernels tile the keys, the fused step kernel holds 256): a
    ``backend="triton"`` model of such a shape trains on the chunk kernels and used to fail at its first decoding
    step. Its prompt runs on the chunk kernels and its steps on the PyTorch step, and it generates the tokens,
    with the scores, of the same weights on ``backend="torch"``."""
    seen = _spy_on_the_layer_ops(monkeypatch)
    ids = torch.randint(0, 64, (2, 21), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    out = {}
    for backend in ("torch", "triton"):
        torch.manual_seed(0)
        cfg = get_preset("tiny-falcon", chunk_size=16, backend=backend, initializer_range=0.5, **shape)
        model = FalconForCausalLM(cfg).to(DEVICE).eval()
        seen.clear()
        with torch.no_grad():
            out[backend] = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                          return_dict_in_generate=True, output_scores=True)
        prompts = {b for n, b in seen if n == "falcon_attention"}
        steps = [b for n, b in seen if n == "falcon_step"]
        assert prompts == {backend} and steps == ["torch"] * (2 * 5), seen  # 2 layers, 5 steps after the prompt
    assert torch.equal(out["triton"].sequences, out["torch"].sequences)
    assert len(set(out["torch"].sequences[:, 21:].flatten().tolist())) > 2  # the tokens vary
    for got, want in zip(out["triton"].scores, out["torch"].scores):
        assert (got - want).abs().max() <= 1e-4 * want.abs().max()


@pytest.mark.skipif(not KERNELS_RUN, reason=FRESH_PROCESS_REASON)
@pytest.mark.parametrize("shape", [dict(rule="3A", window=16), dict(rule="1A", head_k_dim=256)],
                         ids=["3A-window-16", "1A-keys-256"])
def test_a_triton_model_at_the_fused_step_kernels_limits_decodes_on_it(shape, monkeypatch):
    """At the fused step kernel's widest window and key dim, a ``backend="triton"`` model's decoding steps stay
    on that kernel, with the logits of the same weights on ``backend="torch"``."""
    seen = _spy_on_the_layer_ops(monkeypatch)
    ids = torch.randint(0, 64, (2, 19), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    logits = {}
    for backend in ("torch", "triton"):
        torch.manual_seed(0)
        cfg = get_preset("tiny-falcon", chunk_size=16, backend=backend, initializer_range=0.5, **shape)
        model = FalconForCausalLM(cfg).to(DEVICE).eval()
        seen.clear()
        with torch.no_grad():
            prompt = model(ids[:, :-1], use_cache=True)
            step = model(ids[:, -1:], past_key_values=prompt.past_key_values)
        assert seen == [("falcon_attention", backend)] * 2 + [("falcon_step", backend)] * 2, seen
        logits[backend] = torch.cat([prompt.logits, step.logits], 1)
    assert (logits["triton"] - logits["torch"]).abs().max() <= 1e-4 * logits["torch"].abs().max()
