"""The ``packprep`` command: a thin layer over the library; each command calls one function."""

from __future__ import annotations

import inspect
import json
import os
import sys
import warnings
from pathlib import Path

import click

# transformers' import-time advice ("PyTorch was not found...") is noise for a data tool's user
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
# packprep does no linear algebra; otherwise importing numpy starts an OpenBLAS thread per core,
# which on 16 cores cost 0.1 s of start-up and 2 CPU-seconds (set before numpy is first imported)
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from . import __version__
from .cli_frame import PackprepGroup, SectionedCommand
from .control_text import MODES as CONTENT_SPECIAL
from .errors import EXIT_CODES_HELP, PackprepError
from .layout import layout_names
from .assistant_turns import REASONING
from .normalize import CONSECUTIVE, FORMATS, LEADING, SYSTEM, TOOL_CALLS, changes_text
from .render import TURN_CONTEXTS, context_text
from .packing import ROW_ORDERS, STRATEGIES, STRATEGY_TABLE
from .inspection import inspect_row
from .engines import ENGINES
from .pipeline import pack as pack_, verify_folder
from .settings import ON_ERROR, PREFERENCE, PackConfig
from .balance import SAMPLERS
from .length_stats import DEFAULT_MAX_LENS, DEFAULT_STRATEGIES, stats as stats_
from .verification import verify as verify_
from .plan import OVERLONG, cut_text
from .template_inputs import parse_template_args
from .tokenization import BACKENDS, TRAIN_ON
from .write import SHARD_FORMATS, refuse_reads


def _show_warning(message, category, filename, lineno, file=None, line=None):
    """A warning is one line for a person, not Python's file:line: UserWarning form with internal paths."""
    click.secho(f"warning: {message}", fg="yellow", err=True)


warnings.showwarning = _show_warning

DEFAULT = PackConfig()  # the library's defaults, shown in --help; the CLI sets none of its own


def _default(function, name: str):
    """The default of ``function``'s argument ``name``: the library's, shown in --help."""
    return inspect.signature(function).parameters[name].default


# options pack and stats share, so that both read records the same way
_SAMPLES_PER_ROW = click.option("--samples-per-row", default=None, type=int, help="Samples per row for --strategy minibatch.")
_TURN_CONTEXT = click.option(
    "--turn-context", default=DEFAULT.turn_context, show_default=True, type=click.Choice(TURN_CONTEXTS),
    help="A turn the chat template renders differently in the whole conversation than at inference (Qwen3, "
    "DeepSeek-R1): exact trains every turn in its inference context (the conversation becomes several "
    "sequences, their repeated context counted); intact trains only the turns the whole rendering holds so; "
    "rendered trains them as the whole rendering writes them. See docs/chat-templates.md.")
_NUM_PROC = click.option("--num-proc", default=None, type=int, help="Tokenizer processes [default: all cores].")


def _label_options(command):
    """--train-on, --turn-context, how records are read and --overlong: what pack and stats both apply."""
    command = click.option("--overlong", default=DEFAULT.overlong, show_default=True, type=click.Choice(OVERLONG),
                           help="What to do with a sample longer than --max-len.")(command)
    command = _record_options(_TURN_CONTEXT(command))
    return click.option("--train-on", default=DEFAULT.train_on, show_default=True, type=click.Choice(TRAIN_ON),
                        help="Which tokens get labels: every assistant turn, only the last, or all tokens.")(command)


def _template_args(ctx, param, values) -> dict:
    try:
        return parse_template_args(values)
    except PackprepError as exc:
        raise click.BadParameter(str(exc)) from None


