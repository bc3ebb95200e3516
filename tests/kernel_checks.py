"""Shared checks of the Triton chunk kernels against the float64 recurrent form.

``check_kernel`` draws random inputs (``kernel_inputs``), runs
``falcon_chunk_triton`` on them and ``falcon_attention(form="recurrent")`` on the
same values in float64 (``run_op``), backpropagates the same fixed random float64
projection of every output (``o``, and with ``output_final_state`` the final ``S``,
last key and window tail) through both, and requires every output and every input
gradient to agree within the dtype's relative error (``TOL``, in the norm
``rel_norm``). ``poison_allocator`` and ``PoisonedEmpty`` make fresh kernel buffers
start as NaN, so that a value read before it is written shows. What only the public op
does (the normalized read ``eps_attn``, ``segments``, the floor of a hard-reset gate) is
checked through ``falcon_attention(backend="triton")`` (``check_kernel(through_op=True)``).

Without CUDA the kernels run through Triton's interpreter, which must be switched
on before ``triton`` is first imported: importing this module does that (or finds
that it is too late, see ``in_this_process``) before it imports the kernels.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Dict, Optional, Sequence

import pytest
import torch

from test_triton_interpreter import FRESH_PROCESS_REASON, prepare_interpreter

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
in_this_process = pytest.mark.skipif(not prepare_interpreter(), reason=FRESH_PROCESS_REASON)
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
pytest.importorskip("falcon_fwa.ops.triton")  # triton, and one the kernels take

from falcon_fwa import FalconState, falcon_attention  # noqa: E402
from falcon_fwa.ops.triton import falcon_chunk_triton  # noqa: E402

TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 1e-2}
PER_COLUMN = ("2", "2A")
OP_INPUTS = ("q", "k", "v", "beta", "lam")
FINAL_TENSORS = ("S_T", "last_key", "tail_x", "tail_y", "z")


def kernel_inputs(B: int, T: int, H: int, K: int, V: int, dtype: torch.dtype, *, seed: int, rule: str,
                  window: int = 1, gate: bool = True, state: bool = False, N: Optional[int] = None,
                  key_power: float = 0.25, lam_scale: float = 0.5, beta_scale: float = 0.9,
                  empty_slot: float = 0.0, sentinel: bool = False, normalizer: bool = False,
                  reset_at: Sequence[int] = (), zero_keys_at: Sequence[int] = ()) -> Dict[str, Optional[torch.Tensor]]:
    """Random leaves ``q, k`` ``[B, T, H, K]`` (scaled by ``K ** -key_power``), ``v``
    ``[B, T, H, V]``, ``beta`` in ``[0.1, 0.1 + beta_scale)`` (``[B, T, H, V]`` for the
    per-column rules 2/2A, else ``[B, T, H]``), ``lam`` in ``[0, lam_scale)``,
    ``log_gate`` in ``(-0.1, 0]`` (``None`` without ``gate``) and, with ``state``, an
    initial state of ``N`` rows (default ``B``): ``S0`` ``[N, H, K, V]``, ``last_key``
    ``[N, H, K]`` and for ``window > 1`` the tail ``tail_x`` ``[N, H, W-1, K]``,
    ``tail_y`` ``[N, H, W-1, V]`` with the boolean ``tail_valid`` ``[N, W-1]``, whose
    oldest slot of row 0 is empty and holds ``empty_slot``. Absent entries are ``None``.
    ``sentinel``: the state starts a new sequence from ``S0`` (``FalconState.fresh``): no
    ``last_key``, and every tail slot empty (holding random values that must not count).
    ``normalizer`` (for the normalized read): ``q, k`` made nonnegative (``|q| + 0.05 / scale``,
    ``|k|``, where ``z^T q`` stays positive) and, with ``state``, a nonnegative ``z0`` ``[N, H, K]``
    (``[N, H, K, V]`` for 2A). ``reset_at``: steps whose ``log_gate`` is ``-inf`` (a hard reset);
    ``zero_keys_at``: steps whose key is exactly zero in every row and head."""
    g = torch.Generator().manual_seed(seed)
    N = B if N is None else N
    W = window
    scale = K ** key_power
    bshape = (B, T, H, V) if rule in PER_COLUMN else (B, T, H)
    t = dict(
        q=torch.randn(B, T, H, K, generator=g) / scale,
        k=torch.randn(B, T, H, K, generator=g) / scale,
        v=torch.randn(B, T, H, V, generator=g),
        beta=torch.rand(*bshape, generator=g) * beta_scale + 0.1,
        lam=torch.rand(B, T, H, generator=g) * lam_scale,
        log_gate=-torch.rand(B, T, H, generator=g) * 0.1 if gate else None,
        S0=torch.randn(N, H, K, V, generator=g) * 0.1 if state else None,
        last_key=torch.randn(N, H, K, generator=g) / scale if state else None,
        tail_x=torch.randn(N, H, W - 1, K, generator=g) / scale if state and W > 1 else None,
        tail_y=torch.randn(N, H, W - 1, V, generator=g) if state and W > 1 else None,
    )
    tail_valid = None
    if state and W > 1:  # the oldest slot of the first row is empty (that segment was short)
        tail_valid = torch.ones(N, W - 1, dtype=torch.bool)
        tail_valid[0, 0] = False
        t["tail_x"][0, :, 0] = empty_slot
        t["tail_y"][0, :, 0] = empty_slot
        if sentinel:
            tail_valid[:] = False
    if sentinel:
        t["last_key"] = None
    if normalizer:  # drawn after the rest, so that the other leaves are those of the same seed without it
        t["q"], t["k"] = t["q"].abs() + 0.05 / scale, t["k"].abs()
        zshape = (N, H, K, V) if rule in PER_COLUMN else (N, H, K)
        t["z0"] = torch.rand(*zshape, generator=g) / scale if state else None
    for step in reset_at:
        t["log_gate"][:, step] = float("-inf")
    for step in zero_keys_at:
        t["k"][:, step] = 0.0
    leaves = {n: None if x is None else x.to(dtype) for n, x in t.items()}
    leaves["tail_valid"] = tail_valid
    return leaves


def on_device(leaves: Dict[str, Optional[torch.Tensor]], device, dtype: Optional[torch.dtype] = None):
    """The leaves moved to ``device`` (float ones also cast to ``dtype`` if given)."""
    return {n: None if x is None else x.to(device, dtype if dtype is not None and x.is_floating_point() else x.dtype)
            for n, x in leaves.items()}


def run_op(op, leaves: Dict[str, Optional[torch.Tensor]], *, rule: str, window: int, shift: bool,
           output_final_state: bool, probes: Optional[Dict[str, torch.Tensor]] = None, **op_switches):
    """Run ``op`` (``falcon_chunk_triton`` or ``falcon_attention``) on fresh copies of
    the leaves, from the initial state they hold, and backpropagate
    ``sum_t <P_t, t>`` over the outputs ``t`` (``o``, then the final ``S``, last key,
    tail and read normalizer ``z`` where present) with fixed float64 probes ``P_t``: drawn
    in that order from a generator seeded 123 (``probe_tensors``), or taken from ``probes``
    by name. Returns
    the outputs by name and the gradients of the leaves that receive one."""
    tail_valid = leaves.get("tail_valid")
    leaves = {n: x.detach().clone().requires_grad_() for n, x in leaves.items()
              if x is not None and n != "tail_valid"}
    state = None
    if "S0" in leaves:
        state = FalconState(rule=rule, window=window, shift=shift, S=leaves["S0"],
                            last_key=leaves.get("last_key") if shift else None, tail_x=leaves.get("tail_x"),
                            tail_y=leaves.get("tail_y"), tail_valid=tail_valid, z=leaves.get("z0"))
    o, final = op(*(leaves[n] for n in OP_INPUTS), rule=rule, window=window, log_gate=leaves.get("log_gate"),
                  shift=shift, initial_state=state, output_final_state=output_final_state, **op_switches)
    outs = {"o": o}
    if output_final_state:
        outs.update(S_T=final.S, last_key=final.last_key, tail_x=final.tail_x, tail_y=final.tail_y,
                    tail_valid=final.tail_valid, z=final.z)
    probed = {n: t for n, t in outs.items() if n != "tail_valid" and t is not None}
    if probes is None:
        probes = probe_tensors({n: t.shape for n, t in probed.items()})
    loss = sum((t.double() * probes[n].to(t.device)).sum() for n, t in probed.items())
    loss.backward()
    grads = {n: x.grad for n, x in leaves.items() if x.grad is not None}
    return outs, grads


def probe_tensors(shapes: Dict[str, Sequence[int]]) -> Dict[str, torch.Tensor]:
    """The float64 probes of ``run_op`` for outputs of the given shapes (CPU tensors): one
    generator seeded 123 draws them in the order ``o``, ``S_T``, ``last_key``, ``tail_x``,
    ``tail_y``, ``z`` (those present)."""
    g = torch.Generator().manual_seed(123)
    return {n: torch.randn(tuple(shapes[n]), generator=g, dtype=torch.float64)
            for n in ("o",) + FINAL_TENSORS if n in shapes}


def reference_by_rows(leaves: Dict[str, Optional[torch.Tensor]], shapes: Dict[str, Sequence[int]], device, *,
                      rule: str, window: int, shift: bool, output_final_state: bool, **op_switches):
    """``run_op(falcon_attention, form="recurrent")`` in float64, one batch row at a time.

    The rows of a batch (without ``cu_seqlens``) are independent, so running them one by one
    gives the whole batch's outputs and gradients (concatenated along the batch) with the
    memory of one row: the recurrent form keeps every step's state for its backward, which
    at B=8, T=2048, H=16, K=V=128 in float64 would hold tens of GB. ``shapes`` are the output
    shapes of the whole batch; the probes are those of ``probe_tensors(shapes)``, cut by row."""
    probes = probe_tensors(shapes)
    B = shapes["o"][0]
    rows = []
    for b in range(B):
        row = {n: None if x is None else x[b:b + 1] for n, x in leaves.items()}
        rows.append(run_op(falcon_attention, on_device(row, device, torch.float64), rule=rule, window=window,
                           shift=shift, output_final_state=output_final_state, form="recurrent", backend="torch",
                           probes={n: p[b:b + 1] for n, p in probes.items()}, **op_switches))
    outs = {n: None if rows[0][0][n] is None else torch.cat([r[0][n] for r in rows]) for n in rows[0][0]}
    grads = {n: torch.cat([r[1][n] for r in rows]) for n in rows[0][1]}
    return outs, grads


def rel_norm(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` (Frobenius, float64, on ``a``'s device)."""
    a, b = a.double(), b.double().to(a.device)
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _nan_buffer(shape, like, dtype=None):
    return torch.full(shape, float("nan"), dtype=like.dtype if dtype is None else dtype, device=like.device)


