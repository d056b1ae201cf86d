"""Tokenize-stage benchmark: packprep (HF and tiktoken backends) vs the raw HF tokenizer vs TRL.

    HF_HUB_OFFLINE=1 /work/venv-bench/bin/python benchmarks/bench_tokenize.py [--n 5000] [--repeat 3]

Data: every file of ../shared/fixtures/conversations/, normalized by packprep, cycled to ``--n``
conversations; tokenizers llama3, qwen2.5 (byte-level BPE), mistral-7b-v0.1 and llama2
(SentencePiece BPE) from ../shared/fixtures/tokenizers/. For each
tokenizer, every method runs once per repeat, round-robin (so machine noise hits all alike), and the
table gives the median. tokens/s is always the *same* token count -- the tokens of packprep's
rendering of the conversations (one tokenizer call, no truncation) -- divided by the method's time.

Methods:
  render            packprep renders the chat template (once per conversation, finding every turn)
  hf raw            tokenizer.backend_tokenizer.encode_batch(all rendered texts), Rayon threads
  tiktoken raw      tiktoken Encoding.encode_batch(all rendered texts, num_threads=cores)
  stage hf|tiktoken ChatEncoder.encode in batches of 256: render + tokenize + labels, one process
  TRL               SFTTrainer._prepare_dataset (what SFTTrainer runs on its train set): ChatML,
                    per-example apply_chat_template(tokenize=True), labels, BFD packing; packing=True,
                    packing_strategy="bfd", max_length=4096, dataset_num_proc=2, starting from an
                    in-memory datasets.Dataset (no file reading)
  pack hf|tiktoken  packprep.pack end to end: read the JSONL, normalize, tokenize, pack (bfd,
                    4096), write parquet shards, verify; --num-proc 1 and 2. Includes loading the
                    tokenizer (and, with 2 processes, loading it again in each worker)

TRL needs ``trl`` (with torch==2.13.0) in the running interpreter; without it that row is skipped.
It runs for llama3 and qwen2.5 only (``--trl-tokenizers``): TRL stops at the first conversation a
template refuses, and the Mistral and Llama-2 templates refuse the fixtures' system turns.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import packprep  # noqa: E402
from packprep.normalize import Rejected, detect_format, normalize  # noqa: E402
from packprep.read import read_records, resolve_inputs  # noqa: E402
from packprep.tokenization import ChatEncoder, load_tokenizer  # noqa: E402

FIXTURES = ROOT.parent / "shared" / "fixtures"
MAX_LEN = 4096


def load_conversations(n: int) -> list:
    convs = []
    for path in sorted((FIXTURES / "conversations").glob("*.json*")):
        for record in read_records(resolve_inputs([str(path)])[0]):
            try:
                convs.append(normalize(record.data, detect_format(record.data)))
            except Rejected:
                pass
    return [convs[i % len(convs)] for i in range(n)]


def render_all(encoder, convs) -> list:
    rendered = []
    for conversation in convs:
        try:
            rendered.append(encoder.render(conversation))
        except Rejected:
            pass
    return rendered


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def make_trl(tok, convs, tmp):
    try:
        import datasets
        from trl import SFTConfig, SFTTrainer
    except ImportError as exc:
        print(f"TRL skipped: {exc}")
        return None
    datasets.disable_caching()
    datasets.disable_progress_bars()
    rows = [{"messages": c.messages, "tools": json.dumps(c.tools) if c.tools else None} for c in convs]
    dataset = datasets.Dataset.from_list(rows)
    args = SFTConfig(output_dir=str(tmp / "trl"), packing=True, packing_strategy="bfd", max_length=MAX_LEN,
                     dataset_num_proc=2, report_to=[], use_cpu=True, bf16=False)
    trainer = types.SimpleNamespace(_tokenizer=tok, chat_template=None, completion_only_loss=None)

    def run():
        SFTTrainer._prepare_dataset(trainer, dataset, tok, args, True, None, "train")

    return run


def bench(name: str, convs, repeat: int, tmp: Path, with_trl: bool) -> list[tuple]:
    tokenizer_path = str(FIXTURES / "tokenizers" / name)
    tok = load_tokenizer(tokenizer_path)
    hf_encoder = ChatEncoder(tok, backend="hf")
    tk_encoder = ChatEncoder(tok, backend="tiktoken")
    texts = [r.text for r in render_all(hf_encoder, convs)]
    tokens = sum(len(e.ids) for e in tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False))
    encoding = tk_encoder._fast.encoding
    threads = tk_encoder._fast.num_threads

    data = tmp / f"{name}.jsonl"
    with open(data, "w", encoding="utf-8") as handle:
        for c in convs:
            handle.write(json.dumps({"messages": c.messages, **({"tools": c.tools} if c.tools else {})},
                                    ensure_ascii=False) + "\n")

    def stage(encoder):
        return lambda: [encoder.encode(convs[i : i + 256]) for i in range(0, len(convs), 256)]

    def pack(backend, num_proc):
        return lambda: packprep.pack(str(data), str(tmp / "out"), tokenizer_path, overwrite=True, num_proc=num_proc,
                                     strategy="bfd", max_len=MAX_LEN, tokenizer_backend=backend)

    methods = {
        "render (packprep)": lambda: render_all(hf_encoder, convs),
        "hf raw encode_batch": lambda: tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False),
        f"tiktoken raw encode_batch ({threads} threads)": lambda: encoding.encode_batch(
            texts, allowed_special="all", num_threads=threads),
        "stage: ChatEncoder hf": stage(hf_encoder),
        "stage: ChatEncoder tiktoken": stage(tk_encoder),
    }
    trl = make_trl(tok, convs, tmp) if with_trl else None
    if trl is not None:
        methods["TRL SFT prepare (num_proc=2)"] = trl
    for backend in ("hf", "tiktoken"):
        for num_proc in (1, 2):
            methods[f"packprep pack {backend} num_proc={num_proc}"] = pack(backend, num_proc)

    times = {label: [] for label in methods}
    for r in range(repeat):
        for label, fn in methods.items():
            times[label].append(timed(fn))
            print(f"  {name} repeat {r + 1}/{repeat}  {label}: {times[label][-1]:.2f} s", flush=True)
    rows = []
    for label, values in times.items():
        rows.append((name, label, statistics.median(values), min(values), max(values), len(convs), tokens))
    return rows


def table(rows) -> str:
    out = ["| tokenizer | method | median s | min-max s | conv/s | tokens/s | vs TRL | vs hf raw |",
           "|---|---|---:|---:|---:|---:|---:|---:|"]
    for name in dict.fromkeys(r[0] for r in rows):
        group = [r for r in rows if r[0] == name]
        ref = {label: median for _, label, median, *_ in group}
        trl = next((v for k, v in ref.items() if k.startswith("TRL")), None)
        raw = ref["hf raw encode_batch"]
        for _, label, median, low, high, n, tokens in group:
            vs_trl = f"{trl / median:.2f}x" if trl else "-"
            out.append(f"| {name} | {label} | {median:.2f} | {low:.2f}-{high:.2f} | {n / median:,.0f} | "
                       f"{tokens / median / 1e6:.2f}M | {vs_trl} | {raw / median:.2f}x |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=5000, help="conversations (the fixtures, cycled)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--tokenizers", nargs="+", default=["llama3", "qwen2.5", "mistral-7b-v0.1", "llama2"])
    parser.add_argument("--trl-tokenizers", nargs="*", default=["llama3", "qwen2.5"])
    args = parser.parse_args()
    convs = load_conversations(args.n)
    print(f"{len(convs)} conversations; {os.cpu_count()} cores ({len(os.sched_getaffinity(0))} usable); "
          f"python {platform.python_version()}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.tokenizers:
            rows += bench(name, convs, args.repeat, Path(tmp), name in args.trl_tokenizers)
    tokens = {r[0]: r[6] for r in rows}
    print()
    print("tokens (packprep rendering, untruncated): " + ", ".join(f"{k} {v:,}" for k, v in tokens.items()))
    print(table(rows))


if __name__ == "__main__":
    main()
