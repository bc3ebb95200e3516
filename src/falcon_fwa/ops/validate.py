"""Argument checks for the public ops: every error names the argument at fault."""
from __future__ import annotations

import contextlib
import contextvars
import difflib
import functools
import inspect
import math
import numbers
from typing import Iterator, Optional, Tuple

import numpy as np
import torch

from .rules import RuleSpec
from .state import FalconState

FORMS = ("recurrent", "parallel", "chunk")
READS = ("after", "before")


def keyword_hints(**aliases: str):
    """A decorator for the public ops: a call with a keyword argument the op does not take raises ``TypeError`` naming
    every such keyword with the argument it most likely meant: ``aliases`` (``state="initial_state"``: another op's
    name for it), else a spelling at least 0.6 close (``difflib``; ``lamda``: ``lam``), else the op's arguments are
    listed. Python checks the keywords when it calls the op, before the op runs; the wrapper reads them only after
    that failed, so a call with the op's own keywords does nothing more, and a ``TypeError`` raised inside the op
    passes unchanged. The op's signature is kept (``inspect.signature`` follows ``__wrapped__``)."""
    def wrap(fn):
        params = inspect.signature(fn).parameters
        names = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]

        def hint(name: str) -> Optional[str]:
            if aliases.get(name) in params:
                return aliases[name]
            close = difflib.get_close_matches(name, names, 1, 0.6)
            return close[0] if close else None

        @functools.wraps(fn)
        def call(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except TypeError:
                unknown = [n for n in kwargs if n not in params]
                if not unknown:
                    raise
            hints = [(n, hint(n)) for n in unknown]
            listed = ", ".join(f"{n!r}" + (f" (did you mean {h!r}?)" if h else "") for n, h in hints)
            which = "an unexpected keyword argument" if len(unknown) == 1 else "unexpected keyword arguments"
            takes = "" if all(h for _, h in hints) else f"; it takes {', '.join(names)}"
            raise TypeError(f"{fn.__name__}() got {which} {listed}{takes}")
        return call
    return wrap


def _shape(name: str, t: torch.Tensor, want: tuple, hint: str) -> None:
    if tuple(t.shape) != tuple(want):
        raise ValueError(f"{name} must have shape {hint} = {tuple(want)}, got {tuple(t.shape)}")


_VALUES_CHECKED = contextvars.ContextVar("falcon_fwa_values_checked", default=True)


@contextlib.contextmanager
def trusted_values() -> Iterator[None]:
    """Within it, the ops skip the checks of ``lam``'s and ``log_gate``'s values (``lam`` finite and
    ``>= 0``, ``log_gate <= 0``; a reduction each on the device). ``torch.compile`` is no substitute: it
    skips them only in what it traces (``falcon_step``), and ``falcon_attention`` runs outside its graphs.
    For callers whose values are in range by construction, such as the layers' gates: there a NaN
    can only come from a model that has diverged, and it then reaches the loss, which the trainer
    reports as non-finite, instead of stopping the run in the op (on a GPU, by a device-side assertion
    that leaves the process unable to save or log)."""
    token = _VALUES_CHECKED.set(False)
    try:
        yield
    finally:
        _VALUES_CHECKED.reset(token)


def _values_checked() -> bool:
    # Value checks need a host sync; skip them while tracing for torch.compile.
    return _VALUES_CHECKED.get() and not torch.compiler.is_compiling()


def _under_vmap(t: torch.Tensor, err: RuntimeError) -> bool:
    """Whether the host read of ``t`` failed because ``torch.func.vmap`` batches it (``t`` a batched tensor, or, under
    another transform inside the vmap such as ``vmap(grad(f))``, vmap's own error); other failures pass unchanged."""
    is_batched = getattr(getattr(torch._C, "_functorch", None), "is_batchedtensor", None)
    return (is_batched is not None and bool(is_batched(t))) or str(err).startswith("vmap:")


def _check_values(ok: torch.Tensor, message: str) -> None:
    """Raise ``ValueError(message)`` unless the one-element ``ok`` is true. On a GPU the check
    is a device-side assertion, so the host never waits for it (a failure surfaces as a
    CUDA error carrying the message at the next synchronization). Callers reduce their tensor
    first (``aminmax``, ``amax``): one pass over it, where an elementwise mask and ``any``
    would take several."""
    if ok.is_cuda:
        torch._assert_async(ok, message)
        return
    if ok.is_meta:  # tensors without values (shape inference on the meta device): nothing to check
        return
    try:
        passed = bool(ok)
    except RuntimeError as err:  # torch.func.vmap: one flag per batched call, which no host branch can take
        if not _under_vmap(ok, err):
            raise
        name = message.split(" ", 1)[0]
        raise RuntimeError(f"{name} cannot be checked under torch.func.vmap ({message}; the check reads its "
                           f"result on the host): check the values before the vmap and call the op within "
                           f"falcon_fwa.ops.validate.trusted_values()") from err
    if not passed:
        raise ValueError(message)


_LAM_RANGE = "lam must be finite and >= 0 (it is the actual ridge coefficient lambda_t)"
_GATE_RANGE = "log_gate must be <= 0, not NaN (the gate exp(g_t) is a decay)"


def _unwrapped(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``t`` without the wrappers of ``torch.func``'s transforms (``grad``, ``jvp``: the values; ``vmap``: those of
    every sample), a plain tensor that a kernel can read."""
    functorch = getattr(torch._C, "_functorch", None)
    while t is not None and functorch is not None and functorch.is_functorch_wrapped_tensor(t):
        t = functorch.get_unwrapped(t)
    return t


def check_value_ranges(lam: torch.Tensor, log_gate: Optional[torch.Tensor]) -> None:
    """``lam`` finite and ``>= 0`` (``lam = inf`` would give ``eta_t lam_t = 0 * inf``) and
    ``log_gate <= 0`` (``-inf``, a hard reset, is a gate; NaN and positive values are not).
    On a GPU one kernel flags both and device-side assertions raise
    (``ops.triton.checks.assert_ranges``); elsewhere a reduction each (NaN propagates through
    them and fails the comparisons)."""
    if lam.is_cuda:
        try:
            from .triton.checks import assert_ranges
        except ImportError:  # no Triton: the reductions below
            pass
        else:  # (the kernel reads the values under torch.func's wrappers, which hold no storage of their own)
            assert_ranges(_unwrapped(lam), _unwrapped(log_gate), _LAM_RANGE, _GATE_RANGE)
            return
    if lam.numel():
        low, high = torch.aminmax(lam)
        _check_values((low >= 0) & (high < math.inf), _LAM_RANGE)
    if log_gate is not None and log_gate.numel():
        _check_values(log_gate.amax() <= 0, _GATE_RANGE)


def check_switches(**switches) -> None:
    """A ``TypeError`` naming the first on/off argument that is not a ``bool`` (a string such as
    ``"False"`` would otherwise count as true)."""
    for name, value in switches.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")


def _is_bool(value) -> bool:
    return isinstance(value, (bool, np.bool_))


def as_int(value) -> Optional[int]:
    """``value`` as a Python ``int`` if it is an integer as ``numbers.Integral`` defines one (numpy's
    integer scalars too; not a bool, a float such as ``2.0`` or an array), else ``None``."""
    if _is_bool(value) or not isinstance(value, numbers.Integral):
        return None
    return int(value)


def as_float(value) -> Optional[float]:
    """``value`` as a Python ``float`` if it is a real number as ``numbers.Real`` defines one (numpy's
    scalars too; not a bool or an array), else ``None``."""
    if _is_bool(value) or not isinstance(value, numbers.Real):
        return None
    try:
        return float(value)
    except OverflowError:  # an integer past float's range: as large as the largest float, for the range checks
        return math.inf if value > 0 else -math.inf


def plain_number(value):
    """``value`` as the Python number it is: an ``int`` for an integer (``numbers.Integral``, numpy's
    too), a ``float`` for another real number (``numbers.Real``); anything else (a bool, text, an array,
    ``None``) unchanged, for the checks to name. The op's options pass through it before they reach
    the kernels, which take Python numbers only (a numpy integer is no Triton constant)."""
    number = as_int(value)
    if number is None and not isinstance(value, numbers.Integral):
        number = as_float(value)
    return value if number is None else number


def check_number(name: str, value, low: float, high: Optional[float] = None, *, open_low: bool = False) -> float:
    """``value`` as a Python ``float``; a ``ValueError`` naming ``name`` unless it is a real number
    (``numbers.Real``, numpy's scalars included; not a bool, not NaN) at or above ``low`` (above it
    with ``open_low``) and below ``high`` when given."""
    number = as_float(value)
    if number is None:
        raise ValueError(f"{name} must be a number, got {value!r}")
    above = number > low if open_low else number >= low
    if not above or (high is not None and not number < high):
        if high is None:
            span = f"{'>' if open_low else '>='} {low}"
        else:
            span = f"lie in {'(' if open_low else '['}{low}, {high})"
        raise ValueError(f"{name} must {'be ' if high is None else ''}{span}, got {value!r}")
    return number


def check_tensor_types(q, k, v, beta, lam, log_gate=None, *, query: str = "q") -> None:
    """A ``TypeError`` naming the first of the op's tensor arguments that is not a tensor
    (``log_gate`` may be ``None``; the first argument is called ``query``). Host-only."""
    for name, t in ((query, q), ("k", k), ("v", v), ("beta", beta), ("lam", lam), ("log_gate", log_gate)):
        if t is None and name == "log_gate":
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    lam: torch.Tensor,
    log_gate: Optional[torch.Tensor],
    rule: RuleSpec,
    *,
    window: int,
    form: str,
    chunk_size: int,
    eps: float,
    decay_floor: float,
    read: str,
    initial_state: Optional[FalconState],
    shift: bool,
    query: str = "q",
) -> None:
    """Check the arguments of ``falcon_attention`` (shapes in its docstring), raising
    ``TypeError``/``ValueError`` that names the argument at fault (the first tensor is called
    ``query``: ``falcon_trace`` passes its keys there)."""
    check_sequence_tensors(q, k, v, beta, lam, log_gate, rule, query=query)
    B, T, H, K = q.shape
    V = v.shape[-1]
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    check_options(rule, window=window, eps=eps, decay_floor=decay_floor, read=read)
    check_chunk_size(chunk_size)
    if _values_checked():
        check_value_ranges(lam, log_gate)
    if initial_state is not None:
        check_state(initial_state, rule, window=window if rule.sliding else 1, shift=shift, B=B, H=H, K=K, V=V,
                    device=q.device)


def check_sequence_tensors(q, k, v, beta, lam, log_gate, rule: RuleSpec, *, query: str = "q") -> None:
    """The tensors of a sequence (``[B, T, H, *]``, or ``[1, total, H, *]`` packed): tensors, of floating
    point, on ``q``'s device, ``T >= 1``, and shaped like ``q`` (the argument called ``query``)."""
    check_tensor_types(q, k, v, beta, lam, log_gate, query=query)
    for name, t in ((query, q), ("k", k), ("v", v), ("beta", beta), ("lam", lam), ("log_gate", log_gate)):
        if t is None:
            continue
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but {query} is on {q.device}")
    if q.dim() == 4 and q.shape[1] < 1:
        raise ValueError(f"{query} must have at least one time step (T >= 1)")
    check_shapes(q, k, v, beta, lam, log_gate, rule, ("B", "T", "H"), query=query)


def check_options(rule: RuleSpec, *, window: int, eps: float, decay_floor: float,
                  read: str) -> Tuple[int, float, float]:
    """The op's options that are not tensors: ``read`` one of :data:`READS`, ``window`` an integer
    ``>= 1`` for a sliding rule, ``eps`` finite and ``>= 0``, ``decay_floor`` in ``(0, 1)``.
    Host-only, so ``falcon_step`` checks them even with ``validate=False``. Returns ``window``,
    ``eps`` and ``decay_floor`` as Python numbers (numpy's scalars are taken)."""
    if read not in READS:
        raise ValueError(f"read must be one of {READS}, got {read!r}")
    window = check_window(rule, window)
    eps = check_number("eps", eps, 0, math.inf)
    decay_floor = check_number("decay_floor", decay_floor, 0, 1, open_low=True)
    return window, eps, decay_floor


def check_window(rule: RuleSpec, window):
    """``window`` must be an integer ``>= 1`` for a sliding rule (the others ignore it). Returns it as a
    Python ``int`` where it is an integer (``numbers.Integral``, numpy's too), else unchanged."""
    number = as_int(window)
    if rule.sliding and (number is None or number < 1):
        raise ValueError(f"window must be an integer >= 1 for the sliding rule {rule.name}, got {window!r}")
    return window if number is None else number


def check_positive_int(name: str, value) -> int:
    """``value`` as a Python ``int``; a ``ValueError`` naming ``name`` unless it is an integer >= 1
    (``numbers.Integral``, numpy's integers too; a bool or a float such as ``2.0`` is not one)."""
    number = as_int(value)
    if number is None or number < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return number


def check_chunk_size(chunk_size) -> int:
    """``chunk_size`` must be an integer >= 1 (``ValueError`` naming it); returned as a Python ``int``."""
    return check_positive_int("chunk_size", chunk_size)


def check_shapes(q, k, v, beta, lam, log_gate, rule: RuleSpec, axes: Tuple[str, ...], query: str = "q") -> None:
    """The shapes of the tensors against ``q``'s (the argument called ``query``), whose leading
    axes are named ``axes`` (``("B", "T", "H")`` for a sequence, ``("B", "H")`` for one step)."""
    lead = ", ".join(axes)
    if q.dim() != len(axes) + 1:
        raise ValueError(f"{query} must have shape [{lead}, K], got {tuple(q.shape)}")
    if q.shape[-1] < 1:  # an empty feature axis (e.g. a head width rounded down to 0) holds no state
        raise ValueError(f"{query} must have at least one feature (K >= 1), got shape {tuple(q.shape)}")
    dims = tuple(q.shape[:-1])
    _shape("k", k, tuple(q.shape), f"[{lead}, K] like {query}")
    if v.dim() != len(axes) + 1 or tuple(v.shape[:-1]) != dims:
        raise ValueError(f"v must have shape [{lead}, V] with {lead} = {dims} from {query}, got {tuple(v.shape)}")
    if v.shape[-1] < 1:
        raise ValueError(f"v must have at least one value column (V >= 1), got shape {tuple(v.shape)}")
    if rule.per_column:
        _shape("beta", beta, dims + (v.shape[-1],), f"[{lead}, V] for the per-column rule {rule.name}")
    else:
        _shape("beta", beta, dims, f"[{lead}] for rule {rule.name}")
    _shape("lam", lam, dims, f"[{lead}]")
    if log_gate is not None:
        _shape("log_gate", log_gate, dims, f"[{lead}]")


def check_step_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, lam: torch.Tensor,
                      log_gate: Optional[torch.Tensor], rule: RuleSpec) -> None:
    """The shapes of one decoding step's arguments (``falcon_step``: ``q``, ``k`` ``[B, H, K]``,
    ``v`` ``[B, H, V]``), named as such, of tensors (``falcon_step`` checks that first,
    ``check_tensor_types``); ``check_inputs`` then checks the rest."""
    check_shapes(q, k, v, beta, lam, log_gate, rule, ("B", "H"))


