"""Template conformance: every template of the zoo x every data shape, against the token-exact reference.

    python benchmarks/template_conformance.py                       # the whole zoo, 6 records a shape
    python benchmarks/template_conformance.py --templates qwen3,gemma-4 --shapes chat,tools_str --count 2
    python benchmarks/template_conformance.py --reasoning drop --out /tmp/conf   # another policy

Tokenizer folders are built into a cache folder (tests/template_folders.py), records are generated
(tests/zoo_shapes.py), each template's records are packed once with ``packprep.pack`` (default
options, plus those given) and every assistant turn is checked against the reference built on
transformers' renderer alone (tests/zoo_reference.py, tests/zoo_conformance.py). Writes
``template_conformance.json`` (every tally, and examples of misses with expected and got ids) and
``template_conformance.md`` (the tables) into ``--out`` (default: benchmarks/).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tests.template_folders import ZOO, ZOO_NAMES, build_zoo_folder  # noqa: E402
from tests.zoo_conformance import check_template  # noqa: E402
from tests.zoo_shapes import SHAPE_NAMES  # noqa: E402

KEYS = ("turns", "trained", "missed", "turns_policy", "turns_unrenderable", "rejected_renderable", "records",
        "reasoning_traces", "reasoning_lost", "reasoning_not_written")


def run(templates, shapes, count, cache: Path, settings: dict, save=None) -> dict:
    results = {}
    for name in templates:
        start = time.perf_counter()
        folder = str(build_zoo_folder(name, cache / name))
        try:
            result = check_template(name, folder, shapes, count, **settings)
        except Exception as exc:  # a run packprep refuses as a whole is a result too
            result = {"template": name, "error": f"{type(exc).__name__}: {str(exc)[:300]}", "shapes": {}}
        result["seconds"] = round(time.perf_counter() - start, 1)
        result["source"] = f"zoo/{ZOO[name].template}" if name in ZOO else name
        results[name] = result
        totals = _sum(result["shapes"].values())
        print(f"{name:28s} trained {totals['trained']:4d}/{totals['turns']:4d}  missed {totals['missed']:4d}  "
              f"rejected-renderable {totals['rejected_renderable']:3d}  {result['seconds']:6.1f}s"
              + (f"  ERROR {result['error'][:80]}" if "error" in result else ""), flush=True)
        if save:
            save(results)  # after each template: a long run's tables so far are on disk
    return results


def _sum(tallies) -> Counter:
    total = Counter({k: 0 for k in KEYS})
    for tally in tallies:
        total.update(tally)
    return total


def usable(result) -> bool:
    """A template counts toward the zoo when the reference renders at least one of its turns."""
    return "error" not in result and _sum(result["shapes"].values())["turns"] > 0


def _pct(a, b) -> str:
    return f"{a}/{b} ({100 * a / b:.0f}%)" if b else "-"


def markdown(results: dict, shapes, count, settings) -> str:
    lines = [f"# Template conformance ({len([r for r in results.values() if usable(r)])} usable templates, "
             f"{count} records a shape, settings {settings or 'default'})", "",
             "A turn is *trained* when a sequence of its record starts with exactly its inference context and "
             "trains exactly its target ids (tests/zoo_reference.py). *policy*: turns with tool calls where the "
             "template renders none (left out). *unrenderable*: the template refuses the prefix. *reasoning lost*: "
             "traces in no trained token; *not written*: turns whose reasoning the template itself writes nowhere "
             "in the turn (it writes reasoning only in other turns, or strips it from every reply; or `--reasoning drop`), what "
             "packprep counts as `reasoning_dropped`.", "",
             "## By template", "",
             "| template | trained / turns | missed | rejected but renderable | policy | unrenderable | reasoning lost "
             "/ traces | not written | manifest inlined / dropped | main miss causes |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    lost_uncounted, dropped, unmatched = 0, 0, []
    grand = Counter()
    for name, result in results.items():
        if "error" in result:
            lines.append(f"| {name} | error: {result['error'][:120]} | | | | | | | | |")
            continue
        t = _sum(result["shapes"].values())
        grand.update(t)
        causes = Counter()
        for tally in result["shapes"].values():
            causes.update({k[7:]: v for k, v in tally.items() if k.startswith("missed:")})
        norm = result.get("normalized", {})
        lost_uncounted += max(0, t["reasoning_lost"] - norm.get("reasoning_dropped", 0))
        dropped += norm.get("reasoning_dropped", 0)
        if norm.get("reasoning_dropped", 0) != t["reasoning_not_written"]:
            unmatched.append(name)
        lines.append(f"| {name} | {_pct(t['trained'], t['turns'])} | {t['missed']} | {t['rejected_renderable']} | "
                     f"{t['turns_policy']} | {t['turns_unrenderable']} | {t['reasoning_lost']}/{t['reasoning_traces']} | "
                     f"{t['reasoning_not_written']} | "
                     f"{norm.get('reasoning_inlined', 0)}/{norm.get('reasoning_dropped', 0)} | "
                     f"{', '.join(f'{k} {v}' for k, v in causes.most_common(3))} |")
    lines += ["", f"**All: {_pct(grand['trained'], grand['turns'])} turns trained in context; "
              f"{grand['rejected_renderable']} records rejected that the template renders; "
              f"{grand['reasoning_lost']} of {grand['reasoning_traces']} reasoning traces in no trained token "
              f"({lost_uncounted} more than the manifests count as dropped); the manifests count "
              f"{dropped} turns' reasoning dropped, the reference finds {grand['reasoning_not_written']} the template "
              f"writes nowhere in the turn, differing on {len(unmatched)} templates"
              f"{' (' + ', '.join(unmatched) + ')' if unmatched else ''}.**", "",
              "## By shape", "", "| shape | trained / turns | missed | rejected but renderable | reasoning lost / traces "
              "| main miss causes |", "|---|---|---|---|---|---|"]
    for shape in shapes:
        t, causes = Counter({k: 0 for k in KEYS}), Counter()
        for result in results.values():
            tally = result["shapes"].get(shape, {})
            t.update(tally)
            causes.update({k[7:]: v for k, v in tally.items() if k.startswith("missed:")})
        lines.append(f"| {shape} | {_pct(t['trained'], t['turns'])} | {t['missed']} | {t['rejected_renderable']} | "
                     f"{t['reasoning_lost']}/{t['reasoning_traces']} | "
                     f"{', '.join(f'{k} {v}' for k, v in causes.most_common(3))} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--templates", default=",".join(ZOO_NAMES))
    parser.add_argument("--shapes", default=",".join(SHAPE_NAMES))
    parser.add_argument("--count", type=int, default=6, help="records a shape")
    parser.add_argument("--cache", default=None, help="where the tokenizer folders are built [a temporary folder]")
    parser.add_argument("--out", default=str(REPO / "benchmarks"))
    parser.add_argument("--reasoning", default=None, help="packprep's --reasoning (default: its own)")
    parser.add_argument("--tables-from", default=None, metavar="JSON", help="only rewrite the tables of a run's JSON")
    args = parser.parse_args(argv)
    if args.tables_from:
        report = json.loads(Path(args.tables_from).read_text())
        md = Path(args.tables_from).with_suffix(".md")
        md.write_text(markdown(report["templates"], report["shapes"], report["count"], report["settings"]))
        return
    settings = {"reasoning": args.reasoning} if args.reasoning else {}
    templates, shapes = args.templates.split(","), args.shapes.split(",")
    cache = Path(args.cache or tempfile.mkdtemp(prefix="zoo-folders-"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def save(results):
        report = {"count": args.count, "settings": settings, "shapes": shapes, "templates": results}
        (out / "template_conformance.json").write_text(json.dumps(report, indent=1, ensure_ascii=False, default=dict))
        (out / "template_conformance.md").write_text(markdown(results, shapes, args.count, settings))
    save(run(templates, shapes, args.count, cache, settings, save))
    print(f"wrote {out / 'template_conformance.md'}")


if __name__ == "__main__":
    main()
