"""A time limit on rendering: a chat template is a program, and one that never finishes (a nested
``range(100000)`` loop) must not hang the run (issue 24).

Jinja templates compile to Python code, so a watchdog thread can stop one by raising
``RenderTimeout`` in the rendering thread (``PyThreadState_SetAsyncExc``), whichever thread it is:
signals would only reach the main thread. The exception is raised at the next bytecode the
rendering thread runs; one raised as the block ends is taken back and raised by the block itself,
so it never escapes later.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from contextlib import contextmanager


class RenderTimeout(BaseException):
    """Rendering ran past its time limit (not an Exception: a template's ``except Exception`` must
    not take it for the template's own error)."""


class _Watchdog:
    def __init__(self):
        self._lock = threading.Condition()
        self._deadlines: dict[int, list] = {}  # thread id -> [deadline, fired]
        self._thread: threading.Thread | None = None
        self._wake_at = float("inf")  # when the watchdog looks next: an earlier deadline must wake it

    def reset(self) -> None:
        """In a forked child: the parent's thread is gone, and its lock may have been held."""
        self.__init__()

    def _run(self) -> None:
        with self._lock:
            while True:
                now = time.monotonic()
                for tid, entry in self._deadlines.items():
                    if not entry[1] and entry[0] <= now:
                        entry[1] = True
                        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), ctypes.py_object(RenderTimeout))
                pending = [d for d, fired in self._deadlines.values() if not fired]
                self._wake_at = min(pending, default=float("inf"))
                self._lock.wait(max(0.0, self._wake_at - now) + 0.01 if pending else None)

    @contextmanager
    def limit(self, seconds: float | None):
        if not seconds:
            yield
            return
        tid = threading.get_ident()
        entry = [time.monotonic() + seconds, False]
        with self._lock:
            if self._thread is None or not self._thread.is_alive():  # a forked worker has no watchdog yet
                self._thread = threading.Thread(target=self._run, daemon=True, name="packprep-render-limit")
                self._thread.start()
            self._deadlines[tid] = entry
            if entry[0] < self._wake_at:
                self._wake_at = entry[0]
                self._lock.notify()
        try:
            yield
        finally:
            with self._lock:
                self._deadlines.pop(tid, None)
                late = entry[1]
                if late:  # raised, or still pending: take a pending one back
                    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), None)
        if late:
            raise RenderTimeout()


_WATCHDOG = _Watchdog()
os.register_at_fork(after_in_child=_WATCHDOG.reset)


def time_limit(seconds: float | None):
    """A block that raises ``RenderTimeout`` once it has run ``seconds`` (None or 0: no limit)."""
    return _WATCHDOG.limit(seconds)
