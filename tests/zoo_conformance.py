"""Conformance of packprep's shards to the token-exact turn definition (tests/zoo_reference.py).

For one template, every shape's records go into one JSONL file, ``packprep.pack`` (the public API,
default options unless given) packs it, and the shards are read back with pyarrow. Each reference turn
of each record is then:

- ``trained``: a sequence of that record (``source_index``) starts with exactly context + target, with
  labels -100 on the context and equal to the target ids on the target (labels are unshifted);
- ``counted``: not trained, and the template itself refuses the turn (it raises on the prefix, or its
  rendering does not extend the context) while packprep rejected the record or counted the turn;
- ``policy``: a turn of a record with tool calls where the template renders no tool calls (what is
  done with them is a policy: left out of the totals, as the definition says);
- ``missed``: anything else, with the record's rejection code when it was rejected.

Per record: ``rejected_renderable`` (rejected though the template renders the whole conversation);
per reasoning trace: whether its text is in trained tokens, against the manifest's counts; per turn with
reasoning: ``reasoning_not_written`` where the reference's target holds none of it (the template writes
no reasoning in that turn, though it may in others: Gemma 4 and Command R7B only beside tool calls,
Kimi-K2-Thinking only after the first answer; or ``--reasoning drop``), the reason a lost trace may have.
"""

from __future__ import annotations

import json
import re
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

import pyarrow.parquet as pq

from .zoo_reference import as_messages, fit, probe, reasoning_of, reference_turns, renderer
from .zoo_shapes import shape_records

TURN_COUNTS = ("turns_not_located", "turns_out_of_context")


def pack_and_read(folder: str, records: list[dict], work: Path, **settings):
    """(manifest, {source_index: [(ids, labels)]}, {index: reject code}) of packing ``records``."""
    import packprep

    path = work / "input.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    settings.setdefault("max_len", 32768)
    try:
        manifest = packprep.pack(str(path), str(work / "out"), tokenizer=folder, num_proc=1, overwrite=True,
                                 **settings)
    except Exception as exc:  # the run refused as a whole (every record rejected, exit 3): each record refused
        found = re.search(r"were rejected \((\w+)", str(exc))  # "all N records were rejected (CODE n: ..."
        code = f"all_rejected:{found.group(1)}" if found else f"run_refused ({type(exc).__name__}: {str(exc)[:160]})"
        empty = {"counts": {"normalized": {}, "rejected_by_reason": {code: len(records)}}}
        return empty, {}, dict.fromkeys(range(len(records)), code)
    sequences = defaultdict(list)
    for shard in manifest["shards"]:
        table = pq.read_table(work / "out" / shard["path"]).to_pylist()
        for row in table:
            start = 0
            for length, source in zip(row["seq_lens"], row["source_index"]):
                sequences[source].append((row["input_ids"][start:start + length], row["labels"][start:start + length]))
                start += length
    rejects = {}
    rejects_file = work / "out" / "rejects.jsonl"
    if rejects_file.is_file():
        for line in rejects_file.read_text(encoding="utf-8").splitlines():
            entry = json.loads(line)
            rejects[entry["index"]] = entry["code"]
    return manifest, sequences, rejects


def trained_in_context(sequences, context, target) -> bool:
    """A sequence starts with context + target and trains exactly the target's ids. Its labels on the
    context are -100 or earlier turns' own ids (a multi-turn sequence trains those too; labels are
    unshifted, so a trained label equals the id at its position and the turn's conditioning is the same)."""
    n, wanted = len(context), context + target
    return any(ids[: len(wanted)] == wanted and all(x in (-100, i) for x, i in zip(labels[:n], ids))
               and labels[n: len(wanted)] == target for ids, labels in sequences)


def _squeeze(text: str) -> str:
    return "".join(text.replace("▁", " ").split())


def trained_text(tok, sequences) -> str:
    """The record's trained tokens decoded run by run, white space removed (for finding reasoning)."""
    runs = []
    for ids, labels in sequences:
        run = []
        for label in labels + [-100]:
            if label != -100:
                run.append(label)
            elif run:
                runs.append(tok.decode(run))
                run = []
    return _squeeze("\n".join(runs))


