"""`harness bisect GOOD BAD`: which difference between two runs flips the result - a commit, a config key.

Each probe is an ordinary recorded replay of GOOD (nested under one `bisect` run) with part of what BAD changed:
the code of a commit between the two, or some of BAD's config values. A probe that reproduces GOOD (BITWISE or
WITHIN_TOLERANCE by GOOD's tolerance) keeps the change innocent; one that does not holds the culprit. Commits are
searched by halving the ancestry path between the two runs' commits (ceil(log2 n) probes after the first two),
config keys by splitting the changed keys in halves until one half alone flips the result. What this machine
cannot vary (a GPU model, a driver, the torch build) is named, never guessed at.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from harness import events, tags as T
from harness.commands.options import BisectOptions
from harness.config import as_override
from harness.errors import EXIT_FAILED, EXIT_OK, RepositoryError, RunRefused, UsageError
from harness.fmt import markdown_table
from harness.judge.compare import Comparison, compare_runs
from harness.judge.delta import ConfigChange, config_delta, environment_delta
from harness.judge.verdicts import Policy, Verdict, verdicts
from harness.record import derived, loading
from harness.rundata import RunRecord
from harness.store.tracking import Tracker
from harness.systems import git as gitsource
from harness.version import __version__

# A probe judged like GOOD by GOOD's tolerance: the change it carries is innocent. Not the exit code's REPRODUCED: a
# probe within the seeds' noise changed the result, which is what bisect looks for.
INNOCENT = verdicts(Policy.WITHIN_TOLERANCE)


@dataclass
class Probe:
    """One replay of GOOD with part of BAD's changes, and how it was judged against GOOD."""

    what: str  # "commit 1a2b3c4d5e6f (subject)", "config train.lr, train.wd", "GOOD as recorded"
    run_id: str
    verdict: str
    summary: str
    replayed: Any = None  # replay.ReplayResult: its comparison and records, for --localize
    reused_from: str | None = None  # bisect --resume: the earlier bisect that ran this probe

    @property
    def flipped(self) -> bool:
        return self.verdict not in INNOCENT


@dataclass
class BisectResult:
    run_id: str
    good: str
    bad: str
    probes: list[Probe] = field(default_factory=list)
    culprit_commit: tuple[str, str] | None = None  # (sha, subject): the first commit whose code flips the result
    culprit_keys: list[ConfigChange] = field(default_factory=list)  # the config keys whose BAD values flip it
    unresolved: str | None = None  # what could not be decided, and why
    not_varied: list[str] = field(default_factory=list)  # differences this machine cannot vary
    culprit_probe: Probe | None = None  # the probe that carried the culprit alone and flipped the result
    localized: Any = None  # trace.Localized: where that probe first differed from GOOD (--localize)

    @property
    def found(self) -> bool:
        return self.culprit_commit is not None or bool(self.culprit_keys)

    @property
    def exit_code(self) -> int:
        return EXIT_OK if self.found else EXIT_FAILED

    def culprit(self) -> str:
        parts = []
        if self.culprit_commit is not None:
            parts.append(f"commit {self.culprit_commit[0]}")
        if self.culprit_keys:
            parts.append("config " + " ".join(c.key for c in self.culprit_keys))
        return "; ".join(parts)

    def lines(self) -> list[str]:
        out = [f"probe {i}: {p.what}: {p.summary}  (replay {p.run_id}"
               + (f", reused from bisect {p.reused_from})" if p.reused_from else ")") for i, p in enumerate(self.probes, 1)]
        out += [f"not varied here: {what}" for what in self.not_varied]
        if self.culprit_commit is not None:
            sha, subject = self.culprit_commit
            out.append(f"culprit: commit {sha[:12]} ({subject}): its code flips the result")
        for c in self.culprit_keys:
            out.append(f"culprit: config {c.key}: {c.a} -> {c.b} flips the result")
        if self.localized is not None:
            probe = f" (probe replay {self.culprit_probe.run_id})" if self.culprit_probe is not None else ""
            out += [f"at the culprit{probe}: {line}" for line in self.localized.lines()]
        if self.unresolved:
            out.append(f"unresolved: {self.unresolved}")
        n = len(self.probes)
        out.append(f"bisect: {self.culprit() or 'no culprit found'} ({n} probe{'s' if n != 1 else ''})")
        return out

    def markdown(self) -> str:
        out = [f"# Bisect of {self.good} (good) against {self.bad} (bad)", ""]
        out += markdown_table(["#", "probe", "verdict", "replay"],
                              [[str(i), p.what, p.verdict, f"`{p.run_id}`"] for i, p in enumerate(self.probes, 1)])
        return "\n".join(out + ["", *[f"- {line}" for line in self.lines()[len(self.probes):]], ""])


class _Budget(Exception):
    """--max-probes were spent before the search ended."""


