"""The tests assert behaviour through public results (manifest, shard bytes, CLI output, exit codes,
the public functions' return values), not packprep's private names: a test that reads ``obj._x``,
imports ``_y`` or patches ``module._z`` breaks on a refactor that changes nothing a user sees, and
passes on one that breaks what they see. The few faults injected at a private seam are listed here,
each with why no public seam does."""

import ast
import functools
from pathlib import Path

TESTS = Path(__file__).resolve().parent
PACKAGE = TESTS.parent / "packprep"

# (test file, private name): why the fault is injected there
SEAMS = {
    ("test_tiktoken_backend.py", "_cached_ranks"):
        "a wrong tiktoken conversion, for the start and data guards to catch: no input makes packprep "
        "convert wrongly, so the conversion itself is broken (two ranks swapped)",
    ("test_render.py", "_watchable"):
        "a Jinja release without the internals the one-pass watch uses, for the fallback to the reference "
        "renderer: the installed Jinja has them, and breaking Jinja itself would break the reference too",
}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name != "_"


def defined_private_names(root: Path) -> set[str]:
    """The private names defined under ``root``: functions, classes, module and class attributes,
    and ``self._x`` / ``cls._x`` attributes."""
    names = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    for part in ast.walk(target):
                        if isinstance(part, ast.Name):
                            names.add(part.id)
                        elif isinstance(part, ast.Attribute) and ast.unparse(part.value) in ("self", "cls"):
                            names.add(part.attr)
    return {name for name in names if _private(name)}


def private_uses(source: str, private: set[str]) -> list[tuple[int, str]]:
    """(line, name) of each use of a private packprep name in a test's source: imported from packprep,
    read as an attribute, or named as a string to setattr/getattr/delattr/hasattr (monkeypatch's too)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "packprep":
            found += [(node.lineno, a.name) for a in node.names if _private(a.name)]
            found += [(node.lineno, part) for part in node.module.split(".") if _private(part)]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, part) for a in node.names if a.name.startswith("packprep.")
                      for part in a.name.split(".") if _private(part)]
        elif isinstance(node, ast.Attribute) and node.attr in private:
            found.append((node.lineno, node.attr))
        elif isinstance(node, ast.Call) and ast.unparse(node.func).rpartition(".")[2] in (
                "setattr", "getattr", "delattr", "hasattr"):
            for arg in node.args:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    dotted = arg.value.split(".")
                    if arg.value in private or (dotted[0] == "packprep" and any(map(_private, dotted))):
                        found.append((node.lineno, dotted[-1]))
    return sorted(found)


@functools.cache
def _private_in_tests() -> dict[tuple[str, str], list[int]]:
    # a helper's own private names (tests/hub_server.py's stand-in Hub) are not packprep's
    private = defined_private_names(PACKAGE) - defined_private_names(TESTS)
    uses: dict[tuple[str, str], list[int]] = {}
    for path in sorted(TESTS.rglob("*.py")):
        for line, name in private_uses(path.read_text(), private):
            uses.setdefault((str(path.relative_to(TESTS)), name), []).append(line)
    return uses


def test_no_test_reads_or_patches_a_private_packprep_name_but_the_listed_seams():
    unlisted = {f"tests/{file}:{lines[0]}: {name}" for (file, name), lines in _private_in_tests().items()
                if (file, name) not in SEAMS}
    assert not unlisted, ("assert through public results, or list the fault-injection seam in SEAMS with why: "
                          f"{sorted(unlisted)}")


def test_every_listed_seam_is_still_used():
    assert set(SEAMS) <= set(_private_in_tests()), "a seam no test uses any more: take it off SEAMS"


def test_the_check_finds_each_kind_of_use():
    """The check itself can fail: each way of reaching a private name is found, public ones are not."""
    source = '''
from packprep.mix import _weighted, plan_rounds
import packprep._hidden.x
assert encoder._fast.num_threads == 1
monkeypatch.setattr(packing, "_CLASS_LIMIT", 8)
monkeypatch.setattr("packprep.read._read_json", whole)
getattr(encoder, "_guard_chars")
monkeypatch.setattr(packing, "CLASS_LIMIT", 8)
os._exit(3)
'''
    private = {"_fast", "_CLASS_LIMIT", "_guard_chars", "_weighted"}
    assert private_uses(source, private) == [
        (2, "_weighted"), (3, "_hidden"), (4, "_fast"), (5, "_CLASS_LIMIT"), (6, "_read_json"), (7, "_guard_chars")]
