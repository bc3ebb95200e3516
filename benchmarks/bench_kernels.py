"""Side-by-side kernel timings in one process: Falcon's Triton chunk kernels, the
PyTorch chunk form, flash-linear-attention's chunk kernels and torch's flash
attention, bf16, forward and forward+backward, with peak memory.

    python benchmarks/bench_kernels.py --out OUT --name h200-COMMIT   # --overwrite to write over a tracked file

Writes ``<out>/<name>.json`` (a list of rows ``{op, B, T, H, K, V, mode, ms,
peak_mem_bytes, commit, dirty}``, ``mode`` ``"fwd"`` or ``"fwdbwd"``, plus ``window`` for the sliding rules,
``process`` with ``--tag`` and ``graph_ms`` with ``--cudagraph``) and ``<out>/<name>.md`` (the table, GPU,
versions, commit and the ratios against the fla counterparts); ``--plot`` also draws those ratios with their
targets into ``<out>/<name>.png`` (``plot_kernels.py``, which draws the same from a ``<name>.json``). ``ms`` is
the median of ``triton.testing.do_bench``; ``peak_mem_bytes`` is the peak allocated during one call
above what was allocated before it (inputs excluded). ``fwd`` runs under
``torch.no_grad()``; ``fwdbwd`` is the forward plus ``backward`` of the output with
a fixed upstream gradient.

A row that fails (fla not installed, out of memory, past ``--row-timeout``) is listed in the table as
``failed: <error type>``, with the message under "Failures", and the run goes on; it has no row in
``<name>.json``. Both files are rewritten after every row, timed or failed: a run cut off keeps them.

``--paired ROUNDS`` also times each Falcon op against its fla counterpart in alternation
(:func:`paired_ratio`) and writes ``<out>/<name>-paired.json``: rows ``{op, fla_op, B, T, H, K, V,
mode: "fwdbwd-paired", ms, fla_ms, ratio, ratio_min, ratio_max, rounds, target, commit, dirty}``.

``commit`` is the full commit of the falcon_fwa checkout that runs, and ``dirty`` whether that checkout had
uncommitted changes to tracked files (:func:`falcon_fwa.provenance.command_provenance`); ``--commit`` names the
commit on a machine without git metadata, and ``dirty`` is then ``null`` (unknown), as it is outside a checkout,
where ``commit`` is ``"unknown"`` (:func:`source`). The table's first line says the same (:func:`commit_words`).

``--decode`` also times one decoding step of one layer's mixer op, the fused step kernel against the
PyTorch step (rules 1A and 1, batch 1 and 64), into ``<out>/<name>-decode.json``: rows ``{op, B, T: 1, H, K, V,
mode: "decode", ms, tokens_per_s_12_layers, commit, dirty}``.

``--cudagraph`` also times every row from a CUDA graph (``triton.testing.do_bench_cudagraph``:
the calls replayed from one captured graph) and adds ``graph_ms`` to the row (``graph_error`` where
an op cannot be captured). Replayed, a call costs its kernels' device time and no host enqueue:
the ratio of two ``graph_ms`` is that of the ops' device work, which the host's speed does not move.

The configurations that fla's autotuned kernels picked in the process go to
``<out>/<name>-autotune.json`` (:func:`autotune_picks`): fla's times move between
processes, and this file tells whether its picks did.

``falcon-3-seg2``, ``falcon-3-seg4``, ``falcon-3-seg8``, ``falcon-2-seg2`` and ``falcon-2-seg4`` run the public op
with ``segments=n`` (``ops/segments.py``): the sequence in ``n`` pieces, each recomputed in the
backward, peak memory traded for one more forward.

flash-linear-attention 0.6.0 refuses its gated backward on Triton 3.4-3.7.0 on
Hopper (a known miscompile); ``--allow-fla-gated`` lifts that guard for timing only.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import sys
import tempfile
import traceback
from statistics import median
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from falcon_fwa.provenance import command_provenance, committed_files, recorded_commit, uncommitted_note

SHAPES = [(8, 2048, 16, 128, 128), (2, 8192, 16, 128, 128)]
TARGETS = [  # (falcon op, fla op, target ratio of fwd+bwd medians at the shape of target_at)
    ("falcon-1a", "fla-simple-gla", 1.0),
    ("falcon-1a-unchecked", "fla-simple-gla", 1.0),
    ("falcon-1", "fla-gated-delta-rule", 0.8),
    ("falcon-1-unchecked", "fla-gated-delta-rule", 0.8),
    ("falcon-3a", "fla-simple-gla", 1.3),
    ("falcon-3a-unchecked", "fla-simple-gla", 1.3),
    ("falcon-2a", "fla-gla", 1.0),
    ("falcon-2", "fla-gated-delta-rule", 1.5),
    ("falcon-3", "fla-gated-delta-rule", 3.0),
    ("falcon-3-seg2", "fla-gated-delta-rule", 3.0),
    ("falcon-3-seg4", "fla-gated-delta-rule", 3.0),
    ("falcon-3-seg8", "fla-gated-delta-rule", 3.0),
    ("falcon-2-seg2", "fla-gated-delta-rule", 1.5),
    ("falcon-2-seg4", "fla-gated-delta-rule", 1.5),
]
WINDOW = 4  # the window B of the sliding rules' rows
RULE_3_TARGET_SHAPE = (4, 2048, 16, 128, 128)  # rules 3 and 3A: their targets are set at B=4


def target_at(op: str, shape) -> Optional[float]:
    """The target of ``op``'s ratio (:data:`TARGETS`) at ``shape``, ``None`` away from the shape it is set at:
    rules 3 and 3A (``falcon-3*``) at B=4 (:data:`RULE_3_TARGET_SHAPE`), the others at ``SHAPES[0]`` (B=8)."""
    target = next((t for ours, _, t in TARGETS if ours == op), None)
    where = RULE_3_TARGET_SHAPE if op.startswith("falcon-3") else SHAPES[0]
    return target if tuple(shape) == where else None

# build(B, T, H, K, V) -> (call, leaves): the call returns the output whose backward is timed, the leaves are
# every tensor input of the call, each requiring its gradient. The benchmark builds on CUDA in bf16; the
# keywords ``device`` and ``dtype`` (the inputs' dtype; fla's log decays stay as its layers form them) let the
# registry be checked on the CPU in float32 (Triton's interpreter runs no bf16).
Builder = Callable[..., Tuple[Callable[[], torch.Tensor], List[torch.Tensor]]]
BF16 = torch.bfloat16


def lift_fla_gated_guard() -> None:
    """Let fla 0.6.0 run its gated backward on Triton 3.4-3.7.0, which it refuses there (a known
    Hopper miscompile): for timing and memory only, its gradients are not checked."""
    import fla.ops.common.chunk_o as chunk_o
    chunk_o.TRITON_ABOVE_3_7_1 = True


def _randn(*shape, scale=1.0, device="cuda", dtype=BF16):
    return (torch.randn(*shape, device=device) * scale).to(dtype)


def _leaves(*ts):
    return [t.requires_grad_() for t in ts]


def _falcon_inputs(B, T, H, K, V, per_column=False, device="cuda", dtype=BF16):
    """``beta`` is ``[B, T, H, V]`` for the per-column rules (2, 2A), ``[B, T, H]`` otherwise."""
    q, k = (_randn(B, T, H, K, scale=K ** -0.5, device=device, dtype=dtype) for _ in range(2))
    v = _randn(B, T, H, V, device=device, dtype=dtype)
    beta = torch.rand(B, T, H, *((V,) if per_column else ()), device=device).to(dtype)
    lam = (0.1 * torch.rand(B, T, H, device=device)).to(dtype)
    return _leaves(q, k, v, beta, lam)


def falcon_triton(rule: str, validate: bool = True) -> Builder:
    """The whole op: pairs, step sizes and the chunk kernels (``validate=False``
    skips the argument checks, whose value checks are device-side assertions: launches
    of their own, no synchronization); the sliding rules run with ``window=WINDOW``."""
    def build(B, T, H, K, V, device="cuda", dtype=BF16):
        from falcon_fwa.ops.triton import falcon_chunk_triton
        leaves = _falcon_inputs(B, T, H, K, V, per_column=rule in ("2", "2A"), device=device, dtype=dtype)
        return (lambda: falcon_chunk_triton(*leaves, rule=rule, window=WINDOW, chunk_size=64,
                                            validate=validate)[0]), leaves
    return build


def falcon_segmented(rule: str, segments: int) -> Builder:
    """The public op on the kernels with ``segments=n``: the sequence in ``n`` pieces, each piece's
    forward run again in the backward (``ops/segments.py``): peak memory for time."""
    def build(B, T, H, K, V, device="cuda", dtype=BF16):
        from falcon_fwa import falcon_attention
        leaves = _falcon_inputs(B, T, H, K, V, per_column=rule in ("2", "2A"), device=device, dtype=dtype)
        return (lambda: falcon_attention(*leaves, rule=rule, window=WINDOW, chunk_size=64, backend="triton",
                                         segments=segments)[0]), leaves
    return build


def falcon_core(B, T, H, K, V, device="cuda", dtype=BF16):
    """The 1A kernels alone, on precomputed write keys, step sizes and log carries."""
    from falcon_fwa.ops.triton.scalar_decay import scalar_decay_chunk
    q, x = (_randn(B, T, H, K, scale=K ** -0.5, device=device, dtype=dtype) for _ in range(2))
    q, x, v = _leaves(q, x, _randn(B, T, H, V, device=device, dtype=dtype))
    eta = (0.5 * torch.rand(B, T, H, device=device)).requires_grad_()
    log_a = (-0.05 * torch.rand(B, T, H, device=device)).requires_grad_()
    leaves = [q, x, v, eta, log_a]
    return (lambda: scalar_decay_chunk(q, x, v, eta, log_a, None, read_after=True, chunk_size=64)[0]), leaves


def torch_chunk(rule: str) -> Builder:
    def build(B, T, H, K, V, device="cuda", dtype=BF16):
        from falcon_fwa import falcon_attention
        leaves = _falcon_inputs(B, T, H, K, V, per_column=rule in ("2", "2A"), device=device, dtype=dtype)
        return (lambda: falcon_attention(*leaves, rule=rule, window=WINDOW, form="chunk", chunk_size=64,
                                         backend="torch")[0]), leaves
    return build


def fla_simple_gla(B, T, H, K, V, device="cuda", dtype=BF16):
    from fla.ops.simple_gla import chunk_simple_gla
    q, k, v = _leaves(*(_randn(B, T, H, D, device=device, dtype=dtype) for D in (K, K, V)))
    g = F.logsigmoid(torch.randn(B, T, H, device=device) + 4).requires_grad_()
    return (lambda: chunk_simple_gla(q, k, v, g=g)[0]), [q, k, v, g]


def fla_gla(B, T, H, K, V, device="cuda", dtype=BF16):
    from fla.ops.gla import chunk_gla
    q, k, v = _leaves(*(_randn(B, T, H, D, device=device, dtype=dtype) for D in (K, K, V)))
    g = (F.logsigmoid(torch.randn(B, T, H, K, device=device) + 4) / 16).to(dtype).requires_grad_()
    return (lambda: chunk_gla(q, k, v, g=g)[0]), [q, k, v, g]


def fla_delta_rule(B, T, H, K, V, device="cuda", dtype=BF16):
    from fla.ops.delta_rule import chunk_delta_rule
    q, v = _leaves(_randn(B, T, H, K, device=device, dtype=dtype), _randn(B, T, H, V, device=device, dtype=dtype))
    k = F.normalize(torch.randn(B, T, H, K, device=device), dim=-1).to(dtype).requires_grad_()
    beta = torch.rand(B, T, H, device=device).to(dtype).requires_grad_()
    return (lambda: chunk_delta_rule(q, k, v, beta)[0]), [q, k, v, beta]


def fla_gated_delta_rule(B, T, H, K, V, device="cuda", dtype=BF16):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    q, v = _leaves(_randn(B, T, H, K, device=device, dtype=dtype), _randn(B, T, H, V, device=device, dtype=dtype))
    k = F.normalize(torch.randn(B, T, H, K, device=device), dim=-1).to(dtype).requires_grad_()
    beta = torch.rand(B, T, H, device=device).to(dtype).requires_grad_()
    g = F.logsigmoid(torch.randn(B, T, H, device=device) + 4).requires_grad_()
    return (lambda: chunk_gated_delta_rule(q, k, v, g, beta)[0]), [q, k, v, g, beta]


def sdpa(B, T, H, K, V, device="cuda", dtype=BF16):
    """torch's flash attention, causal (on the CPU, where there is none, its math backend)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v = _leaves(*(_randn(B, H, T, D, device=device, dtype=dtype) for D in (K, K, V)))
    backend = SDPBackend.FLASH_ATTENTION if torch.device(device).type == "cuda" else SDPBackend.MATH

    def run():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return run, [q, k, v]


