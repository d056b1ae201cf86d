"""``verify --retokenize N``: check the content of a packed folder against its inputs, independently.

A random sample of N packed sequences is rebuilt from the input records the manifest names, with
nothing the writer's fast paths use: the tokenizer loaded by transformers itself (no tiktoken, no
folder loader), the chat template rendered by transformers' own renderer (what
``apply_chat_template`` calls), every prefix on its own (the label definition in render.py, under
the manifest's ``turn_context``; no one-pass accelerator), and every trained turn's context
tokenized on its own by that tokenizer, its target after it (turn_ids.py), never a whole
sequence's tokenization cut at character offsets. Each sampled sequence's ``input_ids`` must be a slice of one of its record's
re-made sequences (the whole of it, its first ``max_len`` tokens, or a piece of it) and its
labels the same slice of the re-made labels, with ``-100`` at the sequence's first token. In a
shared-prefix folder each packed sequence is a record's prefix tree: it is one of the trees the
record's re-made sequences make in rows of ``max_len`` (prefix_tree.build_trees, the sequences the
encoder keeps, in its order: one tree, or split at branch points), ids, labels, positions and
descendants alike, or the first ``max_len`` tokens of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import numpy as np

from .layout import IGNORE_INDEX, TREE_COLUMN, ShardReader
from .normalize import FieldNames, Policy, Rejected, detect_format, normalize
from .prefix_tree import build_trees, truncate_tree
from .template_fit import fit_to_template
from .parts import stream_records
from .errors import ConfigError
from .read import STDIN, file_sha256, resolve_inputs, spool_stdin
from .control_text import ControlText, render_record
from .encode import chosen_record
from .render import ChatTemplate, Rendered
from .template_inputs import DEFAULT_DATE, prepare_template
from .tokenization import load_tokenizer, tokenizer_files_sha256
from .turn_ids import exact_sequences


@dataclass
class Sampled:
    """One packed sequence of the shards."""

    shard: str
    row: int  # within its shard
    start: int  # first token within its row
    length: int
    source_index: int
    input_ids: np.ndarray | None = None
    labels: np.ndarray | None = None
    tree: tuple[np.ndarray, np.ndarray] | None = None  # a shared-prefix row's (position_ids, descendants)


def retokenize_check(folder: Path, manifest: dict, n: int, seed: int = 0) -> tuple[int, list[tuple[str, str, int | None]]]:
    """Check ``n`` randomly chosen sequences; return (sequences checked, [(shard, message, row)] failures)."""
    sample = _sample(folder, manifest, n, seed)
    _read_tokens(folder, manifest, sample)
    records = _records(manifest, sorted({s.source_index for s in sample}))
    config = manifest["config"]
    tokenizer = _packed_tokenizer(manifest["tokenizer"])
    variables = prepare_template(tokenizer, config.get("chat_template"), config.get("date", DEFAULT_DATE),
                                 config.get("template_args"))
    template = ChatTemplate(tokenizer, transformers=True, variables=variables)
    fields = FieldNames(config.get("messages_field"), config.get("text_field", "text"))
    policies = (config.get("leading_assistant", "drop"), config.get("consecutive", "merge"))
    policy = fit_to_template(template.render, *policies, config.get("system", "auto"), config.get("reasoning", "inline"),
                             config.get("tool_calls", "text")) \
        if template.source else Policy(*policies)  # fitted as pack fits it, here through transformers' renderer
    # text spelling a control token: found as pack finds it, tokenized here by transformers (split_special_tokens)
    control = ControlText(tokenizer) if config.get("content_special_tokens", "special") == "text" else None
    remade: dict[int, list[tuple[np.ndarray, np.ndarray]] | str] = {}
    settings = (config["train_on"], config.get("turn_context", "intact"), control,  # before turn_context: intact
                config.get("preference") == "chosen")
    failures = []
    for seq in sample:
        if seq.source_index not in remade:
            remade[seq.source_index] = _remake(records[seq.source_index], fields, policy, config.get("format"), template,
                                               tokenizer, *settings)
        remade_here = remade[seq.source_index]
        tree = seq.tree is not None and not isinstance(remade_here, str)
        problem = _compare_tree(seq, remade_here, int(config["max_len"])) if tree else _compare(seq, remade_here)
        if problem:
            where = records[seq.source_index][0]
            failures.append((seq.shard, f"sequence of {where}: {problem}", seq.row))
    return len(sample), failures


def _packed_tokenizer(said: dict):
    """The tokenizer the folder was packed with, loaded by transformers; a folder whose files changed
    since is another tokenizer, whose tokens say nothing about the output."""
    name = said["name_or_path"]
    tokenizer = load_tokenizer(name, transformers=True)
    if said.get("kind") == "folder" and said.get("files_sha256") not in (None, tokenizer_files_sha256(name)):
        raise ConfigError(f"--retokenize: the tokenizer {name} changed since the folder was packed (its files' "
                          f"sha256 differs); {AS_PACKED}")
    return tokenizer


def _sample(folder: Path, manifest: dict, n: int, seed: int) -> list[Sampled]:
    """``n`` sequences chosen uniformly (all if there are fewer), in shard order."""
    import pyarrow.compute as pc

    per_shard = []
    for shard in manifest["shards"]:
        table = ShardReader(folder / shard["path"], manifest.get("layout")).read(["seq_lens", "source_index"])
        lens = table.column("seq_lens")
        counts = pc.list_value_length(lens).to_numpy(zero_copy_only=False).astype(np.int64)
        flat = pc.list_flatten(lens).to_numpy(zero_copy_only=False).astype(np.int64)
        sources = pc.list_flatten(table.column("source_index")).to_numpy(zero_copy_only=False).astype(np.int64)
        rows = np.repeat(np.arange(len(counts)), counts)
        row_first = np.concatenate([[0], np.cumsum(counts)])[rows]  # first sequence of each sequence's row
        ends = np.cumsum(flat)
        starts = ends - flat - np.concatenate([[0], ends])[row_first]
        per_shard.append((shard["path"], rows, starts, flat, sources))
    total = sum(len(p[1]) for p in per_shard)
    chosen = np.sort(np.random.default_rng(seed).choice(total, size=min(n, total), replace=False))
    sample, first = [], 0
    for path, rows, starts, lens, sources in per_shard:
        for k in chosen[(chosen >= first) & (chosen < first + len(rows))] - first:
            sample.append(Sampled(path, int(rows[k]), int(starts[k]), int(lens[k]), int(sources[k])))
        first += len(rows)
    return sample


def _read_tokens(folder: Path, manifest: dict, sample: list[Sampled]) -> None:
    """Fill in each sampled sequence's input_ids and labels (and a shared-prefix row's tree columns)."""
    tree = bool(manifest["config"].get("shared_prefix"))
    columns = ["input_ids", "labels", *(["position_ids", TREE_COLUMN.name] if tree else [])]
    for path in dict.fromkeys(s.shard for s in sample):
        table = ShardReader(folder / path, manifest.get("layout")).read(columns)
        for seq in (s for s in sample if s.shard == path):
            span = slice(seq.start, seq.start + seq.length)
            seq.input_ids, seq.labels, *rest = [np.asarray(table.column(c)[seq.row].values.to_numpy(), np.int64)[span]
                                                for c in columns]
            seq.tree = tuple(rest) if tree else None


def _records(manifest: dict, wanted: list[int]) -> dict[int, tuple[str, object, str]]:
    """source_index -> (where, record data, format), or (where, None, why it cannot be read), from the
    inputs the manifest names."""
    found: dict[int, tuple[str, object, str]] = {}
    first = 0
    for entry in manifest["inputs"]:
        mine = {i - first: i for i in wanted if first <= i < first + entry["records"]}
        first += entry["records"]
        if not mine:
            continue
        path, records, why = entry["path"], {}, None
        stdin = entry.get("named") in STDIN  # its copy was removed when pack ended: read it again, here
        try:
            if stdin:
                path, why = _stdin_again(entry)
            if why is None and entry.get("sha256") and Path(path).is_file() and file_sha256(path) != entry["sha256"]:
                why = (f"standard input is not the data packed from it (sha256 differs); {STDIN_AGAIN}" if stdin
                       else f"{path} changed since it was packed (sha256 differs); {AS_PACKED}")
            elif why is None:
                (source,) = resolve_inputs([path])
                records = {k: r for k, r in enumerate(islice(stream_records(source), max(mine) + 1)) if k in mine}
        except Exception as exc:  # the input moved, or cannot be read from here
            why = f"cannot read {path} ({exc}); run verify where pack ran, or verify without --retokenize"
        if why:  # the inputs are not those packed: nothing is known about the output
            raise ConfigError(f"--retokenize: {why}")
        path = "standard input" if stdin else path
        for k, i in mine.items():
            record = records.get(k)
            where = f"{path}, line {record.line}" if record is not None and record.line else f"{path}, record {k}"
            found[i] = (where, None, "the record is missing") if record is None else (where, record.data, entry["format"])
    return found


AS_PACKED = ("it checks records against the inputs and the tokenizer as they were packed: give them "
             "back, or verify without --retokenize")


STDIN_AGAIN = "pipe the same data into verify (cat chats.jsonl | packprep verify DIR --retokenize N)"


def _stdin_again(entry: dict) -> tuple[str | None, str | None]:
    """The copy of standard input to rebuild records from, where verify's own standard input is piped
    data (else why not)."""
    import sys

    if sys.stdin is None or sys.stdin.isatty():
        return None, f"the input was read from standard input ('-'), which is not kept; {STDIN_AGAIN}"
    return spool_stdin(), None


def _remake(found, fields, policy, forced, template, tokenizer, train_on, turn_context, control,
            chosen: bool) -> list[tuple[np.ndarray, np.ndarray]] | str:
    """(ids, labels) of each of the record's sequences as the definition makes them, or why they cannot be made."""
    _, data, fmt = found
    if data is None:
        return fmt  # why it could not be read
    if chosen and isinstance(data, dict) and "chosen" in data:
        data = chosen_record(data)
    fmt = forced or detect_format(data, fields) or fmt.split("+")[0]  # told per record, as pack tells it
    try:
        conversation = normalize(data, fmt, fields, policy)
        rendered = render_record(template, conversation, train_on, turn_context, control)
    except Rejected as exc:
        return f"the record is rejected when rendered again ({exc})"
    return [seq for r in (*rendered.earlier, rendered) for seq in _sequences(r, tokenizer, turn_context)]


