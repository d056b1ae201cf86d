"""Processor folders of vision-language models, assembled from public processor configs and chat templates.

``build(family, dest)`` writes a folder that ``transformers.AutoProcessor.from_pretrained`` loads as the
model's own processor: the family's ``preprocessor_config.json`` / ``processor_config.json`` /
``chat_template.json`` as published (tests/vision/, sources and sha256 in tests/vision/SOURCES.md),
and a tokenizer: Qwen2.5-VL on its own vocabulary (the Qwen2.5 fixture, whose added tokens already hold
the vision tokens at their upstream ids), the others on a stand-in vocabulary of the fixtures plus the
family's image tokens, the way tests/template_folders.py builds text folders. Families: ``FAMILIES``.

``draw_image(path, size, seed)`` draws a real image (shapes and text) with Pillow, for conversations.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from .conftest import TOKENIZERS
from .template_folders import QWEN25_ADDED, QWEN_CONFIG, _token

VISION = Path(__file__).resolve().parent / "vision"

ROWS_COLS = [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
SMOLVLM_TOKENS = ["<|im_start|>", "<end_of_utterance>", "<fake_token_around_image>", "<image>", "<global-img>",
                  *ROWS_COLS]
GEMMA3_TOKENS = ["<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>", "<image_soft_token>"]


@dataclass(frozen=True)
class VisionFamily:
    base: str  # fixture tokenizer: the model's own vocabulary, or a stand-in
    files: tuple[str, ...]  # public files in tests/vision, as "<prefix>.<name>"
    config: dict  # tokenizer_config.json entries
    added: list | None  # the tokenizer's added tokens (None: the base's)
    own_vocabulary: bool
    renamed: dict = field(default_factory=dict)  # preprocessor_config.json entries that transformers now names otherwise


def _appended(base: str, contents: list[str]) -> list[dict]:
    """The base's added tokens, then ``contents`` as special tokens at the next free ids."""
    tokenizer = json.loads((TOKENIZERS / base / "tokenizer.json").read_text(encoding="utf-8"))
    kept = tokenizer["added_tokens"]
    first = max([*tokenizer["model"]["vocab"].values(), *(t["id"] for t in kept)]) + 1
    return kept + [_token(first + n, content) for n, content in enumerate(contents)]


FAMILIES = {
    "qwen2.5-vl": VisionFamily(
        "qwen2.5", ("config.json", "preprocessor_config.json", "chat_template.json"),
        {**QWEN_CONFIG, "model_max_length": 131072}, QWEN25_ADDED, True,
        {"image_processor_type": "Qwen2VLImageProcessor"}),
    "smolvlm": VisionFamily(
        "gpt2", ("config.json", "preprocessor_config.json", "processor_config.json", "chat_template.json"),
        {"bos_token": "<|im_start|>", "eos_token": "<end_of_utterance>", "pad_token": "<|endoftext|>",
         "unk_token": "<|endoftext|>", "add_prefix_space": False, "clean_up_tokenization_spaces": False,
         "model_max_length": 8192, "tokenizer_class": "GPT2Tokenizer",
         "extra_special_tokens": {"image_token": "<image>", "fake_image_token": "<fake_token_around_image>",
                                  "global_image_token": "<global-img>", "end_of_utterance_token": "<end_of_utterance>"}},
        None, False),
    "gemma3": VisionFamily(
        "llama2", ("config.json", "preprocessor_config.json", "processor_config.json", "chat_template.json"),
        {"bos_token": "<s>", "eos_token": "<end_of_turn>", "pad_token": "<unk>", "unk_token": "<unk>",
         "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
         "model_max_length": 131072, "tokenizer_class": "PreTrainedTokenizerFast",
         "extra_special_tokens": {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                  "image_token": "<image_soft_token>"}},
        None, False),
}
STAND_IN_TOKENS = {"smolvlm": SMOLVLM_TOKENS, "gemma3": GEMMA3_TOKENS}


def build(family: str, dest: str | Path) -> Path:
    """Write the processor folder of ``family`` into ``dest`` (created) and return it."""
    spec = FAMILIES[family]
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    base = TOKENIZERS / spec.base
    tokenizer = json.loads((base / "tokenizer.json").read_text(encoding="utf-8"))
    added = spec.added if spec.added is not None else _appended(spec.base, STAND_IN_TOKENS[family])
    tokenizer["added_tokens"] = added
    if spec.base == "llama2":  # the template writes the BOS itself, as Gemma 3's does
        tokenizer["post_processor"] = None
    template = json.loads((VISION / f"{family}.chat_template.json").read_text(encoding="utf-8"))["chat_template"]
    config = dict(spec.config)
    config["added_tokens_decoder"] = {
        str(t["id"]): {k: t[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")}
        for t in added}
    config["chat_template"] = template
    (dest / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False), encoding="utf-8")
    (dest / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=1), encoding="utf-8")
    for name in spec.files:
        (dest / name).write_bytes((VISION / f"{family}.{name}").read_bytes())
    for key, value in spec.renamed.items():  # SOURCES.md: why
        config = json.loads((dest / "preprocessor_config.json").read_text(encoding="utf-8"))
        (dest / "preprocessor_config.json").write_text(json.dumps({**config, key: value}, indent=2), encoding="utf-8")
    if (base / "LICENSE").is_file():
        (dest / "LICENSE").write_bytes((base / "LICENSE").read_bytes())
    return dest