def check_state_type(state, name: str = "initial_state") -> None:
    """A ``TypeError`` unless ``state`` (the argument called ``name``) is a :class:`FalconState`."""
    if not isinstance(state, FalconState):
        raise TypeError(f"{name} must be a FalconState, got {type(state).__name__}")


def check_state(state: FalconState, rule: RuleSpec, *, window: int, shift: bool, B: int, H: int, K: int, V: int,
                device: torch.device, name: str = "initial_state") -> None:
    """Check that ``state`` (the argument called ``name``) continues this configuration and shape, in
    floating point on the inputs' ``device``."""
    check_state_type(state, name)
    for field in ("S", "last_key", "tail_x", "tail_y", "z"):
        t = getattr(state, field)
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"{name}.{field} must be a floating-point tensor, got "
                            f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
        if t.device != torch.device(device):
            raise ValueError(f"{name}.{field} is on {t.device} but the inputs are on {device}")
    valid = state.tail_valid
    if valid is not None:  # a mask: the window's slots are selected by it, so it must be boolean
        if not isinstance(valid, torch.Tensor) or valid.dtype != torch.bool:
            raise TypeError(f"{name}.tail_valid must be a bool tensor, got "
                            f"{valid.dtype if isinstance(valid, torch.Tensor) else type(valid).__name__}")
        if valid.device != torch.device(device):
            raise ValueError(f"{name}.tail_valid is on {valid.device} but the inputs are on {device}")
    if state.rule != rule.name:
        raise ValueError(f"{name} comes from rule {state.rule!r}, not rule {rule.name!r}")
    if state.shift != shift:
        raise ValueError(f"{name} was made with shift={state.shift}, not shift={shift}")
    if state.window != window:
        raise ValueError(f"{name} was made with window={state.window}, not window={window}")
    _shape(f"{name}.S", state.S, (B, H, K, V), "[B, H, K, V]")
    if shift and state.last_key is not None:  # None: a new sequence from S, opened by the sentinel
        _shape(f"{name}.last_key", state.last_key, (B, H, K), "[B, H, K]")
    if rule.sliding and window > 1:
        if state.tail_x is None or state.tail_y is None or state.tail_valid is None:
            raise ValueError(f"{name} has no sliding-window tail (tail_x, tail_y, tail_valid)")
        _shape(f"{name}.tail_x", state.tail_x, (B, H, window - 1, K), "[B, H, window-1, K]")
        _shape(f"{name}.tail_y", state.tail_y, (B, H, window - 1, V), "[B, H, window-1, V]")
        _shape(f"{name}.tail_valid", state.tail_valid, (B, window - 1), "[B, window-1]")