_POLICIES = (  # the record policies (flag, choices, help); each one's default is the library's (PackConfig)
    ("--reasoning", REASONING,
     "Reasoning (reasoning_content, <think>...</think>) for a template that renders none: write it inline as "
     "<think>...</think> before the answer, drop it, or reject the record. Counted either way."),
    ("--tool-calls", TOOL_CALLS,
     "Tool calls for a template that renders none: write them as JSON text into the reply being trained (counted), "
     "or reject the record."),
    ("--system", SYSTEM,
     "System message: auto gives it to the chat template as it is (a template that writes none drops it, as at "
     "inference) and folds it into the first user turn only where the template refuses one (counted); keep; fold."),
    ("--consecutive", CONSECUTIVE,
     "Two user or two assistant turns in a row: auto gives them to the chat template as they are (each reply trained"
     " after its own header) and merges them only where the template refuses them (counted); merge them always "
     "(blank line between); keep; or reject the record."),
    ("--leading-assistant", LEADING,
     "Turns before the first user turn (a chat chunk that starts mid-way): drop them and train the rest (as FastChat"
     " does), or reject the record."),
    ("--preference", PREFERENCE,
     "Preference (DPO) data, records with 'chosen' and 'rejected' replies: refuse it, or train on each prompt with "
     "its chosen reply."),
    ("--content-special-tokens", CONTENT_SPECIAL,
     "Text in a record that spells a control token (<|eot_id|>, <|im_end|>): text encodes it as plain text, only the"
     " template's own markup gets control ids; special: as the control token itself (injected turns); records "
     "holding such text are counted."),
)


def _record_options(command):
    """--format, --messages-field, --text-field, the normalizing policies and the template inputs:
    how records are read and rendered."""
    command = click.option("--chat-template", default=None, metavar="NAME",
                           help="Which of the tokenizer's named chat templates (e.g. tool_use) [default: default].")(command)
    command = click.option("--date", default=DEFAULT.date, show_default=True, metavar="YYYY-MM-DD",
                           help="The date templates that read the clock render (Llama-3.2's 'Today Date'), "
                           "so the same inputs give the same bytes on any day.")(command)
    command = click.option("--template-arg", "template_args", multiple=True, callback=_template_args, metavar="KEY=VALUE",
                           help="A variable for every rendering, VALUE read as JSON else text; repeatable "
                           "(e.g. enable_thinking=false). A record's own chat_template_kwargs go on top.")(command)
    for flag, choices, text in _POLICIES:
        command = click.option(flag, default=getattr(DEFAULT, flag[2:].replace("-", "_")), show_default=True,
                               type=click.Choice(choices), help=text)(command)
    command = click.option("--render-timeout", default=DEFAULT.render_timeout, show_default=True, type=float,
                           metavar="SECONDS", help="Time one record's rendering may take; a record over it is "
                           "rejected (render_timeout), a template over it on its start-up probes stops the run.")(command)
    command = click.option("--max-record-chars", default=DEFAULT.max_record_chars, show_default=True, type=int,
                           help="Characters of text one record may hold; a record over it is rejected "
                           "(record_too_long) before rendering, which would take minutes and GBs.")(command)
    command = click.option("--text-field", default=DEFAULT.text_field, show_default=True, help="Column holding plain text "
                           "(--format text).")(command)
    command = click.option("--messages-field", default=None,
                           help="Column holding the messages, if not 'conversations'/'messages'.")(command)
    return click.option("--format", "format_", default=None, type=click.Choice(FORMATS),
                        help="Record format; detected per record when omitted.")(command)


# balanced rows for data-parallel training (docs/balanced-packing.md): pack and stats options
_MODEL_CONFIG = click.option("--model-config", default=None, type=click.Path(exists=True),
                             help="The model's config.json (or its folder): the cost model's coefficients "
                             "[default: a Llama-3.2-1B shape].")


def _balance_options(command):
    """--balance-dp, --rows-per-step, --balance-sampler, --model-config: rows balanced across ranks."""
    command = _MODEL_CONFIG(command)
    command = click.option("--balance-sampler", default=DEFAULT.balance_sampler, show_default=True,
                           type=click.Choice(SAMPLERS), help="With --balance-dp: the order the trainer deals rows "
                           "in: distributed (row i to rank i % N: DistributedSampler(shuffle=False), torchtune); "
                           "accelerate (batch b to rank b % N: Trainer/TRL, "
                           "train_sampling_strategy='sequential').")(command)
    command = click.option("--rows-per-step", default=DEFAULT.rows_per_step, show_default=True, type=int,
                           help="With --balance-dp: rows each rank takes per step (its per-device batch).")(command)
    return click.option("--balance-dp", default=None, type=int, metavar="N",
                        help="Re-pack and order rows so that every step's N data-parallel ranks carry equal "
                        "compute (steps in seeded random order; the trainer must not shuffle).")(command)


