"""Runs the fenced blocks of the README and docs/ as a reader would, in a folder of their own.

Every ```bash, ```sh, ```console, ```python, ```yaml and ```json block runs, in page order, in one
sandbox a page; a plain ``` block runs when its first line is a ``$ `` command. A block's output,
where the page shows it (``$ command`` lines followed by what they print, in a console block), must
be what the command prints; a line ``...`` in the shown output stands for any run of lines.

An HTML comment on the line before a block (invisible on GitHub) changes how it runs:

    <!-- doc-test: skip: WHAT IT NEEDS -->   not run; says what it needs (a GPU, the Hub, a download)
    <!-- doc-test: file NAME -->             the block is a file's content: written to NAME
    <!-- doc-test: before COMMAND -->        COMMAND runs first (to make what the block reads)
    <!-- doc-test: exit N -->               the commands exit with N (a documented refusal)
    <!-- doc-test: given model tokenizer --> a Python block gets these names, where the page means "your
                                             model": a tiny random Llama and the bundled example's tokenizer
                                             (``vision_model``: a tiny random Qwen2.5-VL for ./qwen25vl-folder)

Several may share one comment, separated by ``;`` (``before X; exit 2``); ``skip`` stands alone. Shell lines may chain
with ``&&``, end in ``| head -N`` or ``> FILE``; set-up steps (``python3 -m venv``, ``pip install``)
are left out: the tests run in the environment they set up. ``packprep`` runs in-process (quiet, one
process unless the line says otherwise: the output is the same); any other program as a subprocess.
The sandbox holds the names the pages use, made on first mention (``WORLD``): ``chats.jsonl`` is the
bundled example, ``./llama3`` the fixtures' Llama-3 tokenizer, ``./qwen3`` what ``packprep tokenizer make``
makes of the fixtures' Qwen2.5 vocabulary and Qwen3's template, ``mix.yaml`` examples/mix.yaml, and
``../shared`` the fixtures beside the checkout; a name the block writes (``-o ./qwen3``) is left to it.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .conftest import FIXTURES, REPO, TOKENIZERS

RUN = {"bash", "sh", "shell", "console", "python", "py", "yaml", "yml", "json"}
MARK = re.compile(r"<!--\s*doc-test:\s*(.*?)\s*-->\s*$")
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w+-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```\s*$", re.S | re.M)
SETUP = ("python3 -m venv", "python -m venv", "pip install", ".venv/bin/pip install")


def _template(name):
    def make(dest: Path):
        from .template_folders import build_folder

        build_folder(name, dest)
    return make


def _link(target: Path):
    return lambda dest: dest.symlink_to(target, target_is_directory=target.is_dir())


LLAMA_1B = {"model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
            "num_key_value_heads": 8, "intermediate_size": 8192, "vocab_size": 128256}

# the names the pages use, and what they are in the tests: made in the sandbox when a block names them
WORLD = {
    "chats.jsonl": _link(REPO / "examples" / "chats.jsonl"),
    "chats-12.jsonl": lambda dest: dest.write_text(  # the example's first 12 conversations: a few rows
        "".join((REPO / "examples" / "chats.jsonl").read_text().splitlines(keepends=True)[:12])),
    "mix.yaml": lambda dest: dest.write_text(  # examples/mix.yaml, its paths from the sandbox's root
        (REPO / "examples" / "mix.yaml").read_text().replace("path: chats.jsonl", f"path: {REPO}/examples/chats.jsonl")
        .replace("../../shared/", f"{FIXTURES.parent}/")),
    "extra.jsonl": _link(FIXTURES / "conversations" / "fastchat_dummy_conversation.json"),
    "llama3": _link(TOKENIZERS / "llama3"),
    "my-model": lambda dest: (dest.mkdir(), (dest / "config.json").write_text(json.dumps(LLAMA_1B))),
    "qwen3": _template("qwen3"),
    "Qwen3-8B": _template("qwen3"),
    "Llama-3.2-3B-Instruct": _template("llama-3.2"),
    "qwen25vl-folder": lambda dest: _vision().build("qwen2.5-vl", dest),  # Qwen2.5-VL's processor (tests/vision)
    "conversations.jsonl": lambda dest: _vision().conversation_set(dest.parent, 4),  # with drawn images/
    "examples": _link(REPO / "examples"),
    "tests": _link(REPO / "tests"),  # tests/templates: the chat templates as published
    "benchmarks": _link(REPO / "benchmarks"),
}


def _vision():
    from . import vision_folders

    return vision_folders


def _tokenizer():
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(REPO / "examples" / "tokenizer"))


def _model():
    """A tiny random Llama for the bundled example's tokenizer (the shape the tests' trainers use): a block
    given it reads a folder packed with that tokenizer (``before packprep pack ... -t examples/tokenizer``)."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(_tokenizer()), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                      max_position_embeddings=8192)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)


