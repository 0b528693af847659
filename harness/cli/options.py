"""The options several commands share: --tracking-uri's and --json's help, --executor (any registered backend),
where a job runs (its nodes), and the backends' own options, read from the registry only when a command needs them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

TRACKING_HELP = "MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite:///./mlruns/mlflow.db)."
SECRET_IN_DIFF_HELP = ("Record uncommitted changes that hold a secret (a token, a password assigned a literal, a URL's "
                        "password) with each such secret cut from the stored patch; the run is tagged "
                        "harness.git.patch_redacted and a replay warns that its code is not exact there.")
_JSON_HELP = ("Print the result as one JSON document on stdout, and nothing else there (a refusal too: its `error`); "
              "the keys are in docs/json.md.")


def json_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    return click.option("--json", "as_json", is_flag=True, help=_JSON_HELP)(fn)


class _ExecutorName(click.ParamType):
    """--executor NAME: any registered backend. Listed from the registry only when help is shown; an unknown name
    is refused by the command in one line (click's own refusal is a usage block)."""

    name = "executor"

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:
        from harness.commands import backends

        return "[" + "|".join(backends.names()) + "]"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        return str(value)


EXECUTOR = _ExecutorName()


class ExecutorOption(click.Option):
    """--executor: its help ends with every registered backend's own line (Backend.help), read from the registry
    only when the help is shown (so that a command that runs no job never loads the backends)."""

    def get_help_record(self, ctx: click.Context) -> tuple[str, str] | None:
        from harness.commands import backends

        own = self.help or ""
        self.help = own + " " + "; ".join(backends.help_lines()) + "."
        try:
            return super().get_help_record(ctx)
        finally:
            self.help = own


class BackendCommand(click.Command):
    """A command that takes the backends' own options (harness/executors: each backend declares its CliOptions).

    They are made into click options when the command is first parsed or its help shown, so that the commands
    that run no job (`harness runs`, `compare`) never load the backends; they follow the placement options.
    """

    def get_params(self, ctx: click.Context) -> list[click.Parameter]:
        if not getattr(self, "_backend_options", False):
            self._backend_options = True
            at = next(i for i, p in enumerate(self.params) if p.name == "master_port") + 1
            self.params[at:at] = _backend_click_options(self.name or "")
        return super().get_params(ctx)


def _backend_click_options(command: str) -> list[click.Parameter]:
    from harness.commands import backends

    made: list[click.Parameter] = []
    for opt in backends.options(command):
        if opt.type is bool:
            made.append(click.Option([opt.flag, opt.dest], is_flag=True, default=None, help=opt.help))
        elif opt.type is int:
            made.append(click.Option([opt.flag, opt.dest], type=click.IntRange(min=opt.min), default=None,
                                     help=opt.help))
        else:
            made.append(click.Option([opt.flag, opt.dest], type=opt.type, default=None, help=opt.help))
    return made


def placement_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Where the job runs: its nodes (shared by run and replay); the backends' own options follow (BackendCommand)."""
    options = [
        click.option("--nnodes", type=click.IntRange(min=1), default=None,
                     help="Nodes of a multi-node job; run the same command on each with its --node-rank."),
        click.option("--node-rank", type=click.IntRange(min=0), default=None, help="This node's rank (0 records the run)."),
        click.option("--master-addr", default=None, help="Node 0's address, reachable from every node."),
        click.option("--master-port", type=click.IntRange(1, 65535), default=None,
                     help="A free TCP port on node 0 for the job's rendezvous."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn
