"""Run configuration: a YAML or JSON recipe with the sections ``model``, ``data``, ``optim``,
``train`` and ``log``. A recipe may start with ``extends: other.yaml`` (path relative to the
file) and override any subset of it; ``--set section.field=value`` overrides from the command
line. Unknown fields and values of the wrong type are errors that name the field.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import json
import math
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union, get_args, get_origin, get_type_hints

from ..cli_options import dtype_name
from ..data.packing import PACKINGS
from ..data.prepare import DataSpec
from ..data.sources import same_setting

STRATEGIES = ("auto", "single", "ddp", "fsdp2")
DTYPES = ("bf16", "fp32")
_DTYPE_SPELLING = {dtype_name(c, DTYPES): c for c in DTYPES}  # torch's name -> the recipe's (bfloat16 -> bf16)


@dataclass
class ModelSection:
    """``preset``: a name of ``falcon_fwa.models.get_preset``; ``overrides``: config fields
    changed on top of it (``vocab_size`` is taken from the tokenizer unless given)."""
    preset: str = "tiny-falcon"
    overrides: Dict[str, Any] = field(default_factory=dict)


@dataclass
class DataSection(DataSpec):
    """The corpus fields of ``falcon_fwa.data.DataSpec``, plus where its tokens go
    (``out_dir``; default ``{train.out_dir}/data``), row length and packing."""
    train_source: str = ""
    out_dir: str = ""
    seq_len: int = 1024
    packing: str = "cu_seqlens"

    def spec(self) -> DataSpec:
        """The corpus and tokenizer part of this section, for ``prepare_dataset``."""
        return DataSpec(**{f.name: getattr(self, f.name) for f in dataclasses.fields(DataSpec)})


@dataclass
class OptimSection:
    """AdamW with linear warmup then cosine decay to ``min_lr_ratio * lr`` (at ``train.steps``)."""
    lr: float = 1e-3
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    warmup_steps: int = 2000
    min_lr_ratio: float = 0.1
    clip_grad_norm: float = 1.0


@dataclass
class TrainSection:
    """``global_batch`` sequences per optimizer step = ``micro_batch`` x ranks x accumulation."""
    steps: int = 100_000
    global_batch: int = 480
    micro_batch: int = 16
    dtype: str = "bf16"
    compile: bool = False
    activation_checkpointing: bool = False  # run each block again in the backward instead of storing it
    seed: int = 0
    strategy: str = "auto"
    out_dir: str = "runs/run"
    resume: str = "auto"
    save_every: int = 1000
    keep_checkpoints: int = 2
    eval_every: int = 1000
    eval_batches: int = 20  # validation: the first eval_batches x global_batch rows
    export_model: bool = True
    deterministic: bool = False


@dataclass
class LogSection:
    every: int = 10
    tensorboard: bool = True
    wandb_project: Optional[str] = None
    progress: bool = True
    plot: bool = True  # loss.png in the run folder as each launch ends (needs matplotlib)


# build_model passes the tokenizer's end-of-text id; a recipe that sets one is refused (recipe check, build_model)
EOS_OVERRIDE_REFUSED = ("config field model.overrides.eos_token_id: the end-of-text id is the tokenizer's; "
                        "leave it out")


@dataclass
class RunConfig:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    optim: OptimSection = field(default_factory=OptimSection)
    train: TrainSection = field(default_factory=TrainSection)
    log: LogSection = field(default_factory=LogSection)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def validate(self) -> "RunConfig":
        d, o, t = self.data, self.optim, self.train
        # any spelling the commands' --dtype take (bf16/bfloat16, fp32/float32), kept in the recipe's own
        # (bf16, fp32), which the trainer reads; another value is refused with the accepted spellings
        t.dtype = _DTYPE_SPELLING[dtype_name(t.dtype, DTYPES, name="config field train.dtype")]
        checks = [
            (bool(d.train_source), "data.train_source", "must name the training documents"),
            (d.seq_len >= 1, "data.seq_len", "must be >= 1"),
            (d.packing in PACKINGS, "data.packing", f"must be one of {PACKINGS}"),
            (0 < o.lr < math.inf, "optim.lr", "must be a finite number > 0"),
            (len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas), "optim.betas", "must be two numbers in [0, 1)"),
            (0 < o.eps < math.inf, "optim.eps", "must be a finite number > 0 (AdamW divides by sqrt(v) + eps)"),
            (0 <= o.weight_decay < math.inf, "optim.weight_decay", "must be a finite number >= 0"),
            (o.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0"),
            (0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", "must lie in [0, 1]"),
            (o.clip_grad_norm >= 0, "optim.clip_grad_norm", "must be >= 0 (0 turns clipping off)"),
            (t.steps >= 1, "train.steps", "must be >= 1"),
            (0 <= t.seed < 2 ** 32, "train.seed", "must lie in [0, 2**32)"),
            (t.micro_batch >= 1, "train.micro_batch", "must be >= 1"),
            (t.global_batch >= t.micro_batch, "train.global_batch", "must be >= train.micro_batch"),
            (t.strategy in STRATEGIES, "train.strategy", f"must be one of {STRATEGIES}"),
            (t.save_every >= 0, "train.save_every", "must be >= 0 (0: never)"),
            (t.eval_every >= 0, "train.eval_every", "must be >= 0 (0: never)"),
            (t.eval_batches >= 1, "train.eval_batches", "must be >= 1"),
            (t.keep_checkpoints >= 1, "train.keep_checkpoints", "must be >= 1"),
            (self.log.every >= 1, "log.every", "must be >= 1"),
        ]
        for ok, name, why in checks:
            if not ok:
                raise ValueError(f"config field {name} {why}, got {_get(self, name)!r}")
        d.check(name=lambda field: f"config field data.{field}")  # the corpus settings, before any is read
        self._check_model()
        if o.warmup_steps > t.steps:
            warnings.warn(f"optim.warmup_steps={o.warmup_steps} exceeds train.steps={t.steps}: the learning rate "
                          f"ends at {min(t.steps, o.warmup_steps) / max(o.warmup_steps, 1):.3g} of optim.lr, "
                          "still warming up", stacklevel=2)
        return self

    def _check_model(self) -> None:
        """The preset exists and every override is a valid model config field with a valid value
        (checked now, before any data is read). ``vocab_size``, where given, must be an integer >= 1; whether it
        holds the tokenizer's tokens is checked once the tokenizer is known (``build_model``)."""
        from ..models import get_preset
        from ..models.configuration import _int

        overrides = dict(self.model.overrides)
        if "vocab_size" in overrides:
            value = overrides.pop("vocab_size")
            try:
                ok = _int("vocab_size", value) >= 1
            except (ValueError, TypeError):
                ok = False
            if not ok:
                raise ValueError(f"config field model.overrides.vocab_size must be an integer >= 1 (at least the "
                                 f"tokenizer's size; leave it out for the preset's, grown to the tokenizer's where "
                                 f"smaller), got {value!r}")
        if "eos_token_id" in overrides:  # build_model passes the tokenizer's
            raise ValueError(EOS_OVERRIDE_REFUSED)
        try:
            get_preset(self.model.preset, **overrides)
        except ValueError as e:
            raise ValueError(f"config section model (preset {self.model.preset!r}, overrides {overrides}): "
                             f"{e}") from None