def _dp_options(command):
    """stats --dp-size, --rows-per-step, --model-config: the predicted step efficiency."""
    command = _MODEL_CONFIG(command)
    command = click.option("--rows-per-step", "stats_rows_per_step", default=1, show_default=True, type=int,
                           help="With --dp-size: rows each rank takes per step.")(command)
    return click.option("--dp-size", default=None, type=int, metavar="N",
                        help="Also predict the step efficiency over N data-parallel ranks (mean rank cost / "
                        "slowest), rows shuffled vs balanced (pack --balance-dp).")(command)


@click.group(cls=PackprepGroup, epilog=EXIT_CODES_HELP)
@click.version_option(__version__, prog_name="packprep")
def main():
    """Turn chat conversations into packed, training-ready shards.

    \b
    Start with:
      packprep pack chats.jsonl --tokenizer ./tok --max-len 4096 --output packed/
      packprep verify packed/
    """


_MIX = click.option("--mix", default=None, type=click.Path(dir_okay=False), metavar="MIX.yaml",
                    help="Mixture file (YAML or JSON): sources, each a path with a weight (a multiplier of its "
                    "records) or a share (its fraction of the tokens); INPUTS join it at weight 1.")
_VALIDATION_SIZE = click.option("--validation-size", default=None, type=float, metavar="F|N",
                                help="Hold out a fraction F (or N records) of each source, in proportion, as "
                                "the validation split, before weights repeat anything.")


@main.command(cls=SectionedCommand, epilog=EXIT_CODES_HELP)
@click.argument("inputs", nargs=-1)
@click.option("--tokenizer", "-t", required=True, help="Tokenizer folder or Hub id (with a chat template). A folder "
              "with the model's processor files packs conversations with images (docs/vision.md).")
@click.option("--embed-images", is_flag=True, help="With a processor folder: store each image's bytes in its row "
              "(a self-contained folder for a Hub upload) [default: path and sha256 only].")
@click.option("--output", "-o", required=True, type=click.Path(file_okay=False), help="Output folder.")
@click.option("--max-len", default=DEFAULT.max_len, show_default=True, type=int, help="Tokens per packed row.")
@click.option("--strategy", default=DEFAULT.strategy, show_default=True, type=click.Choice(STRATEGIES),
              help="; ".join(f"{s.name}: {s.help}" for s in STRATEGY_TABLE.values()) + ".")
@click.option("--seed", default=DEFAULT.seed, show_default=True, type=int, help="Seed for shuffles; same seed, same bytes.")
@_label_options
@click.option("--row-order", default=DEFAULT.row_order, show_default=True, type=click.Choice(ROW_ORDERS),
              help="Order of rows in the shards; length-sorted rows bias training.")
@_SAMPLES_PER_ROW
@click.option("--shard-format", default=DEFAULT.shard_format, show_default=True, type=click.Choice(SHARD_FORMATS))
@click.option("--layout", default=_default(pack_, "layout"), show_default=True, type=click.Choice(layout_names()),
              help="The training stack the shards are laid out for (README: 'Train on it'); "
              "`packprep export` changes it later without re-tokenizing.")
@click.option("--shard-size", default=DEFAULT.shard_size, show_default=True, help="Upper bound of a shard (uncompressed).")
@click.option("--on-error", default=DEFAULT.on_error, show_default=True, type=click.Choice(ON_ERROR),
              help="skip: list bad records in rejects.jsonl and go on; fail: stop at the first.")
@click.option("--partition-size", default=DEFAULT.partition_size, type=int,
              help="Pack each run of N sequences on its own, with any engine [default: all at once].")
@_balance_options
@_NUM_PROC
@click.option("--tokenizer-backend", default=DEFAULT.tokenizer_backend, show_default=True, type=click.Choice(BACKENDS),
              help="tiktoken: exact fast path for byte-level BPE (Llama-3, Qwen2, GPT-2) and SentencePiece BPE "
              "(Llama-2, Mistral) tokenizers; auto: "
              "tiktoken where it is checked identical, else hf. The output is the same with each.")
@click.option("--engine", default=_default(pack_, "engine"), show_default=True, type=click.Choice(ENGINES),
              help="local: this machine's cores; ray: read, tokenize, write and verify on a Ray cluster, whose "
                   "nodes must all see the inputs and --output (pip install 'packprep[ray]').")
@click.option("--ray-address", default=None, help="With --engine ray: the cluster address [default: start a local Ray].")
@_MIX
@_VALIDATION_SIZE
@click.option("--push-to", default=None, metavar="REPO_ID",
              help="After packing, push the folder to this Hub dataset repo (as `packprep push`).")
