"""``RayEngine`` on a cluster of 4 nodes of one CPU each (``ray.cluster_utils.Cluster``, started once
for the module; an engine a test, since an engine's node actors hold their CPUs until it closes):
results in item order, tasks spread over nodes, the context deserialized once a node and inherited
by the workers forked there, task errors raised as themselves, a stage abandoned early, workers
capped by the cluster's CPUs, a node that cannot start. Skipped without Ray.
"""

from __future__ import annotations

import os
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from packprep.engines import LocalEngine, make_engine
from packprep.errors import ConfigError, InputError

ray = pytest.importorskip("ray")
from packprep.engines.ray_cluster import RayEngine  # noqa: E402  (needs ray)

NODES = 4
OBJECT_STORE = 80 << 20  # per node: 4 of them fit a small machine


class Context:
    """A stage context that counts, per worker process, how often it is deserialized, and loads a
    resource lazily the way the encode context loads its tokenizer."""

    def __init__(self, name: str, offset: int = 0, nodes: str = ""):
        self.name, self.offset, self.nodes, self.loaded = name, offset, nodes, None

    def __reduce__(self):
        return _deserialize, (self.name, self.offset, self.nodes)


DESERIALIZED: Counter = Counter()  # in each worker process: context name -> times deserialized


def _deserialize(name: str, offset: int, nodes: str) -> Context:
    DESERIALIZED[name] += 1
    return Context(name, offset, nodes)


def shift(context: Context, item: int) -> int:
    return item * item + context.offset


def where(context: Context, item: int) -> tuple:
    node = ray.get_runtime_context().get_node_id()
    # wait (30 s at most) until a second node has run a task: with tasks this short, one worker
    # could otherwise run them all before Ray starts a worker on another node
    (Path(context.nodes) / node).touch()
    deadline = time.monotonic() + 30
    while len(os.listdir(context.nodes)) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    if context.loaded is None:
        context.loaded = (os.getpid(), item)  # the "tokenizer": loaded by the worker's first task
    return (item, node, os.getpid(), DESERIALIZED[context.name], context.loaded,
            os.environ.get("TOKENIZERS_PARALLELISM"))


def fail_on_seven(context, item: int) -> int:
    if item == 7:
        raise InputError(f"bad item {item}")
    return item


def span(context, item: int) -> tuple[float, float]:
    start = time.time()
    time.sleep(context)
    return start, time.time()


def span_then_mark(context: tuple[float, str], item: int) -> int:
    seconds, folder = context
    time.sleep(seconds)
    (Path(folder) / str(item)).touch()  # what a stage's task writes (a spill, a shard)
    return os.getpid()


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "object_store_memory": OBJECT_STORE, "include_dashboard": False})
    for _ in range(NODES - 1):
        cluster.add_node(num_cpus=1, object_store_memory=OBJECT_STORE)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)  # engines find this process connected
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture
def engine(cluster):
    """An engine of its own for each test: its actors hold the cluster's CPUs until it is closed."""
    engine = RayEngine(NODES, cluster.address)
    try:
        yield engine
    finally:
        engine.close()


def test_results_in_item_order_equal_the_local_engine(engine):
    context = Context("order", offset=3)
    expected = list(LocalEngine(2).map(shift, context, range(50)))
    assert expected == [i * i + 3 for i in range(50)]
    assert list(engine.map(shift, context, range(50))) == expected
    assert list(engine.map(shift, context, iter(range(50)), workers=2)) == expected


def test_tasks_spread_over_nodes_and_the_context_is_deserialized_once_a_worker(engine, tmp_path):
    results = list(engine.map(where, Context("once", nodes=str(tmp_path)), range(60)))
    assert [r[0] for r in results] == list(range(60))
    assert len({node for _, node, *_ in results}) > 1
    tasks_per_worker = Counter(pid for _, _, pid, *_ in results)
    assert max(tasks_per_worker.values()) > 1  # workers ran several tasks ...
    assert {count for *_, count, _, _ in results} == {1}  # ... and deserialized the context once
    first = defaultdict(set)
    for _, _, pid, _, loaded, _ in results:
        first[pid].add(loaded)
    assert all(len(loaded) == 1 and next(iter(loaded))[0] == pid for pid, loaded in first.items())
    assert {r[-1] for r in results} == {"false"}  # TOKENIZERS_PARALLELISM in the workers


def test_workers_caps_the_tasks_running_at_once(engine):
    spans = list(engine.map(span, 0.2, range(8), workers=2))
    running = max(sum(start <= t < end for start, end in spans) for t, _ in spans)
    assert running <= 2


def test_a_task_error_reaches_the_driver_as_itself(engine):
    with pytest.raises(InputError) as raised:
        list(engine.map(fail_on_seven, None, range(20)))
    assert type(raised.value) is InputError
    assert str(raised.value) == "bad item 7"
    assert list(engine.map(fail_on_seven, None, range(5))) == list(range(5))  # the engine still works


def test_a_consumer_that_stops_early_does_not_wait_for_the_rest(engine, tmp_path):
    started = time.monotonic()
    results = engine.map(span_then_mark, (0.5, str(tmp_path)), range(100))
    next(results), next(results)
    results.close()
    assert time.monotonic() - started < 10  # 100 tasks of 0.5 s on 4 CPUs would take 12.5 s
    written = set(os.listdir(tmp_path))
    time.sleep(1.5)  # a task still running would write its file in this time
    assert set(os.listdir(tmp_path)) == written  # no task of the abandoned stage wrote after it
    assert list(engine.map(shift, Context("after"), range(4))) == [0, 1, 4, 9]  # new workers took their place


