"""stats, report: draw a :func:`packprep.length_stats.stats` or :func:`~packprep.length_stats.stats_folder` report
for a terminal; every line fits 80 columns."""

from __future__ import annotations

import textwrap
from pathlib import Path

from ..normalize import changes_text
from ..render import context_text
from ..packing import STRATEGY_TABLE

WIDTH = 80

_BLOCKS = " ▏▎▍▌▋▊▉█"


def _n(value) -> str:
    """A count, with thousands separators; compact (k, M, G) when longer than 7 characters."""
    value = int(value)
    text = f"{value:,}"
    if len(text) <= 7:
        return text
    for unit, scale in (("k", 1e3), ("M", 1e6), ("G", 1e9), ("T", 1e12)):
        short = value / scale
        if abs(short) < 999.5:
            return f"{short:.3g}{unit}"
    return f"{value:.2e}"


def _bar(count: int, peak: int, width: int) -> str:
    if peak <= 0 or count <= 0:
        return " " * width
    eighths = max(1, round(count / peak * width * 8))
    full, part = divmod(eighths, 8)
    text = "█" * full + (_BLOCKS[part] if part else "")
    return text.ljust(width)


def _histogram_lines(bins: list[dict], total: int, *, fraction: bool = False) -> list[str]:
    if not bins:
        return ["  (no data)"]
    if fraction:
        labels = [f"{b['lo']:>4.0%}–{b['hi']:<4.0%}" for b in bins]
    else:
        labels = [f"{_n(b['lo'])}–{_n(b['hi'] - 1)}" if b["hi"] - 1 > b["lo"] else _n(b["lo"]) for b in bins]
    label_width = max(len(label) for label in labels)
    count_width = max(len(_n(b["count"])) for b in bins)
    # label │bar│ count  pct%
    bar_width = WIDTH - 2 - label_width - 3 - count_width - 8
    peak = max(b["count"] for b in bins)
    lines = []
    for label, b in zip(labels, bins):
        share = b["count"] / total if total else 0.0
        lines.append(
            f"  {label:>{label_width}} │{_bar(b['count'], peak, bar_width)}│ {_n(b['count']):>{count_width}} {share:>6.1%}"
        )
    return lines


def _distribution_table(rows: list[tuple[str, dict]]) -> list[str]:
    head = f"  {'':<18}{'count':>8}{'mean':>9}{'p50':>8}{'p90':>8}{'p99':>8}{'max':>9}"
    lines = [head]
    for name, d in rows:
        mean = _n(round(d["mean"])) if d["mean"] >= 100 else f"{d['mean']:.1f}"
        lines.append(
            f"  {name:<18}{_n(d['count']):>8}{mean:>9}{_n(d['p50']):>8}{_n(d['p90']):>8}"
            f"{_n(d['p99']):>8}{_n(d['max']):>9}"
        )
    return lines


