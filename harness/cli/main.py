"""The `harness` command group: its global options (--quiet, --verbose), and every command in it. The commands live
by the order a user meets them (running.py, inspecting.py, moving.py), the extras' in their folders (harness/extras,
found through harness.extensions); what they share in console.py and options.py.
torch and mlflow load only when a command needs them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import click

from harness import extensions
from harness.cli import inspecting, moving, running
from harness.cli.console import Voice
from harness.cli.help import OrderedGroup, teach
from harness.secrets import scrub


def _asks_json(args: list[str]) -> bool:
    """--json among the options (an argument after `--` is an argument, not the option)."""
    return "--json" in (args[:args.index("--")] if "--" in args else args)


class _Group(OrderedGroup):
    """The group: a usage error click finds (a missing argument, an unknown option, a value of the wrong type) is its
    usage block on stderr as always, and under --json its error document on stdout too (docs/json.md), as a refusal
    of the command itself is: a script reading stdout gets the document whatever stopped the command."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta["harness.args"] = list(args)
        with self._usage_document(ctx):
            return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context) -> Any:
        with self._usage_document(ctx):
            return super().invoke(ctx)

    @contextlib.contextmanager
    def _usage_document(self, ctx: click.Context) -> Iterator[None]:
        try:
            yield
        except click.UsageError as err:
            args = ctx.meta.get("harness.args", [])
            where = err.ctx.command if err.ctx is not None else None
            # The command whose document it is: where click stopped, or (an option of the group's own) the one named.
            name = where.name if where is not None and where is not self else \
                next((a for a in args if not a.startswith("-")), None)
            # No command, or an unknown one: there is no command's document to give.
            if name is not None and name in self.commands and _asks_json(args):
                from harness.commands import documents

                click.echo(scrub(documents.dumps(documents.error(name, err.exit_code, err.format_message()))))
            raise


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="ddp-harness")
@click.option("-q", "--quiet", is_flag=True,
              help="Say only warnings and errors on stderr: no progress, rank output, notices or links.")
@click.option("-v", "--verbose", is_flag=True, help="With an error, also print its traceback (for a bug report).")
def main(quiet: bool, verbose: bool) -> None:
    """Run PyTorch DDP experiments so that they can be replayed and judged bit for bit.

    A run id may be given as a unique prefix of at least 6 of its hex digits (`harness replay 1a2b3c4d`).
    Every command that prints a result takes --json: one JSON document on stdout (docs/json.md).

    Exit codes: 0 success / reproduced, 1 training failed / diverged / nothing to compare, 2 bad input,
    130 interrupted (SIGINT), 143 terminated (SIGTERM).
    """
    if quiet and verbose:
        raise click.UsageError("--quiet and --verbose contradict each other; pass one.")
    Voice.quiet, Voice.verbose = quiet, verbose


# Every click command the command modules define, in their order (`harness --help` lists them in help.ORDER), then
# the extras' (harness/extras and outside packages, from the registry): a command added to one of them is in the
# group without a second list to keep.
for _commands in (running, inspecting, moving, *extensions.cli_modules()):
    for _command in vars(_commands).values():
        if isinstance(_command, click.Command):
            main.add_command(_command)

teach(main)

if __name__ == "__main__":  # pragma: no cover
    main()