def resolved_model(section: dict, leave_out: frozenset = frozenset()) -> dict:
    """A recipe's model section (``RunConfig.to_dict()["model"]``, or one an earlier run recorded) as the model
    it builds: every field of the preset's config with the overrides applied, but those in ``leave_out`` (left
    out of the overrides too). So ``rule: 3a`` and ``3A``, or an override equal to the preset's own value
    (``mixer: falcon`` on ``tiny-falcon``), give the same fields as the section without it. A section that does
    not resolve (a preset this version does not have, an override it does not take) is given as written: the
    preset and each override (``overrides.NAME``)."""
    from ..models import get_preset
    from ..models.configuration import config_fields

    preset = section.get("preset", ModelSection.preset)
    overrides = {k: v for k, v in (section.get("overrides") or {}).items() if k not in leave_out}
    try:
        config = get_preset(preset, **overrides)
    except (ValueError, TypeError, KeyError):
        return {"preset": preset, **{f"overrides.{k}": v for k, v in overrides.items()}}
    return {k: getattr(config, k) for k in sorted(config_fields() - frozenset(leave_out))}


class _Absent:
    """A field one recorded recipe has and the other does not (a recipe of a version without it)."""

    def __repr__(self) -> str:
        return "absent"


ABSENT = _Absent()


