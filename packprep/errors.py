"""Errors that the CLI turns into one clear line and a documented exit code.

A message names settings as the command line spells them (``--max-len``, ``pass --overwrite``); read
from Python (``packprep.pack(...)``) it names them as the library's arguments (``max_len``,
``overwrite=True``): :func:`spell` rewrites it unless the command line is the caller.
"""

import re

EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_CONFIG = 2
EXIT_INPUT = 3
EXIT_VERIFY = 4
EXIT_OUTPUT = 5
EXIT_PUSH = 6
EXIT_LAYOUT = 7

EXIT_CODES_HELP = (
    "Exit codes: 0 success; 1 an unexpected internal error (please report it); "
    "2 usage or configuration error (nothing was written); "
    "3 an input file cannot be read, or a record was rejected under --on-error fail; "
    "4 verification failed; 5 the output could not be written (disk full, permissions); "
    "6 the push to the Hugging Face Hub failed (no or invalid token, no write access, no network, "
    "unknown branch); 7 the folder is laid out for another training stack (torchtune, LLaMA-Factory, Axolotl, "
    "Megatron) and cannot be read back as packed rows: verify or inspect the folder it was exported from; "
    "130 interrupted (Ctrl-C), nothing was written."
)


# options that take no value: from Python they are a True argument
FLAGS = {"overwrite", "accept-truncated", "private", "json", "quiet", "shared-prefix", "color", "embed-images"}
_OPTION = re.compile(r"(?<![\w-])--([a-z][a-z0-9-]*)(?:[ =]([a-z][a-z0-9_]*)(?![\w.-]))?")
_WORDS = re.compile(r"^(?:to|or|and|the|a|an|with|for|at|of|in|is|must|not|only|applies|apply|needs|re|orders|"
                    r"says|should|when|then|from|on|as|by|if|without|keeps|takes|names)$")


class Spelling:
    """Who reads the messages: ``"python"`` (the library's callers) unless the CLI says ``"cli"``."""

    reader = "python"


def spell(message: str) -> str:
    """``message`` in its reader's terms: ``--max-len`` -> ``max_len``, ``--overwrite`` -> ``overwrite=True``,
    ``--preference chosen`` -> ``preference="chosen"``."""
    if Spelling.reader == "cli":
        return message

    def python(match: re.Match) -> str:
        name, value = match[1], match[2]
        argument = name.replace("-", "_")
        if name in FLAGS:
            return f"{argument}=True" + (f" {value}" if value else "")
        if value and not _WORDS.match(value) and not value[0].isdigit():
            return f"{argument}={value!r}".replace("'", '"')
        return argument + (f" {value}" if value else "")

    return _OPTION.sub(python, message)


class PackprepError(Exception):
    """Base class: a message meant for the user, plus the exit code the CLI returns."""

    exit_code = EXIT_INTERNAL

    def __str__(self) -> str:
        return spell(super().__str__())


class ConfigError(PackprepError):
    """The run cannot start as configured; raised before any work is done."""

    exit_code = EXIT_CONFIG


class InputError(PackprepError):
    """An input file cannot be parsed, or a record was rejected under --on-error fail."""

    exit_code = EXIT_INPUT


class VerifyError(PackprepError):
    """A packed output folder breaks the output contract."""

    exit_code = EXIT_VERIFY


class OutputError(PackprepError):
    """The output folder could not be written."""

    exit_code = EXIT_OUTPUT


class UnreadableLayout(PackprepError):
    """A folder exported for a training stack whose files cannot be read back as packed rows."""

    exit_code = EXIT_LAYOUT


class PushError(PackprepError):
    """The folder could not be pushed to the Hugging Face Hub (token, access, network, branch)."""

    exit_code = EXIT_PUSH


class Rejected(Exception):
    """A record that cannot be trained on (not a run error: the record is set aside and counted).

    ``str(exc)`` is the reason written to rejects.jsonl; ``code`` is the short category that the
    manifest counts (``rejected_by_reason``).
    """

    def __init__(self, reason: str, code: str = "invalid_record"):
        super().__init__(reason)
        self.code = code
