"""What `--help` teaches beyond the options: the commands in the order a user meets them, and each command's examples.

Kept apart from the commands so that the examples read as one page; `teach` puts them under each command's help
(click's epilog), and scripts/gen_docs.py carries them into docs/reference/cli.md.
"""

from __future__ import annotations

import click

# The order a newcomer meets them: the loop (run, replay, look), then checking and comparing, then the tools for a
# failed or suspicious run, then studies and claims, then moving and signing records. A command not named here
# (a new one) is listed after these, by name.
ORDER = (
    "run", "replay", "runs", "ui", "check", "compare", "resume", "mark", "calibrate", "audit", "trace", "bisect",
    "verify", "export", "import", "attest", "verify-record",
)

# Each line: the command, then (after two spaces and #) what it does. `<run-id>` is the last line `harness run`
# printed; every id may be given to the commands that take one.
EXAMPLES: dict[str, list[str]] = {
    "run": [
        "harness run experiments/linear_ddp                     # record, launch 2 ranks; the run id is the last line",
        "harness run experiments/linear_ddp train.lr=0.05 world_size=4   # KEY=VALUE overrides of experiment.yaml",
        "harness run experiments/linear_ddp --seeds 5           # a study: 5 runs, seeds seed..seed+4",
        "harness run experiments/linear_ddp --require-clean     # refuse uncommitted changes",
    ],
    "replay": [
        "harness replay <run-id>                   # rerun the record and judge it: verdict: BITWISE ...",
        "harness replay <run-id> --steps 8         # a first check: only the first 8 steps",
        "harness replay <run-id> --world-size 4    # another number of ranks (counted apart)",
        "harness replay <run-id> train.lr=0.1 --allow-changes   # a changed config, reported as a change",
        "harness replay <study-id> --members 3     # 3 members of a study, judged against the seeds' noise",
    ],
    "runs": [
        "harness runs                    # the 20 newest runs of every experiment, with their replays' verdicts",
        "harness runs linear_ddp -n 50   # the 50 newest of one experiment",
        "harness runs --all              # also what commands made: calibrations, traces, audits, seeds, probes",
        "harness runs --kind trace --status FAILED   # only the traces that failed",
    ],
    "ui": [
        "harness ui                      # the MLflow UI on the newest run's experiment, http://127.0.0.1:5050",
        "harness ui linear_ddp --port 8080",
        "harness ui --tracking-uri http://mlflow.lab:5000   # a tracking server: prints its link, starts nothing",
    ],
    "check": [
        "harness check experiments/linear_ddp                # every check `harness run` makes, nothing recorded",
        "harness check experiments/linear_ddp world_size=8   # would these overrides run here?",
    ],
    "compare": [
        "harness compare <run-id>                 # the run and its newest replay",
        "harness compare <run-a> <run-b>          # environment delta and verdict of two recorded runs",
        "harness compare <run-a> <run-b> --json   # the whole comparison, for a script",
        "harness compare <trace-a> <trace-b> --report diff.html   # two traces: the first op that differs",
    ],
    "resume": [
        "harness resume <run-id>   # a FAILED or KILLED run, from its last complete checkpoint",
    ],
    "mark": [
        "harness runs                               # STATUS STALE: its launcher is gone",
        "harness mark <run-id> --status KILLED      # close it",
    ],
    "calibrate": [
        "harness calibrate <run-id>                 # 8 nudged re-executions of its first 50 steps",
        "harness calibrate <run-id> -k 16 -m 200    # a wider envelope: 16 members, 200 steps",
        "harness calibrate <run-id> train.token=VALUE  # a secret its record hides, given again as to replay",
    ],
    "audit": [
        "harness audit <run-id> -k 3               # replay 3 random checkpoint-to-checkpoint segments",
        "harness audit <run-id> -k 3 --seed 7      # the same draw again",
    ],
    "trace": [
        "harness trace <run-id> --step 12 --ranks 0,1   # every op of step 12 on ranks 0 and 1",
        "harness compare <trace-a> <trace-b>            # then: the first op that differs",
    ],
    "bisect": [
        "harness bisect <good-id> <bad-id>              # which commit or config key flips the result",
        "harness bisect <good-id> <bad-id> --localize   # ... and the first op that differs",
        "harness bisect <good-id> <bad-id> --resume <bisect-id>   # take up a bisect that was cut short",
    ],
    "verify": [
        "harness verify paper/claims.yaml              # each printed number against the record",
        "harness verify paper/claims.yaml --replay     # ... and replay what the claims rest on",
    ],
    "export": [
        "harness export <run-id> -o run.tar.gz                      # the record, its code and its replays",
        "harness export <run-id> -o run.tar.gz --with-data --sign key.pem   # with its data, signed",
    ],
    "import": [
        "harness import run.tar.gz                  # verified whole, then imported; prints the id here",
        "harness import run.tar.gz --data-dir /data/imported",
        "harness import big.tar.gz --max-unpacked-mib 200000   # a bundle over 64 GiB unpacked, from a source you trust",
    ],
    "attest": [
        "harness attest <run-id> --key private.pem -o run.intoto.json",
    ],
    "verify-record": [
        "harness verify-record <run-id> --attestation run.intoto.json --key public.pem",
    ],
}

COMPLETION = (
    "Tab completion: eval \"$(_HARNESS_COMPLETE=bash_source harness)\" in ~/.bashrc (zsh_source in ~/.zshrc, "
    "fish_source for fish)."
)


class OrderedGroup(click.Group):
    """A group that lists its commands in ORDER (click's default is by name)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        names = set(super().list_commands(ctx))
        return [n for n in ORDER if n in names] + sorted(names - set(ORDER))


def examples_epilog(lines: list[str]) -> str:
    """An `Examples:` section, each line kept as written (click's \\b marks a paragraph it must not rewrap)."""
    return "\b\nExamples:\n" + "\n".join(f"  {line}" for line in lines)


def teach(group: click.Group) -> None:
    """Every visible command of `group` gets its examples under its help; the group itself, how to complete."""
    for name, command in group.commands.items():
        if name in EXAMPLES and not command.hidden:
            command.epilog = examples_epilog(EXAMPLES[name])
    group.epilog = COMPLETION