def recipe_differences(was: dict, now: dict) -> List[tuple]:
    """``(field, was's value, now's value)`` for each setting where the recipes ``was`` and ``now``
    (``RunConfig.to_dict()`` mappings, or a part of one; either may be one an earlier run recorded) differ,
    :data:`ABSENT` for a field one of them lacks. The model section is compared as the model it builds
    (:func:`resolved_model`, every field: those that only change how it computes too), so an override that
    restates the preset's value is no difference. The other sections (data, optim, train, log) are compared
    field by field as recorded: ``to_dict`` writes every field, its default included, so a field set to its
    default and one left out of the recipe are recorded alike, and the fields that take several spellings are
    recorded in one (``train.dtype``, ``data.tokenizer``); the data section's paths (its sources, tokenizer and
    ``out_dir``) are compared as the files and folders they name from the working folder
    (:func:`~falcon_fwa.data.sources.same_setting`: ``corpus.jsonl``, ``./corpus.jsonl`` and its absolute path are
    one), ``hf:`` names as text; a field one recipe lacks is one of another version, whose default may have been
    another, so it differs."""
    differ = []
    for section in sorted(set(was) | set(now), key=str):
        a, b = was.get(section, ABSENT), now.get(section, ABSENT)
        if section == "model" and isinstance(a, dict) and isinstance(b, dict):
            a, b = resolved_model(a), resolved_model(b)
        if not (isinstance(a, dict) and isinstance(b, dict)):
            if a != b:
                differ.append((str(section), a, b))
            continue
        same = same_setting if section == "data" else (lambda k, x, y: x == y)
        differ += [(f"{section}.{k}", a.get(k, ABSENT), b.get(k, ABSENT)) for k in sorted(set(a) | set(b), key=str)
                   if k not in a or k not in b or not same(k, a[k], b[k])]
    return differ


def _get(cfg, dotted: str):
    obj = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if v is None and isinstance(out.get(k), dict):
            continue  # an empty section (YAML reads `train:` with its fields commented out as null) changes nothing
        if isinstance(v, dict) and isinstance(out.get(k), dict) and k != "overrides":
            out[k] = _deep_merge(out[k], v)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = {**out[k], **v}
        else:
            out[k] = copy.deepcopy(v)
    return out


def _read_file(path: str) -> dict:
    import yaml

    is_yaml = path.endswith((".yaml", ".yml"))
    with open(path) as f:
        try:
            raw = (load_yaml(f) or {}) if is_yaml else json.load(f)
        except (yaml.YAMLError, json.JSONDecodeError) as err:
            raise ValueError(f"recipe {path!r} is not valid {'YAML' if is_yaml else 'JSON'}: "
                             f"{' '.join(str(err).split())}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"recipe {path!r} must hold a mapping of sections")
    return raw


def trains_in_bf16(train: "TrainSection") -> bool:
    """Whether ``train.dtype`` (any spelling the recipe takes: bf16/bfloat16, fp32/float32) trains under bf16
    autocast; also for a config never validated. A ``ValueError`` naming ``train.dtype`` otherwise."""
    return dtype_name(train.dtype, DTYPES, name="config field train.dtype") == "bfloat16"


def _parent_path(path: str, parent) -> Optional[str]:
    """The file that recipe ``path``'s ``extends: parent`` names, resolved next to ``path`` (``None``: none); a
    value that is no file name, or a file not there, is a ValueError naming the recipe and its ``extends``."""
    if parent is None:
        return None
    if not isinstance(parent, str) or not parent.strip():
        raise ValueError(f"recipe {path!r}: extends must name a recipe file (a path relative to the recipe's "
                         f"folder), got {parent!r}")
    full = os.path.join(os.path.dirname(path), parent)
    if not os.path.isfile(full):
        what = "is a folder, not a file" if os.path.isdir(full) else "does not exist"
        raise ValueError(f"recipe {path!r} extends {parent!r}, but {full!r} {what} (extends is read in the folder "
                         "of the recipe that names it: copy that file there too, or give its path)")
    return full


def recipe_parent(path: str) -> Optional[str]:
    """The file recipe ``path`` extends (``extends:``, resolved next to it; ``None``: none)."""
    return _parent_path(path, _read_file(path).get("extends"))


def read_recipe(path: str, _chain: tuple = ()) -> dict:
    """The raw dict of a recipe file, with ``extends`` chains resolved (a cycle is a ValueError)."""
    here = os.path.realpath(path)
    if here in _chain:
        raise ValueError(f"recipe {path!r} extends itself: {' -> '.join(_chain + (here,))}")
    raw = _read_file(path)
    parent = _parent_path(path, raw.pop("extends", None))
    if parent:
        return _deep_merge(read_recipe(parent, _chain + (here,)), raw)
    return raw


@functools.lru_cache(maxsize=None)
def _yaml_loader():
    """``yaml.SafeLoader`` that also reads exponent numbers without a dot as floats."""
    import re

    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_implicit_resolver("tag:yaml.org,2002:float",
                                 re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
                                 list("-+0123456789"))
    return Loader


def load_yaml(stream):
    """``yaml.safe_load`` that also reads exponent numbers without a dot (``1e-3``, ``5E4``) as
    floats, as YAML 1.2 does; PyYAML's YAML 1.1 rules read them as text."""
    import yaml

    return yaml.load(stream, Loader=_yaml_loader())


def _parse_value(text: str):
    return load_yaml(text)


def assign_text(field: str, text: str) -> str:
    """A ``--set`` assignment of the string ``text`` to ``field``, quoted so that it stays that string (a
    path or name holding ``#``, ``: `` or one that reads as a number would otherwise be read as YAML)."""
    return f"{field}={json.dumps(text)}"


def apply_overrides(raw: dict, assignments: List[str]) -> dict:
    """``["train.steps=10", "model.overrides.hidden_size=64"]`` applied onto a raw recipe dict."""
    import yaml

    raw = copy.deepcopy(raw)
    for item in assignments:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set expects section.field=value, got {item!r}")
        node = raw
        parts = key.split(".")
        for i, p in enumerate(parts[:-1]):
            if node.get(p) is None:  # absent, or an empty section in the file
                node[p] = {}
            node = node[p]
            if not isinstance(node, dict):
                raise ValueError(f"--set {item!r}: {'.'.join(parts[:i + 1])} is a value, not a section")
        try:
            node[parts[-1]] = _parse_value(value)
        except yaml.YAMLError as err:
            raise ValueError(f"--set {item!r}: the value is not valid YAML ({' '.join(str(err).split())}); "
                             "quote a string that holds YAML syntax") from None
    return raw


def _typed(name: str, kind, value):
    """``value`` as the field type ``kind`` (int, float, bool, str, Optional, List, Dict), or a
    ValueError naming the field. A float field also takes a number written as a string: YAML
    reads ``1e-3`` (no dot) as text."""
    if get_origin(kind) is Union:
        args = [a for a in get_args(kind) if a is not type(None)]
        return None if value is None else _typed(name, args[0], value)
    if get_origin(kind) in (list, List):
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"config field {name} must be a list, got {value!r}")
        return [_typed(f"{name}[{i}]", get_args(kind)[0], v) for i, v in enumerate(value)]
    if get_origin(kind) in (dict, Dict):
        if not isinstance(value, dict):
            raise ValueError(f"config field {name} must be a mapping, got {value!r}")
        return value
    if kind is bool:
        if not isinstance(value, bool):
            raise ValueError(f"config field {name} must be true or false, got {value!r}")
        return value
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"config field {name} must be an integer, got {value!r}")
        return value
    if kind is float:
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ValueError(f"config field {name} must be a number, got {value!r}")
    if kind is str and not isinstance(value, str):
        raise ValueError(f"config field {name} must be a string, got {value!r}")
    return value


