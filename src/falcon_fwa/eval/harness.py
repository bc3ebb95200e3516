"""lm-evaluation-harness on a saved model folder.

Importing ``falcon_fwa.models`` registers ``model_type="falcon_fwa"`` with the Hugging Face
Auto classes, so the harness's ``hf`` model (``HFLM``: loglikelihood, and ``generate`` with
``use_cache=True`` on left-padded batches) loads the folder directly. ``falcon-fwa`` is
registered as a harness model name too: the same ``HFLM``, except that every request opens
with the tokenizer's end-of-text token, as every document does in training, ``ppl`` and
``generate``, and that no forward pass is shared among requests (``logits_cache``, see
:func:`lm_class`). :func:`evaluate` uses it.
"""
from __future__ import annotations

import collections
import functools
import os
from pathlib import Path
from typing import Dict, List, Optional

from ..cli_options import check_tokenizer_in, dtype_name


@functools.cache
def lm_class():
    """The harness model class of ``falcon-fwa``: ``HFLM`` whose contexts open with end-of-text.

    Training stores each document as ``[eos] + tokens`` and the recurrent state starts at that
    token; the ``hf`` model leaves it out (the byte and ``bpe:N`` tokenizers add no special
    tokens), so its first prediction would be made from a start the model never saw. Here the
    context of a ``loglikelihood`` request and each prompt of a ``generate_until`` batch get
    it in front (left truncation applies after it); ``loglikelihood_rolling`` opens its first
    window with it, as does a ``loglikelihood`` request with an empty context (the harness's
    ``prefix_token_id``, which would be a beginning-of-sequence token where the tokenizer has a
    distinct one). Texts are encoded without special tokens, as training's documents
    (``add_bos_token=False``): a tokenizer that adds a beginning-of-sequence token does not
    add it here. A tokenizer without an end-of-text token, or a text that already opens with
    it, is left as it is. Generation never
    picks the ids past the tokenizer's vocabulary that the embedding pads to a multiple of 64
    (as ``falcon-fwa generate``), and a row of a batch ends at the tokenizer's end-of-text token
    also where the model's config names none; a ``loglikelihood`` request's ``is_greedy`` is
    greedy decoding over the tokenizer's ids too (its log-probability is over all ids, as in
    training and ``ppl``).

    ``logits_cache`` is off unless asked for: the harness's sharing of one forward pass among
    requests whose ``context + continuation[:-1]`` agree takes, for a shorter continuation,
    the log-probabilities of the leading positions of the longest one's instead of the trailing
    ones, so two requests that split the same text differently (``"the state" + " memory key"``
    and ``"the state memory" + " key"``, or equal windows of ``loglikelihood_rolling`` in a batch)
    would get wrong scores."""
    import torch
    from lm_eval.models.huggingface import HFLM

    class FalconFWALM(HFLM):
        """HFLM for falcon-fwa model folders: requests open with end-of-text, as in training."""

        def __init__(self, *args, logits_cache: bool = False, backend: str = "causal",
                     add_bos_token: bool = False, max_length_name: str = "max_length", **kwargs):
            # the folders are decoder-only; left to find out, the harness looks the registered model type up
            # in transformers' own tables, misses it and warns that the type is neither causal nor seq2seq.
            # Texts are encoded without special tokens, as training's documents are: a tokenizer that adds a
            # beginning-of-sequence token would otherwise put it after the end-of-text opening
            super().__init__(*args, logits_cache=logits_cache, backend=backend, add_bos_token=add_bos_token,
                             **kwargs)
            self.max_length_name = max_length_name  # what the errors call the context length

        def _loglikelihood_tokens(self, requests, *args, **kwargs):
            # the harness asserts, with no message, that every continuation fits in max_length
            # (a rolling window's request has no texts, only tokens, and fits by construction)
            if requests:
                longest = max((request[2] for request in requests), key=len)
                if len(longest) > self.max_length:
                    continuation = self.tok_decode(longest)
                    raise ValueError(f"{self.max_length_name} {self.max_length} is shorter than a continuation of "
                                     f"{len(longest)} tokens ({continuation[:40]!r}): give a "
                                     f"{self.max_length_name} of at least {len(longest)}")
            return super()._loglikelihood_tokens(requests, *args, **kwargs)

        def generate_until(self, requests, *args, **kwargs):
            # the context gets max_length - max_gen_toks tokens: the harness asserts that some are left
            for request in requests:
                gen_kwargs = request.args[1] if len(request.args) > 1 and isinstance(request.args[1], dict) else {}
                new = _max_gen_toks(gen_kwargs, self.max_gen_toks)
                if new >= self.max_length:
                    raise ValueError(f"{self.max_length_name} {self.max_length} leaves no tokens of context: the "
                                     f"task generates up to {new} tokens (max_gen_toks), which must be fewer than "
                                     f"{self.max_length_name}; give a {self.max_length_name} above {new}")
            return super().generate_until(requests, *args, **kwargs)

        @property
        def prefix_token_id(self) -> int:
            # what an empty context and the first rolling window open with: end-of-text, as documents do in
            # training (the harness takes the tokenizer's beginning-of-sequence token where it has one)
            if self.custom_prefix_token_id is None and self.tokenizer.eos_token_id is not None:
                return self.tokenizer.eos_token_id
            return super().prefix_token_id

        def _opening(self, ids) -> list:
            eos = self.tokenizer.eos_token_id
            return [] if eos is None or (len(ids) and ids[0] == eos) else [eos]

        def _encode_pair(self, context, continuation):
            context_enc, continuation_enc = super()._encode_pair(context, continuation)
            # the harness cuts tokenize(context + continuation) at len(tokenize(context)); where a token spans the
            # join ("the cat" + "s sat": " cats" is one token) that cut drops the continuation's first characters
            # (or leaves it no tokens: a bare AssertionError). Then the continuation is encoded alone
            n_spaces = len(context) - len(context.rstrip())  # (moved to the continuation, as the harness does)
            head, tail = ((context[:-n_spaces], context[-n_spaces:] + continuation) if n_spaces
                          else (context, continuation))
            if self.backend == "causal" and self.tok_encode(head + tail)[:len(context_enc)] != list(context_enc):
                continuation_enc = self.tok_encode(tail)
            return self._opening(context_enc) + list(context_enc), continuation_enc

        def _model_call(self, inps, attn_mask=None, labels=None):
            # HFLM reads .logits: the output object is asked for, whatever the config's return_dict says (a
            # folder saved with return_dict=False would otherwise give a tuple)
            if attn_mask is not None or labels is not None:  # the seq2seq call, which a causal model never gets
                return super()._model_call(inps, attn_mask, labels)
            dtype = getattr(self, "mixed_precision_dtype", None)
            with torch.no_grad(), torch.autocast(device_type=self.device.type, dtype=dtype, enabled=dtype is not None):
                return self.model(inps, return_dict=True).logits

        def _select_cont_toks(self, logits, contlen=None, inplen=None):
            # the continuation's log-probabilities (taken over all ids): is_greedy is their argmax, which
            # is to be over the tokenizer's ids, the ones generation picks from
            logits = super()._select_cont_toks(logits, contlen=contlen, inplen=inplen)
            if logits.shape[-1] > len(self.tokenizer):
                logits = logits.clone()
                logits[..., len(self.tokenizer):] = float("-inf")
            return logits

        def _model_generate(self, context, max_length, stop, **generation_kwargs):
            padded = range(len(self.tokenizer), self.model.config.vocab_size)
            if len(padded) and "suppress_tokens" not in generation_kwargs:
                generation_kwargs["suppress_tokens"] = list(padded)
            # a config without eos_token_id leaves rows that ended running on, and the text after the
            # end-of-text token (which decoding drops, so no stop string finds it) in their completion
            if self.tokenizer.eos_token_id is not None and "eos_token_id" not in generation_kwargs:
                generation_kwargs["eos_token_id"] = self.tokenizer.eos_token_id
            return super()._model_generate(context, max_length, stop, **generation_kwargs)

        def tok_batch_encode(self, strings, padding_side="left", left_truncate_len=None, truncation=False):
            ids, mask = super().tok_batch_encode(strings, padding_side=padding_side, left_truncate_len=None,
                                                 truncation=truncation)
            pad = self.tokenizer.pad_token_id
            pad = self.tokenizer.eos_token_id if pad is None else pad
            rows, masks = [], []
            for row, keep in zip(ids.tolist(), mask.tolist()):
                real = [t for t, k in zip(row, keep) if k]
                rows.append(self._opening(real) + real)
            width = max(len(r) for r in rows)
            if left_truncate_len:
                width = min(width, left_truncate_len)
                rows = [r[-width:] for r in rows]
            for i, r in enumerate(rows):
                fill = [pad] * (width - len(r))
                masks.append([0] * len(fill) + [1] * len(r) if padding_side == "left" else [1] * len(r) + [0] * len(fill))
                rows[i] = fill + r if padding_side == "left" else r + fill
            return (torch.tensor(rows, dtype=ids.dtype, device=ids.device),
                    torch.tensor(masks, dtype=mask.dtype, device=mask.device))

    return FalconFWALM


