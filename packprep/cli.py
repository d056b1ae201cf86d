"""The ``packprep`` command: a thin layer over the library; each command calls one function."""

from __future__ import annotations

import json
import sys

import click

from . import __version__
from .errors import EXIT_CODES_HELP, PackprepError
from .normalize import FORMATS
from .packing import ROW_ORDERS, STRATEGIES
from .pipeline import ON_ERROR, OVERLONG
from .tokenize import TRAIN_ON
from .write import SHARD_FORMATS


class _Group(click.Group):
    """Turns library errors into one line on stderr and the documented exit code."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except PackprepError as exc:
            click.secho(f"error: {exc}", fg="red", err=True)
            sys.exit(exc.exit_code)
        except KeyboardInterrupt:
            click.secho("interrupted; no output was written", fg="red", err=True)
            sys.exit(130)


@click.group(cls=_Group, epilog=EXIT_CODES_HELP)
@click.version_option(__version__, prog_name="packprep")
def main():
    """Turn chat conversations into packed, training-ready shards.

    \b
    Start with:
      packprep pack chats.jsonl --tokenizer ./tok --max-len 4096 --output packed/
      packprep verify packed/
    """


@main.command(epilog=EXIT_CODES_HELP)
@click.argument("inputs", nargs=-1, required=True)
@click.option("--tokenizer", "-t", required=True, help="Tokenizer folder or Hub id (with a chat template).")
@click.option("--output", "-o", required=True, type=click.Path(file_okay=False), help="Output folder.")
@click.option("--max-len", default=4096, show_default=True, type=int, help="Tokens per packed row.")
@click.option("--strategy", default="greedy", show_default=True, type=click.Choice(STRATEGIES),
              help="greedy: first-fit-decreasing; bfd: best-fit-decreasing; random: shuffle, concatenate, "
              "cut (splits samples); minibatch: B shuffled samples a row; pad: one sample a row.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed for shuffles; same seed, same bytes.")
@click.option("--train-on", default="assistant", show_default=True, type=click.Choice(TRAIN_ON),
              help="Which tokens get labels: every assistant turn, only the last, or all tokens.")
@click.option("--format", "format_", default=None, type=click.Choice(FORMATS),
              help="Record format; detected per file when omitted.")
@click.option("--messages-field", default=None, help="Column holding the messages, if not 'conversations'/'messages'.")
@click.option("--text-field", default="text", show_default=True, help="Column holding plain text (--format text).")
@click.option("--overlong", default="truncate", show_default=True, type=click.Choice(OVERLONG),
              help="What to do with a sample longer than --max-len.")
@click.option("--row-order", default="shuffle", show_default=True, type=click.Choice(ROW_ORDERS),
              help="Order of rows in the shards; length-sorted rows bias training.")
@click.option("--samples-per-row", default=None, type=int, help="Samples per row for --strategy minibatch.")
@click.option("--shard-format", default="parquet", show_default=True, type=click.Choice(SHARD_FORMATS))
@click.option("--shard-size", default="500MB", show_default=True, help="Upper bound of a shard (uncompressed).")
@click.option("--on-error", default="skip", show_default=True, type=click.Choice(ON_ERROR),
              help="skip: list bad records in rejects.jsonl and go on; fail: stop at the first.")
@click.option("--num-proc", default=None, type=int, help="Tokenizer processes [default: all cores].")
@click.option("--overwrite", is_flag=True, help="Replace an existing output folder.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bars.")
def pack(inputs, tokenizer, output, format_, num_proc, overwrite, quiet, **settings):
    """Pack INPUT files (JSON, JSONL, Parquet, Arrow, saved datasets, Hub ids) into shards.

    \b
    Examples:
      packprep pack chats.jsonl -t ./llama3 -o packed/
      packprep pack a.json b.parquet -t Qwen/Qwen2.5-7B-Instruct --max-len 8192 -o packed/
      packprep pack data/ -t ./tok --strategy random --seed 1 --overlong split -o packed/ --overwrite
    """
    from .pipeline import pack as pack_

    manifest = pack_(list(inputs), output, tokenizer, overwrite=overwrite, num_proc=num_proc,
                     progress=not quiet, format=format_, **settings)
    counts = manifest["counts"]
    click.echo(
        f"packed {counts['records']:,} records into {manifest['rows']:,} rows "
        f"({manifest['tokens']['total']:,} tokens, efficiency {manifest['efficiency']:.2%}) in {output}\n"
        f"  packed {counts['packed']:,}, truncated {counts['truncated']:,}, split {counts['split']:,}, "
        f"rejected {counts['rejected']:,}"
        + (f" (see {output}/rejects.jsonl)" if counts["rejected"] else "")
    )
    click.echo(f"next: packprep verify {output}")


@main.command(epilog=EXIT_CODES_HELP)
@click.argument("folder", type=click.Path(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def verify(folder, as_json):
    """Re-read every shard of FOLDER and check the output contract.

    \b
    Checks: manifest and shard hashes, the row schema, position ids restarting
    at each packed sequence, the first label of each sequence being -100, labels
    equal to input ids or -100, rows within max_len, and that every input record
    is packed or rejected. Exits 0 only if all hold.

    \b
    Example:
      packprep verify packed/
    """
    from .errors import EXIT_VERIFY
    from .verify import verify as verify_

    report = verify_(folder)
    if as_json:
        click.echo(json.dumps({"ok": report.ok, "rows": report.rows, "sequences": report.sequences,
                               "tokens": report.tokens, "failures": [vars(f) for f in report.failures]}, indent=2))
    elif report.ok:
        click.echo(f"ok: {report.rows:,} rows, {report.sequences:,} sequences, {report.tokens:,} tokens")
    else:
        for failure in report.failures:
            click.echo(str(failure), err=True)
    if not report.ok:
        sys.exit(EXIT_VERIFY)


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
    from .push import push as push_

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
