"""End-to-end scale benchmark: wall time per stage, tokens/s and peak memory of ``packprep pack``.

    python benchmarks/bench_scale.py                      # 1,000,000 conversations, example tokenizer
    python benchmarks/bench_scale.py --n 100000 --n 300000 --num-proc 1 --num-proc 2
    python benchmarks/bench_scale.py --n 100000 --tokenizer ../shared/fixtures/tokenizers/llama3
    python benchmarks/bench_scale.py --n 1000000 --input jsonl --input json   # JSONL vs one JSON array
    python benchmarks/bench_scale.py --n 10000000 --num-proc 2 --words 4   # many sequences, few tokens

For each size it writes N synthetic ShareGPT conversations (multi-turn, lognormal turn lengths,
Zipf-distributed words; generated with numpy in seconds; ``--words W``: one exchange of W-word
turns each, so that sequences are many and tokens few) to a temporary folder, then runs

    python benchmarks/bench_scale.py _timed pack DATA.jsonl -t TOK -o OUT -q ...

for every ``--num-proc``: that is ``python -m packprep pack`` with timers wrapped around the
pipeline's stages (read+tokenize, pack, write, verify; the rest of the wall time — interpreter
start, imports, tokenizer load, format detection, input hashing, manifest — is "other").
"start-up" is the time from launching the process to the first record read (imports, tokenizer,
chat template, output checks), a part of "other". The driver reports its own
peak RSS (``VmHWM``); a sampler thread also records the peak of the driver plus its worker
processes, counted as PSS (proportional set size) so pages that forked workers share with the
driver are not counted twice. Results: one Markdown table on stdout (and ``--json``).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EXAMPLE_TOKENIZER = REPO / "examples" / "tokenizer"

# ---------------------------------------------------------------------------- synthetic data

_SYLLABLES = (
    "a an ar at be ca co de di el en er es fo ga he in is it ka la le li lo ma me mi mo na ne no "
    "on or pa pe po ra re ri ro sa se si so st ta te ti to tu un ur va ve wa we"
).split()
_COMMON = (
    "the of and to in is that for it as with was on be by this are or from at an which not have "
    "you can we model data training function value code example use if will so one more when"
).split()
_PUNCT = [".", ",", "?", "!", ":", ";", "\n\n", "\n- "]


def _vocabulary(rng, size: int = 20000) -> list[str]:
    """Pseudo-words: the common English words first, then syllable compounds (Zipf ranks)."""
    import numpy as np

    words = list(_COMMON)
    seen = set(words)
    lengths = rng.integers(1, 5, size=size * 2)
    picks = rng.integers(0, len(_SYLLABLES), size=(size * 2, 4))
    for n, row in zip(lengths.tolist(), picks.tolist()):
        word = "".join(_SYLLABLES[i] for i in row[:n])
        if word not in seen:
            seen.add(word)
            words.append(word)
        if len(words) >= size:
            break
    # some numbers and identifiers, as chats about code and arithmetic have
    words += [str(v) for v in rng.integers(0, 100000, size=500).tolist()]
    words += [f"{a}_{b}" for a, b in zip(rng.choice(words[:2000], 300), rng.choice(words[:2000], 300))]
    return [w for w in np.asarray(words, dtype=object)]


def _corpus(rng, words: list[str], n_words: int) -> tuple[str, "np.ndarray"]:
    """A long text of Zipf-distributed words with punctuation; returns it and its word starts."""
    import numpy as np

    weights = 1.0 / np.arange(1, len(words) + 1) ** 1.05  # Zipf's law, bounded to the vocabulary
    ranks = rng.choice(len(words), size=n_words, p=weights / weights.sum())
    tokens = np.asarray(words, dtype=object)[ranks]
    punct = rng.random(n_words) < 0.08
    marks = np.asarray(_PUNCT, dtype=object)[rng.integers(0, len(_PUNCT), size=n_words)]
    pieces = np.where(punct, tokens + marks, tokens)
    lengths = np.fromiter((len(p) for p in pieces.tolist()), dtype=np.int64, count=n_words) + 1
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return " ".join(pieces.tolist()) + " ", starts


def generate(path: Path, n: int, seed: int = 0, words_per_turn: int | None = None) -> dict:
    """Write ``n`` ShareGPT conversations to ``path``; return a summary. ``words_per_turn``: one
    exchange of that many words a turn each (many sequences, few tokens: what measures the
    driver's memory a sequence) instead of 1-8 exchanges of lognormal length."""
    import numpy as np

    rng = np.random.default_rng(seed)
    words = _vocabulary(rng)
    corpus, starts = _corpus(rng, words, 4_000_000)
    n_words = len(starts)
    if words_per_turn:
        exchanges = np.ones(n, dtype=np.int64)
        turn_len = np.full(2 * n, words_per_turn, dtype=np.int64)
    else:
        exchanges = 1 + np.minimum(rng.poisson(1.0, size=n), 7)  # 1..8 user/assistant pairs, mean 2
        is_user = np.tile([True, False], int(exchanges.sum()))
        # lognormal turn lengths in words: user ~ median 16, assistant ~ median 55, long tails
        user_len = rng.lognormal(2.8, 1.0, size=len(is_user))
        bot_len = rng.lognormal(4.0, 1.0, size=len(is_user))
        turn_len = np.clip(np.where(is_user, user_len, bot_len), 1, 6000).astype(np.int64)
    total_turns = int(exchanges.sum()) * 2
    first = rng.integers(0, n_words - 6001, size=total_turns)
    begin = starts[first]
    end = starts[first + turn_len] - 1  # drop the separating space
    system = rng.random(n) < 0.15
    texts = [corpus[b:e] for b, e in zip(begin.tolist(), end.tolist())]
    chars = 0
    with open(path, "w", encoding="utf-8") as handle:
        turn = 0
        buffer = []
        for i, pairs in enumerate(exchanges.tolist()):
            record = {"conversations": []}
            if system[i]:
                record["system"] = "You are a helpful assistant."
            for k in range(pairs * 2):
                record["conversations"].append({"from": "human" if k % 2 == 0 else "gpt", "value": texts[turn]})
                turn += 1
            line = json.dumps(record, ensure_ascii=False)
            chars += len(line)
            buffer.append(line)
            if len(buffer) >= 10000:
                handle.write("\n".join(buffer) + "\n")
                buffer.clear()
        if buffer:
            handle.write("\n".join(buffer) + "\n")
    return {"conversations": n, "turns": total_turns, "mean_words_per_turn": float(turn_len.mean()),
            "bytes": path.stat().st_size}


def as_json_array(jsonl: Path, path: Path) -> None:
    """The conversations of ``jsonl`` as one JSON array (a ShareGPT dump), an item a line."""
    with open(jsonl, encoding="utf-8") as lines, open(path, "w", encoding="utf-8") as out:
        out.write("[")
        for i, line in enumerate(lines):
            out.write(("," if i else "") + "\n" + line.rstrip("\n"))
        out.write("\n]\n")


# ---------------------------------------------------------------------------- timed run


class _Sampler(threading.Thread):
    """Peak of (driver + descendants) memory, as PSS where readable, else RSS; sampled every 0.1 s."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak_kib = 0
        self.stage = "other"  # set by the stage timers: each sample is also counted for its stage
        self.by_stage: dict[str, int] = {}
        self.stop = threading.Event()

    @staticmethod
    def _children() -> dict[int, list[int]]:
        tree: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as handle:
                        fields = handle.read().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                tree.setdefault(int(fields[1]), []).append(int(entry))
        return tree

    @staticmethod
    def _kib(pid: int) -> int:
        for name, key in (("smaps_rollup", "Pss:"), ("status", "VmRSS:")):
            try:
                with open(f"/proc/{pid}/{name}") as handle:
                    for line in handle:
                        if line.startswith(key):
                            return int(line.split()[1])
            except OSError:
                continue
        return 0

    def run(self):
        me = os.getpid()
        while not self.stop.wait(0.1):
            tree = self._children()
            pids, todo = [], [me]
            while todo:
                pid = todo.pop()
                pids.append(pid)
                todo += tree.get(pid, [])
            kib = sum(self._kib(p) for p in pids)
            self.peak_kib = max(self.peak_kib, kib)
            self.by_stage[self.stage] = max(self.by_stage.get(self.stage, 0), kib)


def _driver_peak_kib() -> int:
    """The driver's peak RSS: VmHWM, the high-water mark of this process image. (Not getrusage's
    ru_maxrss: Linux carries that across exec, so a child of the benchmark, which forked from a
    parent holding the generated data, would report the parent's peak as its own.)"""
    with open("/proc/self/status") as handle:
        return next(int(line.split()[1]) for line in handle if line.startswith("VmHWM:"))


def timed_main(argv: list[str]) -> None:
    """``python -m packprep <argv>`` with stage timers; prints one ``BENCH_STAGES {...}`` line."""
    import importlib

    importlib.import_module("packprep.cli")  # first, as in the real command: it sets the environment before numpy loads
    pipeline = importlib.import_module("packprep.pipeline")
    verify_module = importlib.import_module("packprep.verification")  # the module, not packprep.verify()

    stages: dict[str, float] = {}
    sampler = _Sampler()
    peak_after: dict[str, float] = {}  # the driver's peak RSS (MiB) when each stage ended: where it grew

    def timer(owner, name: str, stage: str):
        original = getattr(owner, name)  # an AttributeError here: the pipeline changed, update the timers

        @functools.wraps(original)  # the CLI reads defaults from the signatures
        def wrapped(*args, **kwargs):
            start = time.perf_counter()
            sampler.stage = stage
            try:
                return original(*args, **kwargs)
            finally:
                sampler.stage = "other"
                stages[stage] = stages.get(stage, 0.0) + time.perf_counter() - start
                peak_after[stage] = _driver_peak_kib() / 1024

        setattr(owner, name, wrapped)

    # read+tokenize: from asking the Encoding to run to the token store being built from the parts' spills
    encode_module = importlib.import_module("packprep.encode")
    materialize_module = importlib.import_module("packprep.materialize")
    original_run, original_build = encode_module.Encoding.run, materialize_module.TokenStore.from_spills
    began: list[float] = []

    def run(self, *args, **kwargs):
        if not began:  # (begun already where the pipeline planned the parts: see plan_parts below)
            began.append(time.perf_counter())
        sampler.stage = "read+tokenize"
        return original_run(self, *args, **kwargs)

    def from_spills(*args, **kwargs):
        try:
            return original_build(*args, **kwargs)
        finally:
            if began:
                stages["read+tokenize"] = stages.get("read+tokenize", 0.0) + time.perf_counter() - began.pop()
                peak_after["read+tokenize"] = _driver_peak_kib() / 1024
            sampler.stage = "other"

    encode_module.Encoding.run, materialize_module.TokenStore.from_spills = run, staticmethod(from_spills)
    plan_s: list[float] = []  # cutting the inputs into parts (a JSON array's scan), inside read+tokenize
    original_plan = pipeline.plan_parts

    def plan_parts(*args, **kwargs):
        start = time.perf_counter()
        began.append(start)  # the pipeline plans the parts just before it runs the Encoding: read+tokenize
        sampler.stage = "read+tokenize"
        try:
            return original_plan(*args, **kwargs)
        finally:
            plan_s.append(time.perf_counter() - start)

    pipeline.plan_parts = plan_parts
    timer(pipeline, "_pack", "pack")
    timer(pipeline, "_segments", "pack")
    timer(pipeline, "write_shards", "write")
    timer(verify_module, "verify", "verify")
    # start-up: from the process's launch (BENCH_LAUNCH, set by run_pack) to the first record read
    read_module = importlib.import_module("packprep.read")
    first_read: list[float] = []
    original_read = read_module.read_records

    def read_records(*args, **kwargs):
        if not first_read:
            first_read.append(time.time() - float(os.environ.get("BENCH_LAUNCH", time.time())))
        return original_read(*args, **kwargs)

    for name, module in list(sys.modules.items()):
        if name.startswith("packprep") and getattr(module, "read_records", None) is original_read:
            module.read_records = read_records
    sampler.start()
    start = time.perf_counter()
    from packprep.cli import main

    try:
        main(args=argv, standalone_mode=False)
    finally:
        total = time.perf_counter() - start
        sampler.stop.set()
        sampler.join()
        stages["other"] = total - sum(stages.values())
        stages["total"] = total
        driver_peak_kib = _driver_peak_kib()
        print("BENCH_STAGES " + json.dumps({"stages": stages, "tree_peak_kib": sampler.peak_kib, "tree_peak_by_stage_kib": sampler.by_stage, "peak_after_mib": peak_after,
                                            "startup_s": first_read[0] if first_read else None,
                                            "plan_s": sum(plan_s),
                                            "driver_peak_kib": driver_peak_kib}), flush=True)


def run_pack(data: Path, tokenizer: str, num_proc: int, max_len: int, workdir: Path, engine: str,
             ray_address: str | None = None) -> dict:
    out = workdir / f"packed-{num_proc}-{engine}"
    command = [
        sys.executable, str(Path(__file__).resolve()), "_timed", "pack", str(data),
        "-t", tokenizer, "-o", str(out), "--max-len", str(max_len), "--num-proc", str(num_proc),
        "--engine", engine, "--overwrite", "-q",
    ] + (["--ray-address", ray_address] if ray_address else [])
    launch = time.time()
    env = dict(os.environ, HF_HUB_OFFLINE="1", BENCH_LAUNCH=repr(launch))
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    seconds = time.time() - launch
    if done.returncode != 0:
        raise RuntimeError(f"pack failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    marker = next(line for line in done.stdout.splitlines() if line.startswith("BENCH_STAGES "))
    result = json.loads(marker[len("BENCH_STAGES "):])
    manifest = json.loads((out / "packprep.json").read_text())
    shutil.rmtree(out)
    shards_sha256 = " ".join(shard["sha256"] for shard in manifest["shards"])
    tokens = manifest["tokens"]["total"]
    return {
        "num_proc": num_proc,
        "engine": engine,
        "wall_s": seconds,
        "stages_s": result["stages"],
        "tokens": tokens,
        "rows": manifest["rows"],
        "efficiency": manifest["efficiency"],
        "records": manifest["counts"]["records"],
        "tokens_per_s": tokens / seconds,
        "tokenize_tokens_per_s": tokens / result["stages"]["read+tokenize"],
        "startup_s": result.get("startup_s"),
        "plan_s": result.get("plan_s"),
        "max_rss_mib": result["driver_peak_kib"] / 1024,
        "tree_peak_mib": result["tree_peak_kib"] / 1024,
        "tree_peak_by_stage_mib": {k: v / 1024 for k, v in result.get("tree_peak_by_stage_kib", {}).items()},
        "driver_peak_after_stage_mib": result.get("peak_after_mib", {}),
        "shards_sha256": shards_sha256,
    }


def _ray_cluster(nodes: int, cpus: int):
    """A local Ray cluster of ``nodes`` nodes sharing ``cpus`` CPUs (several raylets on one machine)."""
    from ray.cluster_utils import Cluster

    cluster = Cluster()
    for node in range(nodes):
        cluster.add_node(num_cpus=cpus // nodes + (node < cpus % nodes), include_dashboard=False)
    cluster.wait_for_nodes()
    return cluster


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_timed":
        timed_main(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, action="append", help="conversations (repeatable) [1000000]")
    parser.add_argument("--num-proc", type=int, action="append", help="repeatable [1 and 2]")
    parser.add_argument("--tokenizer", default=str(EXAMPLE_TOKENIZER))
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--words", type=int, default=None,
                        help="short conversations: one exchange of this many words a turn [1-8 exchanges, lognormal]")
    parser.add_argument("--engine", action="append", choices=["local", "ray"], help="repeatable [local]")
    parser.add_argument("--input", action="append", choices=["jsonl", "json"],
                        help="the conversations as JSONL or as one JSON array (repeatable) [jsonl]")
    parser.add_argument("--ray-nodes", type=int, default=4,
                        help="with --engine ray: a local Ray cluster of this many nodes, splitting --num-proc CPUs [4]")
    parser.add_argument("--compare", action="store_true",
                        help="check that every run of a size wrote the same shards (sha256 of each)")
    parser.add_argument("--workdir", default=None, help="where data and output go [a temp dir, removed after]")
    parser.add_argument("--keep-data", action="store_true")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    sizes = args.n or [1_000_000]
    procs = args.num_proc or [1, 2]
    engines = args.engine or ["local"]
    formats = args.input or ["jsonl"]
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="packprep-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    results = []
    try:
        # one small run first, so that every timed run finds the caches a second run of packprep finds
        # (numba's compiled kernels, the tokenizer's tiktoken ranks); its start-up is the cold one
        warmup = workdir / "warmup.jsonl"
        generate(warmup, 2000)
        cold = run_pack(warmup, args.tokenizer, procs[0], args.max_len, workdir, "local")
        print(f"# warm-up run (2,000 conversations): cold start-up {cold['startup_s']:.2f} s", file=sys.stderr, flush=True)
        warmup.unlink()
        for n in sizes:
            data = workdir / f"chats-{n}{f'-w{args.words}' if args.words else ''}.jsonl"
            if not data.exists():
                start = time.perf_counter()
                summary = generate(data, n, words_per_turn=args.words)
                print(f"# generated {n:,} conversations ({summary['bytes'] / 1e6:,.0f} MB, "
                      f"{summary['mean_words_per_turn']:.0f} words a turn) in {time.perf_counter() - start:.1f} s",
                      file=sys.stderr, flush=True)
            if "json" in formats and not data.with_suffix(".json").exists():
                as_json_array(data, data.with_suffix(".json"))
            shards = set()
            for engine, num_proc, form in [(e, p, f) for e in engines for p in procs for f in formats]:
                cluster = _ray_cluster(args.ray_nodes, num_proc) if engine == "ray" else None
                try:
                    result = run_pack(data.with_suffix("." + form), args.tokenizer, num_proc, args.max_len,
                                      workdir, engine, cluster.address if cluster else None)
                finally:
                    if cluster is not None:
                        cluster.shutdown()
                result.update(n=n, input=form, input_mb=data.with_suffix("." + form).stat().st_size / 1e6,
                              tokenizer=Path(args.tokenizer).name, nodes=args.ray_nodes if cluster else 1)
                results.append(result)
                shards.add(result.pop("shards_sha256"))
                print(json.dumps(result), file=sys.stderr, flush=True)
            if args.compare and len(shards) != 1:
                raise SystemExit(f"runs of {n:,} conversations wrote different shards")
            if not args.keep_data:
                for form in formats + ["jsonl"]:
                    data.with_suffix("." + form).unlink(missing_ok=True)
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    print(table(results))


def table(results: list[dict]) -> str:
    """One row a run; each stage as seconds and its share of the wall time."""
    lines = [
        "| conversations | input | tokenizer | engine | --num-proc | start-up | read+tokenize | pack | write | verify | "
        "other | total wall | tokens | tokens/s (end to end) | peak RSS driver | peak PSS driver+workers |",
        "|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        s, wall = dict(r["stages_s"]), r["wall_s"]
        # "other" is everything else of the wall time, interpreter start and imports included
        s["other"] = wall - sum(s.get(name, 0) for name in ("read+tokenize", "pack", "write", "verify"))

        def stage(name):
            return f"{s.get(name, 0):.1f} s ({100 * s.get(name, 0) / wall:.0f}%)"

        startup = f"{r['startup_s']:.2f} s" if r.get("startup_s") is not None else "-"
        lines.append(
            f"| {r['n']:,} | {r['input_mb']:,.0f} MB {r.get('input', 'jsonl')} | {r['tokenizer']} | {r['engine']}"
            f"{' (%d nodes)' % r['nodes'] if r.get('nodes', 1) > 1 else ''} | {r['num_proc']} | {startup} | "
            f"{stage('read+tokenize')} | {stage('pack')} | {stage('write')} | {stage('verify')} | {stage('other')} | "
            f"{wall:.1f} s | {r['tokens'] / 1e6:,.1f} M | {r['tokens_per_s'] / 1e6:,.2f} M | "
            f"{r['max_rss_mib']:,.0f} MiB | {r['tree_peak_mib']:,.0f} MiB |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