@click.option("--private", is_flag=True, help="With --push-to: create the repo private.")
@click.option("--token", default=None, help="With --push-to: Hub token [default: HF_TOKEN, else `hf auth login`].")
@click.option("--overwrite", is_flag=True, help="Replace an existing output folder.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bars.")
@click.option("--shared-prefix", is_flag=True,
              help="With --turn-context exact: write each conversation's sequences as one prefix tree (shared-"
              "prefix rows, a fraction of the tokens), read only by packprep.training.collate_tree with "
              "register_tree_attention(). See docs/chat-templates.md.")
def pack(inputs, tokenizer, output, format_, num_proc, engine, ray_address, push_to, private, token, overwrite, quiet,
         layout, **settings):
    """Pack INPUT files (JSON, JSONL, Parquet, Arrow, saved datasets, Hub ids) into shards.

    \b
    Examples:
      packprep pack chats.jsonl -t ./llama3 -o packed/
      packprep pack a.json b.parquet -t Qwen/Qwen2.5-7B-Instruct --max-len 8192 -o packed/
      packprep pack data/ -t ./tok --strategy random --seed 1 --overlong split -o packed/ --overwrite
      packprep pack chats.jsonl -t ./llama3 --layout trl -o packed-trl/
      packprep pack 'dump/*.json' -t ./llama3 --leading-assistant reject --consecutive keep -o packed/
      packprep pack chats.jsonl -t ./llama3 --max-len 32768 --balance-dp 8 --model-config cfg.json -o packed/
      packprep pack --mix mix.yaml -t ./llama3 --validation-size 0.02 -o packed/
      packprep pack chats.jsonl -t ./qwen3 --template-arg enable_thinking=false -o packed/
      packprep pack chats.jsonl -t ./llama-3.2 --date 2025-01-31 --reasoning drop -o packed/
      packprep pack conversations.jsonl -t ./qwen25vl-folder --max-len 8192 -o packed/
    """
    if push_to:  # a bad token or no network fails before the packing work, not after
        from .hub_upload import check_credentials

        check_credentials(token)
    manifest = pack_(list(inputs), output, tokenizer, overwrite=overwrite, num_proc=num_proc, engine=engine,
                     ray_address=ray_address, progress=not quiet, format=format_, layout=layout, **settings)
    click.echo(_pack_summary(manifest, output))
    if push_to:
        from .hub_upload import push as push_

        click.echo(f"pushed to dataset {push_to}: {push_(output, push_to, private=private, token=token)}")
    else:
        click.echo(f"next: packprep verify {output}, packprep stats {output}, packprep push {output} REPO_ID")


def _plural(n: int, word: str, words: str | None = None) -> str:
    return f"{n:,} {word if n == 1 else (words or word + 's')}"


def _fill_text(manifest: dict) -> str:
    """Packing efficiency, or, where rows may exceed --max-len (minibatch), the fill of rows padded to
    the longest: never a percentage above 100."""
    if manifest.get("rows_may_exceed_max_len"):
        longest = max(int(manifest.get("max_row_len") or 1), 1)
        fill = manifest["tokens"]["total"] / max(manifest["rows"] * longest, 1)
        return (f"fill {fill:.2%} (tokens / (rows × the longest row, {longest:,} tokens): rows of this strategy "
                "may exceed --max-len)")
    return f"efficiency {manifest['efficiency']:.2%} (tokens / (rows × max_len))"