def family(context, item: int) -> tuple[int, int, int | None]:
    time.sleep(0.05)
    return os.getpid(), os.getppid(), getattr(context, "loaded_by", None)


class Loads:
    """A context with a ``load()`` method, like the encode stage's (it loads the tokenizer)."""

    loaded_by = None

    def load(self):
        self.loaded_by = os.getpid()


def test_each_node_forks_its_workers_from_one_process_that_lives_for_the_run(engine):
    """A stage's tasks run in processes forked for it on each node, from one process a node that
    imported the pipeline as it started and stays for every stage; it loads the stage's context
    before it forks, so the workers share what it loaded."""
    first = list(engine.map(family, Loads(), range(40)))
    second = list(engine.map(family, Loads(), range(40, 80)))
    parents = {parent for _, parent, _ in first}
    assert len(parents) == NODES and {parent for _, parent, _ in second} == parents
    assert {pid for pid, *_ in first}.isdisjoint({pid for pid, *_ in second})  # forked again for a stage
    assert all(loaded_by == parent for _, parent, loaded_by in first + second)


def test_more_workers_than_the_clusters_cpus_are_capped_not_waited_for(cluster):
    engine = RayEngine(NODES * 2, cluster.address)
    try:
        assert engine.workers == NODES
        assert list(engine.map(shift, Context("capped"), range(10))) == [i * i for i in range(10)]
    finally:
        engine.close()


def test_a_worker_that_cannot_start_is_a_clear_error(cluster, monkeypatch):
    from packprep.engines import ray_cluster as ray_engine

    monkeypatch.setattr(ray_engine, "WARM_MODULES", ("packprep.no_such_module",))
    engine = RayEngine(2, cluster.address)
    try:
        with pytest.raises(RuntimeError, match="could not start on a node of the Ray cluster: ModuleNotFoundError: No module named "
                           "'packprep.no_such_module'. Is the same packprep installed on every node"):
            list(engine.map(shift, Context("never"), range(3)))
    finally:
        engine.close()


def test_close_leaves_a_ray_it_did_not_start(engine):
    assert ray.is_initialized()
    make_engine("ray", 2).close()
    assert ray.is_initialized()


def test_missing_ray_is_a_config_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(ConfigError, match=r"pip install 'packprep\[ray\]'"):
        make_engine("ray", 1)


def test_pack_on_four_nodes_writes_the_local_engines_bytes(cluster, tmp_path, monkeypatch):
    """The whole pipeline on the cluster: parts read, encoded and spilled by tasks on every node,
    shards written and checked by tasks; the folder is byte-identical to the local engine's."""
    import packprep

    from .conftest import EXAMPLE_CHATS, EXAMPLE_TOKENIZER

    monkeypatch.setattr("packprep.parts.MIN_PART_BYTES", 50_000)  # a dozen parts, so that every node reads some
    settings = {"max_len": 512, "seed": 3, "shard_size": "100KB"}
    local = packprep.pack(str(EXAMPLE_CHATS), tmp_path / "local", str(EXAMPLE_TOKENIZER), num_proc=2, **settings)
    on_ray = packprep.pack(str(EXAMPLE_CHATS), tmp_path / "ray", str(EXAMPLE_TOKENIZER), num_proc=NODES,
                           engine="ray", ray_address=cluster.address, **settings)
    assert len(on_ray["shards"]) > 1
    assert on_ray == local
    files = lambda folder: {str(p.relative_to(folder)): p.read_bytes()  # noqa: E731
                            for p in sorted(folder.rglob("*")) if p.is_file()}
    assert files(tmp_path / "ray") == files(tmp_path / "local")


def test_a_json_arrays_scan_runs_on_the_cluster_and_cuts_where_one_chunk_does(engine, tmp_path, monkeypatch):
    """The planner's chunks of a JSON array are scanned by tasks on the nodes (json_scan.scan_json_chunk): the
    same parts as the whole array scanned as one chunk here."""
    import json

    from packprep import parts, pipeline, read

    from .conftest import EXAMPLE_CHATS

    path = tmp_path / "chats.json"
    path.write_text(json.dumps([json.loads(line) for line in EXAMPLE_CHATS.read_text().splitlines()], indent=1))
    sources = read.resolve_inputs([str(path)])
    monkeypatch.setattr("packprep.parts.MIN_PART_BYTES", 20_000)
    monkeypatch.setattr("packprep.parts.PART_BYTES", 20_000)
    one_chunk = parts.plan_parts(sources, NODES)
    monkeypatch.setattr("packprep.json_scan.JSON_CHUNK_BYTES", 1)  # a chunk a node
    assert pipeline.plan_parts(sources, engine) == one_chunk
    assert len(one_chunk) > 10 and {p.kind for p in one_chunk} == {"json-range"}


def test_workers_are_dealt_evenly_over_the_nodes_none_over_its_cpus():
    from packprep.engines.ray_cluster import shares

    assert shares(16, [4, 4, 4, 4]) == [4, 4, 4, 4]
    assert shares(6, [4, 4, 4, 4]) == [2, 2, 1, 1]
    assert shares(5, [1, 8, 2]) == [1, 2, 2]
    assert shares(20, [1, 8, 2]) == [1, 8, 2]  # more than the cluster has: all of it
    assert shares(3, [0, 2, 2]) == [0, 2, 1]
