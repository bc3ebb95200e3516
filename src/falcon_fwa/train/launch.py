"""What a training process holds while it runs, shared by ``falcon-fwa train`` and the addition task's
runs: the stop signals it turns into a clean stop, and the lock on its run folder; and what a command
that launches runs as child processes needs (``compare``, ``scaling``, ``addition-compare``): children
that end with it, and the name of the machine their speeds were measured on."""
from __future__ import annotations

import os
import signal
import threading

__all__ = ["LOCK_NAME", "StopSignals", "device_description", "end_with_parent"]

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


def end_with_parent():
    """A ``preexec_fn`` for a child process: the child is sent SIGTERM when the process that started it
    ends, also by SIGKILL (Linux ``PR_SET_PDEATHSIG``; elsewhere nothing), so that no run outlives the
    command that launched it."""
    parent = os.getpid()

    def preexec() -> None:
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # 1: PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            return
        if os.getppid() != parent:  # the parent ended before the setting took
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def device_description() -> str:
    """What trains here: ``"2 x NVIDIA H200"`` (the CUDA devices), else ``"CPU (16 cores, gloo)"``."""
    try:
        import torch
        if torch.cuda.is_available():
            return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}"
    except ImportError:
        pass
    return f"CPU ({os.cpu_count()} cores, gloo)"