def _max_gen_toks(gen_kwargs: dict, default: int) -> int:
    """The most tokens a ``generate_until`` request generates, as the harness reads its generation kwargs."""
    try:
        from lm_eval.models.utils import normalize_gen_kwargs
    except ImportError:  # harness versions without it read max_gen_toks alone
        return int(gen_kwargs.get("max_gen_toks", default))
    return int(normalize_gen_kwargs(dict(gen_kwargs), default)["max_gen_toks"])


def register() -> None:
    """Register the model type with transformers and ``falcon-fwa`` (:func:`lm_class`) with the harness."""
    from lm_eval.api.registry import MODEL_REGISTRY, register_model

    from .. import models  # noqa: F401

    if "falcon-fwa" not in MODEL_REGISTRY:
        register_model("falcon-fwa")(lm_class())


# The paper's tables, as lm-evaluation-harness reports their columns. Table 2: accuracy ("acc"), and the
# length-normalized accuracy ("acc_norm") where the paper marks the task; "Avg." the unweighted mean of the
# eight. Table 1's Wiki. and LMB. perplexities: the harness's wikitext (word perplexity) and lambada_openai,
# the convention of the DeltaNet and Gated DeltaNet papers the baselines come from (the paper does not say).
PAPER_TABLE2 = (("PIQA", "piqa", "acc"), ("Hella.", "hellaswag", "acc_norm"), ("Wino.", "winogrande", "acc"),
                ("ARC-e", "arc_easy", "acc"), ("ARC-c", "arc_challenge", "acc_norm"),
                ("OBQA", "openbookqa", "acc_norm"), ("Social IQA", "social_iqa", "acc"), ("SciQ", "sciq", "acc"))