def poison_allocator(monkeypatch, module) -> None:
    """Make ``module._empty(shape, like, dtype=None)``, the buffer allocator of a
    kernel module, return NaN-filled buffers."""
    monkeypatch.setattr(module, "_empty", _nan_buffer)


class PoisonedEmpty:
    """Fresh float buffers from ``torch.empty``, ``torch.empty_like`` and
    ``Tensor.new_empty`` come filled with NaN while active, so a kernel that reads
    memory nobody wrote fails the comparison."""

    def __init__(self, monkeypatch):
        self.monkeypatch = monkeypatch

    @staticmethod
    def _fill(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    def __enter__(self):
        empty, empty_like, new_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty
        self.monkeypatch.setattr(torch, "empty", lambda *a, **kw: self._fill(empty(*a, **kw)))
        self.monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: self._fill(empty_like(*a, **kw)))
        self.monkeypatch.setattr(torch.Tensor, "new_empty", lambda t, *a, **kw: self._fill(new_empty(t, *a, **kw)))

    def __exit__(self, *exc):
        self.monkeypatch.undo()


def check_kernel(rule: str, dims: Sequence[int], dtype: torch.dtype = torch.float32, *, window: int = 1,
                 device: str = DEVICE, seed: int = 0, gate: bool = True, state: bool = False, shift: bool = True,
                 output_final_state: bool = False, cu_seqlens: Optional[Sequence[int]] = None, chunk_size: int = 16,
                 read: str = "after", normalize: bool = True, scale_ridge: bool = False, decay_floor: float = 1e-3,
                 key_power: float = 0.25, lam_scale: float = 0.5, beta_scale: float = 0.9, empty_slot: float = 0.0,
                 sentinel: bool = False, poison=None, tol: Dict[torch.dtype, float] = TOL,
                 reference_rows: bool = False, through_op: bool = False, eps_attn: Optional[float] = None,
                 segments: int = 1, reset_at: Sequence[int] = (), zero_keys_at: Sequence[int] = ()
                 ) -> Dict[str, float]:
    """``falcon_chunk_triton`` in ``dtype`` against ``falcon_attention(form="recurrent")``
    in float64 on the same inputs ``kernel_inputs(*dims, dtype, ...)`` (``dims`` =
    ``(B, T, H, K, V)``): the output's dtype and shape, every output and final-state
    tensor (``tail_valid`` exactly) and the gradient of every leaf must agree within
    ``tol[dtype]`` in ``rel_norm``. ``poison`` (a ``monkeypatch``) runs the kernels on
    NaN-filled fresh buffers; a non-zero ``empty_slot`` (e.g. NaN) in the empty tail
    slot must act as zero. ``reference_rows`` computes the reference one batch row at a
    time (``reference_by_rows``), for shapes whose float64 recurrence would not fit at
    once. ``sentinel``: the initial state starts a new sequence (``kernel_inputs``).
    ``through_op``: the kernels are run through ``falcon_attention(backend="triton",
    form="chunk")``, with ``eps_attn`` (the normalized read: nonnegative features and, with
    ``state``, an initial ``z``; the reference takes it too) and ``segments`` (the kernels'
    side only); ``reset_at`` (hard-reset gates, which the op floors) needs it as well.
    ``zero_keys_at``: steps with zero keys (``kernel_inputs``). Returns the relative errors
    by name."""
    B, T, H, K, V = dims
    N = None if cu_seqlens is None else len(cu_seqlens) - 1
    leaves = kernel_inputs(B, T, H, K, V, dtype, seed=seed, rule=rule, window=window, gate=gate, state=state, N=N,
                           key_power=key_power, lam_scale=lam_scale, beta_scale=beta_scale, empty_slot=empty_slot,
                           sentinel=sentinel, normalizer=eps_attn is not None, reset_at=reset_at,
                           zero_keys_at=zero_keys_at)
    if not through_op and (eps_attn is not None or segments != 1 or reset_at):
        raise ValueError("eps_attn, segments and reset_at are checked through the op: pass through_op=True")
    kernels, op_only = falcon_chunk_triton, {}
    if through_op:
        kernels, op_only = functools.partial(falcon_attention, form="chunk", backend="triton", segments=segments), \
            dict(eps_attn=eps_attn)
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens, device=device)
    switches = dict(rule=rule, window=window, shift=shift, output_final_state=output_final_state, cu_seqlens=cu,
                    read=read, normalize=normalize, scale_ridge=scale_ridge, decay_floor=decay_floor, **op_only)
    with contextlib.nullcontext() if poison is None else PoisonedEmpty(poison):
        tri = run_op(kernels, on_device(leaves, device), chunk_size=chunk_size, **switches)
    if empty_slot != 0.0:  # what the empty slot held must not matter: compare with it zeroed
        leaves["tail_x"][0, :, 0] = 0.0
        leaves["tail_y"][0, :, 0] = 0.0
    if reference_rows:
        if cu_seqlens is not None:
            raise ValueError("reference_rows needs independent batch rows (no cu_seqlens)")
        shapes = {n: t.shape for n, t in tri[0].items() if n != "tail_valid" and t is not None}
        del switches["cu_seqlens"]
        ref = reference_by_rows(leaves, shapes, device, **switches)
    else:
        ref = run_op(falcon_attention, on_device(leaves, device, torch.float64), form="recurrent", backend="torch",
                     **switches)
    assert tri[0]["o"].dtype == dtype and tri[0]["o"].shape == ref[0]["o"].shape
    errors = {}
    for name, r in ref[0].items():
        if name == "tail_valid":
            assert (r is None) == (tri[0][name] is None) and (r is None or torch.equal(tri[0][name], r))
        elif r is None:
            assert tri[0][name] is None, name
        else:
            errors[name] = rel_norm(tri[0][name], r)
    assert set(tri[1]) == set(ref[1]), (set(tri[1]), set(ref[1]))
    errors.update({f"d{n}": rel_norm(tri[1][n], ref[1][n]) for n in ref[1]})
    bad = {n: e for n, e in errors.items() if not e <= tol[dtype]}
    assert not bad, f"relative errors above {tol[dtype]}: {bad} (all: {errors})"
    return errors



