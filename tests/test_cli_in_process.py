"""Project.cli, the in-process `harness` the refusal tests use, answers exactly as `python -m harness` does
and leaves this process as it found it: otherwise a refusal test could pass in-process and fail for users."""

from __future__ import annotations

import importlib
import os
import sys

import pytest

from conftest import Project

REFUSALS = [
    ["run", "experiments/linear_ddp", "seed=-1"],  # the library's HarnessError: one line, exit 2
    ["run", "experiments/linear_ddp", "--no-such-option"],  # click's usage error, with the program's name
    ["replay", "0123456789abcdef0123456789abcdef"],  # a store opened and asked
]


@pytest.mark.parametrize("args", REFUSALS, ids=[a[0] + " " + a[-1] for a in REFUSALS])
def test_in_process_answer_equals_the_subprocess_answer(fresh_project: Project, args: list[str]) -> None:
    in_process = fresh_project.cli(*args)
    assert in_process.returncode == 2, in_process
    assert in_process == fresh_project.harness(*args)


def test_in_process_call_leaves_environment_cwd_and_path_as_they_were(fresh_project: Project) -> None:
    before = (dict(os.environ), os.getcwd(), list(sys.path))
    result = fresh_project.cli("run", "experiments/linear_ddp", "seed=-1", env={"HARNESS_TEST_LEAK": "1"},
                               cwd=fresh_project.root / "experiments")
    assert result.returncode == 2 and "does not exist" in result.stderr  # relative to the cwd given
    assert (dict(os.environ), os.getcwd(), list(sys.path)) == before


def test_an_exception_the_cli_does_not_handle_is_raised_not_an_exit_code(
    fresh_project: Project, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(**params: object) -> None:
        raise RuntimeError("a bug in harness")

    check = importlib.import_module("harness.cli").main.commands["check"]
    monkeypatch.setattr(check, "callback", broken)  # past the CLI's own handling of expected errors
    with pytest.raises(RuntimeError, match="a bug in harness"):
        fresh_project.cli("check", "experiments/linear_ddp")