OPS: Dict[str, Builder] = {
    "falcon-1a": falcon_triton("1A"),
    "falcon-1a-unchecked": falcon_triton("1A", validate=False),
    "falcon-1": falcon_triton("1"),
    "falcon-1-unchecked": falcon_triton("1", validate=False),
    "falcon-3a": falcon_triton("3A"),
    "falcon-3a-unchecked": falcon_triton("3A", validate=False),
    "falcon-2a": falcon_triton("2A"),
    "falcon-2": falcon_triton("2"),
    "falcon-3": falcon_triton("3"),
    "falcon-3-seg2": falcon_segmented("3", 2),
    "falcon-3-seg4": falcon_segmented("3", 4),
    "falcon-3-seg8": falcon_segmented("3", 8),
    "falcon-2-seg2": falcon_segmented("2", 2),
    "falcon-2-seg4": falcon_segmented("2", 4),
    "falcon-1a-kernels-only": falcon_core,
    "torch-chunk-1A": torch_chunk("1A"),
    "torch-chunk-1": torch_chunk("1"),
    "torch-chunk-3A": torch_chunk("3A"),
    "torch-chunk-2A": torch_chunk("2A"),
    "torch-chunk-2": torch_chunk("2"),
    "torch-chunk-3": torch_chunk("3"),
    "fla-simple-gla": fla_simple_gla,
    "fla-gla": fla_gla,
    "fla-delta-rule": fla_delta_rule,
    "fla-gated-delta-rule": fla_gated_delta_rule,
    "sdpa": sdpa,
}


