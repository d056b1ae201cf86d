"""Labels equal the per-prefix reference on every real tokenizer and every fixture file.

The reference of truth: for assistant turn k, the labels are the tokens of
``render(messages[:k+1])`` beyond ``render(messages[:k], add_generation_prompt=True)``, read
positionally (``B[len(A):]``). The fixture templates render every turn of the whole conversation as
at inference, so each conversation is one sequence (tests/test_turn_context.py covers templates
that do not). Where a token straddles the prompt/reply boundary (Mistral v0.1
renders ``[/INST]`` straight against the reply, and ``]`` merges with the reply's first
character), that token sits at position ``len(A) - 1`` and so belongs to the prompt: not trained.
packprep computes the same labels from one rendering and one tokenizer call per conversation.
"""

from __future__ import annotations

import pytest
from jinja2 import TemplateError

from packprep.normalize import Conversation, FieldNames, Policy, Rejected, detect_format, normalize
from packprep.read import read_records, resolve_inputs
from packprep.template_fit import fit_to_template
from packprep.tokenization import ChatEncoder, Encoded, load_tokenizer

from .conftest import CONVERSATIONS, fixture_tokenizer, needs_fixtures
from .reference_labels import exact_sequences, renderer, token_sequences, turn_targets
from .test_control_text import oracle_ids

TOKENIZERS = ["llama3", "qwen2.5", "mistral-7b-v0.1", "llama2", "gpt2"]
FILES = [
    "fastchat_dummy_conversation.json",
    "llamafactory_dpo_en_demo.json",
    "llamafactory_glaive_toolcall_en_demo.json",
    "llamafactory_kto_en_demo.json",
    "medicalgpt_sharegpt_zh_1K_format.jsonl",
]


def conversations(name: str, policy: Policy = Policy()) -> list[Conversation]:
    source = resolve_inputs([str(CONVERSATIONS / name)])[0]
    out = []
    for record in read_records(source):
        try:
            out.append(normalize(record.data, detect_format(record.data), FieldNames(), policy))
        except Rejected:
            pass
    return out


def reference_texts(tok, conversation: Conversation) -> list[str] | None:
    """[full, A_1, B_1, A_2, B_2, ...] rendered with the public API, or None if the template refuses."""
    messages = conversation.messages
    turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns:
        return None
    messages = messages[: turns[-1] + 1]

    def render(prefix, generation=False):
        return tok.apply_chat_template(prefix, tools=conversation.tools, tokenize=False,
                                       add_generation_prompt=generation)

    try:
        texts = [render(messages)]
        for k in turns:
            texts += [render(messages[:k], True), render(messages[: k + 1])]
    except Exception:
        return None
    return texts


# The reference costs O(turns^2) tokens per conversation; the 26 conversations of more than 40
# messages hold 60% of it, so they are checked with one tokenizer (llama3), every other one with all.
LONG = 40


@needs_fixtures
@pytest.mark.parametrize("tokenizer_name", TOKENIZERS)
def test_labels_equal_the_per_prefix_reference(tokenizer_name):
    tok = load_tokenizer(fixture_tokenizer(tokenizer_name), transformers=True)  # the reference
    encoder = ChatEncoder(load_tokenizer(fixture_tokenizer(tokenizer_name)))
    policy = fit_to_template(encoder.template.render)  # as pack fits records to this template
    total = control_text = split = 0
    for name in FILES:
        convs = conversations(name, policy)
        if tokenizer_name != "llama3":
            convs = [c for c in convs if len(c.messages) <= LONG]
        ours = encoder.encode(convs)
        for conversation, encoded in zip(convs, ours):
            texts = reference_texts(tok, conversation)
            if texts is None:
                assert isinstance(encoded, Rejected), f"{name}: reference refuses, packprep packed it"
                continue
            assert isinstance(encoded, Encoded), f"{name}: packprep rejected {encoded}"
            if conversation.trained:  # a turn trained in another form than its history's (tool calls as text)
                messages = conversation.messages[: max(k for k, m in enumerate(conversation.messages)
                                                       if m["role"] == "assistant") + 1]
                found, _, _ = turn_targets(renderer(tok), messages, conversation.tools, trained=conversation.trained)
                expected = [seq for text, spans in exact_sequences(found) for seq in token_sequences(tok, text, spans)]
                assert [(i.tolist(), l.tolist()) for i, l in encoded.sequences] == expected, f"{name}: labels differ"
                total += 1
                continue
            if not encoded.control_text:  # the token-exact definition: each context tokenized on its own
                full = texts[0]
                spans = [(len(before), len(after)) for before, after in zip(texts[1::2], texts[2::2])
                         if len(after) > len(before)]
                assert all(full.startswith(t) for t in texts[1:]), "each prefix's rendering is a prefix of the whole"
                expected = token_sequences(tok, full, spans)
                assert [(i.tolist(), l.tolist()) for i, l in encoded.sequences] == expected, f"{name}: labels differ"
                split += len(expected) > 1
                total += 1
                continue
            assert not encoded.earlier and not encoded.turns_rewritten, "one sequence, every turn as at inference"
            if encoded.control_text:  # content spelling a control token is text (test_control_text.py)
                contents = [m["content"] for m in conversation.messages if isinstance(m.get("content"), str)]
                ids = [oracle_ids(tok, text, contents) for text in texts]
                control_text += 1
            else:
                ids = [e.ids for e in tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False)]
            full = ids[0]
            labels = [-100] * len(full)
            for before, after in zip(ids[1::2], ids[2::2]):
                assert full[: len(after)] == after, "each turn's rendering is a token prefix of the whole"
                labels[len(before) : len(after)] = after[len(before) :]
            assert encoded.input_ids.tolist() == full
            assert encoded.labels.tolist() == labels, f"{name}: labels differ from the reference"
            total += 1
    assert total > 1000
    print(f"{tokenizer_name}: {control_text} of {total} conversations spell a control token in their text; "
          f"{split} need a sequence of their own for a turn whose context tokenizes differently alone")


