"""Every setting: its name, default, allowed values, and the one check that refuses a bad value.

A value is checked here, once, before any work: :class:`PackConfig` (the settings that shape the
output, recorded in the manifest), :class:`RunOptions` (how a run runs: engine, workers), and the
options of ``verify`` and ``stats``. Each library entry point (``pack``, ``repack``, ``stats``,
``verify``) calls these at its start, so a notebook gets the CLI's message. A choice list stays
beside the code that implements its choices (``STRATEGY_TABLE`` in packing.py, ``TRAIN_ON`` in
tokenization.py, ...); the "must be one of" lives only here (tests/test_layering.py holds it so).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from .assistant_turns import REASONING
from .balance import SAMPLERS, can_balance
from .control_text import MODES as CONTENT_SPECIAL
from .cost import CostModel, model_cost, read_model_shape
from .engines import ENGINES
from .errors import ConfigError
from .normalize import CONSECUTIVE, FORMATS, LEADING, SYSTEM, TOOL_CALLS
from .packing import STRATEGIES, STRATEGY_TABLE, ROW_ORDERS, Strategy
from .plan import OVERLONG
from .render import TURN_CONTEXTS
from .template_inputs import DEFAULT_DATE, check_date, check_template_args
from .tokenization import BACKENDS, TRAIN_ON
from .write import SHARD_FORMATS, parse_size

ON_ERROR = ("skip", "fail")
PREFERENCE = ("refuse", "chosen")

# the allowed range of each number setting: checked before any work, the message names it
RANGES = {
    "max_len": (2, 2**31 - 1),  # rows and their positions are int32
    "seed": (0, 2**32 - 1),  # numpy's seeds
    "samples_per_row": (1, 2**31 - 1),
    "partition_size": (1, 2**62),
    "render_timeout": (0.001, 86_400),
    "max_record_chars": (1, 2**62),
    "balance_dp": (1, 2**20),
    "rows_per_step": (1, 2**20),
}
REPACK_SETTINGS = ("max_len", "strategy", "seed", "row_order", "samples_per_row")  # what repack may change
NUM_PROC = (1, 4096)
RETOKENIZE = (0, 2**31 - 1)
VALIDATION_RECORDS = 2**40  # --validation-size N: at most this many records
# a mixture source's weight: copies of each record; more than this is a typo (1e12), and each copy
# costs a round of packing and memory a sequence, so the copies of a record (weights and shares) stop here
MIX_WEIGHT = (0, 1000)
MIX_COPIES = 1000
# a --model-config's numbers: a decoder's shape (the cost model multiplies them; 0 or less is no model)
MODEL_SHAPE = {"hidden_size": (1, 2**20), "num_hidden_layers": (1, 2**16), "num_attention_heads": (1, 2**16),
               "num_key_value_heads": (1, 2**16), "head_dim": (1, 2**20), "intermediate_size": (1, 2**24),
               "vocab_size": (0, 2**32)}


def check_range(option: str, value, low, high) -> None:
    """A ConfigError naming ``option`` and its allowed range unless ``value`` is a number ``low <= value <= high``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{option} must be a number between {low:,} and {high:,}, not {value!r}")
    if not low <= value <= high:  # NaN fails this too
        raise ConfigError(f"{option} must be between {low:,} and {high:,}, not {value:,}")


def check_model_config(path) -> None:
    """``--model-config``: a readable decoder config whose sizes are a model's (``MODEL_SHAPE``)."""
    shape, where = read_model_shape(path)
    for key, (low, high) in MODEL_SHAPE.items():
        if shape.get(key) is not None or key not in ("num_key_value_heads", "head_dim", "vocab_size"):
            check_range(f"--model-config {where}: {key}", shape.get(key), low, high)


def check_mix_weight(where: str, weight) -> float:
    """A mixture source's ``weight``: copies of each of its records (a fraction samples them)."""
    low, high = MIX_WEIGHT
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not low <= weight <= high:
        why = (": a weight repeats each record that many times, and each copy costs a round of packing and memory"
               if isinstance(weight, (int, float)) and weight > high else "")
        raise ConfigError(f"{where}: weight must be between {low:,} and {high:,}, not {weight!r}{why}")
    return float(weight)


def check_copies(name: str, copies: int) -> None:
    """The most copies of one record a mixture source asks for (its weight, or what its share takes)."""
    if copies > MIX_COPIES:
        raise ConfigError(f"mixture source {name!r} would repeat each of its records {copies:,} times; more than "
                          f"{MIX_COPIES:,} copies is refused (each copy is a round of packing and memory a sequence): "
                          "lower its weight or share, or give it more records")


def check_choice(option: str, value, allowed) -> None:
    """A ConfigError naming ``option`` (``--train-on``, or ``where: format``) unless ``value`` is allowed."""
    if value not in allowed:
        raise ConfigError(f"{option} must be one of {', '.join(allowed)}")


