"""What a command says on the terminal: the --quiet / --verbose voice, the library's events drawn on stderr, its JSON
document on stdout, an expected failure's one line, and its exit code: what every command module of harness/cli
draws with (its public names), and the helpers behind them (a leading underscore: this module's own).
"""

from __future__ import annotations

import functools
import os
import re
import sys
from collections.abc import Callable
from typing import Any, NoReturn

import click

from harness import events
from harness.cli import progress
from harness.errors import HarnessError
from harness.secrets import scrub


class Voice:
    """How much the CLI says on stderr (the global --quiet / --verbose); stdout carries only results either way."""

    quiet = False  # only warnings and errors: no notices, progress or links (the job's own output neither)
    verbose = False  # an error's traceback too, after its one line
    plain = False  # no colour: --json (a script reads stdout and stderr alike), set per command


class _Drawer:
    """The listener the commands get: an event from the library drawn on stderr: the ranks' steps as a bar, rank 0's
    output as it printed it, any other event as the line it says (above the bar while there is one). With --quiet
    only the warnings."""

    def __init__(self) -> None:
        self._bar = progress.Bar()

    def __call__(self, event: events.Event) -> None:
        if Voice.quiet and not isinstance(event, events.Warning):
            return
        if isinstance(event, events.Steps):
            self._bar.steps(event)
        elif isinstance(event, events.RankOutput):
            self._bar.write(event.text)  # the user's own output, as rank 0's log has it
        elif isinstance(event, events.Warning):
            self._bar.write(_coloured("Warning:", "unsure") + " " + scrub(event.text))
        else:
            self._bar.write(scrub(event.line()))


draw = _Drawer()


# A verdict's (and an error's) colour on a terminal, by its tone (harness/judge/verdicts.py `tone`).
_COLOURS = {"pass": "green", "fail": "red", "unsure": "yellow"}
_VERDICT_AT = re.compile(r"(verdict: )([A-Z_]+)")


def _coloured(text: str, tone: str | None) -> str:
    """`text` in its tone's colour. click.echo drops the colour where the stream is no terminal (a pipe, a file);
    never any with --json or with NO_COLOR set to anything (https://no-color.org)."""
    if tone is None or Voice.plain or os.environ.get("NO_COLOR"):
        return text
    return click.style(text, fg=_COLOURS[tone], bold=True)


def say_verdict(line: str) -> None:
    """A `verdict: NAME ...` line on stdout, NAME in its colour: green a pass, red DIVERGED, yellow the others."""
    from harness.commands.text import tone

    found = _VERDICT_AT.search(line)
    if found is not None:
        name = found.group(2)
        line = line[:found.start(2)] + _coloured(name, tone(name)) + line[found.end(2):]
    click.echo(line)


def say(line: str) -> None:
    """A line of the CLI's own for the user (a link, where a report went), on stderr; --quiet leaves it out."""
    if not Voice.quiet:
        click.echo(line, err=True)


def emit(doc: dict[str, Any]) -> NoReturn:
    """A command's JSON document (harness/commands/documents.py) on stdout, then its exit code."""
    from harness.commands import documents

    click.echo(scrub(documents.dumps(doc)))  # the same scrubber as every line: a reason may quote outside text
    exit_with(doc["exit_code"])


def _refused(message: str, exit_code: int, as_json: bool) -> NoReturn:
    """An expected failure: its one line on stderr (and with --json its document on stdout); --verbose adds the
    traceback."""
    if Voice.verbose:
        import traceback

        click.echo(traceback.format_exc().rstrip(), err=True)
    message = scrub(message)  # outside text (an MLflow exception, a URL) may carry a password
    click.echo(f"{_coloured('Error:', 'fail')} {message}", err=True)
    if as_json:
        from harness.commands import documents

        click.echo(documents.dumps(documents.error(click.get_current_context().command.name or "", exit_code, message)))
    exit_with(exit_code)


def expected_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """HarnessError -> `Error: ...` on one line and its exit code; no traceback.

    A tracking-store failure that got past the Tracker (MLflow, SQLAlchemy or HTTP) is one line too:
    it is the store failing, not a bug to show a traceback for.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        as_json = bool(kwargs.get("as_json"))
        Voice.plain = as_json
        try:
            with events.listening(draw):  # what the library says on its way, on stderr
                return fn(*args, **kwargs)
        except HarnessError as err:
            _refused(str(err), err.exit_code, as_json)
        except Exception as err:
            from harness.commands.text import store_failure

            failure = store_failure(err, kwargs.get("tracking_uri"))
            if failure is None:
                raise
            _refused(str(failure), failure.exit_code, as_json)

    return wrapper


def exit_with(code: int) -> NoReturn:
    """Exit with `code`. torchrun stops every other rank the moment one exits: a rank that has said why it
    stops keeps its own exit code rather than dying of that SIGTERM on its way out."""
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        import signal

        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.exit(code)