def _pack_summary(manifest: dict, output: str) -> str:
    """What pack made, every input record accounted for: packed whole, truncated, split, rejected,
    left out by a mixture; the validation split; what normalizing, the turn context and --balance-dp did."""
    counts = manifest["counts"]
    lines = [f"  {source['name']}: {_plural(source['train_sequences'], 'sequence')} in train "
             f"({source['realized_share']:.2%} of the train tokens), "
             f"{_plural(source['validation_records'], 'record')} in validation"
             for source in manifest.get("mixture", {}).get("sources", [])]
    fates = (f"packed whole {counts['packed']:,}, truncated {counts['truncated']:,}, split {counts['split']:,}, "
             f"rejected {counts['rejected']:,}"
             + (f" (see {os.path.join(output, 'rejects.jsonl')})" if counts["rejected"] else ""))
    if counts.get("unsampled"):
        fates += f", unsampled {counts['unsampled']:,} (left out by the mixture's weights and shares)"
    lines.append(f"read {_plural(counts['records'], 'record')}: {fates}")
    lines += [f"    {reason}" for reason in counts.get("top_rejections", [])]
    copies = " (copies included)" if manifest.get("mixture") else ""
    lines.append(f"  train: {_plural(manifest['rows'], 'row')}, {_plural(manifest['sequences'], 'sequence')}{copies}, "
                 f"{_plural(manifest['tokens']['total'], 'token')}, {_fill_text(manifest)}, in {output}")
    if (validation := manifest.get("validation")):
        held = sum(len(member["indices"]) for member in validation.get("members", []))
        lines.append(f"  validation: {_plural(held, 'record')} of those above, {_plural(validation['rows'], 'row')}, "
                     f"{_plural(validation['tokens']['total'], 'token')}")
    if (balance := manifest.get("balance")):
        lines.append(f"  balanced for {balance['dp_size']:,} data-parallel ranks ({balance['sampler']} sampler, "
                     f"{_plural(balance['rows_per_step'], 'row')} a rank a step, {_plural(balance['steps'], 'whole step')}): "
                     f"predicted step efficiency {balance['step_efficiency']:.3f} read in order, "
                     f"{balance['step_efficiency_shuffled']:.3f} if a sampler shuffles them")
    lines.append(f"  {changes_text(counts.get('normalized') or {}, counts.get('turns_not_located', 0))}")
    lines.append(f"  {cut_text(counts, manifest['config']['max_len'])}")
    config = manifest["config"]
    lines.append(f"  {context_text(config.get('turn_context', 'exact'), counts, bool(config.get('shared_prefix')))}")
    return "\n".join(lines)


@main.command(epilog=EXIT_CODES_HELP)
@click.argument("folder", type=click.Path(exists=True, file_okay=False))
@click.option("--retokenize", default=_default(verify_, "retokenize"), type=int, metavar="N",
              help="Also rebuild N random sequences from the input records with transformers' own tokenizer "
              "and renderer, and compare ids and labels (the inputs must be readable from here).")
@click.option("--seed", default=_default(verify_, "seed"), show_default=True, type=int,
              help="Seed of the --retokenize sample.")
@click.option("--num-proc", default=None, type=int, help="Processes checking shards [default: all cores].")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def verify(folder, retokenize, seed, num_proc, as_json):
    """Re-read every shard of FOLDER and check the output contract.

    \b
    Checks: manifest and shard hashes, the row schema, position ids restarting
    at each packed sequence, the first label of each sequence being -100, labels
    equal to input ids or -100, rows within max_len, and that every input record
    is packed or rejected. With --retokenize N, N random sequences are also
    rebuilt from their input records and compared. Exits 0 only if all hold.

    \b
    Examples:
      packprep verify packed/
      packprep verify packed/ --retokenize 200
      packprep verify packed/ --num-proc 8
    """
    from .errors import EXIT_VERIFY

    report = verify_folder(folder, num_proc, retokenize=retokenize, seed=seed)
    if as_json:
        click.echo(json.dumps({"ok": report.ok, "rows": report.rows, "sequences": report.sequences,
                               "tokens": report.tokens, "retokenized": report.retokenized,
                               **({"validation": report.validation} if report.validation else {}),
                               "failures": [vars(f) for f in report.failures]}, indent=2))
    elif report.ok:
        split = "train " if report.validation else ""
        click.echo(f"ok: {split}{_plural(report.rows, 'row')}, {_plural(report.sequences, 'sequence')}, "
                   f"{_plural(report.tokens, 'token')}"
                   + (f"; validation {_plural(report.validation['rows'], 'row')}, "
                      f"{_plural(report.validation['sequences'], 'sequence')}, "
                      f"{_plural(report.validation['tokens'], 'token')}" if report.validation else "")
                   + (f"; {_plural(report.retokenized, 'sequence')} equal their records re-tokenized"
                      if retokenize else ""))
    else:
        for failure in report.failures:
            click.echo(str(failure), err=True)
    if not report.ok:
        sys.exit(EXIT_VERIFY)


