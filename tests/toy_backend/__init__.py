"""A backend from outside harness, for the tests: `inline` runs the ranks with mp.spawn on this machine, as the
local backend does, with a config section and a command-line option of its own. It is no module of harness: it
reaches harness only through the `harness.executors` entry point a test declares (tests/test_executors.py)."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

from harness import tags as T
from harness.errors import ConfigError
from harness.executors import Backend, CliOption, Job
from harness.executors.local import LocalExecutor

LABEL_TAG = "toy.inline.label"  # where the run records the label


@dataclass
class InlineConfig:
    """How `executor: inline` runs: this machine's ranks, under a label."""

    label: str = "unlabelled"
    """Recorded in the run's toy.inline.label tag."""


class InlineExecutor(LocalExecutor):
    name = "inline"

    def prepare(self, job: Job) -> dict[str, str]:
        tags = super().prepare(job)
        return {**tags, T.EXECUTOR: self.name, LABEL_TAG: str(job.cfg.inline.label)}


def check(cfg: DictConfig) -> None:
    if not str(cfg.inline.label).strip():
        raise ConfigError("inline.label is empty; give the runs a label (--inline-label NAME).")


BACKEND = Backend(
    name="inline", executor=InlineExecutor, section=InlineConfig, check=check,
    help="this machine's ranks, labelled (a test backend)",
    cli=(CliOption("--inline-label", "inline_label", "inline: the label the run records.", key="label"),),
)