SHAPES = ("ellipse", "rectangle", "polygon", "line")


def draw_image(path: str | Path, size: tuple[int, int], seed: int = 0, fmt: str | None = None) -> Path:
    """A picture of ``size`` (width, height): a few coloured shapes and a caption, drawn with Pillow."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    width, height = size
    image = Image.new("RGB", size, tuple(rng.randrange(256) for _ in range(3)))
    draw = ImageDraw.Draw(image)
    for _ in range(6):
        box = sorted(rng.randrange(width) for _ in range(2)), sorted(rng.randrange(height) for _ in range(2))
        xy = [box[0][0], box[1][0], box[0][1], box[1][1]]
        colour = tuple(rng.randrange(256) for _ in range(3))
        shape = rng.choice(SHAPES)
        if shape == "polygon":
            draw.polygon([(rng.randrange(width), rng.randrange(height)) for _ in range(3)], fill=colour)
        elif shape == "line":
            draw.line(xy, fill=colour, width=max(1, min(size) // 20))
        else:
            getattr(draw, shape)(xy, fill=colour)
    draw.text((2, 2), f"#{seed} {width}x{height}", fill=(255, 255, 255))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, format=fmt)
    return path


# ---- a fixture set: real conversations of the fixtures, with drawn images, in every shape read ------

SIZES = [(640, 480), (300, 200), (64, 900), (1024, 768), (200, 200), (900, 120)]


def conversation_set(dest: str | Path, count: int = 12) -> tuple[Path, list[tuple[list, list[Path]]]]:
    """``dest/conversations.jsonl`` and ``dest/images/``: the first ``count`` multi-turn conversations
    of fastchat's dummy conversation file, each given one or two drawn images (every third record in
    LLaVA's ``<image>`` + ``images`` shape, OpenAI ``image_url`` parts with a relative path or a file://
    URL, or ``{"type": "image"}`` parts with a JPEG and a data: URL). Also returns what each record
    means in transformers' own message form: (messages with image parts, image files in order)."""
    import base64

    dest = Path(dest)
    conversations = json.loads((TOKENIZERS.parent / "conversations" / "fastchat_dummy_conversation.json")
                               .read_text(encoding="utf-8"))
    chosen = [c["conversations"] for c in conversations if len(c["conversations"]) >= 2][:count]
    lines, expected = [], []
    for i, turns in enumerate(chosen):
        two = len(turns) >= 4 and i % 2 == 1
        files = [draw_image(dest / "images" / f"{i}-{k}.{'jpg' if i % 3 == 2 else 'png'}", SIZES[(i + k) % len(SIZES)],
                            seed=10 * i + k) for k in range(2 if two else 1)]
        with_image = [0, 2] if two else [0]
        messages = [{"role": "user" if t["from"] == "human" else "assistant",
                     "content": ([{"type": "image"}] if n in with_image else []) + [{"type": "text", "text": t["value"]}]}
                    for n, t in enumerate(turns)]
        expected.append((messages, files))
        refs = [f"images/{f.name}" for f in files]
        if i % 3 == 0:
            convs = [{"from": t["from"], "value": ("<image>" if n in with_image else "") + t["value"]}
                     for n, t in enumerate(turns)]
            lines.append({"conversations": convs, "images": refs})
            continue
        if i % 3 == 1:
            parts = [{"type": "image_url", "image_url": {"url": refs[0]}}]
            parts2 = [{"type": "image_url", "image_url": {"url": files[-1].resolve().as_uri()}}]
        else:
            parts = [{"type": "image", "image": refs[0]}]
            encoded = base64.b64encode(files[-1].read_bytes()).decode()
            parts2 = [{"type": "image", "image": f"data:image/jpeg;base64,{encoded}"}]
        msgs = [{"role": m["role"], "content": ((parts if n == 0 else parts2) if n in with_image else [])
                 + [{"type": "text", "text": turns[n]["value"]}]} for n, m in enumerate(messages)]
        lines.append({"messages": msgs})
    path = dest / "conversations.jsonl"
    path.write_text("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines), encoding="utf-8")
    return path, expected