def _override(key: str, config: Mapping[str, Any]) -> str:
    """KEY=VALUE giving `key` the value it has in `config`, in YAML that parse_overrides reads back as that value."""
    node: Any = config
    for part in key.split("."):
        node = node[int(part)] if isinstance(node, list) else node[part]
    text = yaml.safe_dump(node, default_flow_style=True, width=10**9).strip()
    return as_override(key, text.removesuffix("...").strip())


def _split(keys: list[ConfigChange], flips: Callable[[list[ConfigChange]], bool]) -> tuple[list[ConfigChange], bool]:
    """The smallest half-by-half part of `keys` (which flip the result together) that flips it alone; and whether
    it is minimal (False: only keys from both halves together flip it, so they are not split further)."""
    if len(keys) == 1:
        return keys, True
    half = len(keys) // 2
    for part in (keys[:half], keys[half:]):
        if flips(part):
            return _split(part, flips)
    return keys, False


def bisect(options: BisectOptions, *, replay: Callable[..., Any], compare: Callable[..., Comparison],
           localizer: Callable[..., Any]) -> BisectResult:
    """Find what flips GOOD's result into BAD's; bad input raises HarnessError before anything is recorded.
    `localize`: then trace the culprit's probe against GOOD and name the first op that differs (replay --localize's
    machinery, on the probe that carried the culprit alone). `resume`: an earlier bisect of the same two runs (cut
    short by --max-probes or a kill): its probes are taken up, not run again; --max-probes counts new ones.

    `replay`, `compare`, `localizer`: commands/replay.py's replay and compare and the trace extra's after_replay,
    handed in by the API. A bisect's probes are replays, judged and localized as `harness replay` judges and localizes
    one, so this verb composes those; it is given them rather than importing them, so that no verb imports another
    (pyproject.toml's independence contract)."""
    good_id, bad_id, max_probes, repo = options.good, options.bad, options.max_probes, options.repo
    tracking_uri, localize, resume = options.tracking_uri, options.localize, options.resume
    if max_probes < 1:
        raise UsageError(f"--max-probes must be >= 1, got {max_probes}.")
    tracker = Tracker(tracking_uri)
    good = loading.load(tracker, tracker.harness_run(good_id), loading.REPLAY).summary
    bad = loading.load(tracker, tracker.harness_run(bad_id), loading.COMPARE).summary
    a, b = tracker.load_record(good.run_id), tracker.load_record(bad.run_id)
    judged = compare_runs(a, b)
    if judged.verdict in (*INNOCENT, Verdict.NOTHING_TO_COMPARE):
        raise UsageError(f"runs {good.run_id} and {bad.run_id} do not differ in their results ({judged.summary()}): "
                           "there is nothing to bisect. Give a run and one whose result differs from it.")
    if good.tags.get(T.EXPERIMENT_PATH) != bad.tags.get(T.EXPERIMENT_PATH):
        raise UsageError(f"runs {good.run_id} and {bad.run_id} are of different experiments "
                           f"({good.tags.get(T.EXPERIMENT_PATH)}, {bad.tags.get(T.EXPERIMENT_PATH)}): bisect compares "
                           "two runs of one experiment.")
    earlier = _earlier_probes(tracker, resume, good.run_id, bad.run_id) if resume else {}
    delta = config_delta(a.config, b.config, a.facts, b.facts)
    keys, not_varied = _config_changes(delta)
    commits, more = _commits(a, b, repo)
    not_varied += more + _fixed_environment(a, b, {c.key for c in delta})

    run_tags = derived.tags(T.KIND_BISECT, version=__version__, parent=good.run_id,
                            extra={T.BISECT_GOOD: good.run_id, T.BISECT_BAD: bad.run_id,
                                   **({T.BISECT_RESUMED_FROM: resume} if resume else {})})
    with derived.opened(tracker, good.experiment, run_tags, f"bisect-{good.run_name}") as bisect_id:
        result = BisectResult(bisect_id, good.run_id, bad.run_id, not_varied=not_varied)

        def probe(what: str, commit: str | None, changed: list[ConfigChange]) -> Probe:
            if what in earlier:
                result.probes.append(earlier[what])
                events.emit(events.Notice(f"bisect: probe {len(result.probes)}: {what}: {earlier[what].verdict} "
                                          f"(reused from bisect {resume})"))
                return earlier[what]
            if sum(1 for p in result.probes if p.reused_from is None) >= max_probes:
                raise _Budget
            replayed = replay(
                good.run_id, overrides=[_override(c.key, b.config) for c in changed], allow_changes=bool(changed),
                commit=commit, tracker=tracker, repo=repo, follow=False, localize=False,
                extra_tags={T.MLFLOW_PARENT_RUN_ID: bisect_id, T.BISECT_OF: bisect_id},
            )
            cmp = replayed.judged
            done = Probe(what, replayed.outcome.run_id, cmp.verdict, cmp.summary(), replayed)
            result.probes.append(done)
            events.emit(events.Notice(f"bisect: probe {len(result.probes)}: {what}: {cmp.verdict}"))
            return done

        try:
            _search(result, probe, a, keys, commits)
        except _Budget:
            result.unresolved = (f"--max-probes {max_probes} spent before the search ended"
                                 + (f"; {result.unresolved}" if result.unresolved else "")
                                 + ". Raise --max-probes and run it again.")
        if localize and result.culprit_probe is not None:
            _localize(tracker, result, result.culprit_probe, repo, compare, localizer)
        _record(tracker, result)
    return result


