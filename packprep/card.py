"""The dataset card (README.md) of an output folder: YAML the Hub reads, and a body a person reads."""

from __future__ import annotations

import json

from .layout import COLUMNS, FILES, LayoutContext, get_layout
from .normalize import changes_text
from .plan import cut_text
from .render import context_text

# Values the Hub accepts for ``size_categories``: (upper bound of rows, label).
SIZE_CATEGORIES = [
    (1_000, "n<1K"), (10_000, "1K<n<10K"), (100_000, "10K<n<100K"), (1_000_000, "100K<n<1M"),
    (10_000_000, "1M<n<10M"), (100_000_000, "10M<n<100M"), (1_000_000_000, "100M<n<1B"),
]
HISTOGRAM_BINS = 10
BAR_WIDTH = 40


def length_histograms(row_lengths, sequence_lengths, max_len: int, bins: int = HISTOGRAM_BINS) -> dict:
    """Counts of row and sequence lengths in ``bins`` equal bins of (0, max_len]; for the manifest.

    Bin ``i`` holds lengths in ``(edges[i], edges[i+1]]``; lengths above max_len (rows of
    ``--strategy minibatch``) are counted in ``rows_over`` / ``sequences_over``.
    """
    import numpy as np

    edges = [round(max_len * i / bins) for i in range(bins + 1)]

    def count(lengths):  # without a copy: there is one sequence length a sequence
        lengths = np.asarray(lengths)
        inside = np.histogram(lengths, bins=np.asarray(edges) + 0.5)[0] if len(lengths) else []  # <= max_len only
        return [int(n) for n in inside] or [0] * bins, int((lengths > max_len).sum())

    rows, rows_over = count(row_lengths)
    sequences, sequences_over = count(sequence_lengths)
    return {"edges": edges, "rows": rows, "sequences": sequences, "rows_over": rows_over,
            "sequences_over": sequences_over}


def _size_category(rows: int) -> str:
    return next((label for bound, label in SIZE_CATEGORIES if rows < bound), "n>1B")


def _features(manifest: dict) -> list[tuple[str, str, bool]]:
    """(name, value type, is a list) of each column the folder's layout writes."""
    layout = get_layout(manifest.get("layout"))
    if layout.writes == FILES:
        return []
    schema = layout.schema(LayoutContext(max_len=int(manifest["config"]["max_len"]), manifest=manifest))
    return [
        (f.name, str(getattr(f.type, "value_type", f.type)), hasattr(f.type, "value_type")) for f in schema
    ]


def _arrow_bytes(manifest: dict) -> int:
    """In-memory (Arrow) size of the canonical table (of the manifest or of its validation split): what
    ``dataset_info.splits.num_bytes`` means on the Hub."""
    tokens, sequences, rows = manifest["tokens"]["total"], manifest["sequences"], manifest["rows"]
    # 3 int32 token columns, seq_lens int32 + source_index int64, and one int32 offset per row per column
    return 12 * tokens + 12 * sequences + 4 * len(COLUMNS) * (rows + 1)


def _histogram_text(edges: list[int], counts: list[int], over: int, unit: str) -> str:
    labels = [f"{edges[i] + 1:>6,} - {edges[i + 1]:>6,}" for i in range(len(counts))]
    values = list(counts)
    if over:
        labels.append(f"{'> ' + format(edges[-1], ','):>15}")
        values.append(over)
    peak = max(values) if values and max(values) else 1
    lines = [f"{'tokens':>15}  {unit:>10}"]
    for label, value in zip(labels, values):
        bar = "#" * (round(BAR_WIDTH * value / peak) if value else 0) or ("." if value else "")
        lines.append(f"{label}  {value:>10,}  {bar}".rstrip())
    return "\n".join(lines)


def _histograms_section(manifest: dict) -> str:
    hist = manifest.get("length_histograms")
    if not hist:
        return (
            "## Lengths\n\n"
            f"The longest row holds {manifest['max_row_len']:,} tokens; the mean row holds "
            f"{manifest['tokens']['total'] / max(1, manifest['rows']):,.1f}. (This manifest records no length "
            "histogram.)\n"
        )
    rows = _histogram_text(hist["edges"], hist["rows"], hist.get("rows_over", 0), "rows")
    sequences = _histogram_text(hist["edges"], hist["sequences"], hist.get("sequences_over", 0), "sequences")
    return f"""## Lengths

Tokens per packed row (how full the rows are; max_len {manifest['config']['max_len']:,}):

```text
{rows}
```

Tokens per packed sequence (one conversation, or one piece of a split one):

```text
{sequences}
```
"""


