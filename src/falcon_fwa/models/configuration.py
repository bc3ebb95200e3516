"""``FalconConfig``: one configuration for the Falcon LM and every baseline mixer.

The token mixer is picked with ``mixer``; every recurrent mixer (``falcon``,
``deltanet``, ``gated_deltanet``, ``mamba2``, ``retnet``) runs through the same
layer and the same op, so a mixer is just a set of defaults for the switches below
(``MIXER_DEFAULTS``). Fields left ``None`` take the mixer's default and are stored
resolved, so a saved config reloads to exactly the same model. The paper's
ablations (pairing x timing, QK-norm, ctx-beta vs ctx-eta, ridge) are config
changes: ``shift``, ``read``, ``qk_norm``, ``gate``, ``lambda_scale``.
"""
from __future__ import annotations

import contextvars
import difflib
import math
from typing import Iterable, Optional

import numpy as np

from transformers import PretrainedConfig

from ..layers.falcon_attention import FEATURE_MAPS
from ..layers.gates import GATES, LOG_GATES
from ..layers.norms import QK_NORMS
from ..ops import kernel_limits
from ..ops.rules import RULES, get_rule
from ..ops.validate import FORMS, as_float, as_int

__all__ = ["FalconConfig", "FalconFWAConfig", "MIXERS", "MIXER_DEFAULTS", "RECURRENT_MIXERS", "check_field_names",
           "config_fields"]

RECURRENT_MIXERS = ("falcon", "deltanet", "gated_deltanet", "mamba2", "retnet")
MIXERS = RECURRENT_MIXERS + ("transformer",)
"""The token mixers a config's ``mixer`` may name: the recurrent ones on ``FalconAttention``, and the
Transformer baseline on ``CausalSelfAttention``."""
BACKENDS = ("native", "torch", "triton", "fla")

# Switches of the recurrent mixers. ``gate``: how the context sets the write gain
# (see FalconAttention); ``log_gate``: the extra state decay exp(g_t). The short
# convolution ends in SiLU (as in DeltaNet and Mamba-2), so the feature map after it
# stays the identity; set ``feature_map`` when the convolution is off.
MIXER_DEFAULTS = {
    # Falcon-1A.3 of the paper: QK-RMSNorm, ctx-eta with the context ridge.
    "falcon": dict(rule="1A", shift=True, normalize=True, read="after", gate="ctx-eta", log_gate="none",
                   lambda_scale=1.0, qk_norm="rmsnorm", feature_map="identity", query_scale=1.0,
                   use_short_conv=True, output_gate=True, use_d_skip=False, norm_before_gate=True),
    # DeltaNet: S_t = S_{t-1} + beta_t k_t (v_t - S_{t-1}^T k_t)^T, L2-normalized keys, beta in (0, 1).
    "deltanet": dict(rule="1", shift=False, normalize=False, read="after", gate="sigmoid", log_gate="none",
                     lambda_scale=0.0, qk_norm="l2", feature_map="identity", query_scale=None,
                     use_short_conv=True, output_gate=False, use_d_skip=False, norm_before_gate=True),
    # Gated DeltaNet: DeltaNet with the data-dependent decay exp(g_t) before the delta write.
    "gated_deltanet": dict(rule="1", shift=False, normalize=False, read="after", gate="sigmoid", log_gate="data",
                           lambda_scale=0.0, qk_norm="l2", feature_map="identity", query_scale=None,
                           use_short_conv=True, output_gate=True, use_d_skip=False, norm_before_gate=True),
    # Mamba-2 SSD: S_t = exp(-dt_t a) S_{t-1} + dt_t B_t x_t^T, read C_t, skip D x_t, z-gated norm
    # RMSNorm(y * SiLU(z)) (Mamba-2's norm_before_gate=False: the gate comes before the norm). B and C
    # are per head (Mamba-2's ngroups = num_heads, not its default of one group), and so is the norm.
    "mamba2": dict(rule="1A", shift=False, normalize=False, read="after", gate="dt", log_gate="dt",
                   lambda_scale=0.0, qk_norm="none", feature_map="identity", query_scale=1.0,
                   use_short_conv=True, output_gate=True, use_d_skip=True, norm_before_gate=False),
    # RetNet / Lightning attention: S_t = gamma_h S_{t-1} + k_t v_t^T with a fixed per-head decay;
    # no xPos rotation of q and k, a per-head RMSNorm in place of RetNet's GroupNorm.
    "retnet": dict(rule="1A", shift=False, normalize=False, read="after", gate="one", log_gate="fixed",
                   lambda_scale=0.0, qk_norm="none", feature_map="identity", query_scale=None,
                   use_short_conv=False, output_gate=True, use_d_skip=False, norm_before_gate=True),
    "transformer": dict(rule="1A", shift=False, normalize=False, read="after", gate="one", log_gate="none",
                        lambda_scale=0.0, qk_norm="none", feature_map="identity", query_scale=None,
                        use_short_conv=False, output_gate=False, use_d_skip=False, norm_before_gate=True),
}


