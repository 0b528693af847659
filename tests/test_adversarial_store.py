"""Adversarial cases against the tracking store: many processes creating one store at once, a full disk during an
import (issue 36 items 7 and 8)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# Eight processes that each open (and so create, or wait for) one SQLite store that does not exist yet: the opening
# path of every `harness run` (Tracker(...).client: probe, the opening lock, the schema built whole), without eight
# training runs around it. A store timeout of 0.3 s gives each holder of the opening lock 1.8 s without progress;
# with an empty schema cache the first process runs every MLflow migration, several seconds on a loaded machine:
# a holder that is building the store must be waited for, not reported as hung.
_OPEN = "import sys; from harness.store.tracking import Tracker; Tracker(sys.argv[1]).client; print('opened')"
OPENERS = 8


def test_concurrent_openers_of_a_store_that_does_not_exist_all_succeed(tmp_path: Path) -> None:
    store = tmp_path / "new store" / "mlflow.db"
    store.parent.mkdir()
    env = {**os.environ, "HARNESS_STORE_TIMEOUT_S": "0.3", "HARNESS_CACHE_DIR": str(tmp_path / "cold cache")}
    procs = [subprocess.Popen([sys.executable, "-c", _OPEN, f"sqlite:///{store}"], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(OPENERS)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0] * OPENERS, [err[-800:] for _, err in outs if err]
    assert all(out.strip() == "opened" for out, _ in outs)
    # One store, made whole; no process's temporary database left beside it.
    assert sorted(p.name for p in store.parent.iterdir() if not p.is_dir()) == ["mlflow.db"]
