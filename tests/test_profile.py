"""Step times and torch.profiler (issue 39): a profiled digits_cnn run, its replay without profiling, and what
compare, verify and the record make of their speed, which never enters a verdict.

Two training runs in all, shared by every test here: the profiled original and its unprofiled replay."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from decimal import Decimal
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import Project
from records import make_record

from harness import tags as T
from harness.commands.verify import judge, judge_replay
from harness.errors import HarnessError
from harness.judge.claims import Claim, Printed, Source
from harness.judge.compare import compare_runs
from harness.judge.verdicts import Verdict
from harness.rundata import RunSummary
from harness.runtime.perf import StepTimer, covered, is_communication, summary
from harness.runtime.plan import ProfilePlan
from harness.store.tracking import Tracker

EPOCH = ["train.epochs=1"]  # 1,437 training digits over 2 ranks of 32: 23 steps
PROFILED = 3


@pytest.fixture(scope="module")
def profiled(project: Project) -> str:
    """`harness run experiments/digits_profile profile.steps=[3]` (digits_cnn, one epoch): the run id."""
    project.add_experiment("digits_profile", source="digits_cnn")
    result = project.harness("run", "experiments/digits_profile", f"profile.steps=[{PROFILED}]", *EPOCH)
    assert result.returncode == 0, result.stderr
    return result.last_line


@pytest.fixture(scope="module")
def replayed(project: Project, profiled: str) -> tuple[str, str]:
    """The profiled run replayed with profiling switched off: (replay id, its stdout)."""
    result = project.harness("replay", profiled, "--allow-changes", "profile.steps=[]")
    assert result.returncode == 0, result.stdout + result.stderr
    return result.last_line, result.stdout


def _artifacts(project: Project, run_id: str) -> Path:
    local = Tracker(project.uri).local_artifact_dir(run_id)
    assert local is not None
    return local


def test_profiled_run_records_a_trace_table_and_summary(project: Project, profiled: str) -> None:
    folder = _artifacts(project, profiled) / T.ARTIFACT_PROFILE_DIR
    stem = f"rank0-step{PROFILED}"
    assert sorted(p.name for p in folder.iterdir()) == [f"{stem}.summary.json", f"{stem}.table.txt",
                                                        f"{stem}.trace.json"]
    trace = json.loads((folder / f"{stem}.trace.json").read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any("DistributedDataParallel.forward" in n for n in names)  # a Chrome trace of the training step
    assert any(is_communication(n) for n in names)  # gloo's all-reduce is in it
    assert "Self CPU" in (folder / f"{stem}.table.txt").read_text()  # key_averages().table
    summary = json.loads((folder / f"{stem}.summary.json").read_text())
    assert summary["step"] == PROFILED and summary["rank"] == 0
    assert any("all_reduce" in e or "allreduce" in e for e in summary["communication_events"])

    tags = project.client().get_run(profiled).data.tags
    share = float(tags[T.PROFILE_COMM_SHARE])
    assert 0.0 < share < 1.0 and math.isclose(share, summary["comm_share"], abs_tol=1e-4)
    assert tags[T.PROFILE_STEPS] == str(PROFILED) and tags[T.PROFILE_RANKS] == "0"
    assert float(tags[T.PROFILE_PEAK_MEMORY_MB]) > 0 and tags[T.PROFILE_PEAK_MEMORY_OF] == "cpu peak rss"


def test_every_run_records_its_step_times_without_the_profiled_step(project: Project, profiled: str) -> None:
    client = project.client()
    times = {m.step: m.value for m in client.get_metric_history(profiled, T.METRIC_STEP_S)}
    slowest = {m.step: m.value for m in client.get_metric_history(profiled, T.METRIC_STEP_S_MAX)}
    assert PROFILED not in times and len(times) == 22  # 23 steps, the profiled one left out
    assert times.keys() == slowest.keys() and all(slowest[k] >= times[k] > 0 for k in times)
    tags = client.get_run(profiled).data.tags
    assert tags[T.PERF_SAMPLES_PER_STEP] == "64"  # ctx.loader's batch of 32 on each of 2 ranks
    assert int(tags[T.PERF_STEPS]) == 20  # after 2 warm-up steps
    median = float(tags[T.PERF_STEP_MEDIAN_S])
    assert median == pytest.approx(float(np.median([times[k] for k in sorted(times)[2:]])), rel=1e-5)
    assert 0.0 <= float(tags[T.PERF_LOADER_WAIT]) < 1.0
    # Recorded as the run's own wall clock, not as metrics the training code logged through MLflow.
    assert T.USER_MLFLOW_METRICS not in tags


def test_a_profiled_run_and_an_unprofiled_replay_are_bitwise(project: Project, replayed: tuple[str, str]) -> None:
    replay_id, out = replayed
    lines = out.strip().splitlines()
    assert lines[-2].startswith(f"verdict: {Verdict.BITWISE}"), out
    speed = next(line for line in lines if line.startswith("performance: "))
    assert "per step" in speed and "communication share" in speed and "-> not profiled" in speed
    assert "performance" not in lines[-2]  # beside the verdict, never in it
    report = (_artifacts(project, replay_id) / T.ARTIFACT_REPORT).read_text()
    assert "## Performance (wall clock: not part of the verdict)" in report
    assert (_artifacts(project, replay_id) / T.ARTIFACT_PLOTS_DIR / "step_times.png").stat().st_size > 0
    assert not (_artifacts(project, replay_id) / T.ARTIFACT_PROFILE_DIR).exists()


def test_compare_prints_the_step_time_ratio(project: Project, profiled: str, replayed: tuple[str, str]) -> None:
    result = project.cli("compare", profiled, replayed[0])
    assert result.returncode == 0, result.stdout
    lines = result.stdout.strip().splitlines()
    assert lines[-1].startswith(f"verdict: {Verdict.BITWISE}")
    speed = lines[-2]
    assert speed.startswith("performance: replay ") and ("x slower per step" in speed or "x faster per step" in speed
                                                          or "as fast per step" in speed), speed
    as_json = json.loads(project.cli("compare", profiled, replayed[0], "--json").stdout)
    assert as_json["speed"]["a"]["comm_share"] is not None and as_json["speed"]["b"]["comm_share"] is None


def test_wall_clock_never_changes_a_verdict(project: Project, profiled: str, replayed: tuple[str, str]) -> None:
    tracker = Tracker(project.uri)
    a, b = tracker.load_record(profiled), tracker.load_record(replayed[0])
    # The store holds the step times apart from the judged metrics.
    assert T.METRIC_STEP_S in a.performance and T.METRIC_STEP_S in b.performance
    assert not any(k.startswith(T.PERF_PREFIX) for k in (*a.metrics, *b.metrics))
    # A replay 100x slower, with other step times at every step, is judged exactly as before.
    steps, seconds = b.performance[T.METRIC_STEP_S]
    slow = replace(b, performance={T.METRIC_STEP_S: (steps, seconds * 100)},
                   facts={**b.facts, T.PERF_STEP_MEDIAN_S: str(float(b.facts[T.PERF_STEP_MEDIAN_S]) * 100),
                          T.PERF_STEP_MAX_MEDIAN_S: str(float(b.facts[T.PERF_STEP_MAX_MEDIAN_S]) * 100)})
    before, after = compare_runs(a, b), compare_runs(a, slow)
    assert before.verdict == after.verdict == Verdict.BITWISE and before.summary() == after.summary()
    assert after.speed is not None and after.speed.ratio is not None and after.speed.ratio > 20
    assert "x slower per step" in (after.speed.line() or "")


def test_verify_holds_a_throughput_claim_to_its_stated_tolerance(project: Project, profiled: str,
                                                                 tmp_path: Path) -> None:
    rate = float(project.client().get_run(profiled).data.tags[T.PERF_SAMPLES_PER_S])
    claims = tmp_path / "claims.yaml"
    claims.write_text(
        "claims:\n"
        f"  - id: speed\n    run: {profiled}\n    metric: {T.METRIC_SAMPLES_PER_S}\n    paper: {rate * 1.1:.0f}\n"
        "    rtol: 0.25\n"
        f"  - id: boast\n    run: {profiled}\n    metric: {T.METRIC_SAMPLES_PER_S}\n    paper: {rate * 3:.0f}\n"
        "    rtol: 0.25\n"
    )
    result = project.harness("verify", str(claims))
    assert result.returncode == 1, result.stdout + result.stderr
    verify_id = result.last_line
    doc = json.loads((_artifacts(project, verify_id) / "verify" / "claims.json").read_text())
    outcomes = {c["id"]: c["outcome"] for c in doc["claims"]}
    assert outcomes == {"speed": "HOLDS", "boast": "MISPRINTED"}
    assert "a speed held to rtol 0.25" in (_artifacts(project, verify_id) / "verify" / "report.md").read_text()


@pytest.mark.parametrize("claim, says", [
    ("metric: loss\n    paper: 0.5\n    rtol: 0.1", "rtol: only a speed claim states one"),
    (f"metric: {T.METRIC_SAMPLES_PER_S}\n    paper: 1000", "rtol: missing"),
    (f"metric: {T.METRIC_SAMPLES_PER_S}\n    paper: 1000\n    rtol: -1", "is not a number >= 0"),
    ("metric: harness.perf.flops\n    paper: 1000\n    rtol: 0.1", "is no speed harness records"),
])
def test_a_malformed_speed_claim_is_refused(project: Project, tmp_path: Path, claim: str, says: str) -> None:
    path = tmp_path / "claims.yaml"
    path.write_text(f"claims:\n  - id: c\n    run: r\n    {claim}\n")
    result = project.cli("verify", str(path))
    assert result.returncode == 2 and says in result.stderr, result.stderr


@pytest.mark.parametrize("override, says", [
    ("profile.steps=[-1]", "profile.steps holds -1"),
    ("profile.steps=[3,3]", "lists a step more than once"),
    ("profile.ranks=[2]", "no rank of world_size=2"),
    ("profile.ranks=[]", "profile.ranks is empty"),
    ("profile.samples_per_step=-5", "profile.samples_per_step must be >= 0"),
    ("profile.step=[3]", "unknown key 'profile.step'"),
    ("profile.steps=[a]", "expected a list of integers, e.g. profile.steps=[0]"),
])
def test_bad_profile_config_is_refused_in_one_line(project: Project, override: str, says: str) -> None:
    result = project.cli("check", "experiments/digits_cnn", override)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and says in lines[0], result.stderr


def test_many_profiled_steps_are_told_their_cost_before_the_run(project: Project) -> None:
    many = project.cli("check", "experiments/digits_cnn", f"profile.steps=[{','.join(map(str, range(300)))}]",
                       "profile.ranks=[0,1]")
    assert many.returncode == 0, many.stderr
    assert ("Warning: profile.steps asks for 300 profiled steps on 2 ranks: 600 Chrome traces with their tables in "
            "the run's artifacts, about 42 MB or more") in many.stderr
    few = project.cli("check", "experiments/digits_cnn", "profile.steps=[3,4]", "profile.ranks=[0,1]")
    assert few.returncode == 0 and "profile.steps asks" not in few.stderr


def test_communication_share_counts_overlapping_collectives_once() -> None:
    assert covered([(0, 10), (5, 15), (20, 25)]) == 20
    assert covered([(0, 10), (2, 3)]) == 10 and covered([]) == 0
    assert is_communication("gloo:all_reduce") and is_communication("c10d::allreduce_")
    assert is_communication("ncclDevKernel_AllReduce_Sum_f32_RING_LL") and not is_communication("aten::addmm")


def test_the_step_timer_times_steps_from_the_fetch_and_profiles_only_its_step(tmp_path: Path) -> None:
    timer = StepTimer(0, torch.device("cpu"), ProfilePlan(str(tmp_path), (1,), (0,)))
    for k in range(6):
        timer.starting(k)  # before the first batch's fetch: the step's time starts here
        timer.fetched(0.002, 64)
        timer.begin(k)
        timer.fetched(0.001, 64)  # a second micro-batch of the same step
        torch.randn(64, 64).matmul(torch.randn(64, 64)).sum()
        timer.end(k)
    times = timer.times
    assert times.steps == [0, 2, 3, 4, 5]  # step 1 was profiled: not a step time
    assert times.waits == [pytest.approx(0.003)] * 5 and times.samples == [128] * 5
    assert all(s > 0 for s in times.seconds)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0-step1.summary.json", "rank0-step1.table.txt",
                                                         "rank0-step1.trace.json"]
    assert [p["step"] for p in timer.profiled] == [1]
    stats = summary(times.steps, times.seconds, times.seconds, times.waits, times.samples)
    assert stats["steps"] == 3 and stats["samples_per_step"] == 128  # after 2 warm-up steps
    timer.close()  # nothing open: nothing happens


def test_a_speed_claim_replayed_elsewhere_holds_only_within_its_rtol() -> None:
    def run(rate: float, run_id: str):  # a run that recorded its median throughput, as record_performance tags it
        return make_record(run_id, facts={T.PERF_SAMPLES_PER_S: str(rate)})

    claim = Claim("speed", T.METRIC_SAMPLES_PER_S, Printed(Decimal("1000")), "1000", run="r", rtol=0.2)
    summary = RunSummary("r", "e", "1", "r", "FINISHED", None, None, {}, {}, [], "")
    outcomes = []
    for replayed in (1150.0, 700.0):  # another machine: 15% faster, then 30% slower
        source = Source("r", summary, [run(1100.0, "r")], False, replay_verdict="BITWISE", replays=[run(replayed, "x")])
        verdict = judge(claim, source, "claims.yaml: claim 'speed'")
        assert verdict.value_ok and verdict.recorded == 1100.0
        judge_replay(verdict)
        outcomes.append((verdict.replayed, verdict.outcome))
    assert outcomes == [(1150.0, "HOLDS"), (700.0, "NOT_REPRODUCED")]
    # A run that recorded no speed is refused in one line naming it.
    bare = Source("r", summary, [make_record("old")], False)
    with pytest.raises(HarnessError, match="run old recorded no step times"):
        judge(claim, bare, "claims.yaml: claim 'speed'")
