"""The Python API of the verify extra: `harness.verify`."""

from __future__ import annotations

from harness import events, seeds
from harness.commands import replay as replay_command
from harness.commands.api import by_keywords, known_executor
from harness.commands.options import VerifyOptions
from harness.extras.verify import command as verify_command
from harness.extras.verify.command import VerifyResult

__all__ = ["VerifyOptions", "verify"]


def verify(options: VerifyOptions) -> VerifyResult:
    o = options
    with events.listening(o.on_event), seeds.given_back():
        known_executor(o.executor)
        # A verify's replays are replay's: that verb is handed to it.
        return verify_command.verify(
            o, replays=verify_command.Replays(by_keywords(replay_command.replay),
                                                     by_keywords(replay_command.replay_study)))