def _localize(tracker: Tracker, result: BisectResult, probe: Probe, repo: Path | None,
              compare: Callable[..., Comparison], localizer: Callable[..., Any]) -> None:
    """Where the culprit's probe first differs from GOOD, recorded on that probe as replay --localize records it."""
    if probe.verdict != Verdict.DIVERGED:
        return
    events.emit(events.Notice(f"bisect: localizing the culprit's probe {probe.run_id}"))
    replayed = probe.replayed
    if replayed is not None and replayed.records is not None:
        (good, replay), judged, changes = replayed.records, replayed.judged, replayed.changes
    else:  # a probe taken up from an earlier bisect: judged again from its record, as it was
        good, replay = tracker.load_record(result.good), tracker.load_record(probe.run_id)
        judged = compare(result.good, probe.run_id, tracker.uri)
        changes = tracker.harness_run(probe.run_id).tags.get(T.CHANGES, "").split()
    result.localized = localizer(tracker, probe.run_id, judged, changes, good, replay, repo)


def _earlier_probes(tracker: Tracker, bisect_id: str, good: str, bad: str) -> dict[str, Probe]:
    """The probes an earlier bisect of GOOD and BAD ran, by what each carried; each probe replay is checked as a
    comparison checks a run (made by harness, sealed and unedited) and must carry the verdict that bisect saw."""
    run = tracker.harness_run(bisect_id)
    if run.tags.get(T.KIND) != T.KIND_BISECT:
        raise RunRefused(f"--resume {bisect_id}: run {bisect_id} is no bisect (harness.kind "
                           f"{run.tags.get(T.KIND)}). Give the id `harness bisect` printed last.")
    if (run.tags.get(T.BISECT_GOOD), run.tags.get(T.BISECT_BAD)) != (good, bad):
        raise UsageError(f"--resume {bisect_id}: that bisect was of {run.tags.get(T.BISECT_GOOD)} and "
                           f"{run.tags.get(T.BISECT_BAD)}, not {good} and {bad}. Resume it with its own two runs.")
    text = tracker.read_text(bisect_id, "bisect/bisect.json")
    if text is None:  # cut before it wrote its report: its probes are nested under it, each tagged with what it carried
        raise RunRefused(f"--resume {bisect_id}: that bisect wrote no bisect/bisect.json (it was stopped before its "
                           "end). Run harness bisect again without --resume.")
    probes: dict[str, Probe] = {}
    for entry in json.loads(text).get("probes", []):
        replay = loading.load(tracker, tracker.harness_run(entry["run_id"]), loading.COMPARE).summary
        if replay.tags.get(T.VERDICT) != entry["verdict"]:
            raise RunRefused(f"--resume {bisect_id}: probe replay {entry['run_id']} carries the verdict "
                               f"{replay.tags.get(T.VERDICT)}, not the {entry['verdict']} that bisect recorded. "
                               "Run harness bisect again without --resume.")
        origin = entry.get("reused_from") or bisect_id
        probes[entry["what"]] = Probe(entry["what"], entry["run_id"], entry["verdict"],
                                      f"{entry['verdict']} (as judged then)", reused_from=origin)
    return probes


