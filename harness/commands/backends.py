"""Where a job's ranks may run, as the command line offers it: the registered backends' names, their help lines and
their own options (read when a command is parsed or its help shown), and the run of a recorded job where a
container or a scheduler's task started `harness _execute`.

Light on purpose: parsing `harness run` loads the registry and nothing of the store or the judge.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from harness.executors import backends

if TYPE_CHECKING:
    from harness.executors import CliOption, Outcome

__all__ = ["execute", "help_lines", "names", "options"]


def names() -> list[str]:
    """The backends --executor takes, the built-in ones first."""
    return list(backends())


def help_lines() -> list[str]:
    """Each backend's own line for --executor's help (`NAME: what it does`); none for one without help."""
    return [f"{name}: {b.help}" for name, b in backends().items() if b.help]


def options(command: str) -> list[CliOption]:
    """The options the backends declare for `command` (run, replay), in the registry's order."""
    return [opt for declared in backends().values() for opt in declared.cli if command in opt.commands]


def execute(run_id: str, code_dir: Path, tracking_uri: str | None, resume_step: int | None) -> Outcome:
    """Run the recorded run `run_id` here, from its code in `code_dir`, placed where the backend that started this
    process says (its environment)."""
    from harness.commands import run as runner
    from harness.executors import topology_from_env

    return runner.execute_recorded(run_id, code_dir, tracking_uri, resume_step, topology_from_env())
