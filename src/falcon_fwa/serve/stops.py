"""Stop strings: a completion's text, decoded as its tokens come, ended where a stop string appears.

:class:`StopText` follows one completion of :func:`~falcon_fwa.serve.generation.generate_text` on the
host, outside the decoding step (and so outside a CUDA graph). After each token its text is
``tokenizer.decode(ids, skip_special_tokens=True)`` of all the tokens so far, whatever the tokenizer (byte-level
BPE, SentencePiece's leading-space marker, a decoder that cleans up spaces such as "a ." into "a.", which
changes text already decoded when the next token comes): the last tokens (a window of ``WINDOW`` to
``2 * WINDOW``) are decoded again at each token after a few tokens of context, and the text of the tokens before
the window is kept (the window is moved on only where that text is the same as in the decode of the longer run,
else all the tokens are decoded again). The text is held while it ends in an incomplete character (U+FFFD): its
next bytes may come with the next token.

The completion ends at the first token after which its text holds one of the stop strings, and its text is
cut just before the earliest occurrence (a stop string may span any number of tokens). For streaming,
:meth:`StopText.take` hands over only the text that is decided: everything except the longest end of the
text that begins a stop string (at most ``len(stop) - 1`` characters), which waits until the next tokens
either complete the stop string (it is then never shown) or leave it, and, for a tokenizer that cleans up
spaces, a space among the last three characters and what follows it.
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

    WINDOW = 16  # tokens kept in the decoded window when it is moved on (it is moved at 2 * WINDOW)
    CONTEXT = 8  # tokens before the window decoded with it, whose text is already in self.text

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer, self.stop = tokenizer, tuple(stop)
        self.ids: List[int] = []
        self.text = ""
        self.stop_string: Optional[str] = None
        self.finished = False
        # self.text == self._settled + decode(ids[_context:])[len(self._context_text):]
        self._settled = ""  # the text of ids[:_start]
        self._context = 0  # ids[_context:_start]: decoded with the window, their text (_context_text) left out
        self._start = 0  # ids[_start:]: the window, whose text is decoded again at each token
        self._context_text = ""
        self._taken = 0  # characters of self.text handed over by take()
        # a decoder that cleans up spaces ("a ." -> "a.") may still take out a space near the end of the text
        self._revises = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))

    def _decode(self, ids: List[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _whole(self) -> str:
        """The text of all the ids, through the window where its context decodes as before, else whole."""
        window = self._decode(self.ids[self._context:])
        if window.startswith(self._context_text):
            return self._settled + window[len(self._context_text):]
        self._settled, self._context, self._start, self._context_text = "", 0, 0, ""
        return self._decode(self.ids)

    def _move_window(self) -> None:
        """Start the window ``WINDOW`` tokens before the end where the text of the tokens before it stays
        the same with the window decoded after them (no character split at the new start, no space that
        the decoder would take out there)."""
        start = len(self.ids) - self.WINDOW
        context = max(0, start - self.CONTEXT)
        before = self._decode(self.ids[context:start])
        window = self._decode(self.ids[context:])
        if window.startswith(before) and self.text.endswith(window[len(before):]):
            self._settled = self.text[:len(self.text) - len(window) + len(before)]
            self._context, self._start, self._context_text = context, start, before

    def _extend(self, final: bool) -> bool:
        now = self._whole()
        if now == self.text or (now.endswith(INCOMPLETE) and not final):
            return False
        # the text before held no stop string: a new one ends past the characters both texts begin with
        same = _common_start(self.text, now, len(self._settled))
        self.text = now
        if len(self.ids) - self._start > 2 * self.WINDOW:
            self._move_window()
        start = max(0, same - max(map(len, self.stop), default=1) + 1)
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
        """The number of characters at the end of ``text`` not yet decided (0 once ended): for a decoder that
        cleans up spaces, a space among the last three characters and what follows it (the space goes if the
        next token begins with "." or "'t"), and the longest end of the text before that which begins a stop
        string."""
        if self.stop_string is not None or self.finished:
            return 0
        space = self.text.rfind(" ", max(0, len(self.text) - 3)) if self._revises else -1
        stable = self.text if space < 0 else self.text[:space]
        stop = max((k for s in self.stop for k in range(min(len(s) - 1, len(stable)), 0, -1)
                    if stable.endswith(s[:k])), default=0)
        return len(self.text) - len(stable) + stop

    def take(self) -> str:
        end = len(self.text) - self.held()
        piece, self._taken = self.text[self._taken:end], max(self._taken, end)
        return piece


def _common_start(a: str, b: str, known: int = 0) -> int:
    """The number of characters ``a`` and ``b`` begin with alike (``known``: a number of them known alike)."""
    if b.startswith(a):
        return len(a)
    n = min(len(a), len(b), known)
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
