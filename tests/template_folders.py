"""Tokenizer folders of current chat models, assembled from the fixture vocabularies and real templates.

The Hub is out of reach in tests, so each folder is built from a fixture tokenizer that has the same
vocabulary as the model (tests/templates/SOURCES.md says why each is the same), the model's own added
tokens at their upstream ids and flags, its special tokens, and its chat template as published
(tests/templates/*.jinja). ``tokenizer_class`` is one whose behaviour lives wholly in tokenizer.json,
so that transformers and packprep's own loader (packprep/tokenizer_folder.py) read the same pipeline.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .conftest import TOKENIZERS

TEMPLATES = Path(__file__).resolve().parent / "templates"


def _token(id, content, special=True, rstrip=False):
    return {"id": id, "content": content, "single_word": False, "lstrip": False, "rstrip": rstrip,
            "normalized": False, "special": special}


QWEN25_ADDED = [
    _token(151643, "<|endoftext|>"), _token(151644, "<|im_start|>"), _token(151645, "<|im_end|>"),
    _token(151646, "<|object_ref_start|>"), _token(151647, "<|object_ref_end|>"), _token(151648, "<|box_start|>"),
    _token(151649, "<|box_end|>"), _token(151650, "<|quad_start|>"), _token(151651, "<|quad_end|>"),
    _token(151652, "<|vision_start|>"), _token(151653, "<|vision_end|>"), _token(151654, "<|vision_pad|>"),
    _token(151655, "<|image_pad|>"), _token(151656, "<|video_pad|>"), _token(151657, "<tool_call>", False),
    _token(151658, "</tool_call>", False), _token(151659, "<|fim_prefix|>", False),
    _token(151660, "<|fim_middle|>", False), _token(151661, "<|fim_suffix|>", False),
    _token(151662, "<|fim_pad|>", False), _token(151663, "<|repo_name|>", False), _token(151664, "<|file_sep|>", False),
]
QWEN3_ADDED = QWEN25_ADDED + [
    _token(151665, "<tool_response>", False), _token(151666, "</tool_response>", False),
    _token(151667, "<think>", False), _token(151668, "</think>", False),
]
# DeepSeek-R1-Distill-Qwen renames the first eight Qwen2.5 added tokens and keeps the rest
DEEPSEEK_QWEN_ADDED = [
    _token(151643, "<｜end▁of▁sentence｜>"), _token(151644, "<｜User｜>", False), _token(151645, "<｜Assistant｜>", False),
    _token(151646, "<｜begin▁of▁sentence｜>"), _token(151647, "<|EOT|>", False), _token(151648, "<think>", False),
    _token(151649, "</think>", False),
] + QWEN25_ADDED[7:]
PHI35_ADDED = [
    _token(0, "<unk>"), _token(1, "<s>"), _token(2, "</s>", False, rstrip=True), _token(32000, "<|endoftext|>"),
    *[_token(32000 + n, content, rstrip=True) for n, content in enumerate(
        ["<|assistant|>", "<|placeholder1|>", "<|placeholder2|>", "<|placeholder3|>", "<|placeholder4|>",
         "<|system|>", "<|end|>", "<|placeholder5|>", "<|placeholder6|>", "<|user|>"], start=1)],
]
# Mistral's v3 SentencePiece tokenizer (Mistral-7B-Instruct-v0.3) is v0.1's with 768 control tokens at ids 3-770
MISTRAL_V3_CONTROLS = (["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
                        "[/TOOL_RESULTS]", "[IMG]", "[PREFIX]", "[MIDDLE]", "[SUFFIX]"]
                       + [f"[control_{i - 2}]" for i in range(14, 751)] + [f"[REFERENCE_DOC_{770 - i}]" for i in range(751, 771)])
QWEN_SPECIALS = ["<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
                 "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
                 "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]


@dataclass(frozen=True)
class Family:
    """How one model's tokenizer folder is assembled from a fixture vocabulary."""

    base: str  # fixture tokenizer folder whose vocabulary (model, pre-tokenizer, normalizer) is the model's
    template: str  # file in tests/templates
    config: dict  # tokenizer_config.json entries (special tokens, flags) as upstream
    added: list | None = None  # the model's added tokens; None keeps the base's
    bos_post_processor: bool = False  # upstream tokenizer.json adds the BOS with a TemplateProcessing
    shift: int = 0  # ids of the base vocabulary's pieces past the first three move up by this many (Mistral v3)


