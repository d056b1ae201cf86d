"""Ray: :class:`RayEngine`, the :class:`~packprep.engines.Engine` on a Ray cluster
(``packprep pack ... --engine ray [--ray-address ADDRESS]``).

On each node of the cluster, :class:`RayEngine` starts one Ray actor that holds that node's share
of the CPUs for the whole run (:class:`NodeWorkers`). A stage's tasks are calls to these actors;
an actor runs them on :class:`~packprep.engines.workers.ForkedWorkers`, processes it forks for the stage
once the stage's context is loaded, as the local engine does on one machine. So a task runs in a
plain forked process that shares its node's tokenizer, with none of a Ray worker's ~40 threads,
and each node always has its next task queued. (A Ray task a part, and then an actor a CPU, were
tried first: each of their Ray workers took 1-2 s to start and loaded the tokenizer itself, and on
16 cores their tasks took 10-25% more CPU than the local engine's; benchmarks/RESULTS.md, "Scale".)

Tasks read the inputs and write the token spills and shards themselves, under the output folder:
on a cluster of several machines, inputs and output must be on a file system every node sees
(NFS, a mounted bucket). The driver only receives each task's small result.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import threading
from collections import deque

from ..errors import ConfigError, WorkerDied
from .workers import IN_FLIGHT_PER_WORKER, ForkedWorkers, ordered

QUEUED_PER_NODE = 1  # calls sent a node beyond its workers: its next task waits there while they run (not
# more: a task queued on one node at the end of a stage is one another node cannot take)
WARM_MODULES = ("packprep.pipeline",)  # what a node imports as it starts: every stage's module
RETRIES = 3  # an actor lost with its node is restarted and its calls run again, as Ray retries tasks


def _import_ray():
    """``ray``, or the ConfigError that says how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise ConfigError(_INSTALL) from exc
    return ray


_INSTALL = "--engine ray needs Ray, which is not installed: pip install 'packprep[ray]'"


def _ray_installed() -> bool:
    """Whether ``import ray`` can work, told without importing it (that takes a second or more)."""
    try:
        return importlib.util.find_spec("ray") is not None
    except ValueError:  # sys.modules holds None for it: importing it fails
        return False


class _QuietThreadStart(logging.Filter):
    """Ray warns that it sets no SIGTERM handler when started in a thread other than the main one;
    the driver's signals are packprep's to handle."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "SIGTERM handler is not set" not in record.getMessage()


_QUIET_THREAD_START = _QuietThreadStart()  # one instance: a logger adds it once however many engines start


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


def shares(total: int, capacities: list[int]) -> list[int]:
    """``total`` workers dealt one at a time over nodes of these CPU ``capacities``: spread evenly,
    none over its node's CPUs."""
    given = [0] * len(capacities)
    while total > 0 and any(g < c for g, c in zip(given, capacities)):
        for n, capacity in enumerate(capacities):
            if total > 0 and given[n] < capacity:
                given[n] += 1
                total -= 1
    return given


class NodeWorkers:
    """A Ray actor: one node's workers for the whole run. For each stage it forks ``processes``
    workers (at the stage's first call, once the stage's context is loaded) and runs the stage's
    calls on them, several at once (a threaded actor)."""

    def __init__(self, warm: tuple[str, ...]):
        for name in warm:
            importlib.import_module(name)
        self.lock = threading.Lock()
        self.key, self.workers = None, None

    def ready(self) -> int:
        return os.getpid()

    def run(self, fn, boxed_context: list, processes: int, item):
        """``fn(context, item)`` on this node's workers for the stage. The context arrives as a
        reference (boxed, so Ray does not fetch it per call) and is deserialized and loaded once
        a stage on this node, before its workers fork."""
        import ray

        ref = boxed_context[0]
        with self.lock:
            if ref.hex() != self.key:
                self._end()  # one stage at a time: the last stage's workers end first
                self.workers, self.key = ForkedWorkers(ray.get(ref), processes), ref.hex()
            workers = self.workers
        return workers.result(workers.submit(fn, item))

    def stop(self) -> None:
        """End the stage's workers: tasks not started are cancelled, running ones finish."""
        with self.lock:
            self._end()

    def _end(self) -> None:
        if self.workers is not None:
            self.workers.close()
            self.workers = self.key = None


class _Nodes:
    """The engine's actors, one a node: started at once, used by a stage as each becomes ready."""

    def __init__(self, ray, num_proc: int):
        self.ray = ray
        nodes = [node for node in ray.nodes() if node.get("Alive") and node["Resources"].get("CPU", 0) >= 1]
        given = shares(num_proc, [int(node["Resources"]["CPU"]) for node in nodes])
        self.cpus: dict = {}  # actor -> its share of the CPUs
        self.starting: dict = {}  # ready() reference -> actor
        self.ready: list = []  # in the order they became ready
        for node, cpus in zip(nodes, given):
            if cpus:
                self._start(node["NodeID"], cpus)
        self.total = sum(self.cpus.values())
        if not self.total:
            raise ConfigError("the Ray cluster has no node with a CPU: start one (ray start --address ...) or "
                              "use --engine local")

    def _start(self, node_id: str, cpus: int) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        actor = self.ray.remote(NodeWorkers).options(
            num_cpus=cpus, max_concurrency=cpus + QUEUED_PER_NODE + 1,  # + 1: stop() gets in while tasks run
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            max_restarts=RETRIES, max_task_retries=RETRIES,
        ).remote(WARM_MODULES)
        self.cpus[actor] = cpus
        self.starting[actor.ready.remote()] = actor

    def started(self, ref) -> None:
        actor = self.starting.pop(ref)
        try:
            self.ray.get(ref)
        except self.ray.exceptions.RayError as error:
            cause = str(error).strip().splitlines()[-1]  # the node's own error, after Ray's traceback
            raise RuntimeError(f"packprep's workers could not start on a node of the Ray cluster: {cause}. Is the "
                               "same packprep installed on every node?") from error
        self.ready.append(actor)

    def kill(self) -> None:
        for actor in self.cpus:
            self.ray.kill(actor)
        self.cpus, self.ready, self.starting = {}, [], {}