def timing_order(ops):
    """``ops`` with the baselines (fla's ops, torch's flash attention) first, each group in its given
    order: a run that a time limit cuts keeps the rows every ratio is taken against."""
    baseline = [n for n in ops if n.startswith("fla-") or n == "sdpa"]
    return baseline + [n for n in ops if n not in baseline]


SLIDING_OPS = ("falcon-3", "falcon-3-seg2", "falcon-3-seg4", "falcon-3-seg8", "falcon-3a", "falcon-3a-unchecked",
               "torch-chunk-3", "torch-chunk-3A")  # run at WINDOW

DECODE_PRESET = dict(layers=12, H=6, K=128, V=128)  # the 130M presets' mixer: 12 layers, 6 heads of 128


def measure_decode(impl: str, rule: str, B: int, device: str = "cuda") -> float:
    """Median ms of one decoding step of one layer (state carried, no gradients). ``impl`` is the
    step op's backend, ``"triton"`` (the fused step) or ``"torch"`` (the PyTorch step), forced:
    ``falcon_step``'s default ``backend="auto"`` takes the fused step on CUDA. Both run without the
    argument checks, as the model's layers call the step."""
    from triton.testing import do_bench
    from falcon_fwa import falcon_step
    if impl not in ("triton", "torch"):
        raise ValueError(f"impl must be 'triton' or 'torch', got {impl!r}")
    H, K, V = DECODE_PRESET["H"], DECODE_PRESET["K"], DECODE_PRESET["V"]
    q, k = (_randn(B, H, K, scale=K ** -0.5, device=device) for _ in range(2))
    v = _randn(B, H, V, device=device)
    beta, lam = torch.rand(B, H, device=device), 0.1 * torch.rand(B, H, device=device)
    with torch.no_grad():
        _, state = falcon_step(q, k, v, beta, lam, state=None, rule=rule, backend=impl)

        def run():
            falcon_step(q, k, v, beta, lam, state=state, rule=rule, backend=impl, validate=False)
        return float(do_bench(run, warmup=25, rep=100, return_mode="median"))


class RowTimeout(Exception):
    pass


@contextlib.contextmanager
def _time_limit(seconds: float):
    """Raise :class:`RowTimeout` in the main thread after ``seconds``. Python checks for the
    signal between bytecodes of the main thread, so a call already under way (a kernel
    compile, or a backward pass, which autograd runs on its device thread) finishes first:
    the limit stops a row's timing loop, not a single call that hangs."""
    def _raise(signum, frame):
        raise RowTimeout(f"row took more than {seconds:g} s (--row-timeout); skipped")
    previous = signal.signal(signal.SIGALRM, _raise)
    try:  # a limit past the timer's range (time_t) is no limit: a year
        signal.setitimer(signal.ITIMER_REAL, min(seconds, 365 * 86400.0))
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _step(build: Builder, shape, mode: str) -> Tuple[Callable[[], None], List[torch.Tensor]]:
    """One timed call of ``build`` at ``shape``: the forward under ``no_grad`` (``"fwd"``) or the forward
    plus the backward of a fixed upstream gradient (``"fwdbwd"``), and the leaves whose gradients it sets."""
    fn, leaves = build(*shape)
    if mode == "fwd":
        def step():
            with torch.no_grad():
                fn()
    else:
        do = torch.randn_like(fn().detach())

        def step():
            fn().backward(do)
    return step, leaves


def measure(build: Builder, shape, mode: str) -> Tuple[float, int]:
    from triton.testing import do_bench
    step, leaves = _step(build, shape, mode)
    step()  # compile / autotune
    for t in leaves:
        t.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    for t in leaves:
        t.grad = None
    ms = do_bench(step, warmup=25, rep=100, grad_to_none=leaves, return_mode="median")
    torch.cuda.empty_cache()
    return float(ms), int(peak)


