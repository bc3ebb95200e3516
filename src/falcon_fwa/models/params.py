"""Parameter counts of configurations, grouped by component, without allocating weights."""
from __future__ import annotations

from collections import OrderedDict
from typing import Dict, Iterable, List

import torch

from .configuration import FalconConfig

__all__ = ["count_parameters", "parameter_table"]


def count_parameters(config: FalconConfig) -> Dict[str, int]:
    """``{"embedding", "mixer", "mlp", "norms", "total"}`` for ``config`` (tied embeddings counted once).

    The model is built on the meta device, so even large configs cost no memory."""
    from .modeling import FalconForCausalLM

    with torch.device("meta"):
        model = FalconForCausalLM(config)
    counts: Dict[str, int] = OrderedDict(embedding=0, mixer=0, mlp=0, norms=0)
    seen = set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if "embed" in name or "lm_head" in name:
            key = "embedding"
        elif ".mixer." in name:
            key = "mixer"
        elif ".mlp." in name:
            key = "mlp"
        else:
            key = "norms"
        counts[key] += p.numel()
    counts["total"] = sum(counts.values())
    return counts


def _short(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}K"


def parameter_table(names: Iterable[str], configs: Iterable[FalconConfig]) -> str:
    """A markdown table of :func:`count_parameters` for named configs."""
    rows: List[str] = ["| preset | mixer | rule | layers | width | heads | mlp | embedding | mixers | MLPs | "
                       "norms | total |", "|" + "---|" * 12]
    for name, cfg in zip(names, configs):
        c = count_parameters(cfg)
        rule = cfg.rule if cfg.mixer == "falcon" else "-"
        rows.append(f"| {name} | {cfg.mixer} | {rule} | {cfg.num_hidden_layers} | {cfg.hidden_size} | "
                    f"{cfg.num_heads} | {cfg.intermediate_size} | {c['embedding']:,} | {c['mixer']:,} | "
                    f"{c['mlp']:,} | {c['norms']:,} | {c['total']:,} ({_short(c['total'])}) |")
    return "\n".join(rows)
