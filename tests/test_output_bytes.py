"""Output bytes do not drift: every strategy and layout, packed from the example and the fixture
conversations, gives the files whose sha256s were captured from the code at 777d603
(``tests/output_bytes.json``), so a refactor that changes one byte of a shard, the manifest, the
rejects or the card fails here. Re-captured once since, at the merge of issues 23-28, where only the
intended changes moved bytes: the manifest and card gained settings and counts, the DPO demo is
packed with ``--preference chosen``, and the KTO demo's literal ``</s>`` is text for Mistral and
Llama-2 (with ``--content-special-tokens special`` the shards equal 777d603's). Re-captured again
for the token-exact definition: no shard changed; the manifest and card gained the ``tool_calls``
setting and the ``roles_mapped`` and ``reasoning_trained`` counts, and the unknown-role rejection
lists ``developer`` among the known roles. And once more when reject reasons came to name settings as
the caller spells them: packed from Python here, the fixtures' rejects.jsonl, manifest and card say
``max_len 1024``, not ``--max-len 1024``; no shard changed. And when reasons came whole: the example's
rejects.jsonl, manifest and card quote the unknown role's list and the schema's complaint without
cutting them, and the manifest names a fourth reason; no shard changed. And when the plain loop's
recipe came to load ``MODEL`` (runnable on the page, not ``...``): the packprep layout's cards only.
And when the manifest and card came to count the assistant turns and supervised tokens
``--max-len`` cuts (``turns_cut``, ``supervised_cut``, and a record that loses a sequence to truncation
counted truncated): no shard or rejects.jsonl changed.
And when a record came to reach the template
as the data has it by default: the manifest records ``consecutive: auto`` and the card says the turns
went ``as the data has them``; no shard or rejection changed (no fixture record has two turns of a role
in a row or a system message for a template that refuses one). And the card's line of what ``--max-len``
cut came to say "1 assistant turn" in the singular: the example's cards only.

Paths of the inputs and the output are replaced by placeholders before hashing. To re-capture after
an intended change of output: ``PYTHONPATH=. python tests/test_output_bytes.py --write``.
"""

import hashlib
import json
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import packprep  # noqa: E402
from packprep.layout import LAYOUTS  # noqa: E402
from packprep.packing import STRATEGIES  # noqa: E402
from tests.conftest import CONVERSATIONS, EXAMPLE_CHATS, EXAMPLE_TOKENIZER, fixture_tokenizer, needs_fixtures  # noqa: E402

EXPECTED = Path(__file__).with_name("output_bytes.json")
TEXT = {"README.md", "packprep.json", "rejects.jsonl"}


def _cases():
    """Every strategy in the default layout and every layout with two strategies, per source."""
    pairs = [(s, "packprep") for s in STRATEGIES]
    pairs += [(s, name) for name in LAYOUTS if name != "packprep" for s in ("greedy", "random")]
    return [(source, s, name) for source in ("example", "fixtures") for s, name in pairs]


def _pack(source: str, strategy: str, layout: str, out: Path) -> None:
    if source == "example":
        inputs, tokenizer, max_len = [str(EXAMPLE_CHATS)], str(EXAMPLE_TOKENIZER), 512
    else:
        inputs = [str(p) for p in sorted(CONVERSATIONS.glob("*.json*"))]
        tokenizer, max_len = fixture_tokenizer("qwen2.5"), 1024
    extra = {"samples_per_row": 4} if strategy == "minibatch" else {}
    if source == "fixtures":
        extra["preference"] = "chosen"  # the DPO demo: preference data is refused unless told what to train
    packprep.pack(inputs, str(out), tokenizer=tokenizer, max_len=max_len, strategy=strategy, layout=layout,
                  num_proc=1, **extra)


def _hashes(out: Path, source: str) -> dict[str, str]:
    """sha256 of each file under ``out``; text files with the machine's paths replaced first."""
    roots = {str(out): "<OUT>", str(EXAMPLE_CHATS.parent.parent): "<REPO>", str(CONVERSATIONS.parent): "<FIXTURES>"}
    found = {}
    for path in sorted(p for p in out.rglob("*") if p.is_file()):
        data = path.read_bytes()
        if path.name in TEXT:
            text = data.decode()
            for root, mark in roots.items():
                text = text.replace(root, mark)
            data = text.encode()
        found[path.relative_to(out).as_posix()] = hashlib.sha256(data).hexdigest()
    return found


def _key(source, strategy, layout):
    return f"{source}/{strategy}/{layout}"


@pytest.mark.parametrize("source,strategy,layout", [
    pytest.param(*case, marks=[needs_fixtures, pytest.mark.slow] if case[0] == "fixtures" else [])
    for case in _cases()])
def test_output_bytes_are_unchanged(source, strategy, layout, tmp_path):
    _pack(source, strategy, layout, tmp_path / "out")
    expected = json.loads(EXPECTED.read_text())[_key(source, strategy, layout)]
    assert _hashes(tmp_path / "out", source) == expected


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    captured = {}
    with tempfile.TemporaryDirectory() as tmp:
        for case in _cases():
            out = Path(tmp) / _key(*case).replace("/", "-") / "out"
            _pack(*case, out)
            captured[_key(*case)] = _hashes(out, case[0])
            print(_key(*case), len(captured[_key(*case)]), "files", flush=True)
    EXPECTED.write_text(json.dumps(captured, indent=1, sort_keys=True) + "\n")