def _what_if_lines(plan: dict) -> list[str]:
    rows = plan["rows"]
    epochs = plan["epochs"]
    lines = [
        f"what if (global batch {plan['global_batch_size']}, {epochs} epoch{'s' if epochs != 1 else ''}, "
        f"--overlong {plan['overlong']}):",
        f"  {'max_len':>7} {'strategy':<9}{'rows':>8}{'effic':>7}{'padding':>9}{'over':>6}"
        f"{'lost tok':>9}{'seq/row':>8}{'steps':>7}{'attn':>6}",
    ]
    previous = None
    for r in rows:
        max_len = _n(r["max_len"]) if r["max_len"] != previous else ""
        previous = r["max_len"]
        over = _n(r["overlong_samples"])
        lines.append(
            f"  {max_len:>7} {r['strategy']:<9}{_n(r['rows']):>8}{r['efficiency']:>7.1%}{_n(r['padding_tokens']):>9}"
            f"{over:>6}{_n(r['overlong_tokens_lost']):>9}{r['samples_per_row']:>8.2f}"
            f"{_n(r['optimizer_steps']):>7}{r['attention_vs_pad']:>6.2f}"
        )
    rejected = {r["max_len"]: r["rejected"] for r in rows if r["rejected"]}
    notes = [
        "  effic: tokens / (rows × max_len)    padding: pad tokens if padded to max_len",
        "  over: samples longer than max_len   lost tok: the tokens they lose",
        "  steps: ceil(rows / batch) × epochs  attn: sum(len²) of packed sequences vs pad",
    ]
    by_key = {(r["max_len"], r["strategy"]): r for r in rows}
    # the packing strategies whose rows fit max_len, in the table's order: greedy first
    preference = [s.name for s in STRATEGY_TABLE.values() if not (s.baseline or s.rows_may_exceed_max_len)]
    baseline = next(s.name for s in STRATEGY_TABLE.values() if s.baseline)
    packed = sorted(
        (r for r in rows if r["strategy"] in preference and (r["max_len"], baseline) in by_key),
        key=lambda r: (r["max_len"], preference.index(r["strategy"])),
    )
    if packed:
        r = packed[0]
        pad_steps = by_key[(r["max_len"], baseline)]["optimizer_steps"]
        if pad_steps != r["optimizer_steps"]:
            notes.extend(_wrap(
                f"  packing changes the step count ({_n(pad_steps)} → {_n(r['optimizer_steps'])} at "
                f"{_n(r['max_len'])}, {r['strategy']}): set warm-up and schedule in steps after "
                "choosing, and revisit the learning rate", indent="    "
            ))
    if rejected:
        notes.append(
            "  left with no trained token after truncation (rejected): "
            + ", ".join(f"{_n(n)} at {_n(m)}" for m, n in rejected.items())
        )
    return lines + notes


def render_text(report: dict) -> str:
    """Draw a :func:`stats` or :func:`stats_folder` report for a terminal; every line fits 80 columns."""
    if report.get("kind") == "packed":
        return _render_folder(report)
    if report.get("kind") in ("vision", "vision-packed"):
        from ..vision.summary import render, render_folder

        return render(report) if report["kind"] == "vision" else render_folder(report)
    lines = []
    names = ", ".join(Path(i["path"]).name for i in report["inputs"])
    if len(names) > WIDTH - 8:
        names = names[: WIDTH - 11] + "..."
    lines.append(f"inputs: {names}")
    tok = str(report["tokenizer"])
    if len(tok) > WIDTH - 30:
        tok = "..." + tok[-(WIDTH - 33):]
    lines.append(f"tokenizer: {tok}, train on {report['train_on']}")
    line = f"{_n(report['records'])} records: {_n(report['conversations'])} conversations, {_n(report['rejected'])} rejected"
    if report["rejected_by_reason"]:
        line += " (" + ", ".join(f"{k} {_n(v)}" for k, v in report["rejected_by_reason"].items()) + ")"
    lines.extend(_wrap(line))
    for reason in report.get("top_rejections", []):
        lines.extend(_wrap(f"  {reason}"))
    lines.extend(_wrap(changes_text(report.get("normalized") or {}, report.get("turns_not_located", 0))))
    lines += _turn_context_lines(report.get("turn_context"))
    lines.append(
        f"{report['tokens']['total']:,} tokens, {report['tokens']['supervised']:,} supervised "
        f"({report['tokens']['supervised'] / max(1, report['tokens']['total']):.1%})"
    )
    lines += _mixture_lines(report.get("mixture"))
    lines.append("")
    d = report["distribution"]
    # --turn-context exact may make a conversation several sequences: lengths are then per sequence
    sequences = sum(b["count"] for b in report["histogram"]["bins"])
    unit = "conversation" if sequences == report["conversations"] else "sequence"
    lines.append("per conversation:" if unit == "conversation" else
                 f"per sequence ({_n(sequences)} sequences of {_n(report['conversations'])} conversations; turns per "
                 "conversation):")
    lines += _distribution_table([("tokens", d["tokens"]), ("supervised tokens", d["supervised"]), ("turns", d["turns"])])
    lines.append("")
    over = " · ".join(f"{_n(int(k))}: {_n(v)}" for k, v in report["over_max_len"].items())
    lines.append(f"tokens per {unit} (log-scaled bins):")
    lines += _histogram_lines(report["histogram"]["bins"], sequences)
    lines.extend(_wrap(f"  {unit}s longer than {over}"))
    lines.append("")
    lines += _what_if_lines(report["what_if"])
    if report["what_if"].get("dp_size"):
        lines += [""] + _step_lines(report["what_if"])
    return "\n".join(lines) + "\n"


