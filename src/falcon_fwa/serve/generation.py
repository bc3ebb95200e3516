"""Text generation from a causal LM and its tokenizer, with honest timings.

:func:`generate_text` runs its own decoding loop over the model's cache (a
:class:`~falcon_fwa.models.FalconCache` for the models of this package: ``O(1)`` per token for
the recurrent mixers): one forward pass over the left-padded prompts of a batch (the prefill),
then one single-token forward pass per new token. Every prompt starts with the tokenizer's
end-of-text token, as every training document does. Tokens are chosen among the tokenizer's
ids only (a model's vocabulary may be padded beyond them). A row ends at its end-of-text token, when its
text holds a stop string (looked for on the host between steps: :mod:`falcon_fwa.serve.stops`) or after
``max_new_tokens``; a batch when all its rows have.

What is measured (``Timing``), per batch and summed, with ``torch.cuda.synchronize`` before each
clock read on CUDA:

* ``prefill_s``: the prompt forward pass and the choice of the first new token (time to first token,
  tokenization excluded);
* ``decode_s``: everything after that until the batch ends (the single-token forward passes, sampling,
  streaming, looking for stop strings), which produces the new tokens after the first: ``decode_tokens``
  counts them over the batch's rows, up to and including the token that ended each row (its end-of-text
  token or the last token of a stop string; the steps a finished row still runs while others go on are not
  counted); ``decode_tokens_per_s = decode_tokens / decode_s``;
* ``peak_gpu_memory_bytes``: ``torch.cuda.max_memory_allocated`` over the call (weights included), on CUDA;
* ``graph_capture_s``: recording the decoding step as a CUDA graph (``cuda_graphs``), once per batch,
  between the prefill and the decoding; ``graphed_batches`` and ``decode_mode`` (``"cuda graph"``,
  ``"eager"`` or ``"mixed"``); ``graph_note``: why steps were not graphed.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, List, Optional, Sequence, Union

import torch

from ..cli_options import check_seed
from ..models.modeling import output_object
from ..ops.validate import as_float, as_int
from .graphs import GraphedDecoder, graphable
from .stops import StopText, check_stop

__all__ = ["Completion", "Timing", "Generation", "check_settings", "generate_text"]


@dataclass
class Completion:
    """One prompt's result: the ids fed (``prompt_ids``, the leading end-of-text token included), the
    new token ids (the end-of-text token, or the tokens of the stop string, that ended it included) and their
    text (special tokens left out; cut just before the stop string that ended it). ``finish_reason``:
    ``"eos"`` (its end-of-text token, ``stopped_at_eos``), ``"stop"`` (``stop_string`` appeared in its text)
    or ``"length"`` (``max_new_tokens`` reached)."""
    prompt: str
    prompt_ids: List[int]
    token_ids: List[int]
    text: str
    stopped_at_eos: bool
    finish_reason: str = "length"
    stop_string: Optional[str] = None


@dataclass
class Timing:
    """Wall-clock seconds and token counts of a :func:`generate_text` call (see the module docstring)."""
    batches: int = 0
    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0
    peak_gpu_memory_bytes: Optional[int] = None
    graph_capture_s: float = 0.0
    graphed_batches: int = 0
    graph_note: str = ""

    @property
    def decode_mode(self) -> str:
        """``"cuda graph"`` (every batch's steps replayed from a graph), ``"eager"`` or ``"mixed"``."""
        if self.graphed_batches == 0:
            return "eager"
        return "cuda graph" if self.graphed_batches == self.batches else "mixed"

    @property
    def decode_tokens_per_s(self) -> Optional[float]:
        return self.decode_tokens / self.decode_s if self.decode_tokens and self.decode_s > 0 else None

    def as_dict(self) -> dict:
        return {**asdict(self), "decode_tokens_per_s": self.decode_tokens_per_s, "decode_mode": self.decode_mode}


@dataclass
class Generation:
    completions: List[Completion] = field(default_factory=list)
    timing: Timing = field(default_factory=Timing)


def check_settings(*, max_new_tokens: int, temperature: float, top_k: int, top_p: float, batch_size: int,
                   seed: Optional[int] = None, stop: Union[None, str, Sequence[str]] = None,
                   name: Callable[[str], str] = str) -> None:
    """Raise ``ValueError`` naming the first bad setting (``name`` turns a parameter name into the
    name the caller knows it by, e.g. a command-line option). The counts (``max_new_tokens``, ``top_k``,
    ``batch_size``, ``seed``) must be integers (numpy's too; not a bool or a float such as ``2.5``, which the
    decoding loop, counting its steps, would never reach) and ``temperature`` and ``top_p`` real numbers."""
    for setting, value in (("max_new_tokens", max_new_tokens), ("top_k", top_k), ("batch_size", batch_size),
                         ("seed", seed)):
        if as_int(value) is None and not (setting == "seed" and value is None):
            raise ValueError(f"{name(setting)} must be an integer, got {value!r}")
    for setting, value in (("temperature", temperature), ("top_p", top_p)):
        if as_float(value) is None:
            raise ValueError(f"{name(setting)} must be a real number, got {value!r}")
    if max_new_tokens < 1:
        raise ValueError(f"{name('max_new_tokens')} must be >= 1, got {max_new_tokens}")
    if not 0 <= temperature < math.inf:  # also catches nan
        raise ValueError(f"{name('temperature')} must be finite and >= 0 (0: greedy), got {temperature}")
    if top_k < 0:
        raise ValueError(f"{name('top_k')} must be >= 0 (0: off), got {top_k}")
    if not 0 < top_p <= 1:
        raise ValueError(f"{name('top_p')} must be in (0, 1], got {top_p}")
    if batch_size < 1:
        raise ValueError(f"{name('batch_size')} must be >= 1, got {batch_size}")
    check_seed(name("seed"), seed)
    check_stop(stop, name)


def _choose(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
            generator: Optional[torch.Generator]) -> torch.Tensor:
    """Next token ``[B]`` from last-position logits ``[B, V]``: the argmax when ``temperature == 0``,
    else a draw from ``softmax(logits / temperature)`` restricted to the ``top_k`` largest and then to
    the smallest set of largest probabilities whose mass reaches ``top_p``."""
    if temperature == 0:
        return logits.argmax(-1)
    if temperature < torch.finfo(logits.dtype).tiny:  # subnormal in the logits' dtype: 0 under flush-to-zero
        logits = logits.double()
    # from the largest logit, so that a tiny temperature sends the others to -inf, not inf - inf = nan
    logits = (logits - logits.max(-1, keepdim=True).values) / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1:
        ordered, order = logits.sort(-1, descending=True)
        probs = ordered.softmax(-1)
        ordered = ordered.masked_fill(probs.cumsum(-1) - probs >= top_p, float("-inf"))  # mass before reached top_p
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, ordered)
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]