_LOADING: contextvars.ContextVar = contextvars.ContextVar("falcon_fwa_config_loading", default=None)
"""While :meth:`FalconFWAConfig.from_dict` builds a config from saved fields (``from_pretrained`` reads
``config.json`` and calls it): the file, as a refusal names it (``None``: a config built by hand)."""


def _fix(field: str, value, built: bool, unset: str = "leave it unset") -> str:
    """How to clear a refused field ``field`` that should be ``value``: ``unset`` in a constructor call, "set it to"
    on a built config, and on a config loaded from a saved file, remove it from the file, set it there, or pass the
    value to ``from_pretrained`` (which gives its fields to the constructor over the saved ones)."""
    source = None if built else _LOADING.get()
    if source is not None:
        return (f"the saved value comes from {source}: remove {field!r} from it or set it to {value!r} there, or pass "
                f"{field}={value!r} to from_pretrained")
    return f"set it to {value!r}" if built else unset


def _choice(field: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"config field {field!r} must be one of {list(allowed)}, got {value!r}")


def _int(field: str, value) -> int:
    """``value`` as an int: an integer (numpy's too; :func:`as_int`) or a real number of integral value
    (``64.0`` from a JSON file, checked exactly, not through its nearest float); a fraction, text, NaN or a
    bool is an error naming ``field``."""
    number = as_int(value)
    if number is None and as_float(value) is not None:  # (a bool or text: None)
        try:  # compared exactly, also past a float's range (a fraction of integral value)
            number = int(value) if value == int(value) else None
        except (OverflowError, ValueError):  # an infinity, NaN
            number = None
    if number is None:
        raise ValueError(f"config field {field!r} must be an integer, got {value!r}")
    return number


def _float(field: str, value) -> float:
    """``value`` as a finite float (:func:`as_float`); NaN, infinities (an integer past a float's range
    among them), bools and text are errors naming ``field``."""
    number = as_float(value)
    if number is None or not math.isfinite(number):
        raise ValueError(f"config field {field!r} must be a finite number, got {value!r}")
    return number


def _bool(field: str, value) -> bool:
    """``value`` if it is a bool (Python's or numpy's): text such as ``"False"`` would otherwise
    count as true, and 0/1 would hide a value meant for another field."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"config field {field!r} must be true or false, got {value!r}")
    return bool(value)


BOOL_FIELDS = ("shift", "normalize", "v_norm", "use_short_conv", "output_gate", "use_d_skip", "norm_before_gate",
               "tie_word_embeddings", "use_cache")
"""The switches of :class:`FalconConfig`: each must be ``True`` or ``False``."""


TOKEN_ID_FIELDS = ("pad_token_id", "bos_token_id", "eos_token_id")
"""The special tokens' ids of :class:`FalconConfig`: ``None`` or a token id of the vocabulary (``eos_token_id`` also
a list of them, as generation takes it)."""


def _token_ids(field: str, value, vocab_size: int):
    """``value`` of the token id field ``field`` as Python ints: ``None``, or an id in ``0..vocab_size - 1`` (a list
    of them for ``eos_token_id``). An id outside the vocabulary is a ``ValueError`` naming ``field`` and
    ``vocab_size`` (the embedding has no row for it, and generation would stop on, or pad with, an id the model
    never emits)."""
    if value is None:
        return None
    many = field == "eos_token_id" and isinstance(value, (list, tuple))
    ids = [_int(field, i) for i in value] if many else [_int(field, value)]
    if many and not ids:
        raise ValueError(f"config field {field!r} must be None, a token id or a list of token ids, got {value!r}")
    for i in ids:
        if not 0 <= i < vocab_size:
            held = f" holds {i}, which" if many else ""
            raise ValueError(f"config field {field!r} = {value!r}{held} is no token id of the vocabulary of "
                             f"vocab_size = {vocab_size} (ids 0 to {vocab_size - 1}): set an id within it, or None")
    return ids if many else ids[0]


def config_fields() -> frozenset:
    """The names :class:`FalconConfig` takes as its own fields (its ``__init__`` arguments)."""
    import inspect
    return frozenset(n for n, p in inspect.signature(FalconConfig.__init__).parameters.items()
                     if n != "self" and p.kind is not p.VAR_KEYWORD)


# Other libraries' names for FalconConfig fields, for the hint of an unknown name
ALIASES = {"num_attention_heads": "num_heads", "n_head": "num_heads", "n_layer": "num_hidden_layers",
           "num_layers": "num_hidden_layers", "n_embd": "hidden_size", "d_model": "hidden_size"}


def _hint(name: str, fields: frozenset, cutoff: float = 0.6) -> Optional[str]:
    """The field ``name`` most likely meant: its alias, or a spelling at least ``cutoff`` close
    (``difflib``'s ratio; ``None``: neither)."""
    if name in ALIASES:
        return ALIASES[name]
    close = difflib.get_close_matches(name, fields, 1, cutoff)
    return close[0] if close else None


def _settable(cls: type, name: str) -> bool:
    """Can ``name``, an attribute of ``cls``'s instances, be set on one: not a method (``to_dict``, ``update``)
    nor a property without a setter (``use_return_dict``, read from ``return_dict``)."""
    attr = getattr(cls, name, None)
    return not callable(attr) and not (isinstance(attr, property) and attr.fset is None)


def check_field_names(names: Iterable[str], where: str = "") -> None:
    """A ``ValueError`` naming every one of ``names`` that is not a :class:`FalconConfig` field,
    with the field it most likely meant (a misspelt override would otherwise be stored unused
    and leave the model unchanged). ``where`` ends the message (e.g. ``" for preset 'x'"``).
    One of Hugging Face's own config attributes (``return_dict``, ``output_hidden_states``, ...) is
    named as such, with no field's spelling for a hint: it is set on the built config."""
    fields = config_fields()
    unknown = sorted(set(names) - fields)
    if unknown:
        base = PretrainedConfig()
        hf = [u for u in unknown if not u.startswith("_") and hasattr(base, u) and _settable(type(base), u)]
        hints = [f"{u!r}" + (" (an attribute of Hugging Face's PretrainedConfig: set it on the built config, "
                             f"config.{u} = ...)" if u in hf else
                             f" (did you mean {h!r}?)" if (h := _hint(u, fields)) else "") for u in unknown]
        raise ValueError(f"unknown config field {', '.join(hints)}{where}")


def _refuse_misspelt(extra: Iterable[str]) -> None:
    """The keyword arguments that ``FalconConfig`` hands to ``PretrainedConfig``: Hugging Face's own
    attributes, and whatever a saved config carries, pass; a name that is not one of those but is an
    alias or a close spelling of a field (``decay_flor``, ``num_attention_heads``) is refused."""
    base = PretrainedConfig()
    fields = config_fields()
    for name in extra:
        if name.startswith("_") or hasattr(base, name):
            continue
        hint = _hint(name, fields, cutoff=0.8)
        if hint is not None:
            raise ValueError(f"unknown config field {name!r} (did you mean {hint!r}?)")


def _check_dtype(extra: dict) -> None:
    """The weights' dtype that Hugging Face's ``dtype`` (or its older name ``torch_dtype``) may name: ``None``, a
    floating-point ``torch.dtype`` or its name (``"bfloat16"``). Anything else is a ``ValueError`` naming the field
    (``PretrainedConfig`` would look a misspelt name up as ``torch.<name>``, an ``AttributeError`` naming neither
    the field nor the names it takes)."""
    import torch

    for field in ("dtype", "torch_dtype"):
        value = extra.get(field)
        if value is None:
            continue
        dtype = getattr(torch, value, None) if isinstance(value, str) else value
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"config field {field!r} must be None or a floating-point torch dtype or its name "
                             f"('float32', 'bfloat16', 'float16', 'float64'), got {value!r}")


