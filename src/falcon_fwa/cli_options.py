"""Options shared by the commands. A bad value ends the command with one line naming the
option (exit status 2): a ``ValueError`` from ``resolve_device`` or ``at_least``, a
``FileNotFoundError`` from ``check_model_option``, a ``ValueError`` from ``check_output_file`` or
``check_output_folder`` (the CLI prints it with the place it was raised), argparse's own error for a
``--dtype`` it cannot read."""
from __future__ import annotations

import argparse
import math
import os
from typing import Callable, Optional, Sequence

DEVICE_HELP = "cpu, cuda, cuda:N or auto (cuda when available)"

# every spelling of a dtype the commands take -> the torch name
_DTYPE_ALIASES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
                  "fp16": "float16", "float16": "float16"}


def resolve_device(name: str) -> str:
    """``name`` as a device string: ``auto`` is ``cuda`` where CUDA is available, else ``cpu``;
    otherwise ``cpu``, ``cuda`` or ``cuda:N`` of a device this machine has. ``ValueError``
    naming ``--device`` for anything else."""
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"--device must be {DEVICE_HELP}, got {name!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"--device must be {DEVICE_HELP}, got {name!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available here")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return name


def check_model_option(folder: str) -> None:
    """``FileNotFoundError`` naming ``--model`` unless ``folder`` is a saved model folder or (by its form)
    a hub id ``owner/name``: the commands that load a model check it before their slower imports. A file
    is refused by name too (it was taken for a hub id, then read by transformers as a config.json)."""
    from .eval.perplexity import check_model_folder

    if os.path.isfile(folder):
        raise FileNotFoundError(f"--model {folder!r} is a file, not a model folder (config.json and the weights)")
    try:
        check_model_folder(folder)
    except FileNotFoundError as err:
        hint = ""
        if os.path.isdir(os.path.join(folder, "checkpoints")) or os.path.isfile(os.path.join(folder, "summary.json")):
            exported = os.path.isfile(os.path.join(folder, "model", "config.json"))  # a training run's folder
            hint = (f"; it is a training run's folder: its model is {os.path.join(folder, 'model')}" if exported else
                    "; it is a training run's folder, whose model is exported to model/ once it reaches train.steps")
        raise FileNotFoundError(f"--model: {err}{hint}") from None


# the files a saved tokenizer leaves in its folder (a fast tokenizer's, or a slow one's vocabulary)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                    "spiece.model", "sentencepiece.bpe.model")


def check_tokenizer_in(option: str, folder: str) -> None:
    """``FileNotFoundError`` naming ``option`` where ``folder``, a local model folder, holds no saved tokenizer
    (``model.save_pretrained`` alone writes none): transformers' own error, after the model has loaded, names
    neither the folder nor the tokenizer. A hub id passes."""
    if os.path.isdir(folder) and not any(os.path.isfile(os.path.join(folder, f)) for f in _TOKENIZER_FILES):
        raise FileNotFoundError(f"{option}: model folder {folder!r} holds no tokenizer (no tokenizer.json or "
                                "tokenizer_config.json): save one there with tokenizer.save_pretrained(folder)")


def _existing_ancestor(path: str) -> str:
    """``path`` itself where it exists, else the nearest folder (or file) above it that does."""
    path = os.path.abspath(path)
    while not os.path.lexists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def check_input_files(option: str, paths) -> None:
    """``FileNotFoundError`` naming ``option`` for the first of ``paths`` (a path or a list of them, files
    the command reads, such as recipes) that is not a file: refused before any work."""
    for path in [paths] if isinstance(paths, str) else list(paths or []):
        if not os.path.isfile(path):
            what = "a folder, not a file" if os.path.isdir(path) else "no such file"
            raise FileNotFoundError(f"{option} {path!r}: {what}")


def check_output_folder(option: str, path: Optional[str]) -> None:
    """``ValueError`` naming ``option`` where ``path``, a folder the command creates or fills, is a file or
    lies under one: refused before any work (it would end the command at its first write)."""
    if not path:
        return
    existing = _existing_ancestor(path)
    if not os.path.isdir(existing):
        where = "" if existing == os.path.abspath(path) else f" lies under {existing!r}, which"
        raise ValueError(f"{option} {path!r}{where} is a file, not a folder")


def ends_in_separator(path: str) -> bool:
    """Whether ``path`` ends in a path separator, as a folder's name may (``DIR/new/``)."""
    return path.endswith(tuple(sep for sep in (os.sep, os.altsep) if sep))


def check_output_file(option: str, path: Optional[str]) -> None:
    """``ValueError`` naming ``option`` where ``path``, a file the command writes, is a folder (or names one by
    its final separator, ``DIR/new/``) or lies under a file: refused before any work (a finished evaluation
    would otherwise be lost at its write)."""
    if not path:
        return
    if os.path.isdir(path):
        raise ValueError(f"{option} {path!r} is a folder: give the path of a file")
    if ends_in_separator(path):
        raise ValueError(f"{option} {path!r} ends in a separator, as a folder does: give the path of a file")
    existing = _existing_ancestor(os.path.dirname(os.path.abspath(path)))
    if not os.path.isdir(existing):
        raise ValueError(f"{option} {path!r} lies under {existing!r}, which is a file, not a folder")


def at_least(option: str, value, low, *, strict: bool = False) -> None:
    """``ValueError`` naming ``option`` unless ``value >= low`` (``value > low`` when ``strict``);
    NaN fails, ``None`` (an option left out) passes. For integer and number options whose bad
    values would otherwise end in a traceback or be silently taken as "off"."""
    if value is not None and not (value > low if strict else value >= low):
        raise ValueError(f"{option} must be {'>' if strict else '>='} {low}, got {value}")


def finite_at_least(option: str, value, low, *, strict: bool = False) -> None:
    """:func:`at_least` for a number option that must also be finite (``inf``
    passes a lower bound, and ends in an error far from the option, or in a run of nothing)."""
    if value is not None and not math.isfinite(value):
        raise ValueError(f"{option} must be a finite number {'>' if strict else '>='} {low}, got {value}")
    at_least(option, value, low, strict=strict)


def check_seed(option: str, value: Optional[int]) -> None:
    """``ValueError`` naming ``option`` unless ``value`` is a seed torch takes, in ``[-2^63, 2^64)``
    (torch's own overflow error names nothing); ``None`` passes."""
    if value is not None and not -2 ** 63 <= value < 2 ** 64:
        raise ValueError(f"{option} must lie in [-2^63, 2^64), got {value}")


def _spellings(choices: Sequence[str]) -> str:
    """``choices`` with their other spellings, for an error message: ``fp32 (float32), bf16 (bfloat16)``."""
    return ", ".join(f"{c} ({'/'.join(a for a, t in _DTYPE_ALIASES.items() if t == _DTYPE_ALIASES[c] and a != c)})"
                     for c in choices)


def dtype_name(value: str, choices: Sequence[str], *, name: str = "dtype") -> str:
    """The torch name (``"float32"``, ``"bfloat16"``, ``"float16"``) of ``value``, any spelling of one
    of ``choices``: the Python functions behind the commands take what their ``--dtype`` takes.
    ``ValueError`` naming ``name`` otherwise."""
    allowed = {_DTYPE_ALIASES[c] for c in choices}
    torch_name = _DTYPE_ALIASES.get(str(value).strip().lower())
    if torch_name not in allowed:
        raise ValueError(f"{name} must be one of {_spellings(choices)}, got {value!r}")
    return torch_name


def dtype_option(choices: Sequence[str]) -> Callable[[str], str]:
    """argparse ``type`` of a ``--dtype`` option whose values are ``choices`` (a command's own
    spellings): any spelling of the same dtype (``bf16`` or ``bfloat16``, ``fp32`` or ``float32``,
    ``fp16`` or ``float16``) is taken and returned in the command's spelling."""
    by_dtype = {_DTYPE_ALIASES[c]: c for c in choices}

    def parse(text: str) -> str:
        name = _DTYPE_ALIASES.get(text.strip().lower())
        if name not in by_dtype:
            raise argparse.ArgumentTypeError(f"must be one of {_spellings(choices)}, got {text!r}")
        return by_dtype[name]

    parse.__name__ = "dtype"
    return parse