def check_segments_continue(rule: str, *, seed: int, cut: int, window: int = 1, key_power: float = 0.25,
                            dims=(1, 40, 2, 16, 16)) -> None:
    """The kernels on ``[0, cut)`` and then on ``[cut, T)`` from the state of the first
    part give the output of one call on ``[0, T)`` (within ``1e-5``) and its final
    state: ``S`` within ``1e-5``, the last key and the window tail exactly."""
    B, T, H, K, V = dims
    x = on_device(kernel_inputs(B, T, H, K, V, torch.float32, seed=seed, rule=rule, window=window,
                                key_power=key_power), DEVICE)

    def run(a, b, state=None):
        return falcon_chunk_triton(*[x[n][:, a:b] for n in OP_INPUTS], rule=rule, window=window,
                                   log_gate=x["log_gate"][:, a:b], chunk_size=16, initial_state=state,
                                   output_final_state=True)

    whole, end = run(0, T)
    first, st = run(0, cut)
    second, end2 = run(cut, T, st)
    assert rel_norm(torch.cat([first, second], 1), whole) < 1e-5
    assert rel_norm(end2.S, end.S) < 1e-5 and torch.equal(end2.last_key, end.last_key)
    for name in ("tail_x", "tail_y", "tail_valid"):
        a, b = getattr(end2, name), getattr(end, name)
        assert (a is None and b is None) or torch.equal(a, b), name