def measure_graph(build: Builder, shape, mode: str) -> float:
    """Median ms of one call of ``build`` at ``shape`` replayed from a CUDA graph
    (``triton.testing.do_bench_cudagraph``; ``fwdbwd``: gradients reset to ``None`` before every
    call, as in :func:`measure`). The host enqueues the whole graph once, so what is timed is the
    device's work; an op that synchronizes with the host (or allocates on it) cannot be captured
    and raises."""
    from triton.testing import do_bench_cudagraph
    step, leaves = _step(build, shape, mode)
    step()  # compile / autotune outside the capture
    for t in leaves:
        t.grad = None
    torch.cuda.synchronize()
    ms = do_bench_cudagraph(step, rep=100, grad_to_none=leaves or None, return_mode="median")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return float(ms)


def paired_ratio(ours: Callable[[], float], theirs: Callable[[], float], rounds: int) -> dict:
    """Ratio of two timings taken in alternation: round ``i`` times ``ours`` then ``theirs`` (each
    timer returns a median in ms) and keeps ``ours / theirs``. A slow spell of the host (other
    processes launching or compiling) then falls on both sides of most ratios, which a ratio of two
    medians taken minutes apart does not ensure. Returns the median ratio, its range over the
    rounds, and the median of each side."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    a, b = [], []
    for _ in range(rounds):
        a.append(float(ours()))
        b.append(float(theirs()))
    ratios = [x / y for x, y in zip(a, b)]
    return dict(ratio=median(ratios), ratio_min=min(ratios), ratio_max=max(ratios), ms=median(a), fla_ms=median(b),
                rounds=rounds)


PAIRED_DRIFT = 0.25  # a paired median this far (relative) from its op's own row of the process is flagged


def paired_drift(pair: dict, rows: List[dict], limit: float = PAIRED_DRIFT) -> Optional[str]:
    """Compare the two medians of a paired row with the ops' own ``fwdbwd`` rows at its
    shape ``(B, T, H, K, V)`` in the same process. The paired rounds are meant to cancel a slow spell that
    falls on both sides; when one side's paired median is more than ``limit`` off its own
    row, the spell fell on one side only and the ratio is not to be trusted. Returns a
    sentence saying so, or ``None`` (also when a row is missing)."""
    index = {(r["op"], _shape(r)): r["ms"] for r in rows if r["mode"] == "fwdbwd"}
    shape = _shape(pair)
    found = []
    for op, ms in ((pair["op"], pair["ms"]), (pair["fla_op"], pair["fla_ms"])):
        row = index.get((op, shape))
        if row is not None and abs(ms / row - 1.0) > limit:
            found.append(f"{op} {ms:.3f} ms paired against {row:.3f} ms in its row ({ms / row - 1.0:+.0%})")
    if not found:
        return None
    a, b = index.get((pair["op"], shape)), index.get((pair["fla_op"], shape))
    rows_ratio = f" (the rows' ratio: {a / b:.2f})" if a and b else ""
    return (f"paired {pair['op']} / {pair['fla_op']}: " + "; ".join(found)
            + f": the paired ratio {pair['ratio']:.2f} is not reliable{rows_ratio}")


def autotune_picks(prefix: str = "fla") -> Dict[str, Dict[str, str]]:
    """The configuration every autotuned Triton kernel of the modules ``prefix`` and
    ``prefix.*`` picked in this process, by tuning key: ``{"module.kernel": {key: config}}``.
    Kernels that never ran with more than one candidate (an empty cache) are left out;
    ``triton.heuristics`` wrappers are looked through."""
    from triton.runtime.autotuner import Autotuner
    found, seen = {}, set()
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not (mod_name == prefix or mod_name.startswith(prefix + ".")):
            continue
        for attr, obj in list(vars(mod).items()):
            while obj is not None and id(obj) not in seen:  # a wrapper's .fn is the next layer down
                seen.add(id(obj))
                if isinstance(obj, Autotuner) and obj.cache:
                    found[f"{mod_name}.{attr}"] = {str(k): str(c) for k, c in obj.cache.items()}
                obj = getattr(obj, "fn", None) if hasattr(obj, "run") else None
    return found


def measure_paired(ours: str, theirs: str, shape, rounds: int) -> dict:
    """:func:`paired_ratio` of two ops' forward+backward at ``shape`` (``do_bench`` medians of 20 ms each)."""
    from triton.testing import do_bench
    timers = []
    for name in (ours, theirs):
        step, leaves = _step(OPS[name], shape, "fwdbwd")
        step()  # compile / autotune
        timers.append(lambda step=step, leaves=leaves: do_bench(step, warmup=5, rep=20, grad_to_none=leaves,
                                                                return_mode="median"))
    found = paired_ratio(timers[0], timers[1], rounds)
    torch.cuda.empty_cache()
    return found


SWEEP_CANDIDATES = [  # (BK, BV, num_warps, num_stages)
    (64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 8, 2), (64, 128, 4, 2), (64, 128, 8, 2), (128, 64, 8, 2), (128, 128, 8, 2),
]


def sweep(shape) -> List[dict]:
    """Per kernel, the fwd+bwd time of the 1A kernels with that kernel's launch
    configuration varied and the others at their defaults."""
    from falcon_fwa.ops.triton import launch
    rows = []
    defaults = {k: dict(v) for k, v in launch.LAUNCH.items()}
    for kernel in defaults:
        for BK, BV, warps, stages in SWEEP_CANDIDATES:
            launch.LAUNCH[kernel] = dict(BK=BK, BV=BV, num_warps=warps, num_stages=stages)
            try:
                ms, _ = measure(falcon_core, shape, "fwdbwd")
            except Exception as e:
                ms = float("nan")
                print(f"sweep {kernel} {(BK, BV, warps, stages)} failed: {type(e).__name__}: {e}", flush=True)
            rows.append(dict(kernel=kernel, BK=BK, BV=BV, num_warps=warps, num_stages=stages, ms=ms))
            print(f"sweep {kernel:12s} BK={BK:3d} BV={BV:3d} warps={warps} stages={stages}: {ms:.3f} ms", flush=True)
        launch.LAUNCH[kernel] = defaults[kernel]
    return rows


