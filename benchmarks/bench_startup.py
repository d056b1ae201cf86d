"""Start-up of ``packprep pack``: from launching the process to the first record read for encoding.

    python benchmarks/bench_startup.py                      # the llama3 and qwen2.5 fixtures, 9 runs each
    python benchmarks/bench_startup.py --tokenizer PATH --runs 15

Start-up is everything before ``Encoding.run`` reads the first record to encode: interpreter start,
imports, tokenizer load, chat-template compile, the tiktoken encoder build and its guard, output
checks, format detection. Each run is a fresh ``packprep pack`` process (``_child``) that stops
there. "cold": an empty PACKPREP_CACHE, so the tiktoken conversion is made and saved; "warm": the
cache a previous run left. The table gives medians over the runs (the minimum in brackets) of the
wall time, the process's CPU time, and its parts: imports (launch to ``packprep.cli`` imported,
interpreter start included), ``load_tokenizer`` and ``ChatEncoder`` (template + tiktoken build).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO.parent / "shared" / "fixtures" / "tokenizers"
RECORD = {"conversations": [{"from": "human", "value": "Hi there"}, {"from": "gpt", "value": "Hello! How can I help?"}]}


def child(argv: list[str]) -> None:
    """``packprep <argv>`` until the first record is read for encoding; prints one BENCH_STARTUP line."""
    launch = float(os.environ["BENCH_LAUNCH"])
    import packprep.cli  # first, as in the real command: it sets the environment before numpy loads
    import packprep.encode as encode
    import packprep.tokenization as tokenize

    parts = {"load_tokenizer": 0.0, "ChatEncoder": 0.0}

    def timed(function, part):
        def wrapped(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                parts[part] += time.perf_counter() - start
        return wrapped

    encode.load_tokenizer = timed(encode.load_tokenizer, "load_tokenizer")  # AttributeError: update the timers
    tokenize.ChatEncoder.__init__ = timed(tokenize.ChatEncoder.__init__, "ChatEncoder")

    class Started(BaseException):
        pass

    def run(*args, **kwargs):
        cpu = os.times()
        print("BENCH_STARTUP " + json.dumps({"wall": time.time() - launch, "cpu": cpu.user + cpu.system,
                                             "imports": imported, **parts}), flush=True)
        raise Started

    encode.Encoding.run = run
    from packprep.cli import main

    imported = time.time() - launch
    try:
        main(args=argv, standalone_mode=False)
    except Started:
        return
    raise RuntimeError("packprep pack finished without reading a record through Encoding.run: update the timer")


def measure(tokenizer: str, cold: bool, runs: int, workdir: Path) -> list[dict]:
    data = workdir / "chats.jsonl"
    data.write_text(json.dumps(RECORD) + "\n")
    cache = workdir / "cache"
    command = [sys.executable, str(Path(__file__).resolve()), "_child", "pack", str(data), "-t", tokenizer,
               "-o", str(workdir / "out"), "--overwrite", "-q"]
    results = []
    for i in range(runs + (0 if cold else 1)):  # warm: one more run first, to fill the cache
        if cold or i == 0:
            shutil.rmtree(cache, ignore_errors=True)
        env = dict(os.environ, HF_HUB_OFFLINE="1", PACKPREP_CACHE=str(cache), BENCH_LAUNCH=repr(time.time()))
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        marker = next((line for line in done.stdout.splitlines() if line.startswith("BENCH_STARTUP ")), None)
        if marker is None:
            raise RuntimeError(f"start-up run failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
        if cold or i > 0:
            results.append(json.loads(marker[len("BENCH_STARTUP "):]))
    return results


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_child":
        child(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", action="append", help="folder (repeatable) [the llama3 and qwen2.5 fixtures]")
    parser.add_argument("--runs", type=int, default=9)
    args = parser.parse_args()
    tokenizers = args.tokenizer or [str(FIXTURES / "llama3"), str(FIXTURES / "qwen2.5")]
    print("| tokenizer | cache | start-up (wall) | CPU | imports | load_tokenizer | ChatEncoder |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for tokenizer in tokenizers:
        for cold in (False, True):
            with tempfile.TemporaryDirectory(prefix="packprep-startup-") as workdir:
                results = measure(tokenizer, cold, args.runs, Path(workdir))

            def cell(key):
                values = [r[key] for r in results]
                return f"{statistics.median(values):.2f} s ({min(values):.2f})"

            print(f"| {Path(tokenizer).name} | {'cold' if cold else 'warm'} | {cell('wall')} | {cell('cpu')} | "
                  f"{cell('imports')} | {cell('load_tokenizer')} | {cell('ChatEncoder')} |", flush=True)


if __name__ == "__main__":
    main()
