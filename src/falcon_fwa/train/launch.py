"""What a training process holds while it runs, shared by ``falcon-fwa train`` and the addition task's
runs: the stop signals it turns into a clean stop, and the lock on its run folder."""
from __future__ import annotations

import signal
import threading

__all__ = ["LOCK_NAME", "StopSignals"]

LOCK_NAME = ".train.lock"
"""The lock file (:func:`falcon_fwa.atomic.folder_lock`) a training process holds in its run folder:
one process trains a folder at a time."""


class StopSignals:
    """While active, the first SIGTERM or SIGINT only sets ``received`` (the signal number); a
    second one gets the handler that was there before (SIGINT: KeyboardInterrupt; SIGTERM: the
    default, which ends the process). A signal the process ignores (``SIG_IGN``, e.g. SIGINT in a
    background job of a shell script) stays ignored. Inactive off the main thread, where handlers
    cannot be set."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, enabled: bool):
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.received = 0
        self.previous = {}

    def _handle(self, signum, frame):
        if self.received:
            signal.signal(signum, self.previous[signum] or signal.SIG_DFL)
            signal.raise_signal(signum)
            return
        self.received = signum

    def __enter__(self):
        if self.enabled:
            for sig in self.SIGNALS:
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler or signal.SIG_DFL)
        self.previous = {}