def _check_rope(extra: dict, rope_theta) -> None:
    """Other libraries' RoPE settings (``rope_scaling``, ``rope_parameters``): the Transformer here rotates by
    ``rope_theta`` alone, with no scaling (linear, dynamic, YaRN, ...), so a setting that asks for more than that
    is a ``ValueError`` naming the field (``PretrainedConfig`` would store and validate it, and the model would run
    plain RoPE). ``None``, and a ``"default"`` type with no other entry than a ``rope_theta`` equal to this
    config's, pass."""
    for field in ("rope_scaling", "rope_parameters"):
        value = extra.get(field)
        if value is None:
            continue
        plain = isinstance(value, dict) and value.get("rope_type", value.get("type")) == "default" and \
            not set(value) - {"rope_type", "type", "rope_theta"} and \
            as_float(value.get("rope_theta", rope_theta)) == as_float(rope_theta)
        if not plain:
            raise ValueError(f"config field {field!r} = {value!r}: the Transformer's RoPE rotates by rope_theta "
                             f"alone, without scaling; set rope_theta and leave {field} unset")


class FalconFWAConfig(PretrainedConfig):
    r"""Configuration of :class:`~falcon_fwa.models.FalconForCausalLM`, also importable as ``FalconConfig``.

    The class is named ``FalconFWAConfig`` because transformers' auto classes find a model for a config by
    the config's class name, and ``FalconConfig`` is the name of transformers' own (unrelated) Falcon
    config: under that name, ``AutoModel.from_pretrained`` of a saved folder would build transformers'
    Falcon model. ``AutoModelForCausalLM`` builds :class:`~falcon_fwa.models.FalconForCausalLM`; the other
    auto classes refuse the config by name.

    Model shape: ``vocab_size``, ``hidden_size`` (d), ``num_hidden_layers``,
    ``num_heads`` (H), ``head_k_dim`` / ``head_v_dim`` (default ``d / H``; the
    recurrent mixers' q/k/v widths are ``H*head_k_dim`` and ``H*head_v_dim``),
    ``intermediate_size`` of the SwiGLU MLP (default: 8d/3 rounded up to 64).

    Mixer: ``mixer`` in ``"falcon", "transformer", "deltanet", "gated_deltanet",
    "mamba2", "retnet"``. For the recurrent mixers (all through ``falcon_attention``):

    * ``rule`` ("1", "2", "3", "1A", "2A", "3A"), ``window`` (B of rules 3/3A),
      ``shift`` (pair ``(k_{t-1}, v_t)``), ``normalize`` (NLMS step),
      ``read`` ("after"/"before"), ``log_gate`` ("none"; "data": Gated DeltaNet's
      ``g_t = -exp(A_log) softplus(w^T h_t + b)``; "dt": Mamba-2's ``g_t = -exp(A_log) dt_t``;
      "fixed": RetNet's ``g = log(1 - 2^{-5-h})``), ``form``/``chunk_size`` of training,
      ``segments`` (``falcon_attention(segments=)``: each layer's op runs its sequence in that many
      pieces, each recomputed in the backward, less memory for one more forward of the op; packed
      batches are cut between documents),
      ``eps``, ``decay_floor``, ``eps_attn`` (``None``: the denominator-free read; a number
      ``>= 0``, ``> 0`` with ``shift`` or ``read="before"``, whose first token reads the empty
      memory, and with any feature map but the positive ``"elu1"`` or ``query_scale <= 0``: the normalized read
      ``S^T q / (z^T q + eps_attn)`` of the inner-product rules, Appendix C.1, safe with positive
      features);
    * ``gate``: "ctx-beta" (context emits ``beta in (0, 2)``), "ctx-eta" (context emits
      the normalized step), "sigmoid" (DeltaNet's ``beta in (0, 1)``), "dt" (Mamba-2's
      ``dt = softplus(.)``), "one" (constant 1); ``lambda_scale`` (ridge
      ``lambda-bar in (0, lambda_scale)``; 0 turns the ridge off);
    * features: ``qk_norm`` ("rmsnorm", "l2", "none"), ``v_norm``, ``feature_map``,
      ``query_scale`` (``None``: the mixer's default, 1.0 for "falcon" and "mamba2", else
      ``head_k_dim ** -0.5``), ``use_short_conv``, ``conv_size``, ``output_gate`` (SiLU-gated output RMSNorm),
      ``norm_before_gate`` (``True``: ``RMSNorm(o) * SiLU(g)`` as in Gated DeltaNet / RetNet; ``False``:
      ``RMSNorm(o * SiLU(g))``, Mamba-2's default; read with the output gate only, so with ``output_gate=False``
      another value than the mixer's own is refused by name), ``use_d_skip``;
    * ``backend``: "native" (the library's op, which picks its Triton kernels or PyTorch forms:
      ``falcon_attention(backend="auto")``), "torch" or "triton" (the op with that backend forced, for
      every sequence and decoding step; with "triton", a regression rule or ``form="recurrent"`` takes a
      ``head_k_dim`` of at most 256, ``MAX_WY_HEAD_DIM`` and ``MAX_FUSED_HEAD_DIM`` of ``ops.kernel_limits``;
      rule 3 a ``window`` of 1, 2, 4, 8 or 16, ``SLOT_COUNTS``, rule 3A one of at most 65, ``MAX_WINDOW``, and
      both at most 16 with ``form="recurrent"``, ``MAX_FUSED_WINDOW``), or "fla" (flash-linear-attention kernels for
      the baselines where installed; CUDA only). A "triton" model whose shape the fused step kernel does not hold
      but the chunk kernels do (an inner-product rule's ``head_k_dim`` above 256, a rule-3A ``window`` above 16)
      runs its decoding steps on the PyTorch step (``FalconAttention.step_backend``).

    Transformer: heads ``hidden_size / num_heads`` wide (an even number: RoPE rotates pairs; ``head_k_dim``
    and ``head_v_dim`` left unset), ``rope_theta``; attention through ``scaled_dot_product_attention``. It
    reads none of the recurrent mixers' switches above: one of the rule, gate and feature switches set to
    another value than the Transformer's own (``qk_norm="rmsnorm"``, ``use_short_conv=True``, ...) is refused
    by name (assigned after the config was built: when it is saved or a model is built from it); the settings
    of the recurrent op (``window``, ``form``, ``chunk_size``, ``segments``, ``eps``, ``decay_floor``,
    ``conv_size``, ``backend``) are kept as given and not read.

    Scaling (muP): ``initializer_range`` (std at the base width), ``mup_base_width``
    (width of the proxy whose hyperparameters transfer; ``None``: this width), see
    :meth:`FalconForCausalLM.param_groups`.
    """

    model_type = "falcon_fwa"

    def __init__(
        self,
        vocab_size: int = 50304,
        hidden_size: int = 768,
        num_hidden_layers: int = 12,
        num_heads: int = 6,
        head_k_dim: Optional[int] = None,
        head_v_dim: Optional[int] = None,
        intermediate_size: Optional[int] = None,
        mixer: str = "falcon",
        rule: Optional[str] = None,
        window: int = 4,
        shift: Optional[bool] = None,
        normalize: Optional[bool] = None,
        read: Optional[str] = None,
        gate: Optional[str] = None,
        log_gate: Optional[str] = None,
        lambda_scale: Optional[float] = None,
        qk_norm: Optional[str] = None,
        v_norm: bool = False,
        feature_map: Optional[str] = None,
        query_scale: Optional[float] = None,
        use_short_conv: Optional[bool] = None,
        conv_size: int = 4,
        output_gate: Optional[bool] = None,
        use_d_skip: Optional[bool] = None,
        norm_before_gate: Optional[bool] = None,
        form: str = "chunk",
        chunk_size: int = 64,
        segments: int = 1,
        eps: float = 1e-6,
        decay_floor: float = 1e-3,
        eps_attn: Optional[float] = None,
        backend: str = "native",
        rope_theta: float = 10000.0,
        rms_norm_eps: float = 1e-6,
        initializer_range: float = 0.02,
        mup_base_width: Optional[int] = None,
        tie_word_embeddings: bool = True,
        use_cache: bool = True,
        pad_token_id: Optional[int] = None,
        bos_token_id: Optional[int] = None,
        eos_token_id: Optional[int] = None,
        **kwargs,
    ):
        _refuse_misspelt(kwargs)
        _check_dtype(kwargs)
        _check_rope(kwargs, rope_theta)
        _choice("mixer", mixer, MIXERS)
        defaults = MIXER_DEFAULTS[mixer]

        def pick(name, value):  # a field left None takes the mixer's default
            return defaults[name] if value is None else value

        self.vocab_size = _int("vocab_size", vocab_size)
        self.hidden_size = _int("hidden_size", hidden_size)
        self.num_hidden_layers = _int("num_hidden_layers", num_hidden_layers)
        self.num_heads = _int("num_heads", num_heads)
        self.mixer = mixer
        try:  # stored by its canonical name ("falcon-1a" -> "1A")
            self.rule = get_rule(pick("rule", rule)).name
        except ValueError:  # left to validate_fields, which names the field
            self.rule = str(pick("rule", rule))
        try:  # an integral number is stored as an int
            self.window = _int("window", window)
        except ValueError:  # left to validate_fields, which refuses it for the sliding rules (the others never read it)
            self.window = window
        self.shift = _bool("shift", pick("shift", shift))
        self.normalize = _bool("normalize", pick("normalize", normalize))
        self.read = pick("read", read)
        self.gate = pick("gate", gate)
        self.log_gate = pick("log_gate", log_gate)
        self.lambda_scale = _float("lambda_scale", pick("lambda_scale", lambda_scale))
        self.qk_norm = pick("qk_norm", qk_norm)
        self.v_norm = _bool("v_norm", v_norm)
        self.feature_map = pick("feature_map", feature_map)
        self.use_short_conv = _bool("use_short_conv", pick("use_short_conv", use_short_conv))
        self.conv_size = _int("conv_size", conv_size)
        self.output_gate = _bool("output_gate", pick("output_gate", output_gate))
        self.use_d_skip = _bool("use_d_skip", pick("use_d_skip", use_d_skip))
        self.norm_before_gate = _bool("norm_before_gate", pick("norm_before_gate", norm_before_gate))
        self.form = form
        self.chunk_size = _int("chunk_size", chunk_size)
        self.segments = _int("segments", segments)
        self.eps = _float("eps", eps)
        self.decay_floor = _float("decay_floor", decay_floor)
        self.eps_attn = None if eps_attn is None else _float("eps_attn", eps_attn)
        self.backend = backend
        self.rope_theta = _float("rope_theta", rope_theta)
        self.rms_norm_eps = _float("rms_norm_eps", rms_norm_eps)
        self.initializer_range = _float("initializer_range", initializer_range)
        self.mup_base_width = None if mup_base_width is None else _int("mup_base_width", mup_base_width)
        self.use_cache = _bool("use_cache", use_cache)
        for field in ("hidden_size", "num_heads"):  # before the head dims are derived from them
            if getattr(self, field) < 1:
                raise ValueError(f"config field {field!r} must be >= 1, got {getattr(self, field)}")
        if head_k_dim is None or head_v_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"config field 'num_heads' = {self.num_heads} does not divide 'hidden_size' = {self.hidden_size};"
                    " choose num_heads dividing the width or set 'head_k_dim' / 'head_v_dim'")
        per_head = self.hidden_size // self.num_heads
        self.head_k_dim = per_head if head_k_dim is None else _int("head_k_dim", head_k_dim)
        self.head_v_dim = per_head if head_v_dim is None else _int("head_v_dim", head_v_dim)
        for field in ("head_k_dim", "head_v_dim"):  # before head_k_dim ** -0.5 below reads it
            if getattr(self, field) < 1:
                raise ValueError(f"config field {field!r} must be >= 1, got {getattr(self, field)}")
        if intermediate_size is None:
            intermediate_size = 64 * -(-(8 * self.hidden_size // 3) // 64)
        self.intermediate_size = _int("intermediate_size", intermediate_size)
        qs = pick("query_scale", query_scale)
        self.query_scale = float(self.head_k_dim ** -0.5) if qs is None else _float("query_scale", qs)
        if self.vocab_size >= 1:  # before PretrainedConfig, which only warns of an id outside the vocabulary
            pad_token_id, bos_token_id, eos_token_id = (_token_ids(field, value, self.vocab_size) for field, value in
                                                        zip(TOKEN_ID_FIELDS, (pad_token_id, bos_token_id, eos_token_id)))
        super().__init__(pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                         tie_word_embeddings=_bool("tie_word_embeddings", tie_word_embeddings), **kwargs)
        self._check_fields(built=False)

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        """``PretrainedConfig.from_dict``, with the keyword arguments that are fields of this config (as
        ``from_pretrained(path, window=2)`` passes them) given to the constructor along with the stored ones,
        so they are converted, canonicalized and checked as in ``FalconConfig(...)`` (Hugging Face sets them
        on the built config afterwards, unchecked). A stored field that the constructor refuses (one written
        before the refusal existed) is refused naming the saved file, with the value to write there or to pass."""
        fields = config_fields()
        own = {name: kwargs.pop(name) for name in list(kwargs) if name in fields}
        _refuse_misspelt(kwargs)  # a keyword one letter off a field would be dropped, leaving the field as stored
        # a field the constructor refuses is a saved value here: the refusal says to change the file
        token = _LOADING.set(_LOADING.get() or "the saved config (config.json)")
        try:
            return super().from_dict({**config_dict, **own}, **kwargs)
        finally:
            _LOADING.reset(token)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """``PretrainedConfig.from_pretrained``, whose refusal of a saved field names the folder's ``config.json``
        (:meth:`from_dict`)."""
        import os
        token = _LOADING.set(f"the config.json of {os.fspath(pretrained_model_name_or_path)!r}")
        try:
            return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        finally:
            _LOADING.reset(token)

    def save_pretrained(self, save_directory, push_to_hub: bool = False, **kwargs):
        """``PretrainedConfig.save_pretrained`` of a config that passes :meth:`validate_fields` first: a field
        assigned since the config was built that the constructor refuses (``config.qk_norm = "rmsnorm"`` on a
        Transformer, ``config.dtype = "int64"``) is a ``ValueError`` naming it here, as when a model is built from
        the config, instead of a ``config.json`` that ``from_pretrained`` refuses. A config that saves loads back
        equal."""
        self.validate_fields()
        return super().save_pretrained(save_directory, push_to_hub=push_to_hub, **kwargs)

    def validate_fields(self) -> None:
        """Raise ``ValueError`` naming the first inconsistent field (also after fields were
        assigned one by one: the types are checked again, and every range check is written so
        that NaN fails it). Numbers and switches assigned since the config was built are stored
        as Python's ``int``, ``float`` and ``bool`` (numpy's scalars too), as the constructor stores
        them, so that the config saves as JSON."""
        self._check_fields(built=True)

    def _check_fields(self, built: bool) -> None:
        """:meth:`validate_fields`; ``built``: the config was built before (the fields derived from others when it
        was, the Transformer's head dims and ``query_scale``, may have been left behind by a field assigned since),
        else the constructor checks the fields it was given."""
        for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_heads", "intermediate_size", "head_k_dim",
                      "head_v_dim", "chunk_size", "segments", "conv_size"):
            setattr(self, field, _int(field, getattr(self, field)))
            if getattr(self, field) < 1:
                raise ValueError(f"config field {field!r} must be >= 1, got {getattr(self, field)}")
        if built:  # after vocab_size or an id was assigned on the built config (the constructor checked the ids
            for field in TOKEN_ID_FIELDS:  # it was given before PretrainedConfig stored them)
                setattr(self, field, _token_ids(field, getattr(self, field, None), self.vocab_size))
            # the weights' dtype assigned since (config.dtype = ..., or torch_dtype, which transformers 5 stores as
            # dtype): the constructor checked the one it was given; read from the instance, not the deprecated property
            _check_dtype({field: vars(self).get(field) for field in ("dtype", "torch_dtype")})
        for field in BOOL_FIELDS:
            setattr(self, field, _bool(field, getattr(self, field)))
        for field in ("lambda_scale", "query_scale", "eps", "decay_floor", "rope_theta", "rms_norm_eps",
                      "initializer_range"):
            setattr(self, field, _float(field, getattr(self, field)))
        if self.mup_base_width is not None:
            self.mup_base_width = _int("mup_base_width", self.mup_base_width)
        try:  # an integral number is stored as an int (the rules that are not sliding never read it)
            self.window = _int("window", self.window)
        except ValueError:
            pass
        _choice("mixer", self.mixer, MIXERS)
        if self.rule not in RULES:
            raise ValueError(f"config field 'rule' must be one of {sorted(RULES)}, got {self.rule!r}")
        if RULES[self.rule].sliding and (isinstance(self.window, bool) or not isinstance(self.window, int)
                                         or self.window < 1):
            raise ValueError(f"config field 'window' must be an integer >= 1 for the sliding rule "
                             f"{self.rule!r}, got {self.window!r}")
        _choice("read", self.read, ("after", "before"))
        _choice("gate", self.gate, GATES)
        _choice("log_gate", self.log_gate, LOG_GATES)
        _choice("qk_norm", self.qk_norm, QK_NORMS)
        _choice("feature_map", self.feature_map, FEATURE_MAPS)
        _choice("form", self.form, FORMS)
        _choice("backend", self.backend, BACKENDS)
        triton = self.backend == "triton" and self.mixer in RECURRENT_MIXERS  # (the Transformer reads neither field)
        if triton and self.form == "parallel":
            raise ValueError("config field 'backend' = 'triton' runs the chunk form (the kernels have no masked-parallel "
                             "form): set form='chunk' or backend='native'")
        # the kernels' own limits (ops.kernel_limits, which the kernel modules import)
        if triton and self.form == "chunk" and self.chunk_size not in kernel_limits.SUPPORTED_CHUNK_SIZES:
            raise ValueError(f"config field 'chunk_size' = {self.chunk_size}: backend='triton' runs the chunk form on "
                             f"kernels for chunks of {', '.join(map(str, kernel_limits.SUPPORTED_CHUNK_SIZES))} "
                             f"tokens; choose one of those or backend='native'")
        if triton and self.form == "recurrent":
            kernels, widest = "the fused recurrent kernel of form='recurrent'", kernel_limits.MAX_FUSED_HEAD_DIM
        elif triton and RULES[self.rule].regression:
            kernels, widest = f"the rule-{self.rule} kernels", kernel_limits.MAX_WY_HEAD_DIM
        else:
            kernels = widest = None
        if kernels is not None and self.head_k_dim > widest:
            raise ValueError(f"config field 'head_k_dim' = {self.head_k_dim}: backend='triton' runs {kernels}, whose "
                             f"one tile holds a head's whole key dim, at most {widest} wide; set "
                             f"head_k_dim <= {widest} (left unset: hidden_size / num_heads) or "
                             f"backend='native', which runs the PyTorch forms where the kernels do not reach")
        if triton and RULES[self.rule].sliding:
            if self.form == "recurrent" and self.window > kernel_limits.MAX_FUSED_WINDOW:
                kernels = "the fused recurrent kernel of form='recurrent', which unrolls the window's slots"
                supported = f"at most {kernel_limits.MAX_FUSED_WINDOW}"
            elif self.form != "recurrent" and self.rule == "3" and self.window not in kernel_limits.SLOT_COUNTS:
                kernels = "the rule-3 kernels, which group a step's window writes in blocks of 16 rows"
                supported = f"one of {', '.join(map(str, kernel_limits.SLOT_COUNTS))}"
            elif self.form != "recurrent" and self.rule == "3A" and self.window > kernel_limits.MAX_WINDOW:
                kernels = "the rule-3A kernels, which hold the window's band in one tile"
                supported = f"at most {kernel_limits.MAX_WINDOW}"
            else:
                kernels = None
            if kernels is not None:
                raise ValueError(f"config field 'window' = {self.window}: backend='triton' runs {kernels}, taking a "
                                 f"window of rule {self.rule!r} of {supported}; set window to {supported} or "
                                 f"backend='native', which runs the PyTorch forms where the kernels do not reach")
        for field in ("lambda_scale", "eps", "initializer_range"):
            if not getattr(self, field) >= 0:
                raise ValueError(f"config field {field!r} must be >= 0, got {getattr(self, field)}")
        for field in ("rms_norm_eps", "rope_theta"):
            if not getattr(self, field) > 0:
                raise ValueError(f"config field {field!r} must be > 0, got {getattr(self, field)}")
        # (also when assigned after the config was built: config.rope_scaling = {...} is stored as it is given)
        _check_rope({field: getattr(self, field, None) for field in ("rope_scaling", "rope_parameters")},
                    self.rope_theta)
        if not 0.0 < self.decay_floor < 1.0:
            raise ValueError(f"config field 'decay_floor' must lie in (0, 1), got {self.decay_floor}")
        if self.eps_attn is not None:
            number = as_float(self.eps_attn)
            if number is None or not math.isfinite(number) or number < 0:
                raise ValueError(f"config field 'eps_attn' must be None or a finite number >= 0, got {self.eps_attn}")
            self.eps_attn = number
            if self.mixer == "transformer" or RULES[self.rule].regression:
                raise ValueError(f"config field 'eps_attn' (the normalized read) needs an inner-product rule (1A, 2A, "
                                 f"3A) of a recurrent mixer, got mixer={self.mixer!r}, rule={self.rule!r}")
            if self.eps_attn == 0 and (self.shift or self.read == "before"):
                raise ValueError("config field 'eps_attn' must be > 0 with shift=True or read='before': the first "
                                 "token of every sequence (the first two with both) reads the empty memory, "
                                 "0 / (0 + eps_attn), NaN at 0")
            if self.eps_attn == 0 and (self.feature_map != "elu1" or not self.query_scale > 0):
                raise ValueError(f"config field 'eps_attn' must be > 0 with feature_map={self.feature_map!r} and "
                                 f"query_scale={self.query_scale}: only 'elu1' and a positive query_scale keep every "
                                 f"z^T q > 0 (relu gives 0 / 0 where a query shares no positive feature with the "
                                 f"memory, signed features denominators of either sign)")
        if self.gate == "ctx-eta" and not self.normalize:
            raise ValueError("config field 'gate' = 'ctx-eta' needs 'normalize' = True (the step is normalized)")
        if self.log_gate == "dt" and self.gate != "dt":
            raise ValueError("config field 'log_gate' = 'dt' needs 'gate' = 'dt' (Mamba-2 shares dt)")
        if self.mixer == "transformer":
            if self.hidden_size % self.num_heads:
                raise ValueError(f"config field 'num_heads' = {self.num_heads} does not divide 'hidden_size' = "
                                 f"{self.hidden_size} (the Transformer's head dim)")
            per_head = self.hidden_size // self.num_heads
            if per_head % 2:
                raise ValueError(f"config field 'num_heads' = {self.num_heads} gives the Transformer the odd head dim "
                                 f"hidden_size / num_heads = {per_head}; RoPE rotates pairs of dimensions, so it must "
                                 f"be even")
            if built and self.head_k_dim == self.head_v_dim != per_head:
                # derived from hidden_size / num_heads when the config was built: a num_heads or hidden_size assigned
                # since leaves them, and the query_scale of that head dim, as they were
                raise ValueError(f"config fields 'head_k_dim' and 'head_v_dim' = {self.head_k_dim} differ from the "
                                 f"Transformer's head dim hidden_size / num_heads = {self.hidden_size} / "
                                 f"{self.num_heads} = {per_head}: the config took its head dims (and query_scale) "
                                 f"from hidden_size / num_heads when it was built, and num_heads or hidden_size "
                                 f"assigned since does not change them; set head_k_dim = head_v_dim = {per_head} and "
                                 f"query_scale = {per_head ** -0.5!r} as well, or build the config again with the new "
                                 f"num_heads / hidden_size (head_k_dim, head_v_dim and query_scale left unset)")
            for field in ("head_k_dim", "head_v_dim"):
                if getattr(self, field) != per_head:
                    fix = _fix(field, per_head, built, "leave them unset")
                    raise ValueError(f"config field {field!r} = {getattr(self, field)} differs from the Transformer's "
                                     f"head dim hidden_size / num_heads = {per_head} (head_k_dim and head_v_dim size "
                                     f"the recurrent mixers' heads; {fix})")
            # softmax attention reads none of the recurrent mixers' switches: another value would be saved with a
            # model that ignores it
            own = {**MIXER_DEFAULTS["transformer"], "v_norm": False, "query_scale": float(per_head ** -0.5)}
            for field, value in own.items():
                same = math.isclose(self.query_scale, value, rel_tol=1e-12) if field == "query_scale" else \
                    getattr(self, field) == value  # (a scale saved as 1 / sqrt(d) may differ in the last bit)
                if not same:
                    fix = _fix(field, value, built) + (
                        f" (its head dim hidden_size / num_heads = {per_head} ** -0.5)"
                        if field == "query_scale" and (built or _LOADING.get()) else "")
                    raise ValueError(f"config field {field!r} = {getattr(self, field)!r} configures the recurrent "
                                     f"mixers only; the Transformer (softmax attention over RoPE queries and keys, "
                                     f"scaled by head_dim ** -0.5) takes {value!r} there: {fix}")
        if self.mixer in RECURRENT_MIXERS and not self.output_gate:
            # the output norm orders itself and the gate only when there is a gate (layers.norms.RMSNorm): without
            # one, another value than the mixer's own would be saved with a model that ignores it
            own = MIXER_DEFAULTS[self.mixer]["norm_before_gate"]
            if self.norm_before_gate != own:
                fix = _fix("norm_before_gate", own, built, f"leave it unset (the mixer's own is {own!r})")
                raise ValueError(f"config field 'norm_before_gate' = {self.norm_before_gate!r} orders the output "
                                 f"RMSNorm and the SiLU output gate, and the {self.mixer!r} mixer has no output gate "
                                 f"here (output_gate=False), so it would not be read: keep it with output_gate=True, "
                                 f"or {fix}")
        if self.mup_base_width is not None and _int("mup_base_width", self.mup_base_width) < 1:
            raise ValueError(f"config field 'mup_base_width' must be >= 1, got {self.mup_base_width}")

    @property
    def width_multiplier(self) -> float:
        """muP width multiplier ``m = hidden_size / mup_base_width`` (1 without a base width)."""
        return 1.0 if self.mup_base_width is None else self.hidden_size / self.mup_base_width


FalconConfig = FalconFWAConfig
"""The name this library uses for :class:`FalconFWAConfig` (the same class)."""
