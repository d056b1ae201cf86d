"""Pack throughput of conversations with images, beside the text path and the processor itself.

    PYTHONPATH=. python benchmarks/bench_vision.py [--n 600] [--sizes 40] [--repeat 3] [--num-proc 2]

Data: the first ``--n`` conversations of the fixtures' ShareGPT files, cycled, every one given one
image (every other one two, in its second user turn) drawn with Pillow at one of ``--sizes`` sizes
(64 to 1600 pixels a side, aspect ratios 1:6 to 6:1; tests/vision_folders.draw_image), written as
LLaVA ``<image>`` records with relative paths. Folders: tests/vision_folders.build("qwen2.5-vl")
(Qwen2.5-VL's processor on its own vocabulary) and, for the text path, the same records without
images on Qwen2.5's text template (tests/template_folders "qwen2.5" of the zoo).

Methods, each run once per repeat, round-robin; the table gives medians:
  vision pack     packprep.pack end to end with the processor folder (--num-proc processes): read, check
                  and hash every image, ask the processor once per size, render, expand, tokenize, pack,
                  write parquet; start-up included (loading transformers and the processor, 5-25 s)
  processor       what a training launch does per example without packprep: the processor's
                  apply_chat_template + processor(text, images) on each conversation (pixel values
                  included), in one process (no reading, no writing, no labels)
  text pack       packprep.pack of the same conversations without images (--num-proc processes)
images/s and tokens/s use the same counts for every method: the images, and the tokens of the
vision pack's rows (text pack: its own rows' tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import packprep  # noqa: E402
from tests.template_folders import build_zoo_folder  # noqa: E402
from tests.vision_folders import build, draw_image  # noqa: E402

FIXTURES = ROOT.parent / "shared" / "fixtures" / "conversations"


def conversations(n: int) -> list[list[dict]]:
    found = []
    for path in sorted(FIXTURES.glob("*.json*")):
        text = path.read_text(encoding="utf-8")
        records = json.loads(text) if path.suffix == ".json" else [json.loads(l) for l in text.splitlines() if l]
        for record in records:
            turns = record.get("conversations") if isinstance(record, dict) else None
            if (isinstance(turns, list) and len(turns) >= 2 and all(isinstance(t, dict) for t in turns)
                    and [t.get("from") for t in turns[:2]] == ["human", "gpt"]
                    and all(isinstance(t.get("value"), str) for t in turns)):
                found.append(turns)
    return [found[i % len(found)] for i in range(n)]


def make_data(root: Path, n: int, sizes: int) -> tuple[Path, Path, int]:
    rng = random.Random(0)
    shapes = [(rng.randint(64, 1600), rng.randint(64, 1600)) for _ in range(sizes)]
    shapes = [(w, max(h, w // 6 + 1, 1)) if w > h else (min(w, h), h) for w, h in shapes]
    for k, size in enumerate(shapes):
        draw_image(root / "images" / f"{k}.png", size, k)
    vision, text, images = [], [], 0
    for i, turns in enumerate(conversations(n)):
        with_image = [0, 2] if i % 2 and len(turns) >= 4 and turns[2].get("from") == "human" else [0]
        refs = [f"images/{rng.randrange(sizes)}.png" for _ in with_image]
        images += len(refs)
        vision.append({"conversations": [{"from": t["from"], "value": ("<image>" if k in with_image else "") + t["value"]}
                                         for k, t in enumerate(turns)], "images": refs})
        text.append({"conversations": turns})
    (root / "vision.jsonl").write_text("".join(json.dumps(r) + "\n" for r in vision))
    (root / "text.jsonl").write_text("".join(json.dumps(r) + "\n" for r in text))
    return root / "vision.jsonl", root / "text.jsonl", images


def processor_baseline(folder: Path, data: Path) -> float:
    from PIL import Image

    from packprep.vision.processor import load_processor

    processor = load_processor(str(folder))
    start = time.perf_counter()
    for line in data.read_text().splitlines():
        record = json.loads(line)
        refs = iter(record["images"])
        messages = []
        for turn in record["conversations"]:
            parts = [{"type": "image"} for _ in range(turn["value"].count("<image>"))]
            messages.append({"role": "user" if turn["from"] == "human" else "assistant",
                             "content": parts + [{"type": "text", "text": turn["value"].replace("<image>", "")}]})
        text = processor.apply_chat_template(messages, tokenize=False)
        images = [Image.open(data.parent / next(refs)) for _ in record["images"]]
        processor(text=[text], images=images, add_special_tokens=False)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=600)
    parser.add_argument("--sizes", type=int, default=40)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--num-proc", type=int, default=2)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-vision-"))
    vision_data, text_data, images = make_data(root / "data", args.n, args.sizes)
    qwen_vl = build("qwen2.5-vl", root / "qwen25vl")
    qwen_text = build_zoo_folder("qwen2.5", root / "qwen25")
    times: dict[str, list[float]] = {"vision pack": [], "processor": [], "text pack": []}
    tokens = {}
    for r in range(args.repeat):
        start = time.perf_counter()
        manifest = packprep.pack(str(vision_data), str(root / f"v{r}"), str(qwen_vl), max_len=8192,
                                 num_proc=args.num_proc)
        times["vision pack"].append(time.perf_counter() - start)
        tokens["vision"] = manifest["tokens"]
        times["processor"].append(processor_baseline(qwen_vl, vision_data))
        start = time.perf_counter()
        manifest = packprep.pack(str(text_data), str(root / f"t{r}"), str(qwen_text), max_len=8192,
                                 num_proc=args.num_proc)
        times["text pack"].append(time.perf_counter() - start)
        tokens["text"] = manifest["tokens"]["total"]
    result = {"machine": f"{platform.node()} {os.cpu_count()} cores", "load_average": os.getloadavg(),
              "num_proc": args.num_proc, "n": args.n, "images": images,
              "distinct_sizes": args.sizes, "tokens": tokens, "times": times, "rows": []}
    for method, values in times.items():
        median = statistics.median(values)
        count = tokens["text"] if method == "text pack" else tokens["vision"]["total"]
        result["rows"].append({"method": method, "median_s": round(median, 3),
                               "records_per_s": round(args.n / median, 1),
                               "images_per_s": None if method == "text pack" else round(images / median, 1),
                               "tokens_per_s": round(count / median)})
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
