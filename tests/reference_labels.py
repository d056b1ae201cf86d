"""An independent per-turn labeler: the label definition (docs/label-definition.md) rebuilt on
transformers' own chat-template renderer, sharing no code with packprep's renderer.

For each assistant turn k: context ``C_k = render(messages[:k], add_generation_prompt=True)`` and
``R_k = render(messages[:k+1])``; the target is ``R_k`` beyond ``C_k``. What packprep finds by
probing a template is *given* here, read off the template by a person (:data:`SHAPES`): the
constant tail after the last message, and the reasoning block a generation prompt opens. Policy
``exact``: from the last turn backwards, a sequence ``C_k + T_k`` trains turn k and every earlier
turn whose ``C_j + T_j`` (tail left out) begins it. Ids follow the definition on token ids:
each turn's context tokenized alone, its target the ids ``C + T`` adds to those (``T`` alone where
they do not begin with them); a sequence is its last turn's context and target ids, and an earlier
turn it does not hold id for id gets a sequence of its own. ``trained`` gives a message's form when
it is the turn trained (reasoning written inline, tool calls as text), never in the history.
"""

from __future__ import annotations

import os
from datetime import date

from transformers.utils.chat_template_utils import render_jinja_template

# template file -> (constant tail, the reasoning block the generation prompt opens, its closing tag)
SHAPES = {
    "phi-3.5-mini": ("<|endoftext|>", "", ""),
    "deepseek-r1-distill-qwen": ("", "<think>\n", "</think>"),
    "qwq": ("", "<think>\n", "</think>"),
}


DAY = date(2024, 7, 26)  # packprep's default fixed date (docs/label-definition.md, Dates)


def renderer(tok, template: str | None = None):
    """``render(messages, generation, tools)`` through transformers' renderer (what apply_chat_template
    calls), on packprep's default fixed date."""
    def render(messages, generation=False, tools=None):
        texts, _ = render_jinja_template(conversations=[messages], tools=tools,
                                         chat_template=template or tok.chat_template,
                                         add_generation_prompt=generation, **tok.special_tokens_map,
                                         strftime_now=DAY.strftime, date_string=DAY.strftime("%d %b %Y"))
        return texts[0]
    return render


def turn_targets(render, messages, tools=None, shape=("", "", ""), last_only=False, trained=None):
    """({k: (context, target, target without the tail)}, turns whose definition has no value, first refusal)."""
    trained = trained or {}
    tail, opening, closing = shape
    turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    if last_only:
        turns = turns[-1:]
    found, missing, refusal = {}, 0, None
    for k in turns:
        try:
            context = render(messages[:k], True, tools)
            rendered = render(messages[:k] + [trained.get(k, messages[k])], False, tools)
        except Exception as exc:
            missing, refusal = missing + 1, refusal or exc
            continue
        if rendered[: len(context)] == context:
            target = rendered[len(context):]
        elif opening and context.endswith(opening) and rendered.startswith(context[: -len(opening)]):
            message = messages[k]
            reasoning = message.get("reasoning_content")
            if reasoning is None:
                content = message.get("content") or ""
                reasoning = content.split(closing)[0].split(opening.strip())[-1] if closing in content else ""
            answer = rendered[len(context) - len(opening):]
            target = reasoning.strip("\n") + "\n" + closing + "\n\n" + answer.lstrip("\n")
        else:  # the rendering does not extend the context
            target = _rewritten(render, messages[:k], trained.get(k, messages[k]), context, rendered, tools)
            if target is None:
                missing += 1
                continue
        bare = target[: -len(tail)] if tail and target.endswith(tail) and target != tail else target
        found[k] = (context, target, bare)
    return found, missing, refusal


OPENINGS = {"<think>": "</think>", "[THINK]": "[/THINK]", "<|START_THINKING|>": "<|END_THINKING|>"}


