"""Perplexity over held-out text, overall and by position bucket.

The held-out documents are tokenized (end-of-text opening each document, as in training),
concatenated and cut into windows of ``seq_len + 1`` tokens, each window's last token the
next one's first (the ``(len - 1) % seq_len`` predictions after the last whole window are not
scored); every window starts from an empty state. Two ways to treat the documents inside a window:

* ``documents="reset"`` (``eos_id`` given; the default of ``falcon-fwa ppl``, and what
  training with ``packing: cu_seqlens`` does): every document starts from an empty state
  (the window is run as packed sequences with ``cu_seqlens`` at each end-of-text), the
  prediction of a document's opening token from the previous document is left out (the
  trainer's losses count it: they score every target of a row, so on data whose documents
  end inside the rows ``ppl`` and ``val_loss`` differ by those predictions), and a token's position is its position in its document; the part of
  a document that continues from the previous window starts from an empty state at the
  window's start, so there a position counts from the window's start (the context the
  model had). A held-out file read as one document (``text_split="file"``) is therefore
  scored by position in the window;
* ``documents="carry"``: the window is one sequence, the state runs across document
  boundaries, and a token's position is its position in the window.

Token ``t`` contributes its next-token loss to its position, so the per-position average
shows how the loss evolves with context length, also beyond the training length (the
length-extrapolation curve):

    ppl(bucket [a, b)) = exp( sum_{a <= t < b} nll_sum_t / sum_{a <= t < b} count_t ).
"""
from __future__ import annotations

import glob
import math
import os
from contextlib import nullcontext
from typing import Callable, List, Optional, Sequence, Union

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..atomic import atomic_path
from ..cli_options import dtype_name
from ..data.shards import TokenShards, is_shard_folder
from ..data.sources import iter_documents
from ..data.tokenizer import encode_documents, is_byte_tokenizer
from ..ops.validate import check_positive_int
from ..plotting import pyplot


def check_model_folder(folder: str) -> None:
    """Raise ``FileNotFoundError`` naming ``folder`` when it is neither a saved model folder nor
    (by its form) a Hugging Face hub id ``owner/name``."""
    if os.path.isdir(folder):
        if not os.path.isfile(os.path.join(folder, "config.json")):
            raise FileNotFoundError(f"model folder {folder!r} holds no config.json: not a saved model"
                                    f"{_compare_hint(folder)}")
    elif (os.path.isabs(folder) or folder.startswith(".") or folder.count("/") > 1
          or ("/" in folder and os.path.isdir(folder.split("/")[0]))):
        # a name whose first part is a local folder (runs/model) is a path, not a hub id
        raise FileNotFoundError(f"model folder {folder!r} does not exist (and is no hub id such as owner/name)"
                                f"{_unexported_hint(folder)}")


def _compare_hint(folder: str) -> str:
    """Where the models of ``falcon-fwa compare``'s ``--out`` folder are (``main/NAME/model``), for an error."""
    if not os.path.isfile(os.path.join(folder, "compare.json")):
        return ""
    models = sorted(glob.glob(os.path.join(glob.escape(folder), "main", "*", "model", "config.json")))
    found = ", ".join(os.path.dirname(m) for m in models) or "none exported yet"
    return f"; it is a compare folder: each recipe's model is main/NAME/model ({found})"


def _unexported_hint(folder: str) -> str:
    """For a training run's ``model/`` that is not there yet: the run exports it at ``train.steps``."""
    run = os.path.dirname(os.path.normpath(folder))
    if os.path.basename(os.path.normpath(folder)) != "model" or not os.path.isdir(os.path.join(run, "checkpoints")):
        return ""
    return (f"; {run or '.'} is a training run that has not reached train.steps: its model is exported to "
            "model/ when it does (the same train command resumes it)")