@main.command(epilog=EXIT_CODES_HELP)
@click.argument("folder", type=click.Path(exists=True, file_okay=False))
@click.option("--output", "-o", required=True, type=click.Path(file_okay=False), help="Output folder.")
@click.option("--max-len", default=None, type=int, help="Tokens per packed row [default: FOLDER's].")
@click.option("--strategy", default=None, type=click.Choice(STRATEGIES), help="Packing strategy [default: FOLDER's].")
@click.option("--seed", default=None, type=int, help="Seed for shuffles [default: FOLDER's].")
@click.option("--row-order", default=None, type=click.Choice(ROW_ORDERS), help="Order of rows [default: FOLDER's].")
@_SAMPLES_PER_ROW
@click.option("--layout", default=None, type=click.Choice(layout_names()),
              help="The training stack the shards are laid out for [default: FOLDER's].")
@click.option("--accept-truncated", is_flag=True,
              help="Where FOLDER truncated (or dropped) sequences at its --max-len and the new one is longer, "
              "repack them as stored, cut, instead of refusing; where FOLDER is a mixture (or has a validation "
              "split) and the new one is shorter, keep its records, copies and split. The manifest says so "
              "(repacked_from).")
@click.option("--num-proc", default=None, type=int, help="Processes that read FOLDER's shards and write the new ones [default: all cores].")
@click.option("--overwrite", is_flag=True, help="Replace an existing output folder.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bars.")
def repack(folder, output, num_proc, overwrite, quiet, layout, accept_truncated, **settings):
    """Pack the sequences stored in FOLDER again, with other settings: no tokenizer, no inputs.

    \b
    The output is byte for byte what `packprep pack` writes with those settings,
    wherever no sequence was cut: sequences truncated or split at FOLDER's
    --max-len are not stored whole, so a longer --max-len is refused where
    FOLDER cut any (see --accept-truncated). A mixture's records, copies and
    validation split are kept as FOLDER has them.

    \b
    Examples:
      packprep repack packed/ -o packed-8k/ --max-len 8192
      packprep repack packed/ -o packed-bfd/ --strategy bfd --seed 1 --row-order input
      packprep repack packed/ -o packed-trl/ --layout trl
    """
    from .pipeline import repack as repack_

    manifest = repack_(folder, output, overwrite=overwrite, num_proc=num_proc, progress=not quiet, layout=layout,
                       accept_truncated=accept_truncated, **settings)
    click.echo(f"repacked {_plural(manifest['sequences'], 'sequence')} into {_plural(manifest['rows'], 'row')} "
               f"(max_len {manifest['config']['max_len']:,}, {_fill_text(manifest)}) in {output}")
    if "repacked_from" in manifest:
        said = manifest["repacked_from"]
        click.echo(f"  the mixture's records, copies and validation split kept as {folder} has them (drawn at "
                   f"max_len {said['max_len']:,}; not what pack would write)" if said.get("selection_as_stored") else
                   f"  as stored, cut at max_len {said['max_len']:,}: {said['truncated_as_stored']:,} truncated "
                   f"sequences, {said['dropped_as_stored']:,} dropped records (not what pack would write)")


@main.command(epilog=EXIT_CODES_HELP)
@click.argument("folder", type=click.Path(exists=True, file_okay=False))
@click.option("--to", "to", required=True, type=click.Choice(layout_names()), help="The layout to write.")
@click.argument("output", type=click.Path(file_okay=False))
@click.option("--overwrite", is_flag=True, help="Replace an existing OUTPUT folder.")
def export(folder, to, output, overwrite):
    """Write the packed FOLDER again at OUTPUT, laid out for another training stack.

    \b
    Reads the shards and converts them (renamed or padded columns, other
    files); never re-tokenizes. OUTPUT gets its own manifest and dataset card
    with that stack's recipe.

    \b
    Examples:
      packprep export packed/ --to trl packed-trl/
      packprep export packed/ --to hf packed-hf/ --overwrite
    """
    from .convert import export as export_

    manifest = export_(folder, to, output, overwrite=overwrite)
    click.echo(f"wrote {_plural(manifest['rows'], 'row')} laid out for {to} in {output} "
               f"(recipe: {os.path.join(output, 'README.md')})")