PAPER_TABLE1 = (("Wiki.", "wikitext", "word_perplexity"), ("LMB.", "lambada_openai", "perplexity"))


def paper_columns(results: dict) -> dict:
    """The columns of the paper's Tables 1 and 2 found in a harness results dict: ``{"table1": {column:
    perplexity}, "table2": {column: accuracy in %, "Avg.": mean of the eight}}``, each table only with the
    tasks that ran (``Avg.`` only when all eight did); ``{}`` when none did."""
    scores = results.get("results", {})

    def metric(task, name):
        return scores.get(task, {}).get(f"{name},none")

    out = {}
    t1 = {col: metric(task, name) for col, task, name in PAPER_TABLE1 if metric(task, name) is not None}
    if t1:
        out["table1"] = t1
    t2 = {col: 100.0 * metric(task, name) for col, task, name in PAPER_TABLE2 if metric(task, name) is not None}
    if t2:
        if len(t2) == len(PAPER_TABLE2):
            t2["Avg."] = sum(t2.values()) / len(PAPER_TABLE2)
        out["table2"] = t2
    return out


def expand_tasks(manager, tasks: List[str], *, option: str = "tasks",
                 include_option: Optional[str] = None) -> List[str]:
    """``tasks`` with each pattern expanded, as lm-evaluation-harness's command line does (its
    ``EvaluatorConfig.process_tasks``): each entry is matched (``fnmatch``: ``*``, ``?``, ``[...]``) against every
    task, group and tag name ``manager`` (a ``TaskManager``) knows, those of its include path among them, and
    gives its matches in sorted order; a plain name matches only itself. An entry that matches no name is kept
    as it is when it is a file (a task YAML file), and one ending in ``.yaml`` gives the files it matches as a
    path pattern, sorted. The result keeps the first of repeated names. Entries that match nothing are refused
    in one ``ValueError`` naming ``option`` (and ``include_option``, where given, as what local task YAML files
    need) and, for each, up to five close names (``difflib.get_close_matches``)."""
    import difflib
    import glob

    expanded: List[str] = []
    missing: List[str] = []
    for spec in tasks:
        matches = manager.match_tasks([spec])
        if not matches and os.path.isfile(spec):
            matches = [spec]
        elif not matches and spec.endswith(".yaml"):
            matches = sorted(path for path in glob.glob(spec) if os.path.isfile(path))
        if not matches:
            missing.append(spec)
        for match in matches:
            if match not in expanded:
                expanded.append(match)
    if missing:
        close = {spec: difflib.get_close_matches(spec, manager.all_tasks, n=5) for spec in missing}
        hints = "; ".join(f"{spec!r}: {', '.join(names)}" for spec, names in close.items() if names)
        raise ValueError(f"{option}: unknown {', '.join(map(repr, missing))}"
                         + (f" (local task YAML files need {include_option})" if include_option else "")
                         + ": each entry is a task, group or tag name, or a pattern of them such as arc_* or "
                           "hellaswag*, and must match at least one" + (f"; close matches of {hints}" if hints else ""))
    return expanded


# TaskManager objects by (constructor, include folder and the state of its YAML files): the index of the harness's
# own task library takes seconds to build, and the same one serves every call of the process
_TASK_MANAGERS: "collections.OrderedDict" = collections.OrderedDict()
_TASK_MANAGERS_KEPT = 4


