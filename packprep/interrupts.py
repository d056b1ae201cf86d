"""What stops a run (Ctrl-C, SIGTERM), and the moments it may not land in.

A stop ends the run with exit 130 and nothing at the output path, or, once the output is in place,
lets it finish: exit 0 and a complete, verified folder, never both. The CLI turns SIGTERM into the
same ``KeyboardInterrupt`` as Ctrl-C (:func:`stop_on_sigterm`); forked workers ignore both and are
ended by the driver; the rename that puts a finished folder in place runs with both held back
(:func:`stops_held`), and the folder it put there is remembered (:data:`COMMITTED`) so that a stop
delivered just after it is not taken for a stop before it.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from pathlib import Path

STOPS = (signal.SIGINT, signal.SIGTERM)
COMMITTED: list[Path] = []  # output folders this process put in place


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextmanager
def stops_held():
    """Ctrl-C and SIGTERM held back (in this thread) for the block and delivered after it: a process
    forked in it starts with them held, and a stop never lands half-way through the block."""
    if not _main_thread():
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOPS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def ignore_stops() -> None:
    """In a forked worker: a stop (Ctrl-C reaches the whole process group) is the driver's to handle."""
    for stop in STOPS:
        signal.signal(stop, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOPS)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


@contextmanager
def stop_on_sigterm():
    """SIGTERM raises ``KeyboardInterrupt`` in the block, as Ctrl-C does: the run cleans up after itself."""
    if not _main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
