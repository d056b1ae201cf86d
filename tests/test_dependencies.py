"""The dependency range packprep declares is the range CI tests: the README's test command installs the
newest releases pip picks today, and ``.ci/run``'s second lane installs the lowest ``transformers``
``pyproject.toml`` allows. And where a transformers release lacks an internal packprep relies on, the
user reads one sentence naming that release and the tested range, not a KeyError."""

import re
from importlib import metadata
from pathlib import Path

from packprep.errors import transformers_lacks

REPO = Path(__file__).resolve().parent.parent


def _floor(name: str) -> str:
    """The lowest release of ``name`` that ``pyproject.toml``'s dependencies allow."""
    return re.search(rf'^\s*"{name}>=([\w.]+)', (REPO / "pyproject.toml").read_text(), re.M).group(1)


def test_the_oldest_lane_installs_the_declared_floor_of_transformers():
    ci = (REPO / ".ci" / "run").read_text()
    pinned = re.findall(r"transformers==([\w.]+)", ci)
    assert pinned == [_floor("transformers")], "the oldest lane of .ci/run and pyproject.toml disagree"


def test_the_newest_lane_takes_what_pip_picks_today():
    """The README's test command (the first lane) pins nothing but torch's CPU build."""
    readme = (REPO / "README.md").read_text()
    command = next(line for line in readme.splitlines() if "pytest" in line and "pip install" in line)
    assert re.findall(r"[\w-]+==", command) == ["torch=="]
    assert command in (REPO / ".ci" / "run").read_text()


def test_a_missing_transformers_internal_is_one_sentence_with_the_version_and_the_range():
    message = transformers_lacks("modeling_qwen3_5.torch_chunk_gated_delta_rule")
    assert f"transformers {metadata.version('transformers')} has no modeling_qwen3_5." in message
    assert f"pip install 'transformers>={_floor('transformers')}" in message
    assert "\n" not in message
