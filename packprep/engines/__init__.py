"""Where a stage's tasks run: this machine's processes, or a Ray cluster (``engines/ray_cluster.py``).

A stage is a plain function ``fn(context, item) -> result`` of a module (so that it pickles by
name). ``context`` is what every task of the stage shares (a tokenizer, a token store's index):
an engine ships it to each worker once, never per task. ``item`` names a small piece of work (a
byte range of an input, a shard to write) and ``result`` is small too; bulk data (tokens, shards)
goes to files, never through the engine. Engines return results in item order, so a run's output
does not depend on the engine or on the number of workers. Steps never import engines: the
pipeline picks one and hands its stages to :meth:`Engine.map`.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterable, Iterator, Protocol

from .workers import IN_FLIGHT_PER_WORKER, ForkedWorkers, ordered

ENGINES = ("local", "ray")
TASKS_PER_WORKER = 4  # a stage whose work splits freely makes about this many tasks a worker: they end together


def runs_per_item(items: int, workers: int) -> int:
    """Into how many runs to cut each of ``items`` (shards) so that ``workers`` finish together: one
    where the items alone make ``TASKS_PER_WORKER`` tasks a worker (or one worker does them all),
    more where they are fewer."""
    return 1 if workers <= 1 else max(1, -(-TASKS_PER_WORKER * workers // max(1, items)))


class Engine(Protocol):
    """Runs one stage's tasks; see the module docstring."""

    workers: int

    def map(self, fn: Callable[[Any, Any], Any], context: Any, items: Iterable[Any],
            workers: int | None = None) -> Iterator[Any]:
        """``fn(context, item)`` for every item, yielded in item order. ``workers`` caps this stage's
        parallelism below the engine's (a stage whose tasks need much memory)."""
        ...

    def close(self) -> None:
        ...


def make_engine(name: str = "local", num_proc: int | None = None, ray_address: str | None = None) -> Engine:
    """The engine called ``name`` with ``num_proc`` workers (default: every core of this machine); the
    caller has checked both (``settings.RunOptions``)."""
    num_proc = num_proc or os.cpu_count() or 1
    if name == "ray":
        from .ray_cluster import RayEngine

        return RayEngine(num_proc, ray_address)
    return LocalEngine(num_proc)


class LocalEngine:
    """Forked processes of this machine (:class:`ForkedWorkers`, a pool a stage); one worker runs
    the stage in this process."""

    def __init__(self, workers: int = 1):
        self.workers = max(1, workers)

    def map(self, fn, context, items, workers=None):
        workers = max(1, min(self.workers, workers or self.workers))
        if workers == 1:
            for item in items:
                yield fn(context, item)
            return
        pool = ForkedWorkers(context, workers)
        stop = False
        try:
            yield from ordered(lambda item: pool.submit(fn, item), pool.result, items,
                               workers * IN_FLIGHT_PER_WORKER)
        except KeyboardInterrupt:
            stop = True
            raise
        finally:  # a failed or abandoned stage does not wait for tasks nobody will collect; an interrupted one ends them
            pool.close(stop)

    def close(self) -> None:
        pass
