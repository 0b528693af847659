"""Colour on a terminal: verdicts green (a pass), red (DIVERGED), yellow (no pass and no difference shown), the
`Error:` of a refusal red; never where the stream is no terminal, with NO_COLOR set (https://no-color.org), or with
--json. The CLI runs in this process through click's CliRunner, whose `color=True` is a terminal's stream."""

from __future__ import annotations

import json

import pytest
from conftest import Project

from harness.judge.verdicts import Verdict, tone

pytestmark = pytest.mark.cli

GREEN, RED, YELLOW, BOLD, RESET = "\x1b[32m", "\x1b[31m", "\x1b[33m", "\x1b[1m", "\x1b[0m"
ON_A_TERMINAL = {"NO_COLOR": ""}  # set to nothing is not set (no-color.org): whatever the machine running this has


@pytest.mark.unit
def test_every_verdict_has_a_tone_by_whether_it_passes() -> None:
    assert {v.value: tone(v.value) for v in Verdict} == {
        "BITWISE": "pass", "WITHIN_ROUNDING": "pass", "WITHIN_TOLERANCE": "pass", "WITHIN_NOISE": "pass",
        "INCONCLUSIVE": "unsure", "DIVERGED": "fail", "NOTHING_TO_COMPARE": "unsure",
    }
    assert tone("FINISHED") is None  # a run's status is no verdict: left as it is


@pytest.mark.unit
def test_a_verdict_line_colours_its_verdict_only(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    from harness.cli import console

    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setattr(console.Voice, "plain", False)
    monkeypatch.setattr(console.click.utils, "should_strip_ansi", lambda stream=None, color=None: False)  # a terminal
    console.say_verdict("verdict: DIVERGED at step 3 (loss)")
    console.say_verdict("verdict: INCONCLUSIVE: 3 of 3 members replayed")
    console.say_verdict("verdict: WITHIN_TOLERANCE (atol 1e-06)")
    assert capsys.readouterr().out.splitlines() == [
        f"verdict: {RED}{BOLD}DIVERGED{RESET} at step 3 (loss)",
        f"verdict: {YELLOW}{BOLD}INCONCLUSIVE{RESET}: 3 of 3 members replayed",
        f"verdict: {GREEN}{BOLD}WITHIN_TOLERANCE{RESET} (atol 1e-06)",
    ]


def test_verdicts_and_errors_are_coloured_on_a_terminal_only(project: Project, reference_run: str) -> None:
    run = reference_run
    shown = project.cli("compare", run, run, color=True, env=ON_A_TERMINAL)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.splitlines()[-1].startswith(f"verdict: {GREEN}{BOLD}BITWISE{RESET}"), shown.stdout
    refused = project.cli("replay", "0" * 32, color=True, env=ON_A_TERMINAL)
    assert refused.returncode == 2 and refused.stderr.startswith(f"{RED}{BOLD}Error:{RESET} "), refused.stderr

    # A pipe or a file (click drops the colour), NO_COLOR set, --json: plain text, every byte of it.
    for plain in (project.cli("compare", run, run),
                  project.cli("compare", run, run, color=True, env={"NO_COLOR": "1"})):
        assert "\x1b[" not in plain.stdout + plain.stderr and plain.stdout.splitlines()[-1].startswith("verdict: BITWISE")
    for plain in (project.cli("replay", "0" * 32, color=True, env={"NO_COLOR": "1"}),
                  project.cli("replay", "0" * 32, "--json", color=True, env=ON_A_TERMINAL)):
        assert plain.returncode == 2 and plain.stderr.startswith("Error: ") and "\x1b[" not in plain.stderr
    as_json = project.cli("compare", run, run, "--json", color=True, env=ON_A_TERMINAL)
    assert "\x1b[" not in as_json.stdout + as_json.stderr and json.loads(as_json.stdout)["verdict"] == "BITWISE"


def test_a_line_written_above_the_bar_keeps_no_colour_in_a_pipe(capsys: pytest.CaptureFixture) -> None:
    """While ranks run, warnings go above the step bar (tqdm's write, which keeps what it is given): in a pipe or a
    file they come without escape codes, as click.echo's lines do."""
    import click

    from harness import events
    from harness.cli.progress import Bar

    bar = Bar()
    bar.steps(events.Steps("linear_ddp, 2 ranks", done=0, total=10))
    bar.write(click.style("Warning:", fg="yellow", bold=True) + " something")
    bar.steps(events.Steps("linear_ddp, 2 ranks", done=10, total=10, ended=True))
    err = capsys.readouterr().err
    assert "Warning: something" in err and "\x1b[" not in err, repr(err)