def _typed_model_overrides(overrides: dict) -> dict:
    """``model.overrides`` with the values of the model config's float fields typed as the
    recipe's own float fields are (numeric text such as ``"1e-6"`` is the number). The other
    values go to :class:`FalconConfig` as they are, which checks them naming the field."""
    from ..models import FalconConfig

    hints = get_type_hints(FalconConfig.__init__)
    floats = {name for name, kind in hints.items() if kind is float or kind == Optional[float]}
    return {k: _typed(f"model.overrides.{k}", hints[k], v) if k in floats else v for k, v in overrides.items()}


def _did_you_mean(name, known) -> str:
    """`` (did you mean 'steps'?)`` for the known name closest to a misspelt ``name``, else ``""``."""
    close = difflib.get_close_matches(str(name), sorted(known), 1, 0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""


def config_from_dict(raw: dict) -> RunConfig:
    """A validated :class:`RunConfig` from a recipe's raw mapping ``{section: {field: value}}``
    (what ``read_recipe`` and ``apply_overrides`` give). Unknown sections or fields and values
    of the wrong type are ``ValueError``s naming the field; the model section is checked
    against its preset (``RunConfig.validate``)."""
    sections = {f.name: f.type for f in dataclasses.fields(RunConfig)}
    kwargs = {}
    for name, value in raw.items():
        if name not in sections:
            raise ValueError(f"unknown config section {name!r}{_did_you_mean(name, sections)}; "
                             f"sections are {sorted(sections)}")
        cls = {"model": ModelSection, "data": DataSection, "optim": OptimSection, "train": TrainSection,
               "log": LogSection}[name]
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"config section {name!r} must be a mapping of fields, got {value!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        for key in value or {}:
            if key not in known:
                raise ValueError(f"unknown config field {name}.{key}{_did_you_mean(key, known)}; "
                                 f"fields of {name!r} are {sorted(known)}")
        types = get_type_hints(cls)
        kwargs[name] = cls(**{k: _typed(f"{name}.{k}", types[k], v) for k, v in (value or {}).items()})
    if "model" in kwargs:
        kwargs["model"].overrides = _typed_model_overrides(kwargs["model"].overrides)
    return RunConfig(**kwargs).validate()


def load_config(path: str, overrides: Optional[List[str]] = None) -> RunConfig:
    """Read, extend, override and validate a recipe file."""
    return config_from_dict(apply_overrides(read_recipe(path), overrides or []))