def _step_lines(plan: dict) -> list[str]:
    """The predicted step efficiency over dp_size ranks, shuffled rows vs pack --balance-dp."""
    cost = plan["cost_model"]
    lines = _wrap(f"step efficiency over {plan['dp_size']} data-parallel ranks, {plan['rows_per_step']} row(s) a "
                  f"rank a step (mean rank cost / slowest rank, averaged over steps; cost model: "
                  f"{Path(cost['source']).name if cost['source'] != 'default' else 'Llama-3.2-1B shape'}):")
    lines.append(f"  {'max_len':>7} {'strategy':<9}{'shuffled':>10}{'balanced':>10}{'attn share':>12}")
    previous = None
    for r in plan["rows"]:
        max_len = _n(r["max_len"]) if r["max_len"] != previous else ""
        previous = r["max_len"]
        balanced = "-" if r["step_efficiency_balanced"] is None else f"{r['step_efficiency_balanced']:.3f}"
        lines.append(f"  {max_len:>7} {r['strategy']:<9}{r['step_efficiency']:>10.3f}{balanced:>10}"
                     f"{r['attention_share']:>12.1%}")
    lines.extend(_wrap("  shuffled: rows dealt by a shuffling sampler; balanced: pack --balance-dp "
                       f"{plan['dp_size']} --rows-per-step {plan['rows_per_step']}, read in order; "
                       "attn share: attention's share of the cost", indent="    "))
    return lines


def _mixture_lines(mixture: dict | None) -> list[str]:
    """The mixture's sources: as asked for, and what the training split holds at the longest max_len."""
    if not mixture:
        return []
    lines = ["", f"mixture (training split at max_len {_n(mixture['max_len'])}; what-if below: per max_len):",
             f"  {'source':<18} {'convs':>7} {'tokens':>9} {'asked':>11} {'held out':>8} {'in train':>8} {'share':>6}"]
    for s in mixture["sources"]:
        name = s["name"].replace("\\", "/").rstrip("/").rsplit("/", 1)[-1]
        name = name if len(name) <= 18 else name[:15] + "..."
        asked = f"share {s['share']:g}" if "share" in s else f"weight {s['weight']:g}"
        lines.append(f"  {name:<18} {_n(s['conversations']):>7} {_n(s['tokens']):>9} {asked:>11} "
                     f"{_n(s['validation_records']):>8} {_n(s['train_sequences']):>8} {s['realized_share']:>6.1%}")
    return lines


def _turn_context_lines(context: dict | None) -> list[str]:
    """Each --turn-context policy's cost on these inputs (render.py), the chosen one marked."""
    if not context:
        return []
    lines = _wrap(context_text(context["policy"], context))
    if not context.get("turns_rewritten"):
        return lines + _wrap("  every --turn-context gives the same: the whole rendering holds each turn as at inference")
    lines.append(f"  {'--turn-context':<16}{'sequences':>11}{'tokens':>14}{'supervised':>13}"
                 f"{'untrained':>11}{'out of ctx':>11}{'rejected':>10}")
    for policy, row in context["policies"].items():
        mark = "*" if policy == context["policy"] else " "
        lines.append(f"  {policy + mark:<16}{_n(row['sequences']):>11}{_n(row['tokens']):>14}{_n(row['supervised']):>13}"
                     f"{_n(row['turns_not_located']):>11}{_n(row['turns_out_of_context']):>11}{_n(row['rejected']):>10}")
    lines += _wrap(f"  {_n(context['turns_rewritten'])} assistant turns are rendered differently in the whole "
                   "conversation than at inference; untrained: turns left without labels")
    exact, rendered = context["policies"].get("exact"), context["policies"].get("rendered")
    if exact and rendered and "shared_prefix_tokens" in exact:
        lines += _wrap(f"  tokens: exact {_n(exact['tokens'])}, exact --shared-prefix {_n(exact['shared_prefix_tokens'])} "
                       f"(bound {_n(exact['shared_prefix_bound'])}: one rendering, each rewritten turn's target once "
                       f"more, a token a branch), rendered {_n(rendered['tokens'])}")
    return lines