class _Task:
    __slots__ = ("item", "ref")

    def __init__(self, item):
        self.item, self.ref = item, None


class _Stage:
    """One stage's tasks, sent in submission order to the nodes as they have room: a call a worker and
    ``QUEUED_PER_NODE`` more, with ``limit`` workers in all (a stage caps its workers for memory),
    dealt over the nodes as the engine's are."""

    def __init__(self, nodes: _Nodes, limit: int, call):
        self.nodes, self.call = nodes, call
        self.processes = dict(zip(nodes.cpus, shares(limit, list(nodes.cpus.values()))))  # actor -> its workers
        self.free: dict = {}  # actor -> calls it can take now
        self.waiting: deque[_Task] = deque()
        self.running: dict = {}  # reference -> actor
        self._enlist()

    def _enlist(self) -> None:
        for actor in self.nodes.ready:
            if self.processes[actor] and actor not in self.free:
                self.free[actor] = self.processes[actor] + QUEUED_PER_NODE

    def _send(self) -> None:
        while self.waiting and self.free:
            actor = max(self.free, key=self.free.__getitem__)  # the node with the most room
            if not self.free[actor]:
                return
            task = self.waiting.popleft()
            task.ref = self.call(actor, self.processes[actor], task.item)
            self.free[actor] -= 1
            self.running[task.ref] = actor

    def submit(self, item) -> _Task:
        task = _Task(item)
        self.waiting.append(task)
        self._send()
        return task

    def result(self, task: _Task):
        """The task's result, or the exception its function raised (an InputError stays one)."""
        ray = self.nodes.ray
        while task.ref is None or task.ref in self.running:
            starting = [ref for ref, actor in self.nodes.starting.items() if self.processes[actor]]
            done, _ = ray.wait(list(self.running) + starting, num_returns=1)
            for ref in done:
                if ref in self.running:
                    self.free[self.running.pop(ref)] += 1
                else:
                    self.nodes.started(ref)
                    self._enlist()
            self._send()
        try:
            return ray.get(task.ref)
        except ray.exceptions.RayTaskError as error:
            raise error.cause from error
        except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError) as error:  # a node's process died
            raise WorkerDied.of(f"a Ray worker process ({type(error).__name__})", None) from error

    def stop(self) -> None:
        """End the stage on every node it used: tasks not started are cancelled, running ones (those of
        a stage nobody collects) finish first, so none writes after its stage; the workers exit."""
        self.waiting.clear()
        ray = self.nodes.ray
        stopped = [actor.stop.remote() for actor in self.free]
        ray.wait(stopped, num_returns=len(stopped))  # not get: a node lost meanwhile must not hide the stage's error
        if self.running:
            ray.wait(list(self.running), num_returns=len(self.running), fetch_local=False)
            self.running.clear()


class RayEngine:
    """One actor a node on the cluster at ``ray_address`` or a Ray started here, ``num_proc`` workers
    in all (at most the cluster's CPUs) dealt over the nodes. See the module docstring.

    Ray is imported and started (or connected to) on a thread of its own, beside the driver's own
    start-up (the tokenizer, the inputs' formats), and the node actors start from there: importing
    Ray takes 1-1.5 s of a 16-core machine, connecting another 1-1.5 s, a node's Ray worker process
    as long again. The thread then waits for :meth:`close`, since Ray ties the processes it starts
    (a local Ray's) to the life of the thread that started them."""

    def __init__(self, num_proc: int, ray_address: str | None = None):
        if not _ray_installed():
            raise ConfigError(_INSTALL)
        self.ray, self.nodes, self.started = None, None, False
        self._error: BaseException | None = None
        self._ready, self._closing = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._connect, args=(max(1, num_proc), ray_address),
                                        name="packprep-ray", daemon=True)
        self._thread.start()

    def _connect(self, num_proc: int, ray_address: str | None) -> None:
        try:
            self.ray = _import_ray()
            logging.getLogger("ray._private.worker").addFilter(_QUIET_THREAD_START)
            self.started = _start_ray(self.ray, ray_address, num_proc)
            self.nodes = _Nodes(self.ray, num_proc)
        except BaseException as error:  # raised in the caller's thread, by _connected
            self._error = error
        finally:
            self._ready.set()
        self._closing.wait()

    def _connected(self) -> _Nodes:
        self._ready.wait()
        if self._error is not None:
            raise self._error
        return self.nodes

    @property
    def workers(self) -> int:
        return self._connected().total

    def map(self, fn, context, items, workers=None):
        nodes = self._connected()
        workers = max(1, min(nodes.total, workers or nodes.total))
        boxed_context = [self.ray.put(context)]
        stage = _Stage(nodes, workers,
                       lambda actor, processes, item: actor.run.remote(fn, boxed_context, processes, item))
        try:
            yield from ordered(stage.submit, stage.result, items, workers * IN_FLIGHT_PER_WORKER)
        finally:
            stage.stop()

    def close(self) -> None:
        self._ready.wait()
        try:
            if self.nodes is not None:
                self.nodes.kill()
                self.nodes = None
            if self.started:
                self.ray.shutdown()
                self.started = False
        finally:
            self._closing.set()
            self._thread.join()