def _rewritten(render, before, message, context, rendered, tools):
    """The target where ``rendered`` does not extend ``context``, by the rules of tests/zoo_reference.py:
    both extend the history: the prompt's unshared rest opens a reasoning block the model writes, or is
    a marker it writes after; else after the generation prompt, found last; else from the content on."""
    history = render(before, False, tools)
    if context.startswith(history) and rendered.startswith(history):
        g, t = context[len(history):], rendered[len(history):]
        common = len(os.path.commonprefix([g, t]))
        for opening, closing in (("<", ">"), ("[", "]")):  # never inside a control string
            cut = g.rfind(opening, 0, common)
            if cut >= 0 and g.find(closing, cut, common) < 0 and (closing in g[cut:] or closing in t[cut:]):
                common = min(common, cut)
        g1, t1 = g[common:], t[common:]
        opening = next((o for o in OPENINGS if o in g1 and OPENINGS[o] not in g1[g1.index(o):]), None)
        if opening and opening not in t1 and t1.lstrip().startswith(OPENINGS[opening]):
            return (message.get("reasoning_content") or "").strip("\n") + t1
        if opening and opening not in t1:
            reasoning = (message.get("reasoning_content") or "").strip("\n")
            return ("" if g1.endswith("\n") else "\n") + reasoning + "\n" + OPENINGS[opening] + "\n\n" + t1.lstrip("\n")
        return t1[next((len(g1) - j for j in range(len(g1)) if t1.startswith(g1[j:])), 0):]
    prompt = context[len(history):] if context.startswith(history) else ""
    if prompt.strip() and prompt in rendered:
        return rendered[rendered.rfind(prompt) + len(prompt):]
    if not isinstance(message.get("content"), str) or not message["content"]:
        return None
    other = render(before + [dict(message, content="Zq9Sentinel")], False, tools)
    start = len(os.path.commonprefix([rendered, other]))
    return rendered[start:] if "Zq9Sentinel" in other[start:] else None


def exact_sequences(found: dict):
    """[(text, [(start, end)])] in conversation order: the fewest sequences, greedily from the last turn."""
    out, todo = [], sorted(found)
    while todo:
        context, target, _ = found[todo[-1]]
        text = context + target
        inside = [j for j in todo if text[: len(found[j][0]) + len(found[j][2])] == found[j][0] + found[j][2]]
        spans = []
        for j in inside:
            c, t, bare = found[j]
            end = len(c) + (len(t) if len(c) + len(t) == len(text) else len(bare))
            if end > len(c):
                spans.append((len(c), end))
        if spans:
            out.insert(0, (text, sorted(spans)))
        todo = [j for j in todo if j not in inside]
    return out


def token_sequences(tok, text: str, spans) -> list[tuple[list[int], list[int]]]:
    """The sequences (ids, labels) of one text sequence, in conversation order, each turn on its
    context tokenized alone (the token-exact definition)."""
    encode = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    # every turn's context and context + target in one call of the tokenizer's batch API: the same ids as one
    # call each, its texts tokenized in parallel (the reference's O(turns^2) tokens are most of its time)
    prefixes = tok([text[:cut] for span in spans for cut in span], add_special_tokens=False)["input_ids"] if spans else []
    turns = []
    for (start, end), context, whole in zip(spans, prefixes[::2], prefixes[1::2]):
        turns.append((context, whole[len(context):] if whole[: len(context)] == context else encode(text[start:end])))
    out, left = [], list(range(len(turns)))
    while left:
        context, target = turns[left[-1]]
        ids = context + target
        if left[-1] == len(turns) - 1 and spans[-1][1] < len(text):
            ids += encode(text[spans[-1][1]:])
        labels = [-100] * len(ids)
        held = [k for k in left if ids[: len(turns[k][0]) + len(turns[k][1])] == turns[k][0] + turns[k][1]]
        for k in held:
            a, b = len(turns[k][0]), len(turns[k][0]) + len(turns[k][1])
            labels[a:b] = ids[a:b]
        out.insert(0, (ids, labels))
        left = [k for k in left if k not in held]
    return out