def _render_folder(report: dict) -> str:
    config = report["config"]
    lines = [f"packed folder: {report['folder']}"[:WIDTH]]
    lines.append(
        f"strategy {config.get('strategy')}, max_len {_n(config['max_len'])}, overlong {config.get('overlong')}, "
        f"train on {config.get('train_on')}"
    )
    counts = report.get("counts") or {}
    if counts:
        lines.extend(_wrap(
            f"{_n(counts.get('records', 0))} records: packed {_n(counts.get('packed', 0))}, "
            f"truncated {_n(counts.get('truncated', 0))}, split {_n(counts.get('split', 0))}, "
            f"rejected {_n(counts.get('rejected', 0))}"
            + (f", unsampled {_n(counts['unsampled'])} (left out by the mixture)" if counts.get("unsampled") else "")
        ))
        lines.extend(_wrap(changes_text(counts.get("normalized") or {}, counts.get("turns_not_located", 0))))
        lines.extend(_wrap(context_text(config.get("turn_context", "exact"), counts)))
    supervised = report["tokens"]["supervised"]
    lines.append(
        f"{_n(report['rows'])} rows, {_n(report['sequences'])} sequences, {_n(report['tokens']['total'])} tokens"
        + (f" ({_n(supervised)} supervised)" if supervised is not None else "")
    )
    width = report.get("row_width", config["max_len"])
    lines.extend(_wrap(
        (f"efficiency {report['efficiency']:.2%}" if width == config["max_len"] else
         f"fill {report['efficiency']:.2%} of rows padded to the longest ({_n(width)} tokens: rows of "
         f"{config.get('strategy')} may exceed max_len)")
        + f", padding {_n(report['padding_tokens'])} tokens, "
        f"{_n(report['optimizer_steps'])} optimizer step{'s' if report['optimizer_steps'] != 1 else ''} "
        f"(batch {report['global_batch_size']}, "
        f"{report['epochs']} epoch{'s' if report['epochs'] != 1 else ''})"
    ))
    lines.append("")
    d = report["distribution"]
    lines.append("per row:")
    lines += _distribution_table(
        [("row tokens", d["row_tokens"]), ("sequences per row", d["sequences_per_row"]),
         ("sequence tokens", d["sequence_tokens"])]
    )
    lines.append("")
    lines.append("row fill (tokens / max_len):")
    lines += _histogram_lines(report["fill_histogram"], report["rows"], fraction=True)
    lines.append("")
    lines.append("tokens per packed sequence (log-scaled bins):")
    lines += _histogram_lines(report["histogram"]["bins"], report["sequences"])
    if report.get("steps"):
        steps = report["steps"]
        lines += [""] + _wrap(
            f"step efficiency over {steps['dp_size']} ranks, {steps['rows_per_step']} row(s) a rank a step "
            f"({steps['sampler']} order): {steps['step_efficiency']:.3f} read in order, "
            f"{steps['step_efficiency_shuffled']:.3f} shuffled; attention {steps['attention_share']:.1%} of the cost")
    return "\n".join(lines) + "\n"


def _wrap(line: str, indent: str = "  ") -> list[str]:
    return textwrap.wrap(line, WIDTH, subsequent_indent=indent, break_on_hyphens=False) or [""]
