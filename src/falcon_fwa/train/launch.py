"""What a training process holds while it runs, shared by ``falcon-fwa train`` and the addition task's
runs: the stop signals it turns into a clean stop, and the lock on its run folder; and what a command
that launches runs as child processes needs (``compare``, ``scaling``, ``addition-compare``): children
that end with it, and the name of the machine their speeds were measured on."""
from __future__ import annotations

import errno
import os
import signal
import threading

__all__ = ["LOCK_NAME", "PARENT_ENDED", "StopSignals", "device_description", "drop_hung_up_terminal",
           "end_with_parent"]

LOCK_NAME = ".train.lock"
"""The lock file (:func:`falcon_fwa.atomic.folder_lock`) a training process holds in its run folder:
one process trains a folder at a time."""

PARENT_ENDED = getattr(signal, "SIGHUP", None)
"""The signal a child launched with :func:`end_with_parent` gets when the command that launched it ends
(SIGHUP: the process it answers to has hung up; ``None`` where the platform has no SIGHUP)."""


class StopSignals:
    """While active, the first SIGTERM, SIGINT or SIGHUP only sets ``received`` (the signal number); a
    second SIGTERM or SIGINT gets the handler that was there before (SIGINT: KeyboardInterrupt; SIGTERM:
    the default, which ends the process). A SIGHUP after the first signal changes nothing: it is how a
    launching command's end reaches its runs (:func:`end_with_parent`), and the system may send it once
    for each thread that command had. A SIGTERM or SIGINT after a SIGHUP is taken as a first signal: the
    two may come together (a launcher that passes a stop on to its runs and then ends), and Python runs
    pending handlers in signal-number order, SIGHUP's first. A signal the process ignores (``SIG_IGN``,
    e.g. SIGINT in a background job of a shell script) stays ignored. On a SIGHUP, standard output and
    error are pointed at /dev/null where their terminal has hung up (:func:`drop_hung_up_terminal`): what
    the stopping run still prints (its progress bar, a validation loss, its last words) then cannot end it
    before its checkpoint, nor change its exit status. Inactive off the main thread, where handlers cannot
    be set."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT) + ((PARENT_ENDED,) if PARENT_ENDED is not None else ())

    def __init__(self, enabled: bool):
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.received = 0
        self.previous = {}

    def _handle(self, signum, frame):
        if signum == PARENT_ENDED:
            drop_hung_up_terminal()
        if self.received:
            if signum == PARENT_ENDED:  # a repeat of the launcher's end, or news of it during a stop
                return
            if self.received == PARENT_ENDED:  # the first stop of its kind: the clean stop under way stands
                self.received = signum
                return
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


def drop_hung_up_terminal() -> None:
    """Point file descriptors 1 and 2 at /dev/null where they are a terminal that has hung up (a write of
    zero bytes fails with EIO, as it does once the terminal is closed); leave them as they are otherwise
    (a live terminal, a file, a pipe). Text still buffered for them is then dropped at its flush instead of
    raising, which would end the process with an error."""
    devnull = -1
    for fd in (1, 2):
        try:
            os.write(fd, b"")
        except OSError as err:
            if err.errno != errno.EIO:
                continue
            if devnull < 0:
                devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, fd)
    if devnull >= 0:
        os.close(devnull)


def end_with_parent():
    """A ``preexec_fn`` for a child process: the child is sent :data:`PARENT_ENDED` (SIGHUP) when the
    process that started it ends, also by SIGKILL (Linux ``PR_SET_PDEATHSIG``; elsewhere nothing), so that
    no run outlives the command that launched it. A run under :class:`StopSignals` stops at the end of its
    step on it. The system sends it again each time the child passes to another thread of the ending
    process, so it may come several times: hence a signal of its own rather than SIGTERM, whose second
    arrival would interrupt the run at once. (``torchrun`` takes SIGHUP as it takes SIGTERM, and passes it
    on to its workers.) The child takes SIGHUP at its default action even where the parent ignores it (a
    command launched with ``nohup``), which it would otherwise inherit, training on through every stop."""
    parent = os.getpid()

    def preexec() -> None:
        if PARENT_ENDED is not None:
            signal.signal(PARENT_ENDED, signal.SIG_DFL)
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, int(PARENT_ENDED))  # 1: PR_SET_PDEATHSIG
        except (OSError, AttributeError, TypeError):
            return
        if os.getppid() != parent:  # the parent ended before the setting took
            os.kill(os.getpid(), PARENT_ENDED)

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