def check_strategy(name: str, samples_per_row: int | None = None) -> Strategy:
    """The strategy called ``name``, or a ConfigError saying what is wrong with the choice."""
    if name not in STRATEGY_TABLE:
        raise ConfigError(f"--strategy must be one of {', '.join(STRATEGIES)}, not {name!r}")
    strategy = STRATEGY_TABLE[name]
    if strategy.needs_samples_per_row and not (samples_per_row and samples_per_row >= 1):
        raise ConfigError(f"--strategy {name} needs samples_per_row (--samples-per-row B, B >= 1)")
    return strategy


@dataclass
class PackConfig:
    """Every setting that shapes the output; recorded in full in the manifest."""

    max_len: int = 4096
    strategy: str = "greedy"
    seed: int = 0
    train_on: str = "assistant"
    turn_context: str = "exact"  # exact | intact | rendered: a turn the full rendering rewrites (render.py)
    shared_prefix: bool = False  # exact only: a record's sequences as one prefix-tree row (prefix_tree.py)
    format: str | None = None  # None: detected per record
    messages_field: str | None = None
    text_field: str = "text"
    overlong: str = "truncate"
    row_order: str = "shuffle"
    samples_per_row: int | None = None
    shard_format: str = "parquet"
    shard_size: str = "500MB"
    on_error: str = "skip"
    tokenizer_backend: str = "auto"  # auto | hf | tiktoken; the output is the same with each
    partition_size: int | None = None  # pack each run of this many sequences on its own; None: globally
    leading_assistant: str = "drop"  # turns before the first user turn: drop | reject (normalize.py)
    consecutive: str = "auto"  # two user or two assistant turns in a row: auto (merged where the template refuses
    # them, else given as they are) | merge | keep | reject
    system: str = "auto"  # auto: given to the template as it is, folded into the first user turn where it refuses one
    balance_dp: int | None = None  # data-parallel ranks to balance each step's rows for (balance.py); None: off
    rows_per_step: int = 1  # with balance_dp: rows each rank takes a step (its per-device batch)
    balance_sampler: str = "distributed"  # with balance_dp: the sampler order targeted (balance.SAMPLERS)
    model_config: str | None = None  # with balance_dp: the model's config.json for the cost model (cost.py)
    render_timeout: float = 60.0  # seconds one record's rendering may take; a record over it is rejected
    max_record_chars: int = 10_000_000  # text one record may hold; more is rejected before rendering (minutes, GBs)
    preference: str = "refuse"  # preference data (chosen/rejected): refuse | chosen (train on the chosen reply)
    content_special_tokens: str = "text"  # text in records that spells a control token: text | special (control_text.py)
    reasoning: str = "inline"  # reasoning for a template that reads none: inline | drop | reject (normalize.py)
    tool_calls: str = "text"  # tool calls for a template that renders none: text | reject (normalize.py)
    date: str = DEFAULT_DATE  # the date templates that read the clock get (template_inputs.py)
    template_args: dict = field(default_factory=dict)  # variables passed to every rendering (--template-arg)
    chat_template: str | None = None  # which of the tokenizer's named templates; None: "default"

    @classmethod
    def from_settings(cls, settings: dict, command: str = "pack", cost: CostModel | None = None) -> "PackConfig":
        """The validated config of these settings; an unknown one is a ConfigError naming the known ones.
        ``cost``: the cost model ``model_config`` gave when the folder was packed (repack: not read again)."""
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(settings) - set(known))
        if unknown:
            raise ConfigError(f"unknown setting(s) for {command}: {', '.join(unknown)} (known: {', '.join(known)})")
        config = cls(**settings)
        config._cost = cost
        config.validate()
        return config

    def cost(self) -> CostModel:
        """The cost model --balance-dp deals rows by: ``model_config``'s (read once), else the default shape."""
        if getattr(self, "_cost", None) is None:
            self._cost = model_cost(self.model_config)
        return self._cost

    def validate(self) -> None:
        check_strategy(self.strategy, self.samples_per_row)
        choices = {
            "overlong": OVERLONG,
            "train_on": TRAIN_ON,
            "turn_context": TURN_CONTEXTS,
            "row_order": ROW_ORDERS,
            "shard_format": SHARD_FORMATS,
            "on_error": ON_ERROR,
            "tokenizer_backend": BACKENDS,
            "leading_assistant": LEADING,
            "consecutive": CONSECUTIVE,
            "system": SYSTEM,
            "content_special_tokens": CONTENT_SPECIAL,
            "preference": PREFERENCE,
            "reasoning": REASONING,
            "tool_calls": TOOL_CALLS,
        }
        for name, allowed in choices.items():
            check_choice(f"--{name.replace('_', '-')}", getattr(self, name), allowed)
        if self.format is not None:
            check_choice("--format", self.format, FORMATS)
        for name, (low, high) in RANGES.items():
            value = getattr(self, name)
            if value is not None:
                check_range(f"--{name.replace('_', '-')}", value, low, high)
        parse_size(self.shard_size)
        check_date(self.date)
        check_template_args(self.template_args)
        if self.chat_template is not None and not (isinstance(self.chat_template, str) and self.chat_template):
            raise ConfigError("--chat-template must name one of the tokenizer's chat templates")
        self._validate_balance()
        self._validate_shared_prefix()

    def _validate_shared_prefix(self) -> None:
        if not self.shared_prefix:
            return
        if self.turn_context != "exact":
            raise ConfigError(f"--shared-prefix stores the sequences of --turn-context exact as one prefix tree; "
                              f"--turn-context {self.turn_context} makes one sequence a record: nothing to share")
        if self.overlong == "split":
            raise ConfigError("--shared-prefix cannot --overlong split: a piece of a tree row cut off from its "
                              "prefix has no context; use --overlong truncate (the tree is cut depth first) or drop")
        if self.balance_dp is not None:
            raise ConfigError("--shared-prefix rows cost attention by their tree, not their length: --balance-dp "
                              "does not model them; leave it off")

    def _validate_balance(self) -> None:
        if self.model_config is not None and getattr(self, "_cost", None) is None:
            check_model_config(self.model_config)  # a bad path or shape fails now, before any tokenizing
        if self.balance_dp is None:
            if self.rows_per_step != 1 or self.balance_sampler != "distributed":
                raise ConfigError("--rows-per-step and --balance-sampler apply only with --balance-dp N")
            return
        check_choice("--balance-sampler", self.balance_sampler, SAMPLERS)
        if not can_balance(STRATEGY_TABLE[self.strategy]):
            able = ", ".join(name for name, s in STRATEGY_TABLE.items() if can_balance(s))
            raise ConfigError(f"--balance-dp re-packs the rows of a packer that keeps samples whole ({able}), "
                              f"not --strategy {self.strategy}")
        if self.row_order != "shuffle":
            raise ConfigError("--balance-dp orders the rows itself (steps in seeded random order); "
                              f"leave --row-order at shuffle, not {self.row_order}")