def _sequences(rendered: Rendered, tokenizer, turn_context: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """The rendered sequence's (ids, labels), every trained turn on its context tokenized alone
    (turn_ids.py, here on the tokenizer itself), unless the policy trains the one rendering as it
    is tokenized (``rendered``, ``train_on all``)."""
    if rendered.train_all or not rendered.spans or turn_context == "rendered":
        return [_labelled(rendered, tokenizer)]

    def encode(ranges):
        if rendered.markup is None:  # one call of the batch API: the same ids, the texts tokenized in parallel
            texts = [rendered.text[a:b] for a, b in ranges]
            return [np.asarray(ids, np.int64) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
        return [_labelled(Rendered(rendered.text[a:b], [], markup=[(x - a, y - a) for x, y in rendered.markup
                                                                   if a <= x and y <= b]), tokenizer)[0]
                for a, b in ranges]

    sequences, _, _ = exact_sequences(len(rendered.text), rendered.spans, encode, turn_context)
    # in the encoder's order (tokenization.ChatEncoder._tokenize), which a shared-prefix tree is built in
    return [(ids.astype(np.int64), labels.astype(np.int64)) for ids, labels in reversed(sequences)]


def _labelled(rendered: Rendered, tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """Tokenize with the tokenizer itself; a token is trained when its first character is in a trained span."""
    encoding = _markup_encoding(rendered, tokenizer) if rendered.markup is not None else \
        tokenizer(rendered.text, add_special_tokens=rendered.add_special_tokens, return_offsets_mapping=True)
    ids = np.asarray(encoding["input_ids"], np.int64)
    if rendered.train_all:
        eos = tokenizer.eos_token_id
        if rendered.add_special_tokens and eos is not None and (len(ids) == 0 or ids[-1] != eos):
            ids = np.append(ids, eos)
        return ids, ids.copy()
    starts = np.asarray([start for start, _ in encoding["offset_mapping"]], np.int64)
    trained = np.zeros(len(ids), bool)
    for first, last in rendered.spans:
        trained |= (starts >= first) & (starts < last)
    return ids, np.where(trained, ids, IGNORE_INDEX)


def _markup_encoding(rendered: Rendered, tokenizer) -> dict:
    """The text's ids and offsets with control ids at the template's markup only: each stretch between
    two markup tokens tokenized with ``split_special_tokens=True``."""
    text, ids, offsets, at = rendered.text, [], [], 0
    for start, end in [*rendered.markup, (len(rendered.text), None)]:
        if at < start:
            part = tokenizer(text[at:start], add_special_tokens=False, split_special_tokens=True,
                             return_offsets_mapping=True)
            ids += part["input_ids"]
            offsets += [(at + a, at + b) for a, b in part["offset_mapping"]]
        if end is not None:
            ids.append(tokenizer.convert_tokens_to_ids(text[start:end]))
            offsets.append((start, end))
            at = end
    tokenizer.backend_tokenizer.encode_special_tokens = False  # transformers leaves it on after split_special_tokens
    if rendered.add_special_tokens:
        wrapped = tokenizer.build_inputs_with_special_tokens([])
        ids, offsets = [*wrapped, *ids], [(0, 0)] * len(wrapped) + offsets
    return {"input_ids": ids, "offset_mapping": offsets}


def _compare(seq: Sampled, remade) -> str | None:
    """None if ``seq`` is a slice of one of the record's re-made sequences, else the first difference."""
    if isinstance(remade, str):
        return remade
    problems = [_compare_one(seq, ids, labels) for ids, labels in remade]
    if None in problems:
        return None
    return next((p for p in problems if "not a slice" not in p), problems[-1])  # the nearest miss


def _compare_tree(seq: Sampled, remade: list[tuple[np.ndarray, np.ndarray]], max_len: int) -> str | None:
    """None if the shared-prefix tree ``seq`` is one of the trees the record's re-made sequences (those the
    encoder keeps: a label trained past the first token) make in rows of ``max_len``
    (``prefix_tree.build_trees``: one tree, or the tree split at branch points), or its first ``seq.length``
    tokens (a sequence longer than the row, cut)."""
    kept = [(ids, labels) for ids, labels in remade if len(ids) and (labels[1:] != IGNORE_INDEX).any()]
    if not kept:
        return "the record re-tokenized trains no token"
    problems = [_tree_problem(seq, tree) for tree in build_trees(kept, max_len)]
    return None if None in problems else problems[0]


def _tree_problem(seq: Sampled, tree) -> str | None:
    n = seq.length
    if len(tree) < n:
        return f"its {n} tokens are more than the record's prefix tree re-made ({len(tree)} tokens)"
    positions, descendants = truncate_tree(tree.position_ids, tree.descendants, n)
    for name, stored, made in (("token ids", seq.input_ids, tree.input_ids[:n]), ("labels", seq.labels, tree.labels[:n]),
                               ("position_ids", seq.tree[0], positions), ("tree_descendants", seq.tree[1], descendants)):
        differ = np.flatnonzero(np.asarray(stored) != np.asarray(made))
        if len(differ):
            k = int(differ[0])
            return (f"its {name} differ from the record's prefix tree re-made at token {k} of {n} "
                    f"(shard {int(stored[k])}, re-made {int(made[k])})")
    return None


def _compare_one(seq: Sampled, ids: np.ndarray, labels: np.ndarray) -> str | None:
    n = seq.length
    offsets = [o for o in np.flatnonzero(ids[: len(ids) - n + 1] == seq.input_ids[0]).tolist()
               if np.array_equal(ids[o : o + n], seq.input_ids)]
    if not offsets:
        return f"its {n} token ids are not a slice of the record re-tokenized ({len(ids)} tokens)"
    if seq.labels[0] != IGNORE_INDEX:
        return "its first label is not -100"
    for o in offsets:
        if np.array_equal(labels[o + 1 : o + n], seq.labels[1:]):
            return None
    o = offsets[0]
    k = int(np.flatnonzero(labels[o + 1 : o + n] != seq.labels[1:])[0]) + 1
    return (f"labels differ from the record re-tokenized at token {k} of {n} "
            f"(shard {int(seq.labels[k])}, re-made {int(labels[o + k])})")