def _cache_of(out):
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def _hand_on(texts: Optional[List[StopText]], on_text: Optional[Callable[[str], None]]) -> None:
    """Pass the one streamed row's newly decided text to ``on_text`` (nothing when there is none)."""
    if on_text is not None:
        piece = texts[0].take()
        if piece:
            on_text(piece)


@torch.inference_mode()
def generate_text(model, tokenizer, prompts: Sequence[str], *, max_new_tokens: int = 64, temperature: float = 0.0,
                  top_k: int = 0, top_p: float = 1.0, seed: Optional[int] = 0, batch_size: int = 1,
                  stop_at_eos: bool = True, stop: Union[None, str, Sequence[str]] = None, stream=None,
                  on_text: Optional[Callable[[str], None]] = None, cuda_graphs: Optional[bool] = None,
                  on_batch: Optional[Callable[[List[Completion]], None]] = None) -> Generation:
    """Continue each of ``prompts`` by up to ``max_new_tokens`` tokens, ``batch_size`` prompts per
    left-padded batch. Each prompt's tokens follow the tokenizer's end-of-text token where it has one, so an
    empty prompt continues that token alone (without one, an empty prompt is a ``ValueError`` naming its
    index). ``temperature == 0`` is greedy (``top_k``, ``top_p`` and ``seed`` unused);
    above 0 it samples, reproducibly for a given ``seed`` (and batch size and device). With
    ``stop_at_eos`` a row ends at its first end-of-text token and a batch when all its rows have.

    ``stop``: a string or a sequence of strings (none empty: ``ValueError`` naming ``stop``). A row also
    ends at the first token after which its text (``serve.stops.StopText``: the decode of all its tokens so far,
    on the host) holds any of them, wherever the token boundaries fall in it; its ``text`` is cut just before the
    earliest occurrence, its ``token_ids`` keep the tokens up to that one, and ``finish_reason`` is
    ``"stop"``. A row that has ended is fed pad tokens while the others of its batch go on, which leaves their
    tokens as they would be alone (each row's cache is its own), and the batch ends when all its rows have.

    ``on_text``: called with each piece of the text as it is decided, only with one prompt per batch; the
    pieces of a completion add up to its ``text``. With ``stop``, text that may be the start of a stop string
    (at most ``len(stop) - 1`` characters) is held until the next tokens complete the stop string (it is then
    never passed) or leave it. As each batch ends, and also when an exception (a Ctrl-C) stops it, the text
    still held is passed on, so that the text of the tokens already chosen is shown.

    ``stream``: an object with ``put(ids)`` and ``end()`` (``transformers.TextStreamer``) that gets each
    new token as it is chosen; only with one prompt per batch, and not with ``stop`` (the tokens of a stop
    string would be shown: use ``on_text``). ``end()`` is called as each batch ends, and also when an
    exception (a Ctrl-C) stops it, so that the tokens already chosen are shown. A streamer with ``skip_prompt``
    set (``TextStreamer(tokenizer, skip_prompt=True)``) first gets each batch's prompt ids, which it drops.

    ``on_batch``: called with each batch's completions as the batch ends, before the next prompt pass and
    outside the timings (``falcon-fwa generate`` prints them so).

    ``cuda_graphs``: replay each decoding step from a CUDA graph (``serve.graphs.GraphedDecoder``; the
    same tokens as eager steps, with a fraction of the host's launch work). ``None``: where possible
    (a recurrent model on CUDA), falling back to eager steps if recording fails; ``True``: required
    (``ValueError`` where not possible); ``False``: eager steps.
    Returns a :class:`Generation`: one :class:`Completion` per prompt, in order, and its :class:`Timing`.
    """
    stops = check_stop(stop)  # read once: a generator of strings is used up by its first reading
    check_settings(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                   batch_size=batch_size, seed=seed, stop=stops)
    max_new_tokens, top_k, batch_size = int(max_new_tokens), int(top_k), int(batch_size)  # (numpy's: torch's too)
    temperature, top_p, seed = float(temperature), float(top_p), None if seed is None else int(seed)
    if isinstance(prompts, str):  # its characters would be taken as prompts
        raise TypeError(f"prompts must be a sequence of strings, got one str ({prompts[:40]!r}); pass [prompt]")
    for option, value in (("stream", stream), ("on_text", on_text)):
        if value is not None and min(batch_size, len(prompts)) > 1:
            raise ValueError(f"{option} needs one prompt per batch, got batch_size={batch_size}")
    if stream is not None and stops:
        raise ValueError("stream gets every token, those of a stop string too: with stop, stream through on_text")
    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    use_graphs, why = graphable(model, device)
    if cuda_graphs and not use_graphs:
        raise ValueError(f"cuda_graphs=True is not possible here: {why}")
    if not use_graphs or cuda_graphs is False:
        timing_note = f"eager: {why}" if not use_graphs else "eager: cuda_graphs=False"
        use_graphs = False
    else:
        timing_note = ""
    as_object = output_object(model)  # .logits and the cache, whatever the config's return_dict
    vocab = len(tokenizer)
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos if eos is not None else 0)
    lead = [] if eos is None else [eos]
    encoded = [lead + tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    for i, ids in enumerate(encoded):
        if not ids:
            raise ValueError(f"prompt {i} is empty and the tokenizer has no end-of-text token to start it")
    generator = None
    if temperature > 0 and seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    def choose(logits):
        return _choose(logits[:, -1, :vocab].float(), temperature, top_k, top_p, generator)

    stopping = stop_at_eos and eos is not None
    result = Generation()
    timing = result.timing
    timing.graph_note = timing_note
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    for start in range(0, len(encoded), batch_size):
        rows = encoded[start:start + batch_size]
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):  # left padding
            input_ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
            mask[i, width - len(r):] = 1
        input_ids, mask = input_ids.to(device), mask.to(device)

        sync()
        t0 = time.perf_counter()
        out = model(input_ids=input_ids, attention_mask=mask, use_cache=True, logits_to_keep=1, **as_object)
        token = choose(out.logits)
        sync()
        t1 = time.perf_counter()
        cache, decoder, t_graph = _cache_of(out), None, t1
        if use_graphs and max_new_tokens > 1:
            try:
                decoder = GraphedDecoder(model, cache, len(rows))
            except Exception as e:  # an op of the step that a graph cannot hold (e.g. a host synchronization)
                if cuda_graphs:
                    raise
                use_graphs = False
                timing.graph_note = f"eager: recording the decoding step failed ({type(e).__name__}: {e})"[:300]
            sync()
            t_graph = time.perf_counter()
            timing.graph_capture_s += t_graph - t1
        timing.graphed_batches += decoder is not None
        done = torch.zeros_like(token, dtype=torch.bool)
        steps = []
        # the rows' texts, on the host, when they are looked into or streamed
        texts = [StopText(tokenizer, stops) for _ in rows] if stops or on_text is not None else None
        ended = [False] * len(rows)
        try:
            if stream is not None and getattr(stream, "skip_prompt", False):
                # transformers' streamers take their first put() (after each end()) as the prompt, as generate()
                # sends it: with skip_prompt they drop it, which would drop the first new token here
                stream.put(torch.tensor([rows[0]]))
            while True:
                steps.append(token)
                if stopping:
                    done = done | (token == eos)
                if stream is not None and not bool(done[0]):
                    stream.put(token.cpu())
                if texts is not None:
                    by_stop = []
                    for i, t in enumerate(token.tolist()):
                        if not ended[i]:
                            if texts[i].add(t):
                                by_stop.append(i)
                            ended[i] = texts[i].stop_string is not None or (stopping and t == eos)
                    if by_stop:
                        done[torch.tensor(by_stop, device=device)] = True
                    _hand_on(texts, on_text)
                if len(steps) == max_new_tokens or ((stopping or stops) and bool(done.all())):
                    break
                if decoder is None:
                    logits = model(input_ids=token[:, None], past_key_values=cache, use_cache=True,
                                   logits_to_keep=1, **as_object).logits
                else:
                    logits = decoder.step(token)[:, None]
                token = torch.where(done, torch.full_like(token, pad), choose(logits))
            sync()
            t2 = time.perf_counter()
        finally:  # also on a Ctrl-C: the streamer shows the text it still holds
            if stream is not None:
                stream.end()
            for row in texts or ():
                row.finish()
            _hand_on(texts, on_text)
        out = cache = decoder = logits = None  # this batch's cache and graph, freed before the next prompt pass

        table = torch.stack(steps, 1).cpu().tolist()
        for i, (prompt, ids, new) in enumerate(zip(prompts[start:start + batch_size], rows, table)):
            if texts is not None:  # the tokens the row's text was made of, up to the one that ended it
                new = texts[i].ids
            stopped = stopping and eos in new
            if stopped:
                new = new[:new.index(eos) + 1]
            if texts is None:
                text, stop_string = tokenizer.decode(new, skip_special_tokens=True), None
            else:
                text, stop_string = texts[i].text, texts[i].stop_string
            reason = "stop" if stop_string is not None else "eos" if stopped else "length"
            result.completions.append(Completion(prompt, ids, new, text, stopped, reason, stop_string))
            timing.prompt_tokens += len(ids)
            timing.new_tokens += len(new)
            timing.decode_tokens += len(new) - 1
        timing.batches += 1
        timing.prefill_s += t1 - t0
        timing.decode_s += t2 - t_graph
        if on_batch is not None:
            on_batch(result.completions[-len(rows):])
    if cuda:
        timing.peak_gpu_memory_bytes = torch.cuda.max_memory_allocated(device)
    return result
