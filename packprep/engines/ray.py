"""Ray: :class:`RayEngine`, the :class:`~packprep.engines.Engine` on Ray core tasks
(``packprep pack ... --engine ray [--ray-address ADDRESS]``).

:class:`RayEngine` runs every item of a stage as one Ray task of one CPU. The stage's context is
put in the object store once per :meth:`RayEngine.map` and reaches the tasks as a reference boxed
in a list, so Ray does not resolve it per task; each worker process deserializes it at its first
task of the stage and keeps it (a tokenizer that the context loads lazily is loaded once a worker).

Tasks read the inputs and write the token spills and shards themselves, under the output folder:
on a cluster of several machines, inputs and output must be on a file system every node sees
(NFS, a mounted bucket). The driver only receives each task's small result.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from typing import Any

from ..errors import ConfigError
from . import IN_FLIGHT_PER_WORKER, ordered


def _import_ray():
    """``ray``, or the ConfigError that says how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise ConfigError("--engine ray needs Ray, which is not installed: pip install 'packprep[ray]'") from exc
    return ray


def _start_ray(ray, ray_address: str | None, num_proc: int) -> bool:
    """Use the Ray of this process if there is one, else connect to ``ray_address`` (``"auto"``: the
    cluster of this machine), else start one of ``num_proc`` CPUs here, quiet: the progress bars are
    packprep's. True when this call started (or connected) Ray, which its caller then shuts down."""
    if ray.is_initialized():
        return False
    quiet = {"log_to_driver": False, "logging_level": logging.WARNING}
    if ray_address:
        ray.init(address=ray_address, **quiet)
    else:
        ray.init(num_cpus=num_proc, include_dashboard=False, **quiet)
    return True


_CONTEXTS: dict[str, Any] = {}  # in a worker process: the running stage's context, by object id


def _run_task(fn, boxed_context: list, item):
    """One task on a worker: ``fn(context, item)``. The context arrives as a reference (boxed, so Ray
    does not fetch it per task) and is deserialized at the worker's first task of the stage; what a
    task caches on it (a lazily loaded tokenizer) stays for the worker's next tasks."""
    import ray

    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one task, one CPU (a runtime_env would start new workers)
    ref = boxed_context[0]
    key = ref.hex()
    if key not in _CONTEXTS:
        _CONTEXTS.clear()  # one stage at a time: free the last stage's context before loading this one
        _CONTEXTS[key] = ray.get(ref)
    return fn(_CONTEXTS[key], item)


class _Task:
    __slots__ = ("item", "ref")

    def __init__(self, item):
        self.item, self.ref = item, None


class _Pool:
    """Starts a stage's tasks in submission order, at most ``limit`` running at once (Ray alone would
    run as many as the cluster has CPUs, and a stage caps its workers for memory)."""

    def __init__(self, ray, start, limit: int):
        self.ray, self.start, self.limit = ray, start, limit
        self.waiting: deque[_Task] = deque()
        self.running: set = set()

    def _start_waiting(self) -> None:
        while self.waiting and len(self.running) < self.limit:
            task = self.waiting.popleft()
            task.ref = self.start(task.item)
            self.running.add(task.ref)

    def submit(self, item) -> _Task:
        task = _Task(item)
        self.waiting.append(task)
        self._start_waiting()
        return task

    def result(self, task: _Task):
        """The task's result, or the exception its function raised (an InputError stays one)."""
        while task.ref is None or task.ref in self.running:
            done, _ = self.ray.wait(list(self.running), num_returns=1)
            self.running.difference_update(done)
            self._start_waiting()
        try:
            return self.ray.get(task.ref)
        except self.ray.exceptions.RayTaskError as error:
            raise error.cause from error

    def stop(self) -> None:
        """Cancel the tasks nobody will collect and wait for them to end: none writes after its stage."""
        self.waiting.clear()
        running = list(self.running)
        for ref in running:
            self.ray.cancel(ref)
        if running:
            self.ray.wait(running, num_returns=len(running), fetch_local=False)
        self.running.clear()


class RayEngine:
    """Ray core tasks of one CPU each, on the cluster at ``ray_address`` or a Ray started here; at
    most ``num_proc`` run at once. See the module docstring."""

    def __init__(self, num_proc: int, ray_address: str | None = None):
        self.ray = _import_ray()
        self.workers = max(1, num_proc)
        self.started = _start_ray(self.ray, ray_address, self.workers)
        self.task = self.ray.remote(num_cpus=1)(_run_task)

    def map(self, fn, context, items, workers=None):
        workers = max(1, min(self.workers, workers or self.workers))
        boxed_context = [self.ray.put(context)]
        pool = _Pool(self.ray, lambda item: self.task.remote(fn, boxed_context, item), workers)
        try:
            yield from ordered(pool.submit, pool.result, items, workers * IN_FLIGHT_PER_WORKER)
        finally:
            pool.stop()

    def close(self) -> None:
        if self.started:
            self.ray.shutdown()
            self.started = False