def load_model(folder: str, *, device: str = "cpu", dtype: str = "fp32"):
    """A saved model folder (or a Hugging Face hub id ``owner/name``) -> (model in eval mode, tokenizer).
    ``dtype``: the weights', ``"fp32"`` or ``"bf16"`` (``"float32"``, ``"bfloat16"`` are taken too). Code that a
    folder brings (``auto_map``) is never run: such a folder is a ``ValueError`` naming ``trust_remote_code``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_model_folder(folder)
    from .. import models  # noqa: F401  (registers model_type "falcon_fwa" with the Auto classes)

    torch_dtype = getattr(torch, dtype_name(dtype, ("fp32", "bf16")))
    try:
        # a folder's own code (config.json's auto_map) never runs: transformers would ask at a terminal
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype, trust_remote_code=False)
        model = model.to(device).eval()
    except OSError as err:
        if os.path.isdir(folder):
            raise
        raise FileNotFoundError(f"model folder {folder!r} does not exist, and loading it as a hub id "
                                f"failed: {err}") from None
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=os.path.isdir(folder), trust_remote_code=False)
    return model, tokenizer


def token_stream(sources: Sequence[str], tokenizer, *, text_split: str = "file", text_field: str = "text",
                 max_tokens: Optional[int] = None, name: Callable[[str], str] = lambda field: field) -> np.ndarray:
    """All held-out tokens in order: text/JSONL/Parquet files, or token shard folders. Each text document
    opens with the end-of-text token, as in training, where the tokenizer has one (else it opens with
    nothing). ``name``: what errors call a setting (``text_field`` -> ``falcon-fwa ppl``'s ``--text-field``)."""
    parts: List[np.ndarray] = []
    total = 0
    for source in sources:
        if is_shard_folder(source):
            shards = TokenShards(source)
            if shards.eos_token_id != tokenizer.eos_token_id or shards.vocab_size != len(tokenizer):
                raise ValueError(
                    f"token shards {source!r} come from another tokenizer (vocab_size {shards.vocab_size}, "
                    f"eos_token_id {shards.eos_token_id}) than the model's ({len(tokenizer)}, "
                    f"{tokenizer.eos_token_id}); tokenize the held-out text with the model's tokenizer")
            docs = shards.documents()
        else:
            eos = np.asarray([] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id], dtype=np.int64)
            byte_level = is_byte_tokenizer(tokenizer)
            docs = (np.concatenate([eos, ids]) for text in iter_documents(source, text_split=text_split,
                                                                          text_field=text_field, name=name)
                    for ids in encode_documents(tokenizer, [text], byte_level=byte_level))
        for ids in docs:
            parts.append(np.asarray(ids, dtype=np.int64))
            total += len(ids)
            if max_tokens is not None and total >= max_tokens:
                return np.concatenate(parts)[:max_tokens]
    if not parts:
        raise ValueError(f"no held-out documents in {list(sources)}")
    return np.concatenate(parts)


def windows(tokens: np.ndarray, seq_len: int, max_windows: Optional[int] = None,
            name: Callable[[str], str] = lambda field: field) -> torch.Tensor:
    """Windows [N, seq_len + 1] (inputs + next-token targets), N = (len(tokens) - 1) // seq_len: each token
    is predicted in at most one of them, and the predictions after the last whole window are in none.
    ``name``: what an error calls ``seq_len`` and ``max_windows`` (``falcon-fwa ppl``'s ``--seq-len``,
    ``--max-windows``); ``max_windows`` below 1 is refused by that name."""
    if max_windows is not None:
        max_windows = check_positive_int(name("max_windows"), max_windows)
    n = (len(tokens) - 1) // seq_len
    if max_windows is not None:
        n = min(n, max_windows)
    if n == 0:
        raise ValueError(f"{len(tokens)} held-out tokens are fewer than one window of {name('seq_len')}={seq_len}")
    idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    return torch.from_numpy(tokens[idx])


