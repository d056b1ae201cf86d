"""Ray: :class:`RayEngine`, the :class:`~packprep.engines.Engine` on Ray core tasks, and the Ray Data
tokenizer that ``encode.py`` runs until the pipeline moves onto engines.

:class:`RayEngine` runs every item of a stage as one Ray task of one CPU. The stage's context is
put in the object store once per :meth:`RayEngine.map` and reaches the tasks as a reference boxed
in a list, so Ray does not resolve it per task; each worker process deserializes it at its first
task of the stage and keeps it (a tokenizer that the context loads lazily is loaded once a worker).

Tokenize on Ray Data: ``packprep pack ... --engine ray [--ray-address ADDRESS]``.

The driver keeps doing what it does for the local engine: it reads and normalizes the records
(that is where every record gets its source index and every rejection is logged in order), packs
from the lengths and writes the shards. Only the expensive step, rendering the chat template and
tokenizing, runs on the cluster: a pool of Ray Data actors (``map_batches`` with a callable
class), each of which loads the tokenizer once.

One Ray Data dataset serves the whole run, so the actors start (and load the tokenizer) once: its
source is a single read task that takes the driver's batches from a queue (a small Ray actor) as
the driver reads them, one row per batch of 256 conversations; ``map_batches`` hands each row to
an actor of the pool, and ``preserve_order`` gives the results back in input order, so the output
is byte-identical to the local engine's. The driver keeps at most ``in_flight`` batches between
the queue and the results, which bounds its memory (and the cluster's) whatever the input size.

Conversations travel pickled (not as Arrow structs: Arrow would give every message dict the union
of all keys, which changes what a chat template renders); results travel pickled too, so a
``Rejected`` keeps its ``code``.
"""

from __future__ import annotations

import inspect
import logging
import os
import pickle
from collections import deque
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Iterable, Iterator

from ..errors import ConfigError
from . import IN_FLIGHT_PER_WORKER, ordered

if TYPE_CHECKING:  # pragma: no cover
    from ..pipeline import PackConfig

# Batches (of 256 conversations) sent to the cluster and not yet collected, per actor.
IN_FLIGHT_PER_ACTOR = 8
_TOKENIZER_FILE_LIMIT = 64 << 20  # ship a tokenizer folder's files to the actors up to this size


def _import_ray(data: bool = False):
    """``ray`` (and ``ray.data`` when ``data``), or the ConfigError that says how to install it."""
    try:
        import ray

        if data:
            import ray.data  # noqa: F401
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
        env = {"env_vars": {"TOKENIZERS_PARALLELISM": "false"}}  # one task, one CPU
        self.task = self.ray.remote(num_cpus=1, runtime_env=env)(_run_task)

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


def make_encoder(tokenizer, config: "PackConfig"):
    """``ChatEncoder`` for ``config``, built the way the local engine builds it."""
    from ..tokenize import ChatEncoder

    return ChatEncoder(tokenizer, config.train_on, config.tokenizer_backend)


def _tokenizer_payload(tokenizer: str) -> tuple[str, dict[str, bytes] | None]:
    """The tokenizer as the actors get it: a local folder travels as its files (the nodes of a
    cluster need not share a file system); a Hub id travels as its name."""
    if not os.path.isdir(tokenizer):
        return tokenizer, None
    files, total = {}, 0
    for name in sorted(os.listdir(tokenizer)):
        path = os.path.join(tokenizer, name)
        if os.path.isfile(path):
            total += os.path.getsize(path)
            if total > _TOKENIZER_FILE_LIMIT:  # a folder with weights beside it: rely on shared paths
                return os.path.abspath(tokenizer), None
            with open(path, "rb") as handle:
                files[name] = handle.read()
    return os.path.abspath(tokenizer), files


def _queue_datasource(queue):
    """A Datasource of one read task that yields the driver's batches from ``queue`` until None."""
    import pyarrow as pa
    from ray.data.block import BlockMetadata
    from ray.data.datasource import Datasource, ReadTask

    def read():
        sequence = 0
        while (blob := queue.get(block=True)) is not None:
            yield pa.table({"seq": pa.array([sequence], pa.int64()), "batch": pa.array([blob], pa.large_binary())})
            sequence += 1

    class QueueDatasource(Datasource):
        def estimate_inmemory_data_size(self):
            return None

        def get_read_tasks(self, parallelism, per_task_row_limit=None, data_context=None):
            metadata = BlockMetadata(num_rows=None, size_bytes=None, input_files=None, exec_stats=None)
            return [ReadTask(read, metadata)]

        def supports_distributed_reads(self) -> bool:
            return False  # the read task only forwards; keep it beside the driver

    return QueueDatasource()


