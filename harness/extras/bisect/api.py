"""The Python API of the bisect extra: `harness.bisect`."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from harness import events, extensions, seeds
from harness.commands import replay as replay_command
from harness.commands.api import by_keywords, compare_by_keywords
from harness.commands.options import BisectOptions
from harness.errors import UsageError
from harness.extras.bisect import command as bisect_command
from harness.extras.bisect.command import BisectResult
from harness.store.tracking import full_ids

__all__ = ["BisectOptions", "bisect"]


def bisect(options: BisectOptions) -> BisectResult:
    o = options
    with events.listening(o.on_event), seeds.given_back():
        good, bad, resume = full_ids(o.tracking_uri, o.good, o.bad, o.resume)
        assert good is not None and bad is not None  # given: only None stays None
        o = replace(o, good=good, bad=bad, resume=resume)
        # A bisect's probes are replays, judged and localized as replay's: those verbs are handed to it, the
        # localizer by the trace extra.
        localizer = extensions.hook(extensions.LOCALIZE)
        if o.localize and localizer is None:
            raise UsageError("--localize traces the culprit, which needs the trace extra (harness.extras.trace); "
                             "drop --localize.")
        return bisect_command.bisect(o, replay=by_keywords(replay_command.replay), compare=compare_by_keywords,
                                     localizer=localizer or _unlocalized)


def _unlocalized(*_: Any) -> None:
    return None
