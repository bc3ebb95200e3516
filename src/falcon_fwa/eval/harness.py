"""lm-evaluation-harness on a saved model folder.

Importing ``falcon_fwa.models`` registers ``model_type="falcon_fwa"`` with the Hugging Face
Auto classes, so the harness's ``hf`` model (``HFLM``: loglikelihood, and ``generate`` with
``use_cache=True`` on left-padded batches) loads the folder directly. ``falcon-fwa`` is also
registered as a harness model name (the same ``HFLM``, with the registration guaranteed).
"""
from __future__ import annotations

import os
from typing import List, Optional

from ..cli_options import dtype_name


def register() -> None:
    """Register the model type with transformers and ``falcon-fwa`` with the harness."""
    from lm_eval.api.registry import MODEL_REGISTRY, register_model
    from lm_eval.models.huggingface import HFLM

    from .. import models  # noqa: F401

    if "falcon-fwa" not in MODEL_REGISTRY:
        register_model("falcon-fwa")(type("FalconFWALM", (HFLM,), {"__doc__": "HFLM for falcon-fwa model folders."}))


def evaluate(model_dir: str, tasks: List[str], *, include_path: Optional[str] = None,
             num_fewshot: Optional[int] = None, batch_size: int = 1, limit: Optional[float] = None,
             device: str = "cpu", dtype: str = "float32", log_samples: bool = False,
             max_length: Optional[int] = None) -> dict:
    """Run ``tasks`` (names; local tasks from ``include_path``) on ``model_dir``; the harness's results dict.

    ``max_length``: the context length in tokens (longer contexts are cut from the left, and
    ``loglikelihood_rolling`` scores a document in windows of it). ``None`` leaves it to the
    harness: the model config's ``max_position_embeddings`` (falcon-fwa configs have none), else
    the tokenizer's ``model_max_length`` (1024 for GPT-2's; the byte and ``bpe:N`` tokenizers set
    none, 2**30), i.e. no cut at all."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from .perplexity import check_model_folder

    check_model_folder(model_dir)
    if max_length is not None and max_length < 1:
        raise ValueError(f"max_length must be at least 1, got {max_length}")
    if include_path and not os.path.isdir(include_path):
        raise FileNotFoundError(f"include_path {include_path!r} is not a folder of task YAML files")
    register()
    manager = TaskManager(include_path=include_path) if include_path else TaskManager()
    known = manager.match_tasks(list(tasks))
    missing = [t for t in tasks if t not in known and not os.path.isfile(t)]
    if missing:
        raise ValueError(f"tasks: unknown {', '.join(map(repr, missing))}"
                         + ("" if include_path else " (local task YAML files need include_path)"))
    # the model type is registered here (register()): no code from the folder runs
    model_args = {"pretrained": model_dir, "dtype": dtype_name(dtype, ("float32", "bfloat16", "float16")),
                  "trust_remote_code": False}
    if max_length is not None:
        model_args["max_length"] = max_length
    return lm_eval.simple_evaluate(
        model="hf", model_args=model_args,
        tasks=tasks, num_fewshot=num_fewshot, batch_size=batch_size, limit=limit, device=device,
        task_manager=manager, log_samples=log_samples)
