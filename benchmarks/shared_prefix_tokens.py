"""Tokens of --turn-context exact as flat rows, as shared-prefix rows, and of one rendering.

For each record: flat = the exact sequences' tokens (what flat exact rows hold); tree = one
shared-prefix row (packprep.prefix_tree); rendered = the whole rendering (the last exact sequence,
what --turn-context rendered trains on); bound = one rendering plus each earlier sequence's trained
tokens and a token a branch. Inputs: the medical ShareGPT fixture file, and a synthetic agentic set
of 16-40 assistant turns a conversation with reasoning and tool calls (generated here, seeded).

    python benchmarks/shared_prefix_tokens.py --template qwen3 [--agentic 200] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from packprep.normalize import FieldNames, Rejected, detect_format, normalize  # noqa: E402
from packprep.template_fit import fit_to_template  # noqa: E402
from packprep.prefix_tree import bound, build_tree, check_tree  # noqa: E402
from packprep.tokenization import ChatEncoder, Encoded, load_tokenizer  # noqa: E402

MEDICAL = ROOT.parent / "shared" / "fixtures" / "conversations" / "medicalgpt_sharegpt_zh_1K_format.jsonl"
WORDS = ("the file holds a list of values that we parse then sort and check against the expected output for each "
         "case while the test runner reports errors in the log so we search the code for the function and read "
         "its arguments before we change the loop or add a guard").split()
TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name} tool", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}}}} for name in ("search", "read_file", "run_python")]


def _text(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def agentic(count: int, seed: int = 1) -> list[dict]:
    """Agent traces: a task, then 16-40 assistant turns, each with reasoning, most calling a tool."""
    rng = random.Random(seed)
    records = []
    for n in range(count):
        messages = [{"role": "system", "content": "You are a coding agent. " + _text(rng, 10, 30)},
                    {"role": "user", "content": _text(rng, 20, 60)}]
        turns = rng.randint(16, 40)
        for turn in range(turns):
            reasoning = _text(rng, 20, 120)
            if turn < turns - 1 and rng.random() < 0.8:
                name = rng.choice(TOOLS)["function"]["name"]
                call = {"id": f"call_{n}_{turn}", "type": "function",
                        "function": {"name": name, "arguments": {"query": _text(rng, 3, 12)}}}
                messages += [{"role": "assistant", "content": "", "reasoning_content": reasoning, "tool_calls": [call]},
                             {"role": "tool", "tool_call_id": call["id"], "content": _text(rng, 30, 200)}]
            else:
                messages.append({"role": "assistant", "content": _text(rng, 10, 80), "reasoning_content": reasoning})
                if turn < turns - 1:
                    messages.append({"role": "user", "content": _text(rng, 5, 30)})
        records.append({"tools": TOOLS, "messages": messages})
    return records


def encoded_records(encoder: ChatEncoder, records: list[dict]) -> list[Encoded]:
    """The records fitted to the encoder's template as pack fits them, and encoded; rejected ones left out."""
    policy = fit_to_template(encoder.template.render)
    conversations = []
    for record in records:
        try:
            conversations.append(normalize(record, detect_format(record), FieldNames(), policy))
        except Rejected:
            pass
    return [encoded for encoded in encoder.encode(conversations) if isinstance(encoded, Encoded)]


def measure(folder: str, records: list[dict]) -> dict:
    encoder = ChatEncoder(load_tokenizer(folder), turn_context="exact")
    totals = dict(records=0, flat=0, tree=0, rendered=0, bound=0, branches=0, sequences=0, tree_seconds=0.0)
    for encoded in encoded_records(encoder, records):
        sequences = encoded.sequences
        started = time.perf_counter()
        tree = build_tree(sequences)
        totals["tree_seconds"] += time.perf_counter() - started
        assert check_tree(tree) is None
        totals["records"] += 1
        totals["sequences"] += len(sequences)
        totals["flat"] += sum(len(ids) for ids, _ in sequences)
        totals["tree"] += len(tree)
        totals["rendered"] += len(sequences[-1][0])
        totals["bound"] += bound(sequences)
        totals["branches"] += tree.branches
    totals["tree_seconds"] = round(totals["tree_seconds"], 3)
    for key in ("flat", "tree", "bound"):
        totals[f"{key}_x"] = round(totals[key] / max(totals["rendered"], 1), 2)
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--template", default="qwen3", help="a family of tests/template_folders.py")
    parser.add_argument("--agentic", type=int, default=200, help="synthetic agent traces")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    from tests.template_folders import build_folder

    with tempfile.TemporaryDirectory() as tmp:
        folder = str(build_folder(args.template, Path(tmp) / args.template))
        medical = [json.loads(line) for line in MEDICAL.read_text(encoding="utf-8").splitlines() if line.strip()]
        results = {"template": args.template,
                   "medical": measure(folder, medical),
                   "agentic": measure(folder, agentic(args.agentic))}
    print(f"{'set':<10}{'records':>8}{'flat':>12}{'tree':>12}{'rendered':>12}{'bound':>12}   flat/tree/bound x rendered")
    for name in ("medical", "agentic"):
        r = results[name]
        print(f"{name:<10}{r['records']:>8}{r['flat']:>12,}{r['tree']:>12,}{r['rendered']:>12,}{r['bound']:>12,}   "
              f"{r['flat_x']}x / {r['tree_x']}x / {r['bound_x']}x")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