def _at_least_float32(logits: torch.Tensor) -> torch.Tensor:
    """Logits to score: bf16/fp16 ones in float32, float32/float64 ones as they are."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


@torch.no_grad()
def position_nll(model, rows: torch.Tensor, *, batch_size: int = 1, device="cpu", bf16: bool = False,
                 progress: bool = True, eos_id: Optional[int] = None):
    """Summed next-token NLL (float64) at each position ``[seq_len]`` and the number of
    predictions summed there (``[seq_len]``, float64).

    ``eos_id=None``: each window is one sequence (``documents="carry"``). With ``eos_id``,
    every end-of-text token in a window opens a fresh sequence (``documents="reset"``):
    positions count from the document start, and predictions of an end-of-text token
    (the boundary into the next document) are not counted.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    seq_len = rows.shape[1] - 1
    from ..models.modeling import output_object

    as_object = output_object(model)  # .logits whatever the config's return_dict
    total = torch.zeros(seq_len, dtype=torch.float64)
    count = torch.zeros(seq_len, dtype=torch.float64)
    autocast = torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16) if bf16 else nullcontext()
    for i in tqdm(range(0, len(rows), batch_size), desc="perplexity", unit="batch", disable=not progress):
        batch = rows[i:i + batch_size].to(device)
        inputs, targets = batch[:, :-1], batch[:, 1:]
        if eos_id is None:
            with autocast:
                logits = model(input_ids=inputs, use_cache=False, **as_object).logits
            nll = F.cross_entropy(_at_least_float32(logits).transpose(1, 2), targets, reduction="none")
            total += nll.double().sum(0).cpu()
            count += len(batch)
            continue
        starts = inputs == eos_id
        starts[:, 0] = True  # a window starts a sequence, also inside a document
        flat_starts = starts.flatten().nonzero()[:, 0]
        cu = torch.cat([flat_starts, flat_starts.new_tensor([inputs.numel()])])
        with autocast:
            logits = model(input_ids=inputs.reshape(1, -1), cu_seqlens=cu, use_cache=False, **as_object).logits
        nll = F.cross_entropy(_at_least_float32(logits[0]), targets.reshape(-1), reduction="none").view_as(targets)
        keep = targets != eos_id
        step = torch.arange(seq_len, device=inputs.device).expand_as(inputs)
        last_start = torch.cummax(torch.where(starts, step, torch.zeros_like(step)), dim=1).values
        pos = (step - last_start)[keep].cpu()
        total.index_add_(0, pos, nll[keep].double().cpu())
        count.index_add_(0, pos, torch.ones(len(pos), dtype=torch.float64))
    return total, count


def default_edges(seq_len: int, first: int = 64) -> List[int]:
    """Position-bucket edges ``[0, first, 2 first, 4 first, ..., seq_len]`` (doubling while below
    ``seq_len``): bucket ``i`` holds the positions ``edges[i] <= p < edges[i + 1]``."""
    edges, e = [0], first
    while e < seq_len:
        edges.append(e)
        e *= 2
    return edges + [seq_len]


def check_edges(edges: Sequence[int], seq_len: int, name: Callable[[str], str] = lambda field: field) -> None:
    """Raise ``ValueError`` unless bucket ``edges`` rise strictly from 0 to ``seq_len`` (called ``name('seq_len')``)."""
    if not edges or list(edges) != sorted(set(edges)) or edges[0] != 0 or edges[-1] != seq_len:
        raise ValueError(f"buckets must rise strictly from 0 to {name('seq_len')}={seq_len}, got {list(edges)}")


def bucket_report(total: torch.Tensor, count: Union[int, torch.Tensor], edges: Sequence[int], *,
                  train_len: Optional[int] = None, windows: Optional[int] = None) -> dict:
    """Overall and per-bucket loss/perplexity from per-position NLL sums ``total`` and
    prediction counts ``count`` (per position, or one number for every position: the
    number of windows). Buckets without predictions report ``loss``/``ppl`` as ``None``."""
    seq_len = len(total)
    check_edges(edges, seq_len)
    if isinstance(count, int):
        windows = count if windows is None else windows
        count = torch.full((seq_len,), float(count), dtype=torch.float64)
    buckets = []
    for a, b in zip(edges[:-1], edges[1:]):
        n = float(count[a:b].sum())
        loss = float(total[a:b].sum()) / n if n > 0 else None
        buckets.append({"start": a, "end": b, "tokens": int(n), "loss": loss,
                        "ppl": None if loss is None else math.exp(loss),
                        "beyond_train_len": bool(train_len is not None and a >= train_len)})
    n = float(count.sum())
    if n == 0:
        raise ValueError("no predictions to average (every target was a document boundary)")
    loss = float(total.sum()) / n
    return {"seq_len": seq_len, "windows": windows, "tokens": int(n), "loss": loss,
            "ppl": math.exp(loss), "train_len": train_len, "buckets": buckets}


def plot_buckets(report: dict, path: str, label: str = "") -> None:
    """Perplexity against position (the buckets' midpoints) as a PNG at ``path`` (written atomically,
    its folder created); nothing (and a line saying so) without matplotlib (``ppl --plot`` checks for it first)."""
    plt = pyplot()
    if plt is None:
        return
    filled = [b for b in report["buckets"] if b["ppl"] is not None]
    mids = [(b["start"] + b["end"]) / 2 for b in filled]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(mids, [b["ppl"] for b in filled], marker="o", label=label or None)
    if report.get("train_len"):
        ax.axvline(report["train_len"], color="gray", ls="--", lw=1, label="training length")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("position in document" if report.get("documents") == "reset" else "position in window")
    ax.set_ylabel("perplexity")
    ax.legend()
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120)
    plt.close(fig)