def _vision_model():
    """A tiny random Qwen2.5-VL on the vocabulary and image tokens of the sandbox's ``qwen25vl-folder``."""
    from packprep.training.vision import VisionCollator

    from .vision_models import tiny_qwen_vl

    return tiny_qwen_vl(VisionCollator("qwen25vl-folder").processor)


# what a page's Python block may take as given (``<!-- doc-test: given model -->``)
GIVEN = {"model": _model, "tokenizer": _tokenizer, "vision_model": _vision_model}


@dataclass
class Block:
    page: str
    line: int
    lang: str
    body: str
    marks: dict = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of ``page`` that are code, with the marks of the comment before each."""
    text = page.read_text()
    found = []
    for match in FENCE.finditer(text):
        lang, body = match["lang"].lower(), match["body"]
        if match["indent"]:
            body = re.sub(rf"^{match['indent']}", "", body, flags=re.M)
        if lang not in RUN and not (lang == "" and body.startswith("$ ")):
            continue
        before = text[: match.start()].rstrip("\n").rpartition("\n")[2]
        marks = {}
        if (mark := MARK.match(before.strip())) and mark[1].startswith("skip"):  # the rest says what it needs
            marks["skip"] = mark[1][4:].lstrip(" :")
        elif mark:
            for part in filter(None, (p.strip() for p in mark[1].split(";"))):
                key, _, value = part.partition(" ")
                marks[key.rstrip(":")] = value.strip()
        line = text.count("\n", 0, match.start()) + 1
        name = str(page.resolve().relative_to(REPO)) if page.resolve().is_relative_to(REPO) else page.name
        found.append(Block(name, line, lang or "console", body, marks))
    return found


class Sandbox:
    """A folder like a checkout (``../shared`` beside it) where a page's blocks run in order."""

    def __init__(self, root: Path):
        self.dir = root / "checkout"
        self.dir.mkdir(parents=True)
        (root / "shared").symlink_to(FIXTURES.parent, target_is_directory=True)
        self.python: dict = {}

    def provide(self, text: str) -> None:
        for name, make in WORLD.items():
            dest = self.dir / name
            written = re.search(rf"(?:-o|--output)\s+(?:\./)?{re.escape(name)}/?(?![\w-])", text)  # the page makes it
            if not dest.exists() and not written and re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text):
                make(dest)

    def run(self, block: Block) -> None:
        if "skip" in block.marks:
            assert block.marks["skip"], f"{block.where}: a skipped block must say what it needs"
            return
        self.provide(block.body + block.marks.get("before", ""))
        old = os.getcwd()
        os.chdir(self.dir)
        try:
            if block.marks.get("before"):
                self.command(block.marks["before"], block)
            if "file" in block.marks:
                (self.dir / block.marks["file"]).write_text(block.body)
            elif block.lang in ("python", "py"):
                for name in block.marks.get("given", "").split():
                    self.python.setdefault(name, GIVEN[name]())
                exec(compile(block.body, block.where, "exec"), self.python)
            elif block.lang in ("yaml", "yml", "json"):
                self.data_file(block)
            elif block.lang == "console":
                self.console(block)
            else:
                for command in commands(block.body):
                    self.command(command, block)
        finally:
            os.chdir(old)

    def data_file(self, block: Block) -> None:
        """A data block names its file in a first-line comment (``# mix.yaml``); it must parse."""
        import yaml

        first = block.body.partition("\n")[0]
        data = yaml.safe_load(block.body)
        assert data is not None, f"{block.where}: empty"
        if (name := re.match(r"#\s*([\w./-]+\.(?:ya?ml|json))\b", first)):
            (self.dir / name[1]).write_text(block.body)

    def console(self, block: Block) -> None:
        for command, shown in console_steps(block.body):
            printed = self.command(command, block)
            if shown:
                assert_shown(printed, shown, f"{block.where}: {command}")

    def command(self, command: str, block: Block) -> str:
        """Run one shell command line the way the page means it; returns what it printed."""
        printed = ""
        for part in re.split(r"\s+&&\s+", command):
            part = part.strip()
            if part.startswith(SETUP) or part.startswith(("cd ",)):
                continue  # the environment the tests run in is the one these commands set up
            pipe_head = redirect = None
            if (m := re.search(r"\s>\s*(\S+)\s*$", part)):  # `command > file`
                part, redirect = part[: m.start()].strip(), m[1]
            if (m := re.search(r"\|\s*head\s+-(?:n\s*)?(\d+)\s*$", part)):
                part, pipe_head = part[: m.start()].strip(), int(m[1])
            argv = shlex.split(part, comments=True)
            if not argv:
                continue
            argv[0] = re.sub(r"^\.venv/bin/", "", argv[0])
            printed = self.execute(argv, block, part)
            if pipe_head is not None:
                printed = "".join(printed.splitlines(keepends=True)[:pipe_head])
            if redirect:
                Path(redirect).write_text(printed)
        return printed

    def execute(self, argv: list[str], block: Block, text: str) -> str:
        want = int(block.marks.get("exit", 0))
        if argv[0] == "packprep":
            from click.testing import CliRunner

            from packprep.cli import main

            # quiet, and one process: the output is the same with any --num-proc, and small inputs go faster
            extra = ["-q", *([] if "--num-proc" in argv else ["--num-proc", "1"])] if _quietable(argv) else []
            result = CliRunner().invoke(main, [*argv[1:], *extra])
            code, out, err = result.exit_code, result.stdout, result.stderr
        else:
            if argv[0] in ("python", "python3"):
                argv[0] = sys.executable
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
            done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
            code, out, err = done.returncode, done.stdout, done.stderr
        assert code == want, f"{block.where}: `{text}` exited {code}, not {want}\n{out[-2000:]}\n{err[-2000:]}"
        return out


