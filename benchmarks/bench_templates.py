"""Pack time per output token for each chat template under each --turn-context, before and after a change.

    python benchmarks/bench_templates.py                         # 2 cores, baseline = git 430b3ba
    python benchmarks/bench_templates.py --baseline-ref c373f0a --families qwen3 --long 0
    python benchmarks/bench_templates.py --num-proc 16 --n 40000 --baseline DIR --fixtures DIR --json OUT

Two data sets, written once: ``short``, ``bench_scale.generate``'s synthetic ShareGPT conversations
(1-8 exchanges, mean 2; seed 1), and ``long``, groups of twelve of them joined into one conversation
(about 24 exchanges: long chats and agent traces), packed at --max-len 4096 and 32768. Each template's tokenizer folder is built from
the fixture vocabularies (tests/template_folders.py); Llama-3 (the fixture) is the reference row.

Every repetition runs the baseline code and this tree's, in alternating order, each in a process of
its own that packs every (data set, template, --turn-context) with ``packprep.pack(..., num_proc=N)``
and times each call (tokenizer load to manifest: all of pack's work but interpreter start-up). The
shards of the two codes are compared byte for byte. The table gives medians: seconds, µs per
output token, after/before, and each template's µs per token over Llama-3's in the same code and
repetition set, and which renderer ran (one-pass or the per-prefix reference). ``--baseline DIR``: a folder holding the baseline's
``packprep/`` (on a machine without the git history); else ``--baseline-ref`` is taken from git.
Templates in ``--exact-only`` are packed under ``exact`` alone: on this data they rewrite no turn, so
every --turn-context packs the same sequences.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FAMILIES = ["qwen3", "qwq", "deepseek-r1-distill-qwen", "phi-3.5-mini", "mistral-v3", "llama-3.1", "llama-3.2"]
CONTEXTS = ["exact", "intact", "rendered"]
EXACT_ONLY = ["phi-3.5-mini", "mistral-v3", "llama-3.1", "llama-3.2"]  # no turn rewritten on this data


def _write_data(folder: Path, n: int, n_long: int) -> dict[str, Path]:
    sys.path.insert(0, str(REPO))
    from benchmarks.bench_scale import generate

    short = folder / "short.jsonl"
    generate(short, n, seed=1)
    records = [json.loads(line) for line in short.open(encoding="utf-8")]
    long = folder / "long.jsonl"
    with long.open("w", encoding="utf-8") as handle:
        for i in range(n_long):
            group = [records[(i * 12 + j) % len(records)] for j in range(12)]
            turns = [t for r in group for t in r["conversations"] if t["from"] != "system"]
            handle.write(json.dumps({"conversations": turns}, ensure_ascii=False) + "\n")
    return {"short": short, "long": long}


def _folders(folder: Path, fixtures: Path, families: list[str]) -> dict[str, str]:
    import types

    sys.path.insert(0, str(REPO))
    if "tests.conftest" not in sys.modules:  # what template_folders needs of it, without pytest (a bare host)
        conftest = types.ModuleType("tests.conftest")
        conftest.TOKENIZERS = fixtures
        sys.modules["tests.conftest"] = conftest
    import tests.template_folders as template_folders

    template_folders.TOKENIZERS = fixtures
    built = {"llama3 (fixture)": str(fixtures / "llama3")}
    for name in families:
        built[name] = str(template_folders.build_folder(name, folder / "tok" / name))
    return built


def _baseline(folder: Path, args) -> Path:
    if args.baseline:
        return Path(args.baseline).resolve()
    out = folder / "baseline"
    out.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", args.baseline_ref, "packprep"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    return out


def _worker(spec: dict) -> None:
    """In a process whose packprep is the code under test: pack every case, print one JSON line each."""
    import warnings

    import packprep

    warnings.simplefilter("ignore")
    first = spec["cases"][0]  # once untimed: what the first pack of a process also pays (caches, imports)
    packprep.pack(first["data"], str(Path(spec["out"]) / "warm-up"), first["tokenizer"], max_len=first["max_len"],
                  num_proc=spec["num_proc"], overwrite=True)
    for case in spec["cases"]:
        out = Path(spec["out"]) / case["key"].replace("/", "_").replace(" ", "_")
        start = time.perf_counter()
        try:
            manifest = packprep.pack(case["data"], str(out), case["tokenizer"], max_len=case["max_len"],
                                     num_proc=spec["num_proc"], turn_context=case["turn_context"], overwrite=True)
        except Exception as exc:  # nothing to pack (every record rejected), say: a row that says so
            print(json.dumps({"key": case["key"], "error": f"{type(exc).__name__}: {str(exc)[:120]}"}), flush=True)
            continue
        seconds = time.perf_counter() - start
        digest = hashlib.sha256()
        for path in sorted(out.rglob("*.parquet")):
            digest.update(path.read_bytes())
        print(json.dumps({"key": case["key"], "seconds": seconds, "tokens": manifest["tokens"]["total"],
                          "records": manifest["counts"]["records"], "shards": digest.hexdigest(),
                          "rendering": manifest["tokenizer"].get("rendering")}), flush=True)


def _run(code: Path, spec: dict) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(code), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, __file__, "_worker", json.dumps(spec)], env=env, capture_output=True,
                          text=True)
    if done.returncode:
        sys.exit(f"the benchmark's worker failed:\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def _table(results: dict, keys: list[str]) -> list[str]:
    lines = ["| data | template | --turn-context | before s | after s | after/before | tokens | "
             "µs/token before | µs/token after | ÷ Llama-3 before | ÷ Llama-3 after | rendering (after) |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]

    def per_token(version, key):
        runs = results[version][key]
        return statistics.median(r["seconds"] / r["tokens"] * 1e6 for r in runs)

    for key in keys:
        data, template, context = key.split("/")
        failed = [r["error"] for version in ("before", "after") for r in results[version][key] if "error" in r]
        if failed:
            lines.append(f"| {data} | {template} | {context} | {failed[0]} |||||||||")
            continue
        reference = f"{data}/llama3 (fixture)/{context}" if f"{data}/llama3 (fixture)/{context}" in keys else \
            f"{data}/llama3 (fixture)/exact"
        before, after = results["before"][key], results["after"][key]
        seconds = [statistics.median(r["seconds"] for r in runs) for runs in (before, after)]
        lines.append(
            f"| {data} | {template} | {context} | {seconds[0]:.2f} | {seconds[1]:.2f} | {seconds[1] / seconds[0]:.2f} | "
            f"{after[-1]['tokens']:,} | {per_token('before', key):.3f} | {per_token('after', key):.3f} | "
            f"{per_token('before', key) / per_token('before', reference):.2f} | "
            f"{per_token('after', key) / per_token('after', reference):.2f} | "
            f"{after[-1]['rendering']} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=1500, help="short conversations")
    parser.add_argument("--long", type=int, default=60, help="long conversations (12 short ones joined); 0: none")
    parser.add_argument("--num-proc", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--baseline", help="a folder holding the baseline's packprep/")
    parser.add_argument("--baseline-ref", default="430b3ba", help="else this git commit of the repo")
    parser.add_argument("--fixtures", default=str(REPO.parent / "shared" / "fixtures" / "tokenizers"),
                        help="the fixture tokenizer folders (llama3, qwen2.5, llama2, mistral-7b-v0.1)")
    parser.add_argument("--families", nargs="*", default=FAMILIES)
    parser.add_argument("--exact-only", nargs="*", default=EXACT_ONLY,
                        help="templates packed under --turn-context exact only (where no turn is rewritten, "
                             "every policy packs the same)")
    parser.add_argument("--long-families", nargs="*", help="templates packed on the long data (default: all)")
    parser.add_argument("--json", help="write every run here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-templates-") as tmp:
        folder = Path(tmp)
        data = _write_data(folder, args.n, args.long)
        tokenizers = _folders(folder, Path(args.fixtures).resolve(), args.families)
        codes = {"before": _baseline(folder, args), "after": REPO}
        cases, keys = [], []
        for name, path in data.items():
            if name == "long" and not args.long:
                continue
            for template, tokenizer in tokenizers.items():
                if name == "long" and args.long_families is not None and not (
                        template.startswith("llama3") or template in args.long_families):
                    continue
                exact_only = template.startswith("llama3") or template in args.exact_only
                for context in (["exact"] if exact_only else CONTEXTS):
                    key = f"{name}/{template}/{context}"
                    keys.append(key)
                    cases.append({"key": key, "data": str(path), "tokenizer": tokenizer, "turn_context": context,
                                  "max_len": 4096 if name == "short" else 32768})
        results = {"before": {k: [] for k in keys}, "after": {k: [] for k in keys}}
        for rep in range(args.reps):
            for version in (["before", "after"] if rep % 2 == 0 else ["after", "before"]):
                spec = {"cases": cases, "out": str(folder / "out" / version), "num_proc": args.num_proc}
                for run in _run(codes[version], spec):
                    results[version][run["key"]].append(run)
                print(f"rep {rep + 1}/{args.reps} {version} done", file=sys.stderr, flush=True)
        differ = [k for k in keys if results["before"][k][-1].get("shards") != results["after"][k][-1].get("shards")]
        print(f"{args.n:,} short and {args.long:,} long conversations, --num-proc {args.num_proc}, {args.reps} "
              f"repetitions (medians); before = {codes['before']}; shards differ: {differ or 'none'}")
        print("\n".join(_table(results, keys)))
        if args.json:
            meta = {"n": args.n, "long": args.long, "num_proc": args.num_proc, "reps": args.reps,
                     "baseline": args.baseline or args.baseline_ref, "cpus": os.cpu_count(), "shards_differ": differ}
            Path(args.json).write_text(json.dumps({"meta": meta, "table": _table(results, keys), "runs": results},
                                                  indent=1))


if __name__ == "__main__":
    if sys.argv[1:2] == ["_worker"]:
        _worker(json.loads(sys.argv[2]))
    else:
        main()
