"""Stop strings: a completion's text, decoded as its tokens come, ended where a stop string appears.

:class:`StopText` follows one completion of :func:`~falcon_fwa.serve.generation.generate_text` on the
host, outside the decoding step (and so outside a CUDA graph). Each new token's text is decoded with the
token before it as context (the piece that ``decode`` of the longer run adds to ``decode`` of the shorter,
so that a tokenizer that drops a leading space of a run's first token gives it back), and held while it ends
in an incomplete character (U+FFFD): its next bytes may come with the next token. The pieces add up to
``tokenizer.decode(ids, skip_special_tokens=True)`` for byte-level tokenizers (those of this package); the
cost is two decodes of a few tokens per row and step, not one of the whole completion.

The completion ends at the first token after which its text holds one of the stop strings, and its text is
cut just before the earliest occurrence (a stop string may span any number of tokens). For streaming,
:meth:`StopText.take` hands over only the text that is decided: everything except the longest end of the
text that begins a stop string (at most ``len(stop) - 1`` characters), which waits until the next tokens
either complete the stop string (it is then never shown) or leave it.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple, Union

__all__ = ["StopText", "check_stop"]

INCOMPLETE = "\ufffd"  # what a decoder gives for the bytes of a character that has not all come yet


def check_stop(stop: Union[None, str, Sequence[str]], name: Callable[[str], str] = str) -> Tuple[str, ...]:
    """``stop`` (``None``, one string, or a sequence of strings) as a tuple of strings; ``ValueError``
    naming ``name("stop")`` for an empty string (it is found in every text), ``TypeError`` for a non-string."""
    if stop is None:
        return ()
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    for i, s in enumerate(stops):
        if not isinstance(s, str):
            raise TypeError(f"{name('stop')} must hold strings, got {type(s).__name__} {s!r} (item {i})")
        if not s:
            raise ValueError(f"{name('stop')}: a stop string must not be empty (item {i}): every text holds it, "
                             "so every completion would end at its first token")
    return stops


class StopText:
    """The text of one completion, token by token (see the module docstring).

    ``add(token)`` takes the next token and returns ``True`` once the text holds a stop string: ``text`` is
    then cut just before the earliest occurrence, ``stop_string`` is the stop string found there (the first
    of ``stop`` when several start at that character) and no more tokens are to be added (``add`` after a stop
    or ``finish()`` raises ``RuntimeError``). ``ids`` are the
    tokens taken, the one that completed the stop string included. ``finish()`` adds the text of bytes still
    held (an incomplete character at the end of a completion cut by its length). ``take()`` returns the
    decided text not yet taken (all of it once stopped or finished)."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer, self.stop = tokenizer, tuple(stop)
        self.ids: List[int] = []
        self.text = ""
        self.stop_string: Optional[str] = None
        self.finished = False
        self._context = 0  # ids[_context:_read]: the tokens decoded again as context for the next piece
        self._read = 0  # ids[:_read]: the tokens whose text is in self.text
        self._taken = 0  # characters of self.text handed over by take()

    def _decode(self, ids: List[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _extend(self, final: bool) -> bool:
        before = self._decode(self.ids[self._context:self._read])
        now = self._decode(self.ids[self._context:])
        if len(now) <= len(before) or (now.endswith(INCOMPLETE) and not final):
            return False
        old = len(self.text)
        self.text += now[len(before):]
        self._context, self._read = self._read, len(self.ids)
        # the text before held no stop string: a new one ends in the new piece
        start = max(0, old - max(map(len, self.stop), default=1) + 1)
        hits = [(at, s) for s in self.stop if (at := self.text.find(s, start)) >= 0]
        if not hits:
            return False
        at, self.stop_string = min(hits, key=lambda hit: hit[0])
        self.text = self.text[:at]
        return True

    def add(self, token: int) -> bool:
        if self.stop_string is not None or self.finished:
            raise RuntimeError("StopText.add: the completion has already ended")
        self.ids.append(int(token))
        return self._extend(final=False)

    def finish(self) -> None:
        if self.stop_string is None and not self.finished:
            self._extend(final=True)
        self.finished = True

    def held(self) -> int:
        """The number of characters at the end of ``text`` that begin a stop string (0 once ended)."""
        if self.stop_string is not None or self.finished:
            return 0
        return max((k for s in self.stop for k in range(min(len(s) - 1, len(self.text)), 0, -1)
                    if self.text.endswith(s[:k])), default=0)

    def take(self) -> str:
        end = len(self.text) - self.held()
        piece, self._taken = self.text[self._taken:end], max(self._taken, end)
        return piece
