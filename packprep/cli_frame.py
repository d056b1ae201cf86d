"""The ``packprep`` command's frame: library errors turned into one line and the documented exit code,
click's own usage errors in the same ``error:`` style, and long option lists under headings."""

from __future__ import annotations

import os
import sys

import click

from .errors import EXIT_INTERNAL, PackprepError, Spelling, check_utf8, shown
from .interrupts import COMMITTED, boundary, exit_now, stop_on_sigterm

# Every option of a sectioned command (pack, stats), by its parameter name, under the heading --help
# shows it: headings in the order written here, options in each in the order written here. A new option
# needs one entry (tests/test_cli.py fails on an option with none).
OPTION_GROUPS = {
    "Input": ("tokenizer", "format_", "messages_field", "text_field", "mix", "validation_size"),
    "Output": ("output", "overwrite", "layout", "embed_images", "shard_format", "shard_size", "quiet", "as_json",
               "plot_path", "push_to", "private", "token"),
    "Packing": ("max_len", "max_lens", "strategy", "strategies", "overlong", "seed", "row_order",
                "samples_per_row", "partition_size", "global_batch_size", "epochs", "shared_prefix",
                "balance_dp", "dp_size", "rows_per_step", "stats_rows_per_step", "balance_sampler",
                "model_config"),
    "Template and labels": ("train_on", "turn_context", "template_args", "chat_template", "date", "reasoning",
                            "tool_calls", "system", "consecutive", "leading_assistant", "content_special_tokens"),
    "Bad records and limits": ("on_error", "preference", "max_record_chars", "render_timeout"),
    "Scale": ("num_proc", "engine", "ray_address", "tokenizer_backend"),
    "Other": (),  # --help, and an option not listed above
}
GROUP_OF = {name: group for group, names in OPTION_GROUPS.items() for name in names}
ORDER = {name: number for number, name in enumerate(GROUP_OF)}


class SectionedCommand(click.Command):
    """A command whose --help lists its options under the headings of :data:`OPTION_GROUPS`, so that a
    user scans for what they need instead of reading fifty options; one not listed goes under Other."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        params = sorted((p for p in self.get_params(ctx) if isinstance(p, click.Option)),
                        key=lambda p: ORDER.get(p.name, len(ORDER)))
        for group in OPTION_GROUPS:
            rows = [row for p in params if GROUP_OF.get(p.name, "Other") == group
                    and (row := p.get_help_record(ctx)) is not None]
            if rows:
                with formatter.section(group):
                    formatter.write_dl(rows)


def packprep_style(exc: click.exceptions.ClickException) -> None:
    """click's own usage errors say what is wrong as packprep's do: one 'error:' line, then where help is
    (not click's 'Usage:' block and 'Error: Invalid value')."""

    def show(file=None):
        message = exc.format_message().rstrip(".")
        ctx = getattr(exc, "ctx", None)
        where = f" (see {ctx.command_path} --help)" if ctx is not None else ""
        click.secho(f"error: {message[:1].lower()}{message[1:]}{where}", fg="red", err=True)

    exc.show = show


class PackprepGroup(click.Group):
    """Turns library errors into one line on stderr and the documented exit code."""

    given: list[str] = []  # the command line, as given

    def parse_args(self, ctx, args):
        self.given = list(args)
        return super().parse_args(ctx, args)

    def invoke(self, ctx):
        COMMITTED.clear()
        reader, Spelling.reader = Spelling.reader, "cli"  # messages name --options, not arguments
        try:
            for given in self.given:
                check_utf8(str(given), "the argument")
            with stop_on_sigterm():
                done = super().invoke(ctx)
                boundary("end")  # the command has printed its result
            boundary("exit")  # stops are ignored from here in the program
            return done
        except PackprepError as exc:
            click.secho(f"error: {shown(str(exc))}", fg="red", err=True)
            sys.exit(exc.exit_code)
        except KeyboardInterrupt:
            if COMMITTED:  # the stop came once the folder was in place: it is complete and verified
                click.secho(f"interrupted after {COMMITTED[-1]} was written; it is complete", fg="yellow", err=True)
                sys.exit(0)
            click.secho("interrupted; no output was written", fg="red", err=True)
            exit_now(130)
        except BrokenPipeError:  # the reader left (`| head`): stop quietly, as a shell tool does
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
            sys.exit(141)
        except click.exceptions.ClickException as exc:
            packprep_style(exc)
            raise
        except (click.exceptions.Exit, click.exceptions.Abort):
            raise
        except Exception as exc:  # a packprep bug: one line for the user, the traceback on request
            if os.environ.get("PACKPREP_DEBUG"):
                raise
            click.secho(
                f"internal error: {type(exc).__name__}: {shown(str(exc))} (please report it; PACKPREP_DEBUG=1 shows the "
                "traceback)",
                fg="red",
                err=True,
            )
            sys.exit(EXIT_INTERNAL)
        finally:
            Spelling.reader = reader

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.exceptions.ClickException as exc:  # `packprep --nope`, `packprep nope`
            packprep_style(exc)
            raise