def check_template(name: str, folder: str, shapes: list[str], count: int = 6, **settings) -> dict:
    """The conformance of template ``name`` (tokenizer folder ``folder``) on ``shapes``: per-shape tallies."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    render = renderer(tok)
    pr = probe(render)
    records, owners = [], []
    for shape in shapes:
        for record in shape_records(shape, count):
            records.append(record)
            owners.append(shape)
    with tempfile.TemporaryDirectory(prefix=f"zoo-{name}-") as work:
        manifest, sequences, rejects = pack_and_read(folder, records, Path(work), **settings)
    result = {"template": name, "probe": vars(pr), "shapes": {}, "examples": [], "refused": next(
                  (c for c in rejects.values() if c.startswith(("run_refused", "all_rejected"))), None),
              "counts": {k: manifest["counts"].get(k) for k in TURN_COUNTS},
              "normalized": manifest["counts"]["normalized"], "rejected_by_reason": manifest["counts"]["rejected_by_reason"]}
    policy = settings.get("reasoning", "inline")
    for index, (record, shape) in enumerate(zip(records, owners)):
        tally = result["shapes"].setdefault(shape, Counter())
        _check_record(tok, render, pr, record, index, sequences.get(index, []), rejects.get(index), policy, tally,
                      result["examples"], shape)
    result["shapes"] = {s: dict(t) for s, t in result["shapes"].items()}
    return result


def _check_record(tok, render, pr, record, index, sequences, rejected, policy, tally, examples, shape):
    messages, tools = as_messages(record)
    messages = fit(messages, pr)
    tally["records"] += 1
    rejected = rejected and rejected.split(" (")[0]
    try:
        render(messages, False, tools)
        renderable = True
    except Exception:
        renderable = False
    if rejected:
        tally[f"rejected:{rejected}"] += 1
        if renderable:
            tally["rejected_renderable"] += 1
    uses_tools = any(m.get("tool_calls") for m in messages)
    for turn in reference_turns(tok, render, messages, tools, pr, policy):
        if uses_tools and pr.args == "none":
            tally["turns_policy"] += 1
            continue
        if turn.reason:
            tally["turns_unrenderable"] += 1
            tally["unrenderable_counted" if rejected else "unrenderable_packed"] += 1
            continue
        tally["turns"] += 1
        reasoning = reasoning_of(messages[turn.index])
        if reasoning and not rejected and _squeeze(reasoning) not in _squeeze(turn.target_text):
            tally["reasoning_not_written"] += 1  # the template writes none in this turn (or --reasoning drop)
        ok = trained_in_context(sequences, turn.context, turn.target) or (
            turn.bare is not None and trained_in_context(sequences, turn.context, turn.bare))
        if ok:
            tally["trained"] += 1
            continue
        why = rejected or _why(tok, sequences, turn)
        tally["missed"] += 1
        tally[f"missed:{why}"] += 1
        if len(examples) < 60 and not any(e["shape"] == shape and e["why"] == why for e in examples):
            examples.append(_example(tok, sequences, turn, shape, index, why))
    traces = [reasoning_of(m) for m in as_messages(record)[0] if m["role"] == "assistant"]
    traces = [t for t in traces if t]
    if traces and not rejected:
        text = trained_text(tok, sequences)
        tally["reasoning_traces"] += len(traces)
        tally["reasoning_lost"] += sum(_squeeze(t) not in text for t in traces)


def _why(tok, sequences, turn) -> str:
    """Why a renderable turn is not trained in its context, as far as the shards tell."""
    n = len(turn.context)
    starts = [(ids, labels) for ids, labels in sequences if ids[:n] == turn.context]
    if not sequences:
        return "no_sequence"
    if not starts:
        best = max(sequences, key=lambda s: _common(s[0], turn.context))[0]
        at = _common(best, turn.context)
        if at >= n - 2 and best[at: at + 3] != turn.context[at: at + 3]:
            return "context_end_merged_with_target"  # the joint tokenization crossed the boundary
        if "think>" in tok.decode(best[at: at + 8]) and "think>" not in tok.decode(turn.context[at: at + 8]):
            return "reasoning_in_history"  # an earlier turn's reasoning is written where the template has none
        return "context_differs"
    ids, labels = starts[0]
    if ids[n: n + len(turn.target)] != turn.target:
        return "target_ids_differ"
    return "labels_differ"


def _example(tok, sequences, turn, shape, index, why) -> dict:
    n = len(turn.context)
    best = max(sequences, key=lambda s: _common(s[0], turn.context + turn.target), default=([], []))
    at = _common(best[0], turn.context + turn.target)
    return {"shape": shape, "record": index, "message": turn.index, "why": why,
            "context_tail": tok.decode(turn.context[-12:]), "target_text": turn.target_text[:200],
            "expected_ids": (turn.context + turn.target)[max(at - 3, 0): at + 6],
            "got_ids": best[0][max(at - 3, 0): at + 6], "got_labels": best[1][max(at - 3, 0): at + 6],
            "diverges_at": at - n, "expected_text": tok.decode((turn.context + turn.target)[max(at - 3, 0): at + 6]),
            "got_text": tok.decode(best[0][max(at - 3, 0): at + 6])}


def _common(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
