"""Which zoo templates the one-pass renderer renders once a conversation, which it does not, and why.

    python benchmarks/onepass_census.py                   # every template of the zoo
    python benchmarks/onepass_census.py --templates qwen3,gemma-4 --json census.json

For each template (tests/template_folders.py: the seven families and the zoo), a conversation of a
system prompt and N exchanges of plain chat is rendered the way ``pack`` renders it
(``ChatEncoder(...).render``) and the work is counted (``ChatTemplate.work``: renderings and the
characters they output) at 2, 8, 32 and 64 exchanges. The table says:

* one-pass: whether the one-pass template was built and agreed with the reference on the probes,
  else why not (no top-level message loop, text after it that depends on the messages, probes);
* vouched: of the prefixes the definition needs at 8 exchanges, how many were cut from the one
  rendering (the rest rendered on their own);
* renderings and characters at each length, and characters at 64 over 32 (2: linear, 4: quadratic);
* reads ahead: what in the template's source makes the watch refuse a cut (counting the messages,
  ``loop.last``, a reversed scan, a list of its own...), found by pattern, for the reader.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tests.template_folders import ZOO_NAMES, build_zoo_folder, zoo_template  # noqa: E402
from tests.zoo_shapes import exchanges  # noqa: E402

TURNS = (2, 8, 32, 64)
# what in a template's source reads ahead of the message being rendered (for the reader of the table)
READS_AHEAD = {
    "messages|length": r"messages\s*\|\s*length|length\s*\(\s*messages",
    "loop.last": r"loop\.last",
    "messages[-1]": r"messages\s*\[\s*-",
    "reversed scan": r"messages\s*\[\s*::\s*-1\s*\]|messages\s*\|\s*reverse",
    "loop.nextitem / index+1": r"loop\.nextitem|loop\.index0?\s*\+\s*1\s*\]",
    "loop over indices or a list of its own": r"for\s+\w+\s+in\s+range\(|for\s+\w+\s+in\s+(?!messages\b)\w+\s*%}",
}


def census(name: str, folder: str) -> dict:
    from packprep.normalize import Conversation, Rejected
    from packprep.render_onepass import OnePassTemplate, Unavailable
    from packprep.tokenization import ChatEncoder, load_tokenizer

    tokenizer = load_tokenizer(folder)
    row = {"template": name}
    try:
        OnePassTemplate(tokenizer)
    except Unavailable as exc:
        row["refused"] = str(exc).split(" (")[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        encoder = ChatEncoder(tokenizer, backend="hf")
    template = encoder.template
    row["one_pass"] = isinstance(template, OnePassTemplate)
    if not row["one_pass"] and "refused" not in row:
        row["refused"] = "probes disagree" if caught else "reference"
    source = zoo_template(name)
    row["reads_ahead"] = [what for what, pattern in READS_AHEAD.items() if re.search(pattern, source)]
    row["renders"], row["chars"] = [], []
    for turns in TURNS:
        conversation = Conversation(messages=exchanges(turns))
        try:
            encoder.render(conversation)  # probes the template's shape once: not this record's work
        except Rejected as exc:
            row["rejected"] = exc.code
            break
        before_renders, before_prefixes = template.work.renders, template.work.prefixes
        before_chars = template.work.chars
        encoder.render(conversation)
        row["renders"].append(template.work.renders - before_renders)
        row["chars"].append(template.work.chars - before_chars)
        if turns == 8:
            row["own_prefixes_at_8"] = template.work.prefixes - before_prefixes
    return row


def table(rows: list[dict]) -> list[str]:
    lines = ["| template | one-pass | prefixes on their own at 8 exchanges | renderings at 2/8/32/64 | "
             "characters at 2/8/32/64 | 64 ÷ 32 | reads ahead (source) |",
             "|---|---|---:|---|---|---:|---|"]
    for row in rows:
        one_pass = "yes" if row["one_pass"] else f"no: {row.get('refused', '')}"
        if "rejected" in row:
            lines.append(f"| {row['template']} | {one_pass} | | refuses plain chat ({row['rejected']}) | | | "
                         f"{', '.join(row['reads_ahead'])} |")
            continue
        chars = row["chars"]
        lines.append(f"| {row['template']} | {one_pass} | {row.get('own_prefixes_at_8', '')} | "
                     f"{'/'.join(map(str, row['renders']))} | {'/'.join(f'{c:,}' for c in chars)} | "
                     f"{chars[3] / chars[2]:.2f} | {', '.join(row['reads_ahead'])} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--templates", help="comma-separated names (default: every template of the zoo)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    names = args.templates.split(",") if args.templates else ZOO_NAMES
    rows = []
    with tempfile.TemporaryDirectory(prefix="onepass-census-") as tmp:
        for name in names:
            rows.append(census(name, str(build_zoo_folder(name, Path(tmp) / name))))
            print(f"{name} done", file=sys.stderr, flush=True)
    linear = sum(1 for r in rows if "rejected" not in r and r["chars"][3] / r["chars"][2] < 2.5)
    print(f"{len(rows)} templates; rendering work linear in the turns (64 ÷ 32 < 2.5) on {linear}")
    print("\n".join(table(rows)))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