class EncoderActor:
    """A Ray Data actor: loads the tokenizer once, then encodes batches of pickled conversations."""

    def __init__(self, tokenizer: str, files: dict[str, bytes] | None, config_fields: dict):
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one actor, one CPU
        from ..pipeline import PackConfig
        from ..tokenize import load_tokenizer

        config = PackConfig(**config_fields)
        if files is not None:
            import tempfile

            self._folder = tempfile.TemporaryDirectory(prefix="packprep-tokenizer-")
            for name, data in files.items():
                with open(os.path.join(self._folder.name, name), "wb") as handle:
                    handle.write(data)
            tokenizer = self._folder.name
        self.encoder = make_encoder(load_tokenizer(tokenizer), config)

    def __call__(self, batch: dict) -> dict:
        results = []
        for blob in batch["batch"]:
            encoded = self.encoder.encode(pickle.loads(blob))
            results.append(pickle.dumps((encoded, self.encoder.backend_name), protocol=5))
        return {"seq": batch["seq"], "result": results}


def ray_encode_batches(
    batches: Iterable[list],
    tokenizer: str,
    config: "PackConfig",
    ray_address: str | None,
    num_proc: int,
    *,
    in_flight: int | None = None,
) -> Iterator[tuple[list, list]]:
    """Yield ``(batch, (encoded, backend))`` for every batch of ``(source_index, record,
    conversation)``, in input order, as the local engine does; ``encoded[i]`` is an ``Encoded`` or a
    ``Rejected``, and ``backend`` the tokenizer backend of the actor that encoded the batch.

    Connects to ``ray_address`` when given (``"auto"``: the cluster this machine belongs to), else
    uses the Ray instance already running in this process, else starts a local one with
    ``num_proc`` CPUs; only a Ray that it started is shut down. ``num_proc`` is the number of
    tokenizer actors; ``in_flight`` the batches sent and not yet collected (default: 8 an actor).
    """
    ray = _import_ray(data=True)
    started = _start_ray(ray, ray_address, num_proc)
    data_logger = logging.getLogger("ray.data")
    level = data_logger.level
    data_logger.setLevel(logging.WARNING)  # no per-dataset INFO lines between packprep's progress bars
    try:
        yield from _run(ray, batches, tokenizer, config, num_proc, in_flight or IN_FLIGHT_PER_ACTOR * num_proc)
    finally:
        data_logger.setLevel(level)
        if started:
            ray.shutdown()


def _run(ray, batches, tokenizer, config, num_proc, in_flight) -> Iterator[tuple[list, list]]:
    from ray.data import DataContext
    from ray.util.queue import Queue

    context = DataContext.get_current()
    saved = (context.execution_options.preserve_order, context.target_max_block_size, context.enable_progress_bars)
    context.execution_options.preserve_order = True
    context.target_max_block_size = 1  # every batch its own block: never wait to fill a bigger one
    context.enable_progress_bars = False
    queue = Queue(actor_options={"num_cpus": 0})
    try:
        path, files = _tokenizer_payload(tokenizer)
        if "num_cpus" in inspect.signature(ray.data.read_datasource).parameters:
            read_args = {"num_cpus": 0}
        else:  # Ray before 2.50 or so
            read_args = {"ray_remote_args": {"num_cpus": 0}}
        dataset = ray.data.read_datasource(_queue_datasource(queue), override_num_blocks=1, **read_args).map_batches(
            EncoderActor,
            fn_constructor_args=(path, files, asdict(config)),
            batch_size=1,
            num_cpus=1,
            batch_format="numpy",
            **_pool_args(ray, num_proc),
        )
        results = iter(dataset.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=0))
        pending: deque = deque()
        iterator = iter(batches)
        exhausted = False
        sent = 0
        while True:
            while not exhausted and len(pending) < in_flight:
                batch = next(iterator, None)
                if batch is None:
                    exhausted = True
                    queue.put(None)
                else:
                    queue.put(pickle.dumps([c for _, _, c in batch], protocol=5))
                    pending.append(batch)
                    sent += 1
            if not pending:
                break
            block = next(results)
            for seq, blob in zip(block["seq"].tolist(), block["result"]):
                expected = sent - len(pending)
                if seq != expected:
                    raise RuntimeError(f"Ray Data returned batch {seq} where batch {expected} was due")
                yield pending.popleft(), pickle.loads(blob)
        for _ in results:  # drain, so that the dataset finishes cleanly
            raise RuntimeError("Ray Data returned more results than batches sent")
    finally:
        ray.kill(queue.actor)
        (context.execution_options.preserve_order, context.target_max_block_size, context.enable_progress_bars) = saved


def _pool_args(ray, num_proc: int) -> dict:
    """A fixed pool of ``num_proc`` actors, in the spelling this Ray version takes."""
    try:
        from ray.data import ActorPoolStrategy

        return {"compute": ActorPoolStrategy(size=num_proc)}
    except (ImportError, TypeError):
        return {"concurrency": num_proc}