def _balance_section(manifest: dict) -> str:
    """How to read rows packed with --balance-dp (docs/balanced-packing.md); empty for other folders."""
    balance = manifest.get("balance")
    if not balance:
        return ""
    n, r = balance["dp_size"], balance["rows_per_step"]
    deal = ("row `i` goes to rank `i % N`: `DistributedSampler(shuffle=False)`, torchtune's `shuffle: False`"
            if balance["sampler"] == "distributed" else
            "batch `b` of R rows goes to rank `b % N`: accelerate, `Trainer`/`SFTTrainer` with "
            "`train_sampling_strategy=\"sequential\"`")
    return f"""## Balanced for {n} data-parallel ranks

Rows are re-packed and ordered so that every step of {n} ranks x {r} row(s) gives the ranks equal compute
(predicted step efficiency {balance['step_efficiency']:.3f}; {balance['step_efficiency_shuffled']:.3f} if a
sampler shuffles them). Read them **in order**, {r} row(s) a rank a step, on {n} ranks: {deal}.
`packprep.training.check_order(loader_or_trainer, DIR)` warns when a sampler would undo the order.

"""


def _form_text(manifest: dict) -> str:
    """The rows' form where it is not one flat sequence a turn context: shared-prefix rows."""
    if not manifest["config"].get("shared_prefix"):
        return ""
    return ("; written as shared-prefix rows (each record's sequences as one prefix tree, depth first, with "
            "`tree_descendants`: read them only with `packprep.training.collate_tree`)")


def _local_name(name_or_path: str) -> str:
    """A Hub id as is; a local path by its last part only (the card is published, the packer's disk is not)."""
    text = str(name_or_path).replace("\\", "/").rstrip("/")
    if text.count("/") > 1 or text.startswith(("/", ".", "~")) or ":" in text:
        return text.rsplit("/", 1)[-1] or text
    return text


def _inputs_text(manifest: dict) -> str:
    lines = []
    for source in manifest["inputs"]:
        name = str(source["path"])
        if source.get("kind") != "hub":  # local files: the name only, not the packer's directories
            name = name.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1] or name
        sha = f", sha256 `{source['sha256'][:16]}`" if source.get("sha256") else ""
        lines.append(f"- `{name}`: {source['records']:,} records, format `{source['format']}`{sha}")
    return "\n".join(lines) or "- (none)"


def _validation_yaml(validation: dict | None, fmt: str) -> tuple[str, str]:
    """The card's YAML lines of a validation split: its files, and its size."""
    if not validation:
        return "", ""
    return (f"  - split: validation\n    path: data/validation-*.{fmt}\n",
            f"  - name: validation\n    num_bytes: {_arrow_bytes(validation)}\n    num_examples: {validation['rows']}\n")


def _mixture_section(manifest: dict) -> str:
    """The mixture (``pack --mix``) and the validation split, where the run had them."""
    text = ""
    mixture, validation = manifest.get("mixture"), manifest.get("validation")
    if mixture:
        lines = ["| source | sha256 | asked | records | held out | in train (with copies) | train tokens | share |",
                 "|---|---|---|---|---|---|---|---|"]
        for s in mixture["sources"]:
            asked = f"share {s['share']:g}" if "share" in s else f"weight {s['weight']:g}"
            sha = ", ".join(f"`{h[:16]}`" for h in s["sha256"] if h) or "-"
            lines.append(f"| `{_local_name(s['name'])}` | {sha} | {asked} | {s['records']:,} | {s['validation_records']:,} "
                         f"| {s['train_records']:,} ({s['train_sequences']:,}) | {s['train_tokens']:,} "
                         f"| {s['realized_share']:.2%} |")
        text += "\n## Mixture\n\n" + "\n".join(lines) + (
            f"\n\n{manifest['counts'].get('unsampled', 0):,} records were left out by the weights and shares "
            "(seeded by the config's seed).\n")
    if validation:
        text += (f"\n## Validation split\n\n{validation['rows']:,} rows ({validation['sequences']:,} sequences, "
                 f"{validation['tokens']['total']:,} tokens) in `data/validation-*`, packed with the same settings; "
                 "no input record is in both splits. `packprep.json` lists the held-out records "
                 "(`validation.members`: input and record index).\n")
    return text


def _layout_section(layout) -> str:
    renamed = ", ".join(f"`{a}` is named `{b}`" for a, b in layout.renames.items())
    if layout.convert is not None or layout.write_files is not None:
        what = f"These files are laid out for {layout.stack} (`packprep export --to {layout.name}`), not as the columns above."
    else:
        what = f"Laid out for {layout.stack} (layout `{layout.name}`{'; ' + renamed if renamed else ''})."
    return f"""## Load and train

{what} `packprep export DIR --to NAME OUT` re-lays it out for another stack (see packprep's README).

{layout.recipe}
"""


def _template_inputs_text(config: dict) -> str:
    """What every rendering got besides the messages (docs/chat-templates.md, Template inputs)."""
    args = json.dumps(config.get("template_args") or {}, ensure_ascii=False)
    return (f"date `{config.get('date', 'the clock')}`, template args `{args}`, named template "
            f"`{config.get('chat_template') or 'default'}`, reasoning without a place `{config.get('reasoning', 'not recorded')}`")


def render_card(manifest: dict) -> str:
    layout = get_layout(manifest.get("layout"))
    return _card_header(manifest, layout) + _card_body(manifest, layout)