def _quietable(argv: list[str]) -> bool:
    return len(argv) > 1 and argv[1] in ("pack", "stats", "repack") and "-q" not in argv and "--quiet" not in argv \
        and "--json" not in argv


def commands(body: str) -> list[str]:
    """The command lines of a shell block: continuations joined, comment lines left out."""
    joined = re.sub(r"\\\n\s*", " ", body)
    return [line for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def console_steps(body: str) -> list[tuple[str, list[str]]]:
    """(command, the lines shown after it) for each ``$ `` line of a console block."""
    steps: list[tuple[str, list[str]]] = []
    lines = body.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("$ "):
            command = lines[i][2:]
            while command.endswith("\\") and i + 1 < len(lines):
                i += 1
                command = command[:-1] + " " + lines[i].strip()
            steps.append((command, []))
        elif steps:
            steps[-1][1].append(lines[i])
        i += 1
    return steps


def assert_shown(printed: str, shown: list[str], what: str) -> None:
    """The shown lines are the printed lines; a shown ``...`` stands for any run of printed lines."""
    got = [line.rstrip() for line in printed.rstrip("\n").splitlines()]
    want = [line.rstrip() for line in shown]
    while want and not want[-1]:
        want.pop()
    if not _matches(want, got):
        diff = "\n".join(f"  page: {w}\n  got:  {g}" for w, g in zip(want, got) if w != g)
        raise AssertionError(f"{what}: the page shows other output than the command prints\n{diff[:3000]}\n"
                             f"--- printed ---\n{printed[:4000]}")


def _matches(want: list[str], got: list[str]) -> bool:
    if not want:
        return not got
    if want[0] == "...":
        return any(_matches(want[1:], got[i:]) for i in range(len(got) + 1))
    return bool(got) and want[0] == got[0] and _matches(want[1:], got[1:])