def repack_config(old: dict, changes: dict, cost: CostModel | None = None) -> PackConfig:
    """A packed folder's config (its manifest's) with ``changes`` (None: keep the folder's), checked;
    ``cost``: the cost model the folder was balanced with, as its manifest records it."""
    unknown = sorted(set(changes) - set(REPACK_SETTINGS))
    if unknown:
        raise ConfigError(f"repack cannot change {', '.join(unknown)} (only {', '.join(REPACK_SETTINGS)}): "
                          "pack again from the inputs")
    return PackConfig.from_settings({**old, **{k: v for k, v in changes.items() if v is not None}}, "repack", cost)


@dataclass(frozen=True)
class RunOptions:
    """How a run runs, not what it writes (the output is the same with any): checked when made."""

    engine: str = "local"
    num_proc: int | None = None  # None: every core of this machine
    ray_address: str | None = None  # with engine "ray": the cluster's address; None: a local Ray

    def __post_init__(self):
        check_choice("--engine", self.engine, ENGINES)
        if self.num_proc is not None:
            check_range("--num-proc", self.num_proc, *NUM_PROC)


def check_verify(retokenize: int, seed: int) -> None:
    """``verify``'s own options: how many sequences to rebuild from the inputs, and the seed that picks them."""
    check_range("--retokenize", retokenize, *RETOKENIZE)
    check_range("--seed", seed, *RANGES["seed"])


def check_what_if(max_lens, strategies, global_batch_size, epochs, overlong, samples_per_row) -> tuple[list, list]:
    """``stats``' plan options, checked: its max_lens (ascending, once each) and strategies (once each)."""
    max_lens = sorted({int(m) for m in max_lens})
    if not max_lens:
        raise ConfigError("give at least one --max-len")
    if max_lens[0] < 2:
        raise ConfigError("--max-len must be at least 2")
    strategies = list(dict.fromkeys(strategies))
    if not strategies:
        raise ConfigError("give at least one strategy")
    for strategy in strategies:
        check_strategy(strategy, samples_per_row)
    if int(global_batch_size) < 1:
        raise ConfigError("--global-batch-size must be at least 1")
    if int(epochs) < 1:
        raise ConfigError("--epochs must be at least 1")
    check_choice("--overlong", overlong, OVERLONG)
    return max_lens, strategies


def check_steps(dp_size: int | None, rows_per_step: int) -> None:
    """``stats --dp-size``: the ranks and the rows each takes a step, when the step prediction is asked for."""
    if dp_size is not None and (dp_size < 1 or rows_per_step < 1):
        raise ConfigError("--dp-size and --rows-per-step must be at least 1")


def check_batches(global_batch_size: int, epochs: int) -> None:
    """``stats`` of a packed folder: the batch and epochs its optimizer steps are counted with."""
    if int(global_batch_size) < 1 or int(epochs) < 1:
        raise ConfigError("--global-batch-size and --epochs must be at least 1")


def check_validation_size(size: float | None) -> None:
    """``--validation-size``: a fraction of the records, or a whole number of them."""
    if size is not None and (isinstance(size, bool) or not isinstance(size, (int, float)) or not math.isfinite(size)
                             or size <= 0 or (size >= 1 and size != int(size)) or size > VALIDATION_RECORDS):
        raise ConfigError("--validation-size must be a fraction between 0 and 1, or a whole number of records "
                          f"(at most {VALIDATION_RECORDS:,}), not {size!r}")