@main.command(epilog=EXIT_CODES_HELP)
@click.argument("folder", type=click.Path(exists=True, file_okay=False))
@click.argument("repo_id")
@click.option("--private", is_flag=True, help="Create the repo private (no effect on an existing repo).")
@click.option("--revision", default=None, help="Existing branch to push to [default: main].")
@click.option("--token", default=None, help="Hub token with write access [default: HF_TOKEN, else `hf auth login`].")
@click.option("--commit-message", "-m", default=None, help="Commit message [default: rows, tokens, strategy].")
def push(folder, repo_id, private, revision, token, commit_message):
    """Verify FOLDER, then upload it to the Hub as the dataset repo REPO_ID.

    \b
    The repo is created if missing. Files already on the Hub with the same
    content are not sent again; large folders go up in several commits, and
    an interrupted push is finished by running it again. A folder that fails
    `packprep verify` is refused. HF_ENDPOINT selects another Hub.

    \b
    Examples:
      packprep push packed/ my-org/chat-packed-4k
      packprep push packed/ chat-packed-4k --private --revision dev -m "repack with seed 1"
    """
    from .hub_upload import push as push_

    result = push_(folder, repo_id, private=private, revision=revision, token=token, commit_message=commit_message)
    if result.commits:
        click.echo(
            f"pushed {len(result.uploaded)} file(s) to dataset {result.repo_id} ({result.revision}) in "
            f"{len(result.commits)} commit(s); {len(result.unchanged)} unchanged, {len(result.deleted)} deleted"
        )
    else:
        click.echo(f"dataset {result.repo_id} ({result.revision}) is up to date; nothing was uploaded")
    click.echo(f"commit: {result}")
    click.echo(f"load it: datasets.load_dataset({result.repo_id!r}"
               + (f", revision={result.revision!r}" if result.revision != "main" else "") + ', split="train")')


@main.command(cls=SectionedCommand, epilog=EXIT_CODES_HELP)
@click.argument("inputs", nargs=-1)
@click.option("--tokenizer", "-t", default=None,
              help="Tokenizer folder or Hub id, as for pack (not needed for a packed folder).")
@click.option("--max-len", "max_lens", multiple=True, type=int,
              help=f"Row length to plan for; repeat for several [default: {' '.join(map(str, DEFAULT_MAX_LENS))}].")
@click.option("--strategy", "strategies", multiple=True, type=click.Choice(STRATEGIES),
              help=f"Strategy to plan for; repeat for several [default: {' '.join(DEFAULT_STRATEGIES)}].")
@click.option("--global-batch-size", default=_default(stats_, "global_batch_size"), show_default=True, type=int,
              help="Rows per optimizer step, over all devices and accumulation steps.")
@click.option("--epochs", default=_default(stats_, "epochs"), show_default=True, type=int, help="Epochs, for the optimizer step count.")
@_label_options
@click.option("--seed", default=DEFAULT.seed, show_default=True, type=int, help="Seed of the random strategy, as for pack.")
@_SAMPLES_PER_ROW
@click.option("--partition-size", default=DEFAULT.partition_size, type=int,
              help="Plan as pack --partition-size: each run of this many samples packed on its own.")
@_dp_options
@_MIX
@_VALIDATION_SIZE
@_NUM_PROC
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--plot", "plot_path", default=None, type=click.Path(dir_okay=False),
              help="Also draw the histograms and what-if curves into this PNG (needs packprep[plot]).")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
def stats(inputs, tokenizer, max_lens, strategies, global_batch_size, epochs, format_, num_proc, as_json,
          plot_path, quiet, dp_size, stats_rows_per_step, **settings):
    """Length statistics and a what-if packing plan, before packing.

    \b
    For INPUT files (tokenized exactly as pack would): tokens, supervised
    tokens and turns per conversation (count, mean, p50, p90, p99, max), a
    log-binned histogram, and for each --max-len and strategy the rows,
    packing efficiency, padding, over-long samples and the tokens they lose,
    samples per row, optimizer steps and relative attention cost. The plan
    runs pack's own packing engine on the lengths, so it is exact.
    For a packed output FOLDER (holding packprep.json): rows, sequences per
    row, efficiency and the row fill histogram, read from the shards.

    \b
    Examples:
      packprep stats chats.jsonl -t ./llama3
      packprep stats chats.jsonl -t ./llama3 --max-len 2048 --max-len 8192 --global-batch-size 128
      packprep stats a.json b.parquet -t Qwen/Qwen2.5-7B-Instruct --json > plan.json
      packprep stats chats.jsonl -t ./llama3 --plot lengths.png
      packprep stats chats.jsonl -t ./llama3 --max-len 32768 --dp-size 8
      packprep stats --mix mix.yaml -t ./llama3 --validation-size 0.02
      packprep stats packed/
    """
    from .length_stats import plot, render_text, require_matplotlib

    if plot_path:  # a plot over what the run reads is refused before anything else is asked of it
        refuse_reads("--plot", plot_path, Path(os.path.realpath(plot_path)),
                     [*inputs, tokenizer, settings.get("mix"), settings.get("model_config")])
        require_matplotlib()
    report = stats_(list(inputs), tokenizer, max_lens or None, strategies or None, global_batch_size, epochs,
                    num_proc=num_proc, progress=not quiet, format=format_, dp_size=dp_size,
                    rows_per_step=stats_rows_per_step, **settings)
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        click.echo(render_text(report), nl=False)
    if plot_path:
        plot(report, plot_path)
        click.echo(f"plot written to {plot_path}", err=True)


