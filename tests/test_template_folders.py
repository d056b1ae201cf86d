"""The tokenizer folders of current chat models (tests/template_folders.py) load as upstream's do.

Each is checked by transformers and by packprep's own loader: same special tokens and size, the
model's added tokens at their upstream ids, and the same rendering and ids for a 2-turn chat.
"""

import pytest
from transformers import AutoTokenizer

from packprep.render import ChatTemplate
from packprep.template_inputs import template_variables
from packprep.tokenization import load_tokenizer
from packprep.tokenizer_folder import FolderTokenizer

from .conftest import needs_fixtures, slow_but
from .template_folders import FAMILIES

CHAT = [{"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris."}]

# (size with added tokens, bos id, eos id, {token: id} that must hold, rendering of CHAT)
EXPECTED = {
    "qwen3": (151669, None, 151645, {"<think>": 151667, "</think>": 151668, "<tool_response>": 151665,
                                     "</tool_response>": 151666, "<tool_call>": 151657},
              "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
              "<think>\n\n</think>\n\nThe capital of France is Paris.<|im_end|>\n"),
    "qwq": (151669, None, 151645, {"<think>": 151667, "</think>": 151668},
            "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
            "The capital of France is Paris.<|im_end|>\n"),
    "deepseek-r1-distill-qwen": (
        151665, 151646, 151643, {"<｜User｜>": 151644, "<｜Assistant｜>": 151645, "<think>": 151648, "</think>": 151649},
        "<｜begin▁of▁sentence｜><｜User｜>What is the capital of France?<｜Assistant｜>"
        "The capital of France is Paris.<｜end▁of▁sentence｜>"),
    "phi-3.5-mini": (32011, 1, 32000, {"<|assistant|>": 32001, "<|system|>": 32006, "<|end|>": 32007, "<|user|>": 32010},
                     "<|user|>\nWhat is the capital of France?<|end|>\n<|assistant|>\n"
                     "The capital of France is Paris.<|end|>\n<|endoftext|>"),
    "mistral-v3": (32768, 1, 2, {"[INST]": 3, "[/INST]": 4, "[TOOL_CALLS]": 5, "[AVAILABLE_TOOLS]": 6,
                                 "[TOOL_RESULTS]": 8, "[control_12]": 14, "[REFERENCE_DOC_0]": 770},
                   "<s>[INST] What is the capital of France?[/INST] The capital of France is Paris.</s>"),
    "llama-3.1": (128256, 128000, 128009, {"<|eot_id|>": 128009, "<|python_tag|>": 128010, "<|eom_id|>": 128008},
                  "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
                  "Today Date: 26 Jul 2024\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n"
                  "What is the capital of France?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
                  "The capital of France is Paris.<|eot_id|>"),
    "llama-3.2": (128256, 128000, 128009, {"<|eot_id|>": 128009},
                  "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
                  "Today Date: 26 Jul 2024\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n"
                  "What is the capital of France?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
                  "The capital of France is Paris.<|eot_id|>"),
}


def test_every_family_has_an_expectation():
    assert set(EXPECTED) == set(FAMILIES)


@needs_fixtures
@pytest.mark.parametrize("name", slow_but({"phi-3.5-mini", "mistral-v3", "deepseek-r1-distill-qwen"}, sorted(FAMILIES)))
def test_the_folder_loads_in_transformers_and_in_packprep_alike(name, template_folder):
    folder = template_folder(name)
    theirs, ours = AutoTokenizer.from_pretrained(folder), load_tokenizer(folder)
    assert isinstance(ours, FolderTokenizer)
    size, bos, eos, ids, rendering = EXPECTED[name]
    assert (len(theirs), theirs.bos_token_id, theirs.eos_token_id) == (size, bos, eos)
    assert (len(ours), ours.bos_token_id, ours.eos_token_id) == (size, bos, eos)
    assert {token: theirs.convert_tokens_to_ids(token) for token in ids} == ids
    assert {token: ours.backend_tokenizer.token_to_id(token) for token in ids} == ids

    # Llama-3.2 reads the clock (strftime_now): packprep gives it a fixed date, and so does this call
    text = theirs.apply_chat_template(CHAT, tokenize=False, **template_variables())
    assert text == rendering
    assert ChatTemplate(ours).render(CHAT, None, False) == text
    expected_ids = theirs(text, add_special_tokens=False)["input_ids"]
    assert ours.backend_tokenizer.encode(text, add_special_tokens=False).ids == expected_ids
    for token, id in ids.items():
        if token in text:
            assert id in expected_ids  # the added tokens are read as single tokens, not spelled out
