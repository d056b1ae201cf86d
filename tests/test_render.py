"""One rendering per conversation gives the same spans as rendering every prefix.

render.py cuts ``render(messages[:n], add_generation_prompt=g)`` out of one watched rendering when
it can vouch for it. Here each template is written to tempt a wrong cut (looking ahead, counting
messages, printing them, a tail that is not constant...) and the spans are compared with the
definition: every prefix rendered by transformers' own chat-template renderer
(tests/reference_labels.py).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import packprep
from packprep.normalize import Conversation, Rejected
from packprep.render import ChatTemplate
from packprep.render_onepass import OnePassTemplate, choose_template
from packprep.tokenization import ChatEncoder, load_tokenizer
from packprep.tokenizer_folder import RenderTooLong

from .conftest import EXAMPLE_CHATS, EXAMPLE_TOKENIZER, fixture_tokenizer, needs_fixtures
from .conftest import FIXTURES
from .reference_labels import exact_sequences, renderer, turn_targets
from .test_labels_reference import FILES, conversations

TOKENIZERS_PRESENT = FIXTURES.is_dir()

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# name -> (template, whether every prefix can be cut from the one rendering)
TEMPLATES = {
    "plain loop": (CHATML, True),
    "system from messages[0], loop over messages[1:]": (
        "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}[SYS {{ messages[0]['content'] }}]"
        "{% else %}{% set loop_messages = messages %}{% endif %}"
        "{% for m in loop_messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ loop.index0 }}>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}", True),
    "looks back with loop.previtem": (
        "{% for m in messages %}{% if loop.previtem is defined and loop.previtem['role'] == m['role'] %}+{% endif %}"
        "<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{% if not add_generation_prompt %}.{% else %}<assistant>{% endif %}",
        True),
    "peeks with loop.last": (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% if loop.last %}<END>{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}", False),
    "peeks after user turns only, no generation prompt": (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
        "{% if m['role'] == 'user' and not loop.last %}|{% endif %};{% endfor %}", False),
    "looks ahead with messages[i + 1]": (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
        "{% if messages[loop.index0 + 1] is defined %}|{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}", False),
    "counts the messages first": (
        "{{ messages|length }}:{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}", False),
    "reads the last message first": (
        "[{{ messages[-1]['role'] }}]{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}", False),
    "uses loop.length": (
        "{% for m in messages %}<{{ m['role'] }} {{ loop.revindex }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}", False),
    "filters the messages first": (
        "{% set system = messages|selectattr('role', 'equalto', 'system')|list %}{{ system|length }}"
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}", False),
    "serialises the messages": (
        "{{ messages|tojson }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}", False),
    "prints the messages": (
        "{{ messages }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}", False),
    "compares the messages": (
        "{% if messages == [] %}empty{% endif %}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}", False),
    "a tail that counts": (
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}<{{ m['role'] }}>{{ m['content'] }}"
        "{% endfor %}{% if add_generation_prompt %}<assistant {{ ns.n }}>{% endif %}", False),
    "a tail that reads settings made before the loop": (
        "{% if flag is not defined %}{% set flag = 'on' %}{% endif %}{% set first = messages[0]['role'] %}"
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant {{ flag }} {{ first }}>{% endif %}", True),
    "a tail that reads a name the loop sets": (
        "{% set last = 'none' %}{% for m in messages %}{% set last = m['role'] %}<{{ m['role'] }}>{{ m['content'] }}"
        "{% endfor %}{% if add_generation_prompt %}<assistant {{ last }}>{% endif %}", False),
    "a tail that always writes": (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<EOS>"
        "{% if add_generation_prompt %}<assistant>{% endif %}", True),
    "a filtered loop": (
        "{% for m in messages if m['role'] != 'system' %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}", False),
    "the loop inside an if": (
        "{% if messages %}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{% endif %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}", False),
    "strips reasoning from past turns": (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and not loop.last %}{{ m['content'].split('</think>')[-1] }}"
        "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}", False),
    "raises on a role": (
        "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}{% endif %}"
        "<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}", True),
}


def reference(tok, messages: list[dict]):
    """The definition, through transformers' renderer (tests/reference_labels.py): ([(text, spans)] of
    each sequence, turns not located), or the error. A turn whose prefix the template refuses is not
    located; the conversation is refused if no turn is (a conversation the template refuses whole trains
the turns it renders). None of these templates has a constant tail
    or opens a reasoning block."""
    turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    messages = messages[: turns[-1] + 1]
    render = renderer(tok)  # apply_chat_template's renderer: it also takes the empty prefix
    try:
        render(messages)
        whole = None
    except Exception as exc:  # refused whole: each turn it renders is still trained on its own
        whole = exc
    found, missing, refused = turn_targets(render, messages)
    sequences = exact_sequences(found)
    if (refused or whole) is not None and not sequences:
        return refused or whole
    return sequences, missing


def ours(encoder, messages):
    try:
        rendered = encoder.render(Conversation(messages=messages))
    except Rejected as exc:
        return exc
    return [(r.text, r.spans) for r in (*rendered.earlier, rendered)], rendered.turns_not_located


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(str(EXAMPLE_TOKENIZER))


message = st.fixed_dictionaries({
    "role": st.sampled_from(["user", "assistant", "system", "tool"]),
    "content": st.text(alphabet="ab </think>\n", max_size=12),
})
chats = st.lists(message, min_size=1, max_size=9).filter(lambda ms: any(m["role"] == "assistant" for m in ms))


@pytest.mark.parametrize("name", list(TEMPLATES))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=chats)
def test_one_rendering_gives_the_spans_of_every_prefix_rendered(tok, name, messages):
    tok.chat_template = TEMPLATES[name][0]
    assert_agrees(ours(ChatEncoder(tok, backend="hf"), messages), reference(tok, messages))


def assert_agrees(got, expected):
    if isinstance(expected, Exception):
        assert isinstance(got, Rejected) and got.code == "template_error", (expected, got)
        if type(expected).__name__ == "TemplateError":  # raise_exception(): the template author's words are quoted
            assert str(expected) in str(got)
        else:  # an error inside the template's code ("list object has no element 0") is not
            assert len(str(expected)) < 4 or str(expected) not in str(got)
    elif isinstance(got, Rejected):  # no turn located, or nothing to train: the reference agrees
        assert not expected[0], (expected, got)
    else:
        assert got == expected


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_the_watch_cuts_exactly_where_it_can_vouch(tok, name):
    template, vouches = TEMPLATES[name]
    tok.chat_template = template
    encoder = ChatEncoder(tok, backend="hf")
    messages = [{"role": r, "content": f"{r} {i}"} for i, r in enumerate(["system", "user", "assistant", "user", "assistant",
                                                                        "user", "assistant"])]
    assert_agrees(ours(encoder, messages), reference(tok, messages))
    assert (encoder.template.work.prefixes == 0) == vouches


@needs_fixtures
@pytest.mark.parametrize("tokenizer_name", ["llama3", "qwen2.5", "mistral-7b-v0.1", "llama2", "gpt2"])
def test_real_templates_render_each_conversation_once(tokenizer_name):
    """The label reference test proves the spans right; this proves the shortcut is taken on real templates."""
    encoder = ChatEncoder(load_tokenizer(fixture_tokenizer(tokenizer_name)), backend="hf")
    convs = [c for name in FILES for c in conversations(name)]
    rendered = 0
    for conversation in convs:
        before = encoder.template.work.prefixes
        try:
            encoder.render(conversation)
            rendered += 1
        except Rejected:
            pass
        try:
            encoder.template.render(conversation.messages, conversation.tools)
        except Rejected:  # refused whole (Mistral: roles that do not alternate): each prefix is rendered on its own
            encoder.template.work.prefixes = before
    tool_turns = sum(1 for c in convs for m in c.messages if m["role"] == "tool")
    assert rendered > 500
    # qwen2.5 peeks ahead (loop.last) after tool messages only; no other template ever looks ahead
    assert encoder.template.work.prefixes <= (tool_turns if tokenizer_name == "qwen2.5" else 0)


# ---------------------------------------------------------------------------------------------
# the accelerator is optional, checked, and never silently off
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["example", "llama3", "qwen2.5", "mistral-7b-v0.1", "llama2", "gpt2"])
def test_the_one_pass_accelerator_runs_with_the_installed_jinja(name):
    """Fails loudly when an upgrade takes away what render_onepass relies on (Jinja's compiled
    render function, its loop context), instead of every run silently rendering the slow way."""
    if name != "example" and not TOKENIZERS_PRESENT:
        pytest.skip("../shared/fixtures is not beside the repo")
    tok = load_tokenizer(str(EXAMPLE_TOKENIZER) if name == "example" else fixture_tokenizer(name))
    OnePassTemplate(tok)  # raises Unavailable, saying why, where it cannot be built
    encoder = ChatEncoder(tok, backend="hf")
    assert isinstance(encoder.template, OnePassTemplate) and encoder.template.name == "one-pass"


def test_the_one_pass_rendering_stops_at_the_size_limit():
    """A loop that writes a message over and over (no single big string for the sandbox's ``*`` check)
    meets the size limit in the watched rendering as in the reference's, before the whole text is in
    memory: with nested loops it would be gigabytes."""
    tok = load_tokenizer(str(EXAMPLE_TOKENIZER))
    tok.chat_template = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
                         "{% for i in range(copies) %}{{ message['content'] }}{% endfor %}{{ '<|im_end|>\\n' }}"
                         "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    messages = [{"role": "user", "content": "y" * 1000}, {"role": "assistant", "content": "ok"}]
    assert len(OnePassTemplate(tok, {"copies": 2}).render_with_prefixes(messages, None)[0]) == 2065
    with pytest.raises(RenderTooLong):  # 100M characters, 1,000 at a time
        OnePassTemplate(tok, {"copies": 99_999}).render_with_prefixes(messages, None)


def _pack(tmp_path, name):
    out = tmp_path / name
    manifest = packprep.pack(str(EXAMPLE_CHATS), str(out), str(EXAMPLE_TOKENIZER), max_len=512, num_proc=1)
    return manifest, {p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*.parquet"))}


def test_without_the_accelerator_the_reference_runs_says_so_and_gives_the_same_bytes(tmp_path, monkeypatch):
    import packprep.render_onepass as render_onepass

    fast_manifest, fast_shards = _pack(tmp_path, "fast")
    assert fast_manifest["tokenizer"]["rendering"] == "one-pass"

    def changed_jinja(environment, source):  # what a Jinja release without the internals the watch uses does
        raise AttributeError("'Template' object has no attribute 'root_render_func'")

    monkeypatch.setattr(render_onepass, "_watchable", changed_jinja)
    with pytest.warns(UserWarning, match="reference way.*Jinja differs.*root_render_func"):
        manifest, shards = _pack(tmp_path, "reference")
    assert manifest["tokenizer"]["rendering"] == "reference"
    assert shards == fast_shards


def test_an_accelerator_that_disagrees_with_the_reference_is_not_used(tok, monkeypatch):
    tok.chat_template = CHATML
    assert isinstance(choose_template(tok), OnePassTemplate)
    render = OnePassTemplate.render
    monkeypatch.setattr(OnePassTemplate, "render", lambda self, *args: render(self, *args).replace("\n", "\r\n"))
    with pytest.warns(UserWarning, match="differently from the reference"):
        template = choose_template(tok)
    assert type(template) is ChatTemplate and template.name == "reference"