# the folders whose YAML files the harness's index leaves out (lm_eval.tasks._index._IGNORE_DIRS): a notebook's
# checkpoint copies, Python's caches
INDEX_IGNORED_FOLDERS = frozenset({"__pycache__", ".ipynb_checkpoints"})


def _yaml_files_state(folder: str) -> tuple:
    """The YAML files under ``folder`` (as the harness's index finds them: none under a folder of
    :data:`INDEX_IGNORED_FOLDERS`), each with its size and modification time: a file added, removed or edited
    changes it; one the index leaves out (a notebook's checkpoint copy) does not."""
    root = Path(folder)
    state = []
    for path in sorted(root.glob("**/*.yaml")):
        if INDEX_IGNORED_FOLDERS.intersection(path.relative_to(root).parts[:-1]):
            continue
        try:
            stat = path.stat()
        except OSError:  # (a dangling link: the index skips it too)
            continue
        state.append((path.relative_to(root).as_posix(), stat.st_size, stat.st_mtime_ns))
    return tuple(state)


def task_manager(include_path: Optional[str] = None):
    """lm-evaluation-harness's ``TaskManager`` (its index of task, group and tag names) of its own tasks and, where
    given, those of the folder ``include_path``. Built once per process for each include folder and reused by
    later calls (building it reads every YAML file of the harness's task library, seconds); a folder whose YAML
    files were added, removed or edited since gets a new one. The few last ones are kept."""
    from lm_eval.tasks import TaskManager

    key = (TaskManager, None if not include_path else
           (os.path.realpath(include_path), _yaml_files_state(include_path)))
    manager = _TASK_MANAGERS.get(key)
    if manager is None:
        manager = TaskManager(include_path=include_path) if include_path else TaskManager()
        _TASK_MANAGERS[key] = manager
        while len(_TASK_MANAGERS) > _TASK_MANAGERS_KEPT:
            _TASK_MANAGERS.popitem(last=False)
    _TASK_MANAGERS.move_to_end(key)
    return manager


def evaluate(model_dir: str, tasks: List[str], *, include_path: Optional[str] = None,
             num_fewshot: Optional[int] = None, batch_size: int = 1, limit: Optional[float] = None,
             device: str = "cpu", dtype: str = "float32", log_samples: bool = False,
             max_length: Optional[int] = None, names: Optional[Dict[str, str]] = None) -> dict:
    """Run ``tasks`` (names; local tasks from ``include_path``) on ``model_dir``; the harness's results dict.

    ``max_length``: the context length in tokens (longer contexts are cut from the left, and
    ``loglikelihood_rolling`` scores a document in windows of it). ``None`` leaves it to the
    harness: the model config's ``max_position_embeddings`` (falcon-fwa configs have none), else
    the tokenizer's ``model_max_length`` (1024 for GPT-2's; the byte and ``bpe:N`` tokenizers set
    none, 2**30), i.e. no cut at all. ``names``: what the errors call the arguments (``model_dir``,
    ``tasks``, ``include_path``, ``max_length``), where a command takes them under its own options.

    ``tasks`` may hold patterns (``arc_*``, ``hellaswag*``), expanded as the harness's own command line
    expands them (:func:`expand_tasks`); the results dict's ``tasks`` is the expanded list that ran. The harness's
    index of task names is built once per process for each ``include_path`` (:func:`task_manager`): a second call
    skips its seconds."""
    import lm_eval

    from .perplexity import check_model_folder

    def name(argument: str) -> str:
        return (names or {}).get(argument, argument)

    check_model_folder(model_dir)
    if max_length is not None and max_length < 1:
        raise ValueError(f"{name('max_length')} must be at least 1, got {max_length}")
    if include_path and not os.path.isdir(include_path):
        raise FileNotFoundError(f"{name('include_path')} {include_path!r} is not a folder of task YAML files")
    register()
    manager = task_manager(include_path)
    tasks = expand_tasks(manager, tasks, option=name("tasks"),
                         include_option=None if include_path else name("include_path"))
    check_tokenizer_in(name("model_dir"), model_dir)  # the harness would load the model first, then fail naming neither
    # the model type is registered here (register()): no code from the folder runs
    model_args = {"pretrained": model_dir, "dtype": dtype_name(dtype, ("float32", "bfloat16", "float16")),
                  "trust_remote_code": False}
    if max_length is not None:
        model_args["max_length"] = max_length
    if name("max_length") != "max_length":  # the harness model's errors name it as the caller does
        model_args["max_length_name"] = name("max_length")
    results = lm_eval.simple_evaluate(
        model="falcon-fwa", model_args=model_args,
        tasks=tasks, num_fewshot=num_fewshot, batch_size=batch_size, limit=limit, device=device,
        task_manager=manager, log_samples=log_samples)
    if results is not None:  # (None on the processes of a distributed run other than the first)
        results["tasks"] = tasks
    return results
