"""`harness bisect`: the command line of the bisect extra (harness/cli/main.py adds it to the group)."""

from __future__ import annotations

import sys
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import click

from harness.cli.console import draw, emit, expected_errors
from harness.cli.options import TRACKING_HELP, json_option

if TYPE_CHECKING:  # imported where the command runs, so that `harness --help` stays instant
    from harness.extras.bisect.command import BisectResult


@click.command()
@click.argument("good")
@click.argument("bad")
@click.option("--max-probes", type=click.IntRange(min=1), default=24, show_default=True,
              help="At most this many probe replays; then it says how far the search got.")
@click.option("--localize", is_flag=True,
              help="Then trace the culprit's probe against GOOD and name the first op that differs.")
@click.option("--resume", "resume", default=None, metavar="BISECT_ID",
              help="Take up the probes of an earlier bisect of GOOD and BAD that was cut short (not run again).")
@click.option("--tracking-uri", default=None, help=TRACKING_HELP)
@json_option
@expected_errors
def bisect(good: str, bad: str, max_probes: int, localize: bool, resume: str | None, tracking_uri: str | None,
           as_json: bool) -> None:
    """Find which difference between runs GOOD and BAD flips the result: a commit between theirs, a config key.

    Each probe is a replay of GOOD, recorded and nested under one bisect run, with part of BAD's changes: the
    code of a commit on the path from GOOD's commit to BAD's (halved each time), or some of BAD's config values
    (split in halves until one alone flips it). Prints each probe, what cannot be varied on this machine, the
    culprit, and the bisect run's id as the last line. Run it inside a clone holding both commits.
    Exit 0 a culprit was found, 1 none was (said why), 2 bad input (nothing recorded).
    """
    from harness.extras.bisect import api

    result = api.bisect(api.BisectOptions(good, bad, max_probes=max_probes, tracking_uri=tracking_uri, localize=localize,
                                    resume=resume, on_event=draw))
    if as_json:
        emit(document(result))
    for line in result.lines():
        click.echo(line)
    click.echo(result.run_id)
    sys.exit(result.exit_code)


def document(result: BisectResult) -> dict[str, Any]:
    """`bisect`'s --json document (docs/json.md): the result's fields, the culprit and each probe shaped as documented."""
    from harness.commands.documents import document as made, keys

    commit = result.culprit_commit
    return made("bisect", result.exit_code, keys(
        result, drop=("culprit_commit", "culprit_keys", "culprit_probe"), found=result.found,
        culprit={"commit": None if commit is None else {"sha": commit[0], "subject": commit[1]},
                 "config": [asdict(c) for c in result.culprit_keys]},
        probes=[keys(p, drop=("replayed",)) for p in result.probes],
        localized=result.localized.lines() if result.localized is not None else None))
