"""Perplexity over held-out text, overall and by position bucket.

The held-out documents are tokenized (end-of-text opening each document, as in training),
concatenated and cut into windows of ``seq_len + 1`` tokens; every window starts from an
empty state. Token ``t`` of a window contributes its next-token loss to position ``t``, so
the per-position average shows how the loss evolves with context length, also beyond the
training length (the length-extrapolation curve):

    ppl(bucket [a, b)) = exp( sum_{windows} sum_{a <= t < b} nll_t / (#windows * (b - a)) ).
"""
from __future__ import annotations

import math
import os
from contextlib import nullcontext
from typing import List, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..data.shards import TokenShards
from ..data.sources import iter_documents
from ..data.tokenizer import encode_documents, is_byte_tokenizer


def load_model(folder: str, *, device: str = "cpu", dtype: str = "fp32"):
    """A saved model folder -> (model in eval mode, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .. import models  # noqa: F401  (registers model_type "falcon_fwa" with the Auto classes)

    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return model, tokenizer


def token_stream(sources: Sequence[str], tokenizer, *, text_split: str = "file", text_field: str = "text",
                 max_tokens: Optional[int] = None) -> np.ndarray:
    """All held-out tokens in order: text/JSONL/Parquet files, or token shard folders."""
    parts: List[np.ndarray] = []
    total = 0
    for source in sources:
        if os.path.isfile(os.path.join(source, "meta.json")):
            docs = TokenShards(source).documents()
        else:
            eos = np.asarray([tokenizer.eos_token_id], dtype=np.int64)
            byte_level = is_byte_tokenizer(tokenizer)
            docs = (np.concatenate([eos, ids]) for text in iter_documents(source, text_split=text_split,
                                                                          text_field=text_field)
                    for ids in encode_documents(tokenizer, [text], byte_level=byte_level))
        for ids in docs:
            parts.append(np.asarray(ids, dtype=np.int64))
            total += len(ids)
            if max_tokens is not None and total >= max_tokens:
                return np.concatenate(parts)[:max_tokens]
    if not parts:
        raise ValueError(f"no held-out documents in {list(sources)}")
    return np.concatenate(parts)


def windows(tokens: np.ndarray, seq_len: int, max_windows: Optional[int] = None) -> torch.Tensor:
    """Non-overlapping windows [N, seq_len + 1] (inputs + next-token targets)."""
    n = (len(tokens) - 1) // seq_len
    if max_windows is not None:
        n = min(n, max_windows)
    if n == 0:
        raise ValueError(f"{len(tokens)} held-out tokens are fewer than one window of seq_len={seq_len}")
    idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    return torch.from_numpy(tokens[idx])


@torch.no_grad()
def position_nll(model, rows: torch.Tensor, *, batch_size: int = 1, device="cpu", bf16: bool = False,
                 progress: bool = True):
    """Summed next-token NLL (float64) at each position [seq_len] and the number of windows."""
    seq_len = rows.shape[1] - 1
    total = torch.zeros(seq_len, dtype=torch.float64)
    autocast = torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16) if bf16 else nullcontext()
    for i in tqdm(range(0, len(rows), batch_size), desc="perplexity", unit="batch", disable=not progress):
        batch = rows[i:i + batch_size].to(device)
        with autocast:
            logits = model(input_ids=batch[:, :-1], use_cache=False).logits
        nll = F.cross_entropy(logits.float().transpose(1, 2), batch[:, 1:], reduction="none")
        total += nll.double().sum(0).cpu()
    return total, len(rows)


def default_edges(seq_len: int, first: int = 64) -> List[int]:
    edges, e = [0], first
    while e < seq_len:
        edges.append(e)
        e *= 2
    return edges + [seq_len]


def bucket_report(total: torch.Tensor, n_windows: int, edges: Sequence[int], *,
                  train_len: Optional[int] = None) -> dict:
    """Overall and per-bucket loss/perplexity from per-position NLL sums."""
    seq_len = len(total)
    if list(edges) != sorted(set(edges)) or edges[0] != 0 or edges[-1] != seq_len:
        raise ValueError(f"buckets must rise strictly from 0 to seq_len={seq_len}, got {list(edges)}")
    buckets = []
    for a, b in zip(edges[:-1], edges[1:]):
        loss = float(total[a:b].sum() / (n_windows * (b - a)))
        buckets.append({"start": a, "end": b, "tokens": n_windows * (b - a), "loss": loss, "ppl": math.exp(loss),
                        "beyond_train_len": bool(train_len is not None and a >= train_len)})
    loss = float(total.sum() / (n_windows * seq_len))
    return {"seq_len": seq_len, "windows": n_windows, "tokens": n_windows * seq_len, "loss": loss,
            "ppl": math.exp(loss), "train_len": train_len, "buckets": buckets}


def plot_buckets(report: dict, path: str, label: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mids = [(b["start"] + b["end"]) / 2 for b in report["buckets"]]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(mids, [b["ppl"] for b in report["buckets"]], marker="o", label=label or None)
    if report.get("train_len"):
        ax.axvline(report["train_len"], color="gray", ls="--", lw=1, label="training length")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("position in window")
    ax.set_ylabel("perplexity")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
