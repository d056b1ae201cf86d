"""Tokenizer folders of current chat models, assembled from the fixture vocabularies and real templates.

The Hub is out of reach in tests, so each folder is built from a fixture tokenizer that has the same
vocabulary as the model (tests/templates/SOURCES.md says why each is the same), the model's own added
tokens at their upstream ids and flags, its special tokens, and its chat template as published
(tests/templates/*.jinja). ``tokenizer_class`` is one whose behaviour lives wholly in tokenizer.json,
so that transformers and packprep's own loader (packprep/tokenizer_folder.py) read the same pipeline.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from packprep.tokenizer_make import added_token, write_folder

from .conftest import TOKENIZERS

TEMPLATES = Path(__file__).resolve().parent / "templates"


_token = added_token


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
    return write_folder(dest, tokenizer, config, (TEMPLATES / family.template).read_text(encoding="utf-8"), base)


# ---- the template zoo: every public template of tests/templates/zoo/ on a fixture vocabulary ----------

ZOO_TEMPLATES = TEMPLATES / "zoo"
# The control strings a template writes: <|im_start|>, <｜User｜>, [INST], <start_of_turn>, <seed:think>,
# Gemma 4's <|turn>/<turn|>, MiniMax's ]~b], and the XML-like tags reasoning/tool templates use as tokens.
CONTROL = re.compile(
    r"<\|[^|<>\s'\"{}]{1,40}\|>|<\|\"\|>|<｜[^｜\s'\"]{1,40}｜>|\[/?[A-Z][A-Z_]{1,30}\]|\[gMASK\]|<sop>"
    r"|<(?:start|end)_of_turn>|</?seed:[a-z_]+>|<\|[a-z_]+>|<[a-z_]+\|>|<SPECIAL_\d+>|<sep>|\]~!?b[\[\]]|\[e~\["
    r"|</?(?:think|thinking|tool_call|tool_calls|tool_response|tools|arg_key|arg_value|available_tools)>")
PLAIN = re.compile(r"</?[a-z_]+>")  # tag-like strings are added as non-special tokens, as Qwen3's <think>


@dataclass(frozen=True)
class ZooEntry:
    """A template of the zoo and the fixture vocabulary it is tokenized with (SOURCES.md: which are the
    model's own vocabulary and which stand in for one that is in no fixture)."""

    template: str  # file in tests/templates/zoo
    base: str  # fixture tokenizer
    bos: str | None
    eos: str
    extra: tuple = ()  # control strings the pattern misses


Q, L3, MI, L2, G2 = "qwen2.5", "llama3", "mistral-7b-v0.1", "llama2", "gpt2"
DS_BOS, DS_EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
ZOO = {
    "qwen2.5": ZooEntry("Qwen-Qwen2.5-7B-Instruct.jinja", Q, None, "<|im_end|>"),
    "qwen3-coder": ZooEntry("Qwen3-Coder.jinja", Q, None, "<|im_end|>"),
    "qwen3.5": ZooEntry("Qwen3.5-4B.jinja", Q, None, "<|im_end|>"),
    "mimo-vl": ZooEntry("MiMo-VL.jinja", Q, None, "<|im_end|>"),
    "mirothinker": ZooEntry("MiroThinker.jinja", Q, None, "<|im_end|>"),
    "smollm3": ZooEntry("HuggingFaceTB-SmolLM3-3B.jinja", L3, None, "<|im_end|>"),
    "hermes-3": ZooEntry("NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja", L3, "<|begin_of_text|>", "<|im_end|>"),
    "firefunction-v2": ZooEntry("fireworks-ai-llama-3-firefunction-v2.jinja", L3, "<|begin_of_text|>", "<|eot_id|>"),
    "functionary-v3.1": ZooEntry("meetkai-functionary-medium-v3.1.jinja", L3, "<|begin_of_text|>", "<|eot_id|>"),
    "functionary-v3.2": ZooEntry("meetkai-functionary-medium-v3.2.jinja", L3, "<|begin_of_text|>", "<|eot_id|>"),
    "deepseek-r1-distill-llama": ZooEntry("deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja", L3, DS_BOS, DS_EOS),
    "deepseek-v3.1": ZooEntry("deepseek-ai-DeepSeek-V3.1.jinja", Q, DS_BOS, DS_EOS),
    "deepseek-v3.2": ZooEntry("deepseek-ai-DeepSeek-V3.2.jinja", Q, DS_BOS, DS_EOS),
    "kimi-k2": ZooEntry("moonshotai-Kimi-K2.jinja", Q, "[BOS]", "<|im_end|>"),
    "kimi-k2-instruct": ZooEntry("Kimi-K2-Instruct.jinja", Q, "[BOS]", "<|im_end|>"),
    "kimi-k2-thinking": ZooEntry("Kimi-K2-Thinking.jinja", Q, "[BOS]", "<|im_end|>"),
    "glm-4.6": ZooEntry("GLM-4.6.jinja", Q, None, "<|endoftext|>"),
    "glm-4.7-flash": ZooEntry("GLM-4.7-Flash.jinja", Q, None, "<|endoftext|>"),
    "minimax-m2": ZooEntry("MiniMax-M2.jinja", Q, "]~!b[", "[e~["),
    "minimax-m3": ZooEntry("MiniMax-M3.jinja", Q, "]~!b[", "[e~["),
    "gpt-oss": ZooEntry("openai-gpt-oss-120b.jinja", Q, "<|startoftext|>", "<|return|>", ("<|constrain|>",)),
    "seed-oss": ZooEntry("ByteDance-Seed-OSS.jinja", Q, "<seed:bos>", "<seed:eos>"),
    "nemotron-nano-v2": ZooEntry("NVIDIA-Nemotron-Nano-v2.jinja", Q, None, "<SPECIAL_12>"),
    "nemotron-3-nano": ZooEntry("NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja", Q, None, "<|im_end|>"),
    "granite-3.3": ZooEntry("ibm-granite-granite-3.3-2B-Instruct.jinja", G2, "<|end_of_text|>", "<|end_of_text|>"),
    "granite-4.0": ZooEntry("ibm-granite-granite-4.0.jinja", G2, "<|end_of_text|>", "<|end_of_text|>"),
    "granite-4.1": ZooEntry("ibm-granite-granite-4.1.jinja", G2, "<|end_of_text|>", "<|end_of_text|>"),
    "command-r-plus": ZooEntry("CohereForAI-c4ai-command-r-plus-tool_use.jinja", Q, "<BOS_TOKEN>", "<|END_OF_TURN_TOKEN|>"),
    "command-r7b": ZooEntry("CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja", Q, "<BOS_TOKEN>",
                            "<|END_OF_TURN_TOKEN|>"),
    "lfm2": ZooEntry("LFM2-8B-A1B.jinja", Q, "<|startoftext|>", "<|im_end|>"),
    "lfm2.5": ZooEntry("LFM2.5-8B-A1B.jinja", Q, "<|startoftext|>", "<|im_end|>"),
    "lfm2.5-instruct": ZooEntry("LFM2.5-Instruct.jinja", Q, "<|startoftext|>", "<|im_end|>"),
    "stepfun-3.5": ZooEntry("StepFun3.5-Flash.jinja", Q, "<｜begin▁of▁sentence｜>", "<|im_end|>"),
    "reka-edge": ZooEntry("Reka-Edge.jinja", Q, None, "<sep>"),
    "gigachat3": ZooEntry("GigaChat3-10B-A1.8B.jinja", Q, "<s>", "</s>"),
    "gigachat3.1": ZooEntry("GigaChat3.1-10B-A1.8B.jinja", Q, "<s>", "</s>"),
    "solar-open": ZooEntry("upstage-Solar-Open-100B.jinja", Q, None, "<|end|>"),
    "apertus": ZooEntry("Apertus-8B-Instruct.jinja", MI, "<s>", "<|assistant_end|>"),
    "apriel-1.5": ZooEntry("unsloth-Apriel-1.5.jinja", MI, "<s>", "<|end|>"),
    "apriel-1.6": ZooEntry("Apriel-1.6-15b-Thinker-fixed.jinja", MI, "<s>", "<|end|>"),
    "bielik-v3": ZooEntry("Bielik-11B-v3.0-Instruct.jinja", MI, "<s>", "<|im_end|>"),
    "mistral-nemo": ZooEntry("mistralai-Mistral-Nemo-Instruct-2407.jinja", MI, "<s>", "</s>"),
    "mistral-small-3.2": ZooEntry("Mistral-Small-3.2-24B-Instruct-2506.jinja", MI, "<s>", "</s>"),
    "devstral-small": ZooEntry("unsloth-mistral-Devstral-Small-2507.jinja", MI, "<s>", "</s>"),
    "ministral-3-reasoning": ZooEntry("mistralai-Ministral-3-14B-Reasoning-2512.jinja", MI, "<s>", "</s>"),
    "gemma-2": ZooEntry("google-gemma-2-2b-it.jinja", L2, "<bos>", "<end_of_turn>"),
    "gemma-4": ZooEntry("google-gemma-4-31B-it.jinja", L2, "<bos>", "<turn|>"),
    "gemma-4-interleaved": ZooEntry("google-gemma-4-31B-it-interleaved.jinja", L2, "<bos>", "<turn|>"),
}
ZOO_NAMES = list(FAMILIES) + list(ZOO)  # every template the conformance checks
KEEP_ADDED = {L3, L2, MI, G2}  # bases whose own added tokens are part of the vocabulary (Qwen2.5's are not)


def zoo_template(name: str) -> str:
    """The chat template of zoo entry (or family) ``name``."""
    path = TEMPLATES / FAMILIES[name].template if name in FAMILIES else ZOO_TEMPLATES / ZOO[name].template
    return path.read_text(encoding="utf-8")


def build_zoo_folder(name: str, dest: str | Path) -> Path:
    """A folder for ``name``: a family of :data:`FAMILIES` as :func:`build_folder` makes it; a zoo entry as
    its base fixture with the base's added tokens (none for Qwen2.5) and then, at the next free ids, the
    control strings its template writes, its BOS and EOS."""
    if name in FAMILIES:
        return build_folder(name, dest)
    entry, template = ZOO[name], zoo_template(name)
    base = TOKENIZERS / entry.base
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    tokenizer = json.loads((base / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = tokenizer["model"]["vocab"]
    added = tokenizer["added_tokens"] if entry.base in KEEP_ADDED else []
    known = set(vocab) | {t["content"] for t in added}
    next_id = max([*vocab.values(), *(t["id"] for t in added)]) + 1
    specials = [t for t in (entry.bos, entry.eos) if t]
    for content in sorted(set(CONTROL.findall(template)) | set(entry.extra)) + specials:
        # BOS and EOS are added tokens even where the vocabulary spells them as text (Qwen2.5's "<s>" is two pieces)
        if content not in known or (content in specials and content not in {t["content"] for t in added}):
            added.append(_token(next_id, content, special=not PLAIN.fullmatch(content)))
            known.add(content)
            next_id += 1
    tokenizer["added_tokens"] = added
    if entry.base in (L2, MI) and entry.bos != "<s>":
        tokenizer["post_processor"] = None  # the base's post-processor adds its <s>
    config = {"bos_token": entry.bos, "eos_token": entry.eos, "pad_token": entry.eos,
              "unk_token": "<unk>" if entry.base in (L2, MI) else None, "clean_up_tokenization_spaces": False,
              "model_max_length": 131072, "tokenizer_class": "PreTrainedTokenizerFast"}
    return write_folder(dest, tokenizer, config, template, base)
