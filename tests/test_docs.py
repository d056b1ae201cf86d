"""The README and docs/ hold together: every command and code block on them runs against the fixtures
(tests/doc_runner.py says how, and how a block is marked that needs a GPU, the Hub or a download),
output shown on a page is what the command prints, every relative link points at a file that exists
and every #anchor at a heading of that file (GitHub's slugs), and the README stays a five-minute read."""

import re
from pathlib import Path

import pytest

from .conftest import needs_fixtures
from .doc_runner import Sandbox, assert_shown, blocks

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PAGES = [*DOCS, REPO / "benchmarks" / "RESULTS.md"]


def _slugs(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    headings = re.findall(r"^#+ (.+)$", text, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists() or (anchor and anchor not in _slugs(file)):
                broken.append(f"{page.relative_to(REPO)}: {target}")
    assert not broken, broken


def test_the_readme_is_a_short_read():
    assert len((REPO / "README.md").read_text().splitlines()) < 300


@needs_fixtures
@pytest.mark.parametrize("page", DOCS, ids=[p.name for p in DOCS])
def test_every_block_on_the_page_runs(page, tmp_path):
    sandbox = Sandbox(tmp_path)
    for block in blocks(page):
        sandbox.run(block)


def test_the_runner_reads_marks_and_compares_output(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("<!-- doc-test: skip: a GPU; and the Hub -->\n```python\nimport cuda\n```\n\n"
                    "<!-- doc-test: before packprep x; exit 2 -->\n```bash\npackprep y\n```\n\n```\nnot code\n```\n",
                    encoding="utf-8")
    first, second = blocks(page)
    assert first.marks == {"skip": "a GPU; and the Hub"} and second.marks == {"before": "packprep x", "exit": "2"}
    assert_shown("a\nb\nc\n", ["a", "...", "c"], "ok")
    assert_shown("a\nb\n", ["...", "b"], "ok")
    with pytest.raises(AssertionError, match="other output"):
        assert_shown("a\nb\n", ["a", "c"], "differs")
    with pytest.raises(AssertionError, match="other output"):
        assert_shown("a\nb\n", ["a"], "a line more")

