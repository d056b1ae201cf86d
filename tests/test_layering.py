"""The modules of packprep import in one direction: no import cycle among them (lazy imports inside
functions count, ``if TYPE_CHECKING:`` ones do not), and the steps of the pipeline import neither
``engines``, ``verification`` nor ``pipeline``: ``pipeline.py`` is the one place that runs stages on an
engine, and each step offers a planner and the functions its workers run. And no module is longer than
600 lines: one that is holds more than one idea."""

import ast
import importlib
import sys
from pathlib import Path

import packprep

PACKAGE = Path(__file__).resolve().parent.parent / "packprep"
STEPS = {"read", "parts", "json_scan", "normalize", "record_schema", "template_fit", "render", "render_onepass", "tokenization", "turn_ids", "tiktoken_backend", "tiktoken_convert", "tokenizer_folder",
         "encode", "ledger", "plan", "repack", "packing", "packing_kernels", "materialize", "write", "join", "layout", "layouts"}
NOT_FROM_STEPS = {"engines", "verification", "pipeline"}


def _name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in PACKAGE.rglob("*.py")}


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(name: str) -> set[str]:
    """The packprep modules ``name`` imports at run time."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    stack = [ast.parse(path.read_text())]
    while stack:
        node = stack.pop()
        if _type_checking(node):
            continue
        stack.extend(ast.iter_child_nodes(node))
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "packprep"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if base.split(".")[0] != "packprep":
                continue
            if node.level and not node.module and path.name != "__init__.py":
                found.add(base)  # `from . import x` runs the package's __init__ first: an import of it
            for alias in node.names:  # `from . import plan` imports the module packprep.plan
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: _imports(name) for name in MODULES}


def _cycle_from(start: str) -> list[str] | None:
    """A path of imports from ``start`` back to itself, if there is one."""
    stack, seen = [(start, [start])], set()
    while stack:
        node, path = stack.pop()
        for nxt in sorted(GRAPH[node]):
            if nxt == start:
                return path + [start]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, path + [nxt]))
    return None


def _top(module: str) -> str:
    """``packprep.layouts.megatron`` -> ``layouts``."""
    return (module.split(".") + [""])[1]


def test_no_import_cycle():
    cycles = {" -> ".join(c) for c in map(_cycle_from, sorted(GRAPH)) if c}
    assert not cycles, sorted(cycles)


def test_steps_import_no_engine_verify_or_pipeline():
    bad = {name: sorted(m for m in deps if _top(m) in NOT_FROM_STEPS) for name, deps in GRAPH.items() if _top(name) in STEPS}
    bad = {name: deps for name, deps in bad.items() if deps}
    assert not bad, bad


def test_verify_builds_no_engine():
    assert not {m for m in GRAPH["packprep.verification"] if m.startswith("packprep.engines")}


ONE_HOME = {"IGNORE_INDEX": "packprep.layout", "FATES": "packprep.fates", "PACKED": "packprep.fates",
            "TRUNCATED": "packprep.fates", "SPLIT": "packprep.fates", "REJECTED": "packprep.fates",
            "DROPPED": "packprep.fates", "EMPTIED": "packprep.fates"}


def test_the_label_mask_and_the_record_fates_are_defined_once():
    """IGNORE_INDEX and the record fates are assigned in one module each, and no other module writes
    the number -100 in code (in words, in messages and docstrings, it may stay)."""
    import io
    import tokenize

    homes, literals = {}, []
    for name, path in MODULES.items():
        source = path.read_text()
        for node in ast.parse(source).body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
            for target in targets:
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Name) and leaf.id in ONE_HOME:
                        homes.setdefault(leaf.id, []).append(name)
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
        literals += [f"{name}:{b.start[0]}" for a, b in zip(tokens, tokens[1:])
                     if a.string == "-" and b.type == tokenize.NUMBER and b.string == "100"]
    assert homes == {name: [home] for name, home in ONE_HOME.items()}
    assert literals == [f"packprep.layout:{_line_of('packprep.layout', 'IGNORE_INDEX = -100')}"]


def _line_of(module: str, text: str) -> int:
    return next(n for n, line in enumerate(MODULES[module].read_text().splitlines(), 1) if line.startswith(text))


def test_no_module_name_collides():
    """No module shadows the standard library or a dependency, and none is named like a function the
    package exports (importing ``packprep.verification`` must never replace ``packprep.verify``)."""
    taken = set(sys.stdlib_module_names) | {"torch", "numpy", "pyarrow", "numba", "click", "transformers",
                                            "datasets", "tiktoken", "ray", "yaml", "jsonschema"}
    leaves = {name.rpartition(".")[2] for name in MODULES}
    assert leaves & taken == set()
    assert leaves & set(packprep.__all__) == set()
    assert packprep.verify.__module__ == "packprep.verification"
    importlib.import_module("packprep.verification")  # a submodule import keeps the function

    assert callable(packprep.verify) and packprep.stats.__module__ == "packprep.length_stats"


REFUSALS = ("must be one of", "must be between", "must be at least")


def _refusals(name: str) -> list[str]:
    """Where module ``name`` refuses a setting's value itself: a message of :data:`REFUSALS` (in a
    string or f-string) or a call of ``check_range``."""
    found = []
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        text = node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else ""
        called = node.func if isinstance(node, ast.Call) else None
        if any(words in text for words in REFUSALS) or (
                called is not None and (getattr(called, "id", None) or getattr(called, "attr", None)) == "check_range"):
            found.append(f"{name}:{node.lineno}")
    return found


def test_settings_are_checked_in_one_place():
    """Every setting's allowed choices and range are checked in settings.py alone: a second place that
    says "must be one of" (or calls check_range) is a second home, and drifts from the first."""
    assert len(_refusals("packprep.settings")) >= 5  # the scan sees them where they are
    elsewhere = [where for name in MODULES if name != "packprep.settings" for where in _refusals(name)]
    assert elsewhere == []


MAX_LINES = 600


def test_every_module_is_at_most_600_lines():
    """A module past 600 lines holds more than one idea: split it by idea (``template_fit.py`` out of
    ``normalize.py``), not by cutting it in two."""
    long = {name: n for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert len(MODULES) > 50 and max(len(p.read_text().splitlines()) for p in MODULES.values()) > 400  # it sees them
    assert long == {}, f"modules over {MAX_LINES} lines: {long}"


def test_no_function_is_longer_than_80_lines():
    """A function that long does more than one thing: its parts want names."""
    long = [f"{name}.{node.name}: {node.end_lineno - node.lineno + 1}" for name, path in MODULES.items()
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80]
    assert not long, long
