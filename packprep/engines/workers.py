"""This machine's worker processes for one stage (:class:`ForkedWorkers`), which the local engine runs a stage
on, and each node of a Ray cluster too (``engines/ray_cluster.py``); and results taken in item order."""

from __future__ import annotations

import atexit
import gc
import multiprocessing
import multiprocessing.util  # its exit handler, which joins child processes, is registered on import: before ours
import os
import signal
import threading
import time
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, Iterable, Iterator

from ..errors import WorkerDied
from ..interrupts import ignore_stops, stops_held

IN_FLIGHT_PER_WORKER = 4  # tasks submitted and not yet collected, per worker: bounds the driver's memory


def ordered(submit: Callable[[Any], Any], result: Callable[[Any], Any], items: Iterable[Any],
            in_flight: int) -> Iterator[Any]:
    """Submit items lazily, at most ``in_flight`` ahead, and yield their results in item order."""
    pending: deque = deque()
    for item in items:
        pending.append(submit(item))
        if len(pending) >= in_flight:
            yield result(pending.popleft())
    while pending:
        yield result(pending.popleft())


_CONTEXT: Any = None  # the running stage's context, set before the workers fork


def _call(fn: Callable, item: Any) -> Any:
    return fn(_CONTEXT, item)


def _exit_with_parent(parent: int) -> None:
    """In a forked worker: exit as soon as the process that forked it is gone (killed, say), instead
    of finishing its task, writing into a run that has ended, and then waiting forever for the next.
    A Ctrl-C (sent to the whole process group) or SIGTERM is the driver's to handle: it stops the
    workers itself, with no traceback from each (they were forked with both held: ``stops_held``)."""
    ignore_stops()

    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="packprep-parent-watch", daemon=True).start()


_OPEN: set["ForkedWorkers"] = set()  # pools not closed yet


def end_workers() -> None:
    """End the workers of every pool still open. A stop that lands in the code consuming a stage's
    results, not in the stage's own wait, leaves the stage's pool open for as long as the stopped frames
    live (the traceback holds them); multiprocessing's exit handler then joins the pool's workers, which
    wait for tasks forever, and the stopped run never exits. Runs at exit, before that handler."""
    for pool in list(_OPEN):
        pool.close(stop=True)


atexit.register(end_workers)  # atexit runs its handlers last registered first


class ForkedWorkers:
    """``workers`` processes forked from this one for one stage, after its ``context`` is set: they
    inherit it (a loaded tokenizer, a token store's index) instead of receiving it pickled. A
    context that loads something lazily says so with a ``load()`` method, called here first, so
    that it is loaded once, not once a worker. Each worker is one CPU: libraries that would start
    threads of their own are told not to. Used by :class:`LocalEngine`, and on each node of a Ray
    cluster by ``engines/ray_cluster.py``."""

    def __init__(self, context: Any, workers: int):
        global _CONTEXT
        if hasattr(context, "load"):
            context.load()
        self._saved = os.environ.get("TOKENIZERS_PARALLELISM")
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        _CONTEXT = context
        gc.freeze()  # the parent's objects stay out of the workers' collections: fewer copy-on-write pages
        self.pool = ProcessPoolExecutor(workers, multiprocessing.get_context("fork"),
                                        initializer=_exit_with_parent, initargs=(os.getpid(),))
        _OPEN.add(self)

    def submit(self, fn: Callable[[Any, Any], Any], item: Any) -> Future:
        with stops_held():  # the workers are forked on the first submit
            return self.pool.submit(_call, fn, item)

    def result(self, future: Future) -> Any:
        """The task's result; a worker that died (killed, out of memory) is said as such, not as a bug."""
        try:
            return future.result()
        except BrokenProcessPool:
            processes = list((getattr(self.pool, "_processes", None) or {}).values())
            self.pool.shutdown(wait=True, cancel_futures=True)  # its thread reaps the processes: then they are known
            ended = [p.exitcode for p in processes if p.exitcode not in (None, 0)]
            # the dead one first: the pool then sends SIGTERM to the others
            ended.sort(key=lambda code: code == -signal.SIGTERM)
            raise WorkerDied.of("a worker process", ended[0] if ended else None) from None

    def close(self, stop: bool = False) -> None:
        """Cancel the tasks not started and wait for the running ones (``stop``: end them now, the run
        was interrupted): none runs after this."""
        global _CONTEXT
        _OPEN.discard(self)
        try:
            if stop:
                for process in list((getattr(self.pool, "_processes", None) or {}).values()):
                    process.kill()
            self.pool.shutdown(wait=True, cancel_futures=True)
        finally:
            gc.unfreeze()
            _CONTEXT = None
            if self._saved is None:
                os.environ.pop("TOKENIZERS_PARALLELISM", None)
            else:
                os.environ["TOKENIZERS_PARALLELISM"] = self._saved