def _card_header(manifest: dict, layout) -> str:
    """The YAML front matter: the Hub's loader configs (for table layouts) and the tags."""
    fmt = manifest["config"]["shard_format"]
    features = "\n".join(
        f"  - name: {name}\n    {'sequence' if is_list else 'dtype'}: {dtype}" for name, dtype, is_list in _features(manifest)
    )
    total_bytes = sum(shard["bytes"] for shard in manifest["shards"] + (manifest.get("validation") or {}).get("shards", []))
    arrow_bytes = _arrow_bytes(manifest)
    validation_files, validation_split = _validation_yaml(manifest.get("validation"), fmt)
    # a layout of other files (e.g. .npy) is no table the Hub's loader reads: no configs, no features
    loadable = "" if layout.writes == FILES else f"""configs:
- config_name: default
  data_files:
  - split: train
    path: data/train-*.{fmt}
{validation_files}dataset_info:
  features:
{features}
  splits:
  - name: train
    num_bytes: {arrow_bytes}
    num_examples: {manifest['rows']}
{validation_split}  download_size: {total_bytes}
  dataset_size: {arrow_bytes + (_arrow_bytes(manifest["validation"]) if manifest.get("validation") else 0)}
"""
    header = f"""---
{loadable}task_categories:
- text-generation
size_categories:
- {_size_category(manifest['rows'])}
tags:
- packed
- sft
- packprep
---
"""
    return header


def _card_body(manifest: dict, layout) -> str:
    """The markdown: what the rows hold, the settings, every record's fate, and how to feed them."""
    config = manifest["config"]
    counts = manifest["counts"]
    tok = manifest["tokenizer"]
    template_hash = (tok.get("chat_template_sha256") or "none")[:16]
    above = (
        100.0 * (manifest["rows"] - manifest["lower_bound_rows"]) / manifest["lower_bound_rows"]
        if manifest["lower_bound_rows"]
        else 0.0
    )
    reasons = ", ".join(f"{code}: {n}" for code, n in counts["rejected_by_reason"].items()) or "none"
    body = f"""
# Packed SFT data (packprep {manifest['packprep_version']})

{manifest['rows']:,} rows of at most {config['max_len']:,} tokens, holding {manifest['sequences']:,} packed
sequences and {manifest['tokens']['total']:,} tokens ({manifest['tokens']['supervised']:,} supervised).
Packing efficiency {manifest['efficiency']:.2%} (tokens / (rows x max_len)); {above:.2f}% more rows
than the lower bound ceil(tokens / max_len).

| setting | value |
|---|---|
| strategy | `{config['strategy']}` |
| max_len | {config['max_len']} |
| seed | {config['seed']} |
| train_on | `{config['train_on']}` |
| overlong | `{config['overlong']}` |
| row order | `{config['row_order']}` |
| tokenizer | `{_local_name(tok['name_or_path'])}` (vocab {tok['vocab_size']}, files sha256 `{tok['files_sha256'][:16]}`) |
| chat template sha256 | `{template_hash}` |
| template inputs | {_template_inputs_text(config)} |

Records: {counts['records']:,} read, {counts['packed']:,} packed whole, {counts['truncated']:,} truncated,
{counts['split']:,} split, {counts['rejected']:,} rejected ({reasons}; see `rejects.jsonl`).
Normalizing, {changes_text(counts.get('normalized') or {}, counts.get('turns_not_located', 0))}.
Truncation, {cut_text(counts, config['max_len'])}.
Labels: {context_text(manifest['config'].get('turn_context', 'exact'), counts, bool(manifest['config'].get('shared_prefix')))}{_form_text(manifest)} (docs/chat-templates.md). Inputs:

{_inputs_text(manifest)}
{_mixture_section(manifest)}
{_histograms_section(manifest)}
{_balance_section(manifest)}## Columns

Each row is one training row. `input_ids`, `labels` and `position_ids` have the row's length; no
padding is stored. `labels` are unshifted (the model shifts them): equal to `input_ids` where the
token is trained, `-100` elsewhere, and `-100` at the first token of every packed sequence, so no
sequence is asked to predict the next one. `position_ids` restart at 0 for each packed sequence;
`seq_lens` are the sequence lengths (a varlen kernel's `cu_seqlens` is their running sum);
`source_index` gives each sequence's input record.

Feed rows to a varlen attention kernel (flash-attention, `torch.nn.attention.varlen`) or to
transformers with `position_ids` and **no attention mask** and `use_cache=False`. An all-ones
attention mask, or a KV cache, silently disables the isolation between packed sequences.

{_layout_section(layout)}

`packprep.json` holds the full configuration, input hashes and counts; `packprep verify DIR` re-checks
every guarantee above.

<details><summary>manifest</summary>

```json
{json.dumps({k: manifest[k] for k in ('config', 'counts', 'tokens', 'rows', 'efficiency')}, indent=2)}
```

</details>
"""
    return body
