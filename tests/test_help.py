"""`--help` teaches: every command shows examples that parse as written and says its exit codes; `harness --help`
lists the commands in the order a user meets them; shell completion works as the README says."""

from __future__ import annotations

import re
import shlex

import click
import pytest
from click.testing import CliRunner

from harness.cli import main
from harness.cli.help import EXAMPLES, ORDER

pytestmark = pytest.mark.unit

CTX = click.Context(main, info_name="harness", **main.context_settings)  # -h as well as --help, as the CLI has
VISIBLE = [n for n in main.list_commands(CTX) if not main.get_command(CTX, n).hidden]  # type: ignore[union-attr]


def _help(name: str) -> str:
    command = main.get_command(CTX, name)
    assert command is not None
    return command.get_help(click.Context(command, info_name=name, parent=CTX))


@pytest.mark.parametrize("name", VISIBLE)
def test_every_command_shows_examples_and_its_exit_codes(name: str) -> None:
    text = _help(name)
    examples = text.split("Examples:\n", 1)
    assert len(examples) == 2, f"`harness {name} --help` has no Examples section"
    lines = [line.strip() for line in examples[1].splitlines() if line.strip()]
    assert any(line.startswith(f"harness {name} ") for line in lines), lines
    assert re.search(r"\bExit (codes?: )?0 ", text) or re.search(r"\bExit 130\b", text), (
        f"`harness {name} --help` does not say its exit codes")


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_every_example_parses_as_written(name: str) -> None:
    # An example naming an option the command lacks (or lacking a required one) would teach a refusal.
    for line in EXAMPLES[name]:
        args = shlex.split(line.split("  #", 1)[0])
        assert args[0] == "harness", line
        command = main.get_command(CTX, args[1])
        assert command is not None, line
        try:
            command.make_context(args[1], args[2:], parent=CTX)
        except click.ClickException as err:
            pytest.fail(f"{line!r}: {err.format_message()}")


def test_commands_are_listed_in_the_order_a_user_meets_them() -> None:
    assert VISIBLE[:4] == ["run", "replay", "runs", "ui"]
    assert set(VISIBLE) <= set(ORDER), f"not placed in help.ORDER: {set(VISIBLE) - set(ORDER)}"
    listed = CliRunner().invoke(main, ["--help"], prog_name="harness").output
    commands = listed.split("Commands:\n", 1)[1].splitlines()
    assert [line.split()[0] for line in commands if line.startswith("  ") and not line.startswith("   ")][:5] == [
        "run", "replay", "runs", "ui", "check"]
    assert "_HARNESS_COMPLETE=bash_source harness" in listed


def test_shell_completion_as_documented() -> None:
    runner = CliRunner()
    source = runner.invoke(main, [], prog_name="harness", env={"_HARNESS_COMPLETE": "bash_source"})
    assert source.exit_code == 0 and "complete -o nosort -F _harness_completion harness" in source.output
    # What bash asks once that function is loaded: `harness re<TAB>`, then `harness replay --st<TAB>`.
    words = runner.invoke(main, [], prog_name="harness", env={
        "_HARNESS_COMPLETE": "bash_complete", "COMP_WORDS": "harness re", "COMP_CWORD": "1"}).output
    assert {"plain,replay", "plain,resume"} <= set(words.split()), words
    options = runner.invoke(main, [], prog_name="harness", env={
        "_HARNESS_COMPLETE": "bash_complete", "COMP_WORDS": "harness replay --st", "COMP_CWORD": "2"}).output
    assert "plain,--steps" in options.split(), options