def _search(result: BisectResult, probe: Callable[[str, str | None, list[ConfigChange]], Probe], a: RunRecord,
            keys: list[ConfigChange], commits: list[tuple[str, str]]) -> None:
    good_commit = a.facts[T.GIT_COMMIT]
    if probe("GOOD as recorded", None, []).flipped:
        result.unresolved = ("GOOD does not reproduce itself, so no difference can be blamed: make it reproducible "
                             "first (harness replay GOOD; determinism.level=strict)")
        return
    flipping: dict[str, Probe] = {}  # what a probe carried -> the probe, for the ones that flipped

    def flips(what: str, commit: str | None, changed: list[ConfigChange]) -> bool:
        done = probe(what, commit, changed)
        if done.flipped:
            flipping[what] = done
        return done.flipped

    def keys_what(part: list[ConfigChange]) -> str:
        return "config " + ", ".join(c.key for c in part)

    if keys:
        if flips(keys_what(keys), None, keys):
            result.culprit_keys, minimal = _split(keys, lambda part: flips(keys_what(part), None, part))
            result.culprit_probe = flipping.get(keys_what(result.culprit_keys))
            if not minimal:
                result.unresolved = "only these config keys together flip the result, none alone"
    if commits:
        def commit_what(i: int) -> str:
            return f"commit {commits[i][0][:12]} ({commits[i][1]})"

        if flips(commit_what(len(commits) - 1), commits[-1][0], []):
            lo, hi = -1, len(commits) - 1  # commits[lo] (or GOOD's commit at -1) keeps GOOD; commits[hi] flips
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if flips(commit_what(mid), commits[mid][0], []):
                    hi = mid
                else:
                    lo = mid
            result.culprit_commit = commits[hi]
            result.culprit_probe = flipping.get(commit_what(hi))
    if not result.found and keys and commits:
        sha, _ = commits[-1]
        if probe(f"commit {sha[:12]} with config " + ", ".join(c.key for c in keys), sha, keys).flipped:
            result.unresolved = "only BAD's commits and config keys together flip the result, neither alone"
            return
    if not result.found and result.unresolved is None:
        result.unresolved = ("no probe flipped the result: the difference lies in what this machine cannot vary"
                             + (f" ({'; '.join(result.not_varied)})" if result.not_varied else "")
                             + f", or in nondeterminism GOOD's own replay did not show (GOOD's commit {good_commit[:12]})")


def _config_changes(delta: list[ConfigChange]) -> tuple[list[ConfigChange], list[str]]:
    """BAD's config changes that affect the result and an override can make; the others, said as not varied."""
    keys, not_varied = [], []
    for change in delta:
        if not change.affects_result:
            continue
        if change.b is None:
            not_varied.append(f"config {change.key} is in GOOD's config only (an override cannot remove a key)")
            continue
        keys.append(change)
    return keys, not_varied


def _commits(a: RunRecord, b: RunRecord, repo: Path | None) -> tuple[list[tuple[str, str]], list[str]]:
    """The commits from GOOD's (excluded) to BAD's, oldest first; and why they cannot be searched, when not."""
    ga, gb = a.facts[T.GIT_COMMIT], b.facts[T.GIT_COMMIT]
    notes = []
    if b.facts.get(T.GIT_DIRTY) == "true":
        notes.append(f"BAD's uncommitted changes (its patch on {gb[:12]}): probes run committed code only")
    if ga == gb:
        return [], notes
    root = gitsource.find_repo(repo or Path.cwd())
    if root is None or not (gitsource.has_commit(root, ga) and gitsource.has_commit(root, gb)):
        raise RepositoryError(f"commits {ga[:12]} and {gb[:12]} of the two runs must both be in the repository at "
                           f"{repo or Path.cwd()}. Run harness bisect inside a clone that has them (git fetch).")
    commits = gitsource.commits_between(root, ga, gb)
    if not commits:
        notes.append(f"commits {ga[:12]} -> {gb[:12]}: GOOD's commit is no ancestor of BAD's, so the history between "
                     "them cannot be halved")
    return commits, notes


def _fixed_environment(a: RunRecord, b: RunRecord, config_keys: set[str]) -> list[str]:
    """Differences of the machine or its software that change the arithmetic and that no probe here can vary
    (`config_keys`: the config keys that differ, which the probes do vary)."""
    return [f"{d.name}: {d.a} -> {d.b}" for d in environment_delta(a, b)
            if d.breaks_bitwise and d.name not in (T.GIT_COMMIT, T.GIT_DIRTY, T.GIT_PATCH_SHA256)
            and d.name.removeprefix(T.PREFIX) not in config_keys]


def _record(tracker: Tracker, result: BisectResult) -> None:
    markdown = result.markdown()
    tracker.set_tags(result.run_id, {T.BISECT_CULPRIT: result.culprit(), T.BISECT_PROBES: str(len(result.probes)),
                                     T.MLFLOW_RUN_NOTE: markdown})
    tracker.log_text(result.run_id, markdown, "bisect/report.md")
    doc = {"good": result.good, "bad": result.bad, "culprit": result.culprit(),
           "culprit_commit": list(result.culprit_commit) if result.culprit_commit else None,
           "culprit_keys": [{"key": c.key, "good": c.a, "bad": c.b} for c in result.culprit_keys],
           "unresolved": result.unresolved, "not_varied": result.not_varied,
           "culprit_probe": result.culprit_probe.run_id if result.culprit_probe is not None else None,
           "localized": result.localized.lines() if result.localized is not None else None,
           "probes": [{"what": p.what, "run_id": p.run_id, "verdict": p.verdict, "reused_from": p.reused_from}
                      for p in result.probes]}
    tracker.log_text(result.run_id, json.dumps(doc, indent=2), "bisect/bisect.json")