def check_public_op_routing(rule: str, *, seed: int, window: int = 1, key_power: float = 0.25) -> list:
    """``falcon_attention(form="chunk")`` with ``backend="triton"`` runs the kernels (equal
    to the PyTorch chunk form within ``1e-5``, not bit for bit), the rule is listed in
    ``TRITON_RULES``, and ``backend="auto"`` keeps the PyTorch form (bit for bit) off CUDA,
    and on CUDA while the rule is not in ``GPU_CHECKED_RULES``. Returns the op's inputs
    ``[q, k, v, beta, lam]`` on ``DEVICE``."""
    from falcon_fwa.ops.triton import GPU_CHECKED_RULES, TRITON_RULES
    x = kernel_inputs(2, 21, 2, 16, 16, torch.float32, seed=seed, rule=rule, window=window, key_power=key_power)
    args = [x[n].to(DEVICE) for n in OP_INPUTS]
    ref, _ = falcon_attention(*args, rule=rule, window=window, chunk_size=16, backend="torch")
    out, _ = falcon_attention(*args, rule=rule, window=window, chunk_size=16, backend="triton")
    assert rel_norm(out, ref) < 1e-5
    assert not torch.equal(out, ref)  # the kernels ran (their rounding differs), so the check below can tell
    assert rule in TRITON_RULES
    auto, _ = falcon_attention(*args, rule=rule, window=window, chunk_size=16)
    if not CUDA or rule not in GPU_CHECKED_RULES:  # "auto" takes the kernels on CUDA only, once checked there
        assert torch.equal(auto, ref)
    else:
        assert rel_norm(auto, ref) < 1e-5
    return args