@needs_fixtures
@pytest.mark.parametrize("tokenizer_name", ["llama3", "qwen2.5", "mistral-7b-v0.1"])
def test_ids_equal_apply_chat_template(tokenizer_name):
    tok = load_tokenizer(fixture_tokenizer(tokenizer_name), transformers=True)  # the reference
    encoder = ChatEncoder(load_tokenizer(fixture_tokenizer(tokenizer_name)))
    convs = conversations("llamafactory_glaive_toolcall_en_demo.json")[:100]
    for conversation, encoded in zip(convs, encoder.encode(convs)):
        if isinstance(encoded, Rejected):
            continue
        try:
            expected = tok.apply_chat_template(conversation.messages, tools=conversation.tools, tokenize=True,
                                               return_dict=False)
        except TemplateError:  # refused whole: each turn it renders is a sequence of its own (test_exact_turns)
            assert encoded.turns_not_located > 0
            continue
        assert encoded.input_ids.tolist() == expected


@needs_fixtures
def test_template_rejections_name_the_cause():
    encoder = ChatEncoder(load_tokenizer(fixture_tokenizer("mistral-7b-v0.1")))
    system = Conversation(messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                                    {"role": "assistant", "content": "Hello"}])
    twice = Conversation(messages=[{"role": "user", "content": "Hi"}, {"role": "user", "content": "Hi?"},
                                   {"role": "assistant", "content": "Hello"}])
    for conversation in (system, twice):
        result = encoder.encode([conversation])[0]
        assert isinstance(result, Rejected)
        assert result.code == "template_error"
        assert "the chat template cannot render" in str(result)
        assert "the template says: " in str(result), "the template author's own words are quoted"


STRIPPING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and not loop.last %}{{ m['content'].split('</think>')[-1] }}"
    "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_that_rewrites_earlier_turns_trains_each_turn_in_its_own_context():
    """turn_context exact (the default): a turn the full rendering rewrites gets a sequence of its own,
    ending with it, as the model saw its context; intact (the behaviour before) leaves it untrained,
    counted; rendered trains it as the full rendering writes it, counted."""
    from .conftest import EXAMPLE_TOKENIZER

    tok = load_tokenizer(str(EXAMPLE_TOKENIZER))
    tok.chat_template = STRIPPING_TEMPLATE
    conversation = Conversation(messages=[
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "<think>hmm</think>first"},
        {"role": "user", "content": "two"},
        {"role": "assistant", "content": "<think>ok</think>second"},
    ])

    def trained(ids, labels):
        return tok.decode([t for t, label in zip(ids, labels) if label != -100])

    exact = ChatEncoder(tok).encode([conversation])[0]
    assert [trained(*s) for s in exact.sequences] == ["<think>hmm</think>first<|im_end|>\n",
                                                        "<think>ok</think>second<|im_end|>\n"]
    assert tok.decode(exact.sequences[0][0]).endswith("first<|im_end|>\n")  # it ends with its turn
    assert (exact.turns_not_located, exact.turns_rewritten, exact.repeated_tokens) == (0, 1, len(exact.earlier[0][0]))
    intact = ChatEncoder(tok, turn_context="intact").encode([conversation])[0]
    assert intact.turns_not_located == 1 and len(intact.sequences) == 1
    assert trained(intact.input_ids, intact.labels) == "<think>ok</think>second<|im_end|>\n"
    rendered = ChatEncoder(tok, turn_context="rendered").encode([conversation])[0]
    assert (rendered.turns_not_located, rendered.turns_out_of_context) == (0, 1)
    assert trained(rendered.input_ids, rendered.labels) == "first<|im_end|>\n<think>ok</think>second<|im_end|>\n"
    only_rewritten = Conversation(messages=conversation.messages[:2] + [{"role": "user", "content": "x"}])
    assert ChatEncoder(tok).encode([only_rewritten])[0].turns_rewritten == 0  # trailing user turn dropped


def test_a_conversation_trained_only_at_its_first_token_is_rejected():
    """A sequence's first label is never trained once packed: a reply that is only that token trains nothing."""
    from .conftest import EXAMPLE_TOKENIZER

    tok = load_tokenizer(str(EXAMPLE_TOKENIZER))
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    encoder = ChatEncoder(tok)
    one, two = encoder.encode([Conversation(messages=[{"role": "user", "content": ""},
                                                      {"role": "assistant", "content": reply}])
                               for reply in ("a", "a b")])
    assert isinstance(one, Rejected) and one.code == "no_supervised_tokens"
    assert isinstance(two, Encoded) and (two.labels == two.input_ids).all() and len(two.labels) == 2
    encoder.eos_token_id = None  # a plain text is then trained as it is, with no EOS added
    one, two = encoder.encode([Conversation(text="a"), Conversation(text="a b")])
    assert isinstance(one, Rejected) and one.code == "no_supervised_tokens"
    assert isinstance(two, Encoded) and two.labels.tolist() == two.input_ids.tolist() == [67, 311]