def profile(name: str, shape, iters: int = 5) -> List[dict]:
    """Mean device time per kernel over ``iters`` forward+backward calls of ``name``."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    fn, leaves = OPS[name](*shape)
    do = torch.randn_like(fn().detach())
    fn().backward(do)
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            for t in leaves:  # as do_bench(grad_to_none=leaves): no gradient accumulation is timed
                t.grad = None
            fn().backward(do)
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None)
        if us is None:
            us = getattr(e, "cuda_time_total", 0)
        if us > 0:
            rows.append(dict(op=name, kernel=e.key[:60], calls=e.count // iters, ms=round(us / iters / 1e3, 4)))
    rows.sort(key=lambda r: -r["ms"])
    for r in rows[:20]:
        print(f"profile {name}: {r['ms']:8.3f} ms  x{r['calls']}  {r['kernel']}", flush=True)
    _print_aten_ops(name, fn, leaves, do, iters)
    return rows[:20]


def _print_aten_ops(name: str, fn, leaves, do, iters: int, top: int = 10) -> None:
    """The PyTorch operators of ``name``'s forward+backward with the most device time, by input
    shapes (which of them a kernel name such as ``elementwise_kernel`` stands for)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        for _ in range(iters):
            for t in leaves:
                t.grad = None
            fn().backward(do)
        torch.cuda.synchronize()
    ops = []
    for e in prof.key_averages(group_by_input_shape=True):
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if e.key.startswith("aten::") and us > 0:
            ops.append((us / iters / 1e3, e.count // iters, e.key, str(e.input_shapes)[:120]))
    for ms, calls, key, shapes in sorted(ops, reverse=True)[:top]:
        print(f"profile {name} aten: {ms:8.3f} ms  x{calls}  {key} {shapes}", flush=True)


def _atomic_write(path: str, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _versions() -> Dict[str, str]:
    import triton
    v = {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
         "gpu": torch.cuda.get_device_name(), "cuda": str(torch.version.cuda)}
    try:
        import fla
        v["fla"] = getattr(fla, "__version__", "?")
    except ImportError:
        v["fla"] = "not installed"
    except Exception as e:  # fla there but failing at import (its rows fail, reported, and the others are timed)
        v["fla"] = f"not importable ({failure(e)})"
    return v


def source(given: Optional[str]) -> Dict[str, Any]:
    """The ``commit`` and ``dirty`` a record names: :func:`falcon_fwa.provenance.command_provenance`'s full commit
    of the falcon_fwa checkout that runs and whether it had uncommitted changes to tracked files (``"unknown"`` and
    ``None`` outside a checkout), or the ``--commit`` ``given`` (for a machine without git metadata), whose
    ``dirty`` is the checkout's where it names the checkout's commit (in full or a prefix of it) and ``None``
    (unknown) where not (:func:`falcon_fwa.provenance.recorded_commit`, as ``falcon-fwa scaling --commit``)."""
    recorded = recorded_commit(given, command_provenance(argparse.Namespace()))
    return dict(recorded, commit=recorded["commit"] or "unknown")


def commit_words(commit: str, dirty: Optional[bool]) -> str:
    """How a report names :func:`source`'s commit: "commit `C`" with
    :func:`falcon_fwa.provenance.uncommitted_note` (" (uncommitted changes unknown)" for a ``--commit`` other
    than the checkout's), or "commit unknown (outside a git checkout)"."""
    if commit == "unknown":
        return "commit unknown (outside a git checkout)"
    return f"commit `{commit}`{uncommitted_note(dirty)}"


def _markdown(rows, versions, commit, notes, errors, dirty: Optional[bool] = None) -> str:
    """The report of ``rows``: timing, paired and decode rows, and the rows that failed (:func:`failed_row`),
    listed in the table in the order they ran; ``commit`` and ``dirty`` as :func:`source` gives them."""
    out = [f"# Kernel benchmark: {versions['gpu']}", "",
           f"{commit_words(commit, dirty)}; torch {versions['torch']}, triton {versions['triton']}, "
           f"flash-linear-attention {versions['fla']}, CUDA {versions['cuda']}, python {versions['python']}.", "",
           "bf16 inputs; median ms of `triton.testing.do_bench`; peak = extra memory allocated during one call "
           "(inputs excluded). `fwd` under `torch.no_grad()`; `fwdbwd` = forward + backward.", ""]
    out += [f"- {n}" for n in notes] + [""]
    graphs = any("graph_ms" in r or "graph_error" in r for r in rows)
    if graphs:
        out += ["`graph ms`: the median of `triton.testing.do_bench_cudagraph`, the calls replayed from a CUDA "
                "graph (the device's work, without the host's enqueue).", ""]
    g_head, g_rule = (" graph ms |", "---|") if graphs else ("", "")
    out += [f"| op | B | T | H | K | V | mode | ms |{g_head} peak MiB |", f"|---|---|---|---|---|---|---|---|{g_rule}---|"]
    table = [r for r in rows if r["mode"] not in ("decode", "fwdbwd-paired")]
    for r in table:
        op = r["op"] if "window" not in r else f"{r['op']} (window {r['window']})"
        if "error" in r:
            g = " - |" if graphs else ""
            out.append(f"| {op} | {r['B']} | {r['T']} | {r['H']} | {r['K']} | {r['V']} | {r['mode']} | "
                       f"failed: {r['error'].split(':')[0]} |{g} - |")
            continue
        g = f" {_graph_cell(r)} |" if graphs else ""
        out.append(f"| {op} | {r['B']} | {r['T']} | {r['H']} | {r['K']} | {r['V']} | {r['mode']} | "
                   f"{r['ms']:.3f} |{g} {r['peak_mem_bytes'] / 2**20:.0f} |")
    g_head, g_rule = (" graph time ratio |", "---|") if graphs else ("", "")
    out += ["", "## Ratios against the fla counterparts (fwd+bwd, time and peak memory)", "",
            f"| Falcon op | fla op | B | T | H | K | V | time ratio |{g_head} target | peak-memory ratio |",
            f"|---|---|---|---|---|---|---|---|{g_rule}---|---|"]
    for pair in fwdbwd_ratios(table):
        dims, target = " | ".join(map(str, pair["shape"])), pair["target"]
        tgt = "-" if target is None else f"<= {target}"
        gone = pair["failed"]
        if gone and (len(pair["missing"]) < 2 or len(gone) == 2):  # a side failed: listed, without a ratio
            g = " - |" if graphs else ""
            out.append(f"| {pair['op']} | {pair['fla_op']} | {dims} | failed ({', '.join(gone)}) |{g} {tgt} | - |")
        elif not pair["missing"]:
            g = "" if not graphs else " - |" if pair["graph_ratio"] is None else f" {pair['graph_ratio']:.2f} |"
            out.append(f"| {pair['op']} | {pair['fla_op']} | {dims} | {pair['eager_ratio']:.2f} |{g} {tgt} | "
                       f"{pair['mem_ratio']:.2f} |")
    paired = [r for r in rows if r["mode"] == "fwdbwd-paired"]
    if paired:
        out += ["", "## Paired ratios (fwd+bwd, the two ops timed in alternation)", "",
                "| Falcon op | fla op | B | T | rounds | median ratio | range | Falcon ms | fla ms | target |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        out += [f"| {r['op']} | {r['fla_op']} | {r['B']} | {r['T']} | {r['rounds']} | {r['ratio']:.2f}"
                f"{' (not reliable: see the notes)' if 'unreliable' in r else ''} | "
                f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f} | {r['ms']:.3f} | {r['fla_ms']:.3f} | "
                f"{'<= ' + str(r['target']) if target_at(r['op'], _shape(r)) is not None else '-'} |" for r in paired]
    decode = [r for r in rows if r["mode"] == "decode"]
    if decode:
        out += ["", "## Decoding step (one layer's mixer op, H=6, K=V=128)", "",
                "| op | B | us / step / layer | tokens/s (12 layers, mixer only) |", "|---|---|---|---|"]
        out += [f"| {r['op']} | {r['B']} | {r['ms'] * 1e3:.1f} | {r['tokens_per_s_12_layers']:,} |" for r in decode]
    if errors:
        out += ["", "## Failures", ""] + [f"- {e}" for e in errors]
    return "\n".join(out) + "\n"


def fwdbwd_ratios(rows: List[dict]) -> List[dict]:
    """The Falcon / fla ratios of the fwd+bwd rows among ``rows`` (timed rows and :func:`failed_row` ones; rows
    of other modes are passed over, a shape of fwd rows only keeping its place): one dict per pair of
    :data:`TARGETS` and shape of ``rows``, pairs in the order of :data:`TARGETS`, shapes in the order they first
    come in ``rows``. The table of ``<name>.md`` and the plot (``plot_kernels.pair_ratios``) both read them.
    Each dict: ``op``, ``fla_op``, ``shape`` (B, T, H, K, V), ``window`` (of the Falcon row, else ``None``),
    ``target`` (:func:`target_at`: ``None`` away from the shape it is set at), ``missing`` (the pair's ops without a
    timed row), ``failed`` (those of them with a failed row) and, when both rows are timed, ``eager_ratio``
    (``ms`` over ``ms``), ``graph_ratio`` (``graph_ms`` over ``graph_ms`` where both rows have one, else
    ``None``) and ``mem_ratio`` (peak memory over peak memory);
    those are ``None`` when a row is missing. An op timed twice at a shape counts its first row."""
    index, lost, shapes = {}, set(), {}
    for r in rows:
        if r.get("mode") not in ("fwd", "fwdbwd"):
            continue
        shapes.setdefault(_shape(r), None)
        if r.get("mode") != "fwdbwd":
            continue
        if "error" in r:
            lost.add((r["op"], _shape(r)))
        else:
            index.setdefault((r["op"], _shape(r)), r)
    found = []
    for ours, theirs, _ in TARGETS:
        for shape in shapes:
            a, b = index.get((ours, shape)), index.get((theirs, shape))
            missing = [op for op, r in ((ours, a), (theirs, b)) if r is None]
            pair = dict(op=ours, fla_op=theirs, shape=shape, window=None if a is None else a.get("window"),
                        target=target_at(ours, shape), missing=missing,
                        failed=[op for op in missing if (op, shape) in lost],
                        eager_ratio=None, graph_ratio=None, mem_ratio=None)
            if a is not None and b is not None:
                pair["eager_ratio"] = a["ms"] / b["ms"]
                if a.get("graph_ms") and b.get("graph_ms"):
                    pair["graph_ratio"] = a["graph_ms"] / b["graph_ms"]
                pair["mem_ratio"] = a["peak_mem_bytes"] / max(b["peak_mem_bytes"], 1)
            found.append(pair)
    return found


def timing_row(op: str, shape, mode: str, ms: float, peak: int, commit: str, tag: Optional[str] = None,
               dirty: Optional[bool] = None) -> dict:
    """One row of ``<name>.json``: ``{op, B, T, H, K, V, mode, ms, peak_mem_bytes, commit, dirty}`` (``commit``
    and ``dirty`` as :func:`source` gives them), ``window`` for the sliding ops (rules 3, 3A), ``process`` with
    ``--tag``."""
    B, T, H, K, V = shape
    row = dict(op=op, B=B, T=T, H=H, K=K, V=V, mode=mode, ms=round(ms, 4), peak_mem_bytes=int(peak), commit=commit,
               dirty=dirty)
    if op in SLIDING_OPS:
        row["window"] = WINDOW
    if tag:
        row["process"] = tag
    return row


def failure(e: BaseException) -> str:
    """``Type: first line of the message`` (200 characters at most; the type alone for an empty message,
    as a bare ``assert`` gives)."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:200]}" if lines else type(e).__name__


def recovered(e: BaseException) -> str:
    """:func:`failure` of ``e`` once the CUDA memory the failed row held is freed, so that the next row runs
    (after a CUDA error freeing raises too, and is let go)."""
    with contextlib.suppress(Exception):
        torch.cuda.empty_cache()
    return failure(e)


def failed_row(op: str, shape, mode: str, error: str) -> dict:
    """A timing row that did not come: listed in the table of ``<name>.md`` (``failed: <type>``), left out of
    ``<name>.json`` (:func:`timed`), whose rows all carry a time."""
    B, T, H, K, V = shape
    row = dict(op=op, B=B, T=T, H=H, K=K, V=V, mode=mode, error=error)
    if op in SLIDING_OPS:
        row["window"] = WINDOW
    return row


def timed(rows: List[dict]) -> List[dict]:
    """The rows of ``<name>.json``: those with a time, the failed ones left out."""
    return [r for r in rows if "error" not in r]


def decode_row(impl: str, rule: str, B: int, ms: float, commit: Optional[str] = None,
               dirty: Optional[bool] = None) -> dict:
    """One row of ``<name>-decode.json``: one decoding step of one layer's mixer op (``T`` = 1; no peak
    memory is measured, and none is written), with ``commit`` and ``dirty`` as :func:`source` gives them."""
    layers = DECODE_PRESET["layers"]
    return dict(op=f"falcon-step-{impl}-{rule.lower()}", B=B, T=1, H=DECODE_PRESET["H"], K=DECODE_PRESET["K"],
                V=DECODE_PRESET["V"], mode="decode", ms=round(ms, 4),
                tokens_per_s_12_layers=round(B / (layers * ms / 1e3)), commit=commit, dirty=dirty)


def _shape(row: dict) -> Tuple[int, int, int, int, int]:
    return row["B"], row["T"], row["H"], row["K"], row["V"]


def _graph_cell(row: dict) -> str:
    if row.get("graph_ms") is not None:
        return f"{row['graph_ms']:.3f}"
    return "not captured" if "graph_error" in row else "-"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--name", default="kernels",
                   help="file names: NAME.md, NAME.json (and NAME-autotune.json, ...) in --out")
    p.add_argument("--overwrite", action="store_true",
                   help="write over result files that git tracks (a run's record) where --out/--name name them")
    p.add_argument("--ops", nargs="*", default=list(OPS),
                   help=f"subset of {list(OPS)}; the baselines (fla-*, sdpa) are timed first at each shape")
    p.add_argument("--commit", default=None,
                   help="commit to record, on a machine without git metadata (uncommitted changes then unknown, "
                        "unless it names the checkout's commit; default: the full commit of the falcon_fwa checkout "
                        "that runs)")
    p.add_argument("--allow-fla-gated", action="store_true",
                   help="lift fla's refusal of its gated backward on Triton 3.4-3.7.0 (timing only)")
    p.add_argument("--sweep", action="store_true",
                   help="also sweep the 1A kernels' launch configurations at the first shape "
                        "(of --shape, else --shapes)")
    p.add_argument("--shapes", nargs="*", type=int, default=list(range(len(SHAPES))),
                   help=f"indices into {SHAPES}")
    p.add_argument("--shape", nargs=5, type=int, action="append", default=None, metavar=("B", "T", "H", "K", "V"),
                   help="a shape of one's own, in place of --shapes (repeat for several)")
    p.add_argument("--profile", nargs="*", default=[], help="ops whose fwd+bwd is profiled per kernel (first shape)")
    p.add_argument("--decode", action="store_true",
                   help="also time one layer's fused decoding step against the PyTorch step (<name>-decode.json)")
    p.add_argument("--tag", default=None,
                   help="recorded as 'process' on every row: ratios are only taken between rows of one process")
    p.add_argument("--paired", type=int, default=0, metavar="ROUNDS",
                   help="also time each Falcon op of --ops against its fla counterpart (also in --ops) in alternation, "
                        "ROUNDS rounds, fwd+bwd at the first shape: a ratio robust to a busy host")
    p.add_argument("--cudagraph", action="store_true",
                   help="also time every row replayed from a CUDA graph (graph_ms: the device's work, "
                        "without the host's enqueue)")
    p.add_argument("--plot", action="store_true",
                   help="also draw <name>.png next to the table: the time and peak-memory ratios against the fla "
                        "counterparts, with the targets (plot_kernels.py; needs matplotlib)")
    p.add_argument("--row-timeout", type=float, default=90.0,
                   help="seconds one row may take before it is skipped and reported (checked between calls: "
                        "one call that hangs is not interrupted)")
    args = p.parse_args(argv)
    written = [os.path.join(args.out, args.name + end) for end in
               (".md", ".json", ".png", "-autotune.json", "-paired.json", "-decode.json", "-sweep.json")]
    committed = [] if args.overwrite else committed_files(written)
    if committed:
        p.error(f"--out {args.out} --name {args.name} would write over {', '.join(committed)}, which git tracks (a "
                "record of earlier runs): give another --name or --out, or --overwrite")
    if not 0 < args.row_timeout < float("inf"):
        p.error(f"--row-timeout must be a positive number of seconds, got {args.row_timeout}")
    if args.paired < 0:
        p.error(f"--paired must be >= 0 rounds, got {args.paired}")
    unknown = [n for n in args.ops + args.profile if n not in OPS]
    if unknown:
        p.error(f"--ops/--profile: unknown op(s) {unknown}; choose from {list(OPS)}")
    if any(not 0 <= i < len(SHAPES) for i in args.shapes):
        p.error(f"--shapes takes indices 0 to {len(SHAPES) - 1} (into {SHAPES}), got {args.shapes}")
    if any(n < 1 for s in args.shape or [] for n in s):
        p.error(f"--shape sizes must be >= 1, got {args.shape}")
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels.py needs a CUDA GPU")
    notes, errors = [], []
    if args.allow_fla_gated:
        try:
            lift_fla_gated_guard()
        except Exception as e:  # fla missing or broken: its rows then fail one by one, reported; the others run
            errors.append(f"--allow-fla-gated: fla not importable: {failure(e)}")
        else:
            notes.append("fla's gated kernels (simple_gla, gla, gated_delta_rule) were timed with "
                         "`fla.ops.common.chunk_o.TRITON_ABOVE_3_7_1 = True`, lifting fla's refusal of its gated "
                         "backward on this Triton (known Hopper miscompile): their timings stand, their gradients "
                         "were not checked.")
    shapes = [tuple(s) for s in args.shape] if args.shape else [SHAPES[i] for i in args.shapes]
    os.makedirs(args.out, exist_ok=True)
    versions, recorded = _versions(), source(args.commit)
    commit, dirty = recorded["commit"], recorded["dirty"]
    if args.sweep:
        found = sweep(shapes[0] if shapes else SHAPES[0])
        _atomic_write(os.path.join(args.out, f"{args.name}-sweep.json"), json.dumps(found, indent=1) + "\n")
    rows, paired, decode = [], [], []  # rows: timed and failed, in the order they ran; paired, decode: their files
    timing = bool(args.ops and shapes)  # timing rows asked for: <name>.json is this run's, else an earlier one's stays

    def save():
        """The files as they stand, after every row and every failure: a run cut off keeps what it found."""
        if timing:
            _atomic_write(os.path.join(args.out, f"{args.name}.json"), json.dumps(timed(rows), indent=1) + "\n")
        if decode:
            _atomic_write(os.path.join(args.out, f"{args.name}-decode.json"), json.dumps(decode, indent=1) + "\n")
        _atomic_write(os.path.join(args.out, f"{args.name}.md"),
                      _markdown(rows + paired + decode, versions, commit, notes, errors, dirty))

    def fail(what: str, e: BaseException) -> str:
        message = recovered(e)
        errors.append(f"{what}: {message}")
        return message

    for shape in shapes:
        for name in timing_order(args.ops):
            for mode in ("fwd", "fwdbwd"):
                try:
                    with _time_limit(args.row_timeout):
                        ms, peak = measure(OPS[name], shape, mode)
                except Exception as e:  # one failing or stalled op must not lose the others
                    traceback.print_exc()
                    rows.append(failed_row(name, shape, mode, fail(f"{name} {shape} {mode}", e)))
                    save()
                    continue
                B, T = shape[:2]
                rows.append(timing_row(name, shape, mode, ms, peak, commit, args.tag, dirty))
                graph = ""
                if args.cudagraph:
                    try:
                        with _time_limit(args.row_timeout):
                            rows[-1]["graph_ms"] = round(measure_graph(OPS[name], shape, mode), 4)
                        graph = f"  graph {rows[-1]['graph_ms']:9.3f} ms"
                    except Exception as e:  # an op that cannot be captured keeps its eager row
                        with contextlib.suppress(Exception):  # a broken capture must not end the run
                            torch.cuda.synchronize()
                        rows[-1]["graph_error"] = fail(f"{name} {shape} {mode} (CUDA graph)", e)
                        graph = "  graph: not captured"
                print(f"{name:24s} B={B} T={T} {mode:7s} {ms:9.3f} ms  peak {peak / 2**20:8.0f} MiB{graph}",
                      flush=True)
                save()
    if args.paired and shapes:
        shape = shapes[0]
        for ours, theirs, target in TARGETS:
            if ours not in args.ops:
                continue
            if theirs not in args.ops:
                notes.append(f"--paired: {ours} not paired: its counterpart {theirs} is not in --ops")
                print(notes[-1], flush=True)
                continue
            try:
                with _time_limit(args.row_timeout):
                    found = measure_paired(ours, theirs, shape, args.paired)
            except Exception as e:
                fail(f"paired {ours} / {theirs}", e)
                save()
                continue
            B, T, H, K, V = shape
            paired.append(dict(op=ours, fla_op=theirs, B=B, T=T, H=H, K=K, V=V, mode="fwdbwd-paired",
                               ms=round(found["ms"], 4), fla_ms=round(found["fla_ms"], 4),
                               ratio=round(found["ratio"], 4), ratio_min=round(found["ratio_min"], 4),
                               ratio_max=round(found["ratio_max"], 4), rounds=found["rounds"], target=target,
                               commit=commit, dirty=dirty, **({"process": args.tag} if args.tag else {})))
            print(f"paired {ours} / {theirs}: ratio {found['ratio']:.3f} ({found['ratio_min']:.3f}-"
                  f"{found['ratio_max']:.3f}) over {found['rounds']} rounds", flush=True)
            drift = paired_drift(paired[-1], timed(rows))
            if drift:
                paired[-1]["unreliable"] = drift
                notes.append(drift)
                print(drift, flush=True)
            _atomic_write(os.path.join(args.out, f"{args.name}-paired.json"), json.dumps(paired, indent=1) + "\n")
            save()
    for name in args.profile:
        try:
            found = profile(name, shapes[0])
            _atomic_write(os.path.join(args.out, f"{args.name}-profile-{name}.json"), json.dumps(found, indent=1) + "\n")
        except Exception as e:
            fail(f"profile {name}", e)
    if args.decode:
        layers = DECODE_PRESET["layers"]
        notes.append(f"decode rows: one step of one Falcon layer's mixer op (H={DECODE_PRESET['H']}, K=V=128, "
                     f"the 130M presets), state carried, no gradients; tokens/s counts {layers} such layers and "
                     "nothing else of the model.")
        for rule in ("1A", "1"):
            for B in (1, 64):
                for impl in ("triton", "torch"):
                    try:
                        ms = measure_decode(impl, rule, B)
                    except Exception as e:
                        fail(f"decode {impl} {rule} B={B}", e)
                    else:
                        decode.append(decode_row(impl, rule, B, ms, commit, dirty))
                        print(f"decode {impl:6s} rule {rule:2s} B={B:3d}: {ms * 1e3:8.1f} us/step/layer", flush=True)
                    save()
    picks = autotune_picks("fla")
    if picks:
        _atomic_write(os.path.join(args.out, f"{args.name}-autotune.json"), json.dumps(picks, indent=1) + "\n")
    for e in errors:
        print(f"failed: {e}", file=sys.stderr, flush=True)
    if timing or args.decode:
        save()
    # else nothing was timed (e.g. ``--ops --profile OP``): the rows of an earlier run under this name stay
    if args.plot and timing:
        from plot_kernels import plot_ratios
        try:
            plot_ratios(timed(rows), os.path.join(args.out, f"{args.name}.png"), gpu=versions["gpu"])
        except ValueError as e:  # no pair timed: the table and the rows stand without a plot
            print(f"--plot: no {args.name}.png: {e}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
