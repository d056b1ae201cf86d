"""What stops a run (Ctrl-C, SIGTERM), and the moments it may not land in.

A stop ends the run with exit 130 and nothing at the output path, or, once the output is in place,
lets it finish: exit 0 and a complete, verified folder, never both. The CLI turns SIGTERM into the
same ``KeyboardInterrupt`` as Ctrl-C (:func:`stop_on_sigterm`); forked workers ignore both and are
ended by the driver; the rename that puts a finished folder in place runs with both held back
(:func:`stops_held`), and the folder it put there is remembered (:data:`COMMITTED`) so that a stop
delivered just after it is not taken for a stop before it. Once a command has ended, the ``packprep``
program ignores stops until it exits (:func:`stop_on_sigterm`): a stop then can change nothing.
The moments between stages are named (:func:`boundary`), so that a test can stop a run at each.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

STOPS = (signal.SIGINT, signal.SIGTERM)
COMMITTED: list[Path] = []  # output folders this process put in place


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextmanager
def stops_held():
    """Ctrl-C and SIGTERM held back for the block and delivered after it: a process forked in it starts
    with them held, and a stop never lands half-way through the block. Blocked in this thread, and
    caught for later in the others (a library's thread may take a signal sent to the process, and
    Python runs its handler here all the same)."""
    if not _main_thread():
        yield
        return
    caught: list[int] = []
    handlers = {stop: signal.signal(stop, lambda signum, frame: caught.append(signum)) for stop in STOPS}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOPS)
    try:
        yield
    finally:
        for stop, handler in handlers.items():
            signal.signal(stop, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        if caught:
            signal.raise_signal(caught[0])


def ignore_stops() -> None:
    """In a forked worker: a stop (Ctrl-C reaches the whole process group) is the driver's to handle."""
    for stop in STOPS:
        signal.signal(stop, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOPS)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def sigterm_interrupts():
    """From now on SIGTERM raises ``KeyboardInterrupt``, as Ctrl-C does; returns the handler it replaced."""
    return signal.signal(signal.SIGTERM, _interrupt)


@contextmanager
def stop_on_sigterm():
    """SIGTERM raises ``KeyboardInterrupt`` in the block, as Ctrl-C does: the run cleans up after itself.
    In the ``packprep`` program, stops are ignored from the block's end to the exit: the run has ended
    (its folder in place, or cleaned up), and a stop in the interpreter's teardown would kill the
    process (status 143) or print a traceback instead of its exit code."""
    if not _main_thread():
        yield
        return
    previous = sigterm_interrupts()
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        if is_program():  # ignored, not blocked: any thread may take a signal sent to the process
            for stop in STOPS:
                signal.signal(stop, signal.SIG_IGN)


def is_program() -> bool:
    """Whether this process is the ``packprep`` program, not a caller's (a notebook, a test runner)."""
    program = Path(sys.argv[0] if sys.argv else "")
    return program.name == "packprep" or program.parent.name == "packprep"


def exit_now(code: int) -> None:
    """Exit with ``code`` at once, where this process is the ``packprep`` program: the run has cleaned
    up, and the interpreter's own teardown of what the run loaded (1.3 s of it in C) would hold a
    stopped run up. Exit handlers still run."""
    if not is_program():
        sys.exit(code)
    import atexit

    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    atexit._run_exitfuncs()
    os._exit(code)


PAUSE_SECONDS = 10.0


def boundary(name: str) -> None:
    """The run is between two stages, at ``name``. Where ``PACKPREP_PAUSE_AT`` names it, the run says
    ``paused at NAME`` on stderr and waits there (up to PAUSE_SECONDS; half a second where stops are
    ignored) for a stop, which lands here as at any other moment: the tests stop each command at each
    boundary this way. With ``PACKPREP_BOUNDARIES`` set to a file, each boundary's name is appended to it."""
    listed = os.environ.get("PACKPREP_BOUNDARIES")
    if listed:
        with open(listed, "a") as handle:
            handle.write(name + "\n")
    if os.environ.get("PACKPREP_PAUSE_AT") != name or sys.stderr is None:
        return
    sys.stderr.write(f"paused at {name}\n")
    sys.stderr.flush()
    ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN  # a stop can change nothing: no need to wait long
    deadline = time.monotonic() + (0.5 if ignored else PAUSE_SECONDS)
    while time.monotonic() < deadline:
        time.sleep(0.005)