QWEN_CONFIG = {"add_bos_token": False, "add_prefix_space": False, "bos_token": None, "eos_token": "<|im_end|>",
               "pad_token": "<|endoftext|>", "unk_token": None, "errors": "replace", "split_special_tokens": False,
               "clean_up_tokenization_spaces": False, "model_max_length": 131072,
               "additional_special_tokens": QWEN_SPECIALS, "tokenizer_class": "Qwen2Tokenizer"}
LLAMA3_CONFIG = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "clean_up_tokenization_spaces": False,
                 "model_input_names": ["input_ids", "attention_mask"], "model_max_length": 131072,
                 "tokenizer_class": "PreTrainedTokenizerFast"}

FAMILIES = {
    "qwen3": Family("qwen2.5", "qwen3.jinja", QWEN_CONFIG, QWEN3_ADDED),
    "qwq": Family("qwen2.5", "qwq.jinja", QWEN_CONFIG, QWEN3_ADDED),
    "deepseek-r1-distill-qwen": Family(
        "qwen2.5", "deepseek-r1-distill-qwen.jinja",
        {"add_bos_token": True, "add_eos_token": False, "bos_token": "<｜begin▁of▁sentence｜>",
         "eos_token": "<｜end▁of▁sentence｜>", "pad_token": "<｜end▁of▁sentence｜>", "unk_token": None,
         "clean_up_tokenization_spaces": False, "model_max_length": 16384,
         "tokenizer_class": "PreTrainedTokenizerFast"},
        DEEPSEEK_QWEN_ADDED, bos_post_processor=True),
    "phi-3.5-mini": Family(
        "llama2", "phi-3.5-mini.jinja",
        {"add_bos_token": False, "add_eos_token": False, "bos_token": "<s>", "eos_token": "<|endoftext|>",
         "pad_token": "<|endoftext|>", "unk_token": "<unk>", "clean_up_tokenization_spaces": False,
         "model_max_length": 131072, "tokenizer_class": "PreTrainedTokenizerFast"},
        PHI35_ADDED),
    "mistral-v3": Family(
        "mistral-7b-v0.1", "mistral-v3.jinja",
        {"add_bos_token": True, "add_eos_token": False, "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
         "clean_up_tokenization_spaces": False, "model_max_length": 32768, "tokenizer_class": "PreTrainedTokenizerFast"},
        [_token(0, "<unk>"), _token(1, "<s>"), _token(2, "</s>")]
        + [_token(3 + n, name) for n, name in enumerate(MISTRAL_V3_CONTROLS)],
        shift=len(MISTRAL_V3_CONTROLS)),
    "llama-3.1": Family("llama3", "llama-3.1.jinja", LLAMA3_CONFIG),
    "llama-3.2": Family("llama3", "llama-3.2.jinja", LLAMA3_CONFIG),
}


def _bos_processor(bos: str, bos_id: int) -> dict:
    special = {"SpecialToken": {"id": bos, "type_id": 0}}
    return {"type": "TemplateProcessing",
            "single": [special, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [special, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}}}


def build_folder(name: str, dest: str | Path) -> Path:
    """Write the tokenizer folder of family ``name`` into ``dest`` (created) and return it."""
    family = FAMILIES[name]
    base = TOKENIZERS / family.base
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    tokenizer = json.loads((base / "tokenizer.json").read_text(encoding="utf-8"))
    if family.shift:  # room for the control tokens, which join the model's vocabulary at ids 3..
        vocab = tokenizer["model"]["vocab"]
        vocab = {piece: id + family.shift if id >= 3 else id for piece, id in vocab.items()}
        vocab.update({t["content"]: t["id"] for t in family.added if t["id"] >= 3})
        tokenizer["model"]["vocab"] = dict(sorted(vocab.items(), key=lambda item: item[1]))
    if family.added is not None:
        tokenizer["added_tokens"] = family.added
    added = tokenizer["added_tokens"]
    config = dict(family.config)
    if family.bos_post_processor:
        bos = config["bos_token"]
        tokenizer["post_processor"] = _bos_processor(bos, next(t["id"] for t in added if t["content"] == bos))
    elif family.base == "llama2":  # Phi-3.5 adds no BOS (add_bos_token false)
        tokenizer["post_processor"] = None
    config["added_tokens_decoder"] = {
        str(t["id"]): {k: t[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")}
        for t in added}
    config["chat_template"] = (TEMPLATES / family.template).read_text(encoding="utf-8")
    (dest / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False), encoding="utf-8")
    (dest / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=1), encoding="utf-8")
    for licence in ("LICENSE", "NOTICE"):
        if (base / licence).is_file():
            (dest / licence).write_bytes((base / licence).read_bytes())
    return dest