@main.command("inspect", epilog=EXIT_CODES_HELP)
@click.argument("folder", type=click.Path(exists=True, file_okay=False))
@click.option("--row", "-r", default=_default(inspect_row, "row"), show_default=True, type=int,
              help="Row to show, counted over all shards from 0 (negative: from the end).")
@click.option("--tokenizer", "-t", default=None, help="Decode with this tokenizer instead of the manifest's.")
@click.option("--color/--no-color", default=None,
              help="Colour trained tokens [default: on a terminal; [[brackets]] when piped].")
def inspect_(folder, row, tokenizer, color):
    """Decode one packed row of FOLDER, showing sequence boundaries and trained tokens.

    \b
    Each packed sequence gets a header (its input record, tokens, trained
    tokens). Trained tokens (label != -100) are green on a terminal, and
    between [[ and ]] when the output is piped or --no-color is given.

    \b
    Examples:
      packprep inspect packed/
      packprep inspect packed/ --row 17
      packprep inspect packed/ --row -1 --no-color | less
    """
    text = inspect_row(folder, row, color=color, tokenizer=tokenizer)
    click.echo(text, nl=False, color=True if color else None)


@main.group(epilog=EXIT_CODES_HELP)
def tokenizer():
    """Tokenizer folders, made offline."""


@tokenizer.command("make", epilog=EXIT_CODES_HELP)
@click.option("--vocab", required=True, metavar="DIR|HUB_ID",
              help="A tokenizer folder holding tokenizer.json (the same vocabulary as the model), or a Hub model id.")
@click.option("--template", required=True, type=click.Path(dir_okay=False), metavar="FILE.jinja",
              help="The model's chat template file, as published (its chat_template.jinja).")
@click.option("--eos", required=True, help="The end-of-turn token the template writes (<|im_end|>, <|eot_id|>).")
@click.option("--bos", default=None, help="The begin-of-text token, where the family has one.")
@click.option("--pad", default=None, help="The padding token [default: the vocabulary's].")
@click.option("--special-token", "special_tokens", multiple=True, metavar="TOKEN",
              help="Another control token the template writes; repeatable.")
@click.option("--added-token", "added_tokens", multiple=True, metavar="TOKEN",
              help="A tag that is one token but decodes as text (Qwen3's <think>, <tool_call>); repeatable.")
@click.option("--output", "-o", required=True, type=click.Path(file_okay=False), help="The folder to write.")
@click.option("--overwrite", is_flag=True, help="Replace an existing output folder.")
def make(vocab, template, output, **tokens):
    """Make a tokenizer folder from a vocabulary, a chat template file and the family's special tokens.

    \b
    Each token given is one token of the folder: the vocabulary's own where it
    has it, else a new one at the next free id, as the model's tokenizer adds it.

    \b
    Examples:
      packprep tokenizer make --vocab ./qwen2.5 --template qwen3.jinja --eos '<|im_end|>' --added-token '<think>' --added-token '</think>' -o ./qwen3
      packprep tokenizer make --vocab Qwen/Qwen2.5-7B-Instruct --template qwen3.jinja --eos '<|im_end|>' -o ./qwen3
    """
    from .tokenizer_make import make_tokenizer_folder

    folder = make_tokenizer_folder(vocab, template, output, **tokens)
    click.echo(f"wrote {folder}: tokenizer.json and tokenizer_config.json with the chat template of {template}")
