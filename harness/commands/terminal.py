"""What the command line draws with from below the commands, passed on here: a comparison's lines, the store's
one-line failures and its UI (the backends' declarations: placement.py). The CLI
imports only the commands and the leaves (the import contract in pyproject.toml), so that a view it draws is
a command's result, never a reach into the layers that make it."""

from __future__ import annotations

from harness.judge.text import (
    comparison_lines as comparison_lines,
    study_replay_lines as study_replay_lines,
    verdict_line as verdict_line,
)
from harness.judge.verdicts import tone as verdict_tone
from harness.store import ui as mlflow_ui
from harness.store.failures import is_store_error as is_store_error, store_failure as store_failure
from harness.store.reach import display_uri as display_uri, resolve_uri as resolve_uri
from harness.store.tracking import Tracker as Tracker
from harness.store.ui import server_url as server_url, ui_command as ui_command

__all__ = [
    "Tracker", "comparison_lines", "display_uri", "is_store_error", "mlflow_ui",
    "resolve_uri", "server_url", "store_failure", "study_replay_lines", "ui_command", "verdict_line",
    "verdict_tone",
]
