"""`harness verify`: a paper's claims file checked against a real 3-seed study, its reports, and a replay."""

from __future__ import annotations

import json
import math
from decimal import Decimal
from pathlib import Path

import numpy as np
from scipy import stats
import pytest

from conftest import OTHER_HARDWARE, Project
from harness.commands.verify import judge, judge_replay
from harness.judge.claims import Claim, Source, load_claims, parse_printed, possible_typo, prints_as
from harness.judge.verify_report import rows, why
from harness.rundata import RunSummary
from records import make_record
from harness.errors import HarnessError

# --- printed numbers ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, value, pm", [
    ("0.970", "0.970", None),  # the trailing zero is precision: kept
    ("97.3 ± 0.4", "97.3", "0.4"),
    ("0.953 +- 0.012", "0.953", "0.012"),
    ("0.953±0.012", "0.953", "0.012"),
    ("0.953 +/- 0.012", "0.953", "0.012"),
    ("1e-3", "0.001", None),  # exponent notation: the mantissa's digits are the precision (to the nearest 0.001)
    ("1.5E-4", "0.00015", None),
    ("\u22120.5", "-0.5", None),  # a typeset minus sign
    (" 12 ", "12", None),
])
def test_printed_numbers_keep_their_precision(text: str, value: str, pm: str | None) -> None:
    printed = parse_printed(text)
    assert printed.value == Decimal(value) and str(printed.value) == value  # digits as printed, no float between
    assert printed.pm == (None if pm is None else Decimal(pm))


def test_exponent_notation_sets_the_rounding_step() -> None:
    assert parse_printed("1e-3").value.as_tuple().exponent == -3
    assert parse_printed("1.5e-3").value.as_tuple().exponent == -4
    assert prints_as(0.00104, parse_printed("1e-3").value) and not prints_as(0.0016, parse_printed("1e-3").value)


@pytest.mark.parametrize("text", ["0.95x", "97.3%", "0.953 ± -0.01", "", "about 0.9", "0.9 ± ", "1,5"])
def test_unprintable_numbers_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_printed(text)


def test_rounding_accepts_half_up_and_half_even() -> None:
    # 0.0125 to 3 decimals: 0.013 rounding half up, 0.012 rounding half to even; both are honest prints.
    assert prints_as(0.0125, Decimal("0.013")) and prints_as(0.0125, Decimal("0.012"))
    assert not prints_as(0.0125, Decimal("0.011")) and not prints_as(0.0125, Decimal("0.014"))
    assert prints_as(Decimal("2.5"), Decimal("3")) and prints_as(Decimal("2.5"), Decimal("2"))
    assert prints_as(Decimal("3.5"), Decimal("4")) and not prints_as(Decimal("3.5"), Decimal("3"))


def test_rounding_compares_decimals_at_the_printed_precision() -> None:
    assert prints_as(0.97, Decimal("0.970")) and prints_as(0.9704, Decimal("0.970"))
    assert not prints_as(0.9706, Decimal("0.970")) and prints_as(0.9706, Decimal("0.97"))
    # 1.8625006675720215 is what a float32 loss reads as: 1.863, never 1.862.
    assert prints_as(1.8625006675720215, Decimal("1.863")) and not prints_as(1.8625006675720215, Decimal("1.862"))
    assert not prints_as(math.nan, Decimal("0.5")) and not prints_as(math.inf, Decimal("1"))


@pytest.mark.parametrize("recorded,printed,typo", [
    (2.8851, "2.858", "possible typo: printed 2.858, runs give 2.885"),  # two adjacent digits swapped
    (2.8851, "2.985", "possible typo: printed 2.985, runs give 2.885"),  # one digit replaced, not the last
    (97.31, "79.3", "possible typo: printed 79.3, runs give 97.3"),
    (2.8851, "2.888", None),  # the last digit: rounding and noise move it too
    (2.8851, "-2.885", None), (2.8851, "28.85", None), (2.8851, "2.89", None), (2.8851, "3.012", None),
])
def test_a_slipped_digit_is_named_a_possible_typo(recorded: float, printed: str, typo: str | None) -> None:
    assert possible_typo(recorded, Decimal(printed)) == typo


def test_a_transposed_mean_inside_the_noise_is_still_misprinted() -> None:
    """Seeds with a wide spread: 2.858 lies inside where another 3 seeds' mean lands, but it is 2.885 with two
    digits swapped, so it is MISPRINTED with the typo named, not WITHIN_NOISE."""
    members = [make_record(f"m{i}", metrics={"loss": (np.arange(3), np.array([3.0, 2.9, v]))})
               for i, v in enumerate((2.8451, 2.8851, 2.9251))]
    study = RunSummary("s1", "wide", "1", "study", "FINISHED", None, None, {}, {}, [], "")
    source = Source("s1", study, members, True)
    swapped = judge(Claim("t", "loss", parse_printed("2.858"), "2.858", study="s1"), source, "claim 't'")
    assert swapped.noise_interval[0] < 2.858 < swapped.noise_interval[1]
    assert (swapped.outcome, swapped.typo) == ("MISPRINTED", "possible typo: printed 2.858, runs give 2.885")
    assert "possible typo: printed 2.858" in " ".join(why(swapped)) and swapped.to_dict()["possible_typo"]
    nearby = judge(Claim("n", "loss", parse_printed("2.870"), "2.870", study="s1"), source, "claim 'n'")
    assert (nearby.outcome, nearby.typo) == ("WITHIN_NOISE", None)


def test_the_table_sets_replayed_members_beside_the_same_members_as_recorded() -> None:
    """--members 2 of 3: the replayed mean stands beside the recorded mean of those 2, not only of all 3."""
    members = [make_record(f"m{i}", metrics={"loss": (np.arange(3), np.array([3.0, 2.9, v]))})
               for i, v in enumerate((2.80, 2.90, 3.30))]
    study = RunSummary("s1", "wide", "1", "study", "FINISHED", None, None, {}, {}, [], "")
    source = Source("s1", study, members, True)
    source.replays = [make_record(f"r{i}", metrics={"loss": (np.arange(3), np.array([3.0, 2.9, v]))})
                      for i, v in enumerate((2.81, 2.91))]
    source.replayed_originals, source.replay_verdict = ["m0", "m1"], "WITHIN_NOISE"
    verdict = judge(Claim("c", "loss", parse_printed("3.00"), "3.00", study="s1"), source, "claim 'c'")
    judge_replay(verdict)
    (row,) = rows([verdict], replayed=True)
    assert row[2] == "3.0000 ± 0.264575 (n=3)"  # recorded: all three members
    assert row[3] == "2.8600 (n=2; these 2 recorded: 2.8500)"  # replayed: m0 and m1, and m0 and m1 as recorded
    (unreplayed,) = rows([judge(Claim("c", "loss", parse_printed("3.00"), "3.00", study="s1"),
                                Source("s1", study, members, True), "claim 'c'")], replayed=False)
    assert unreplayed[3] == "-"


# --- the claims file ---------------------------------------------------------------------------------------

GOOD = """\
claims:
  - id: a
    text: "Linear model, final loss (Table 1)"
    study: s1
    metric: loss
    paper: 0.970
    value: min
    statistic: median
    spread: sem
    scale: 100
  - id: b
    run: r1
    metric: loss
    paper: "1.5 ± 0.25"
"""


def test_claims_file_is_read_with_the_printed_precision(tmp_path: Path) -> None:
    path = tmp_path / "claims.yaml"
    path.write_text(GOOD)
    a, b = load_claims(path)
    assert str(a.paper.value) == "0.970" and a.paper_text == "0.970"  # a YAML float would have lost the zero
    assert (a.study, a.run, a.value, a.statistic, a.spread, a.scale) == ("s1", None, "min", "median", "sem", 100)
    assert a.text == "Linear model, final loss (Table 1)"
    assert (b.run, b.value, b.statistic, b.spread, b.scale) == ("r1", "final", "mean", "std", 1)
    assert (b.paper.value, b.paper.pm) == (Decimal("1.5"), Decimal("0.25"))


BAD = [
    ("claims:\n  - id: a\n    study: s\n    metric: loss\n    paper: 1\n    seed: 3\n", "claim 'a': unknown key 'seed'"),
    ("claims:\n  - id: a\n    study: s\n    run: r\n    metric: loss\n    paper: 1\n", "claim 'a': both study: and run:"),
    ("claims:\n  - id: a\n    metric: loss\n    paper: 1\n", "claim 'a': neither study: nor run:"),
    ("claims:\n  - id: a\n    run: r\n    metric: loss\n    paper: 0.9x\n", "claim 'a': paper: '0.9x': not a number"),
    ("claims:\n  - id: a\n    run: r\n    metric: loss\n    paper: 97%\n", "claim 'a': paper: '97%': drop the '%'"),
    ("claims:\n  - id: a\n    run: r\n    metric: loss\n    paper: 1\n    statistic: mode\n",
     "claim 'a': statistic: unknown statistic 'mode'; valid: mean, median, min, max"),
    ("claims:\n  - id: a\n    run: r\n    metric: loss\n    paper: 1\n    spread: var\n", "claim 'a': spread: unknown spread 'var'"),
    ("claims:\n  - id: a\n    run: r\n    metric: loss\n    paper: 1\n    value: last\n", "claim 'a': value: unknown value 'last'"),
    ("claims:\n  - id: a\n    run: r\n    metric: loss\n    paper: 1\n    scale: -1\n", "claim 'a': scale: '-1' is not a positive"),
    ("claims:\n  - id: a\n    run: r\n    paper: 1\n", "claim 'a': metric: missing"),
    ("claims:\n  - id: a\n    run: r\n    metric: loss\n", "claim 'a': paper: missing"),
    ("claims:\n  - run: r\n    metric: loss\n    paper: 1\n", "claim 1 (line 2): id: missing"),
    ("claims:\n  - id: a\n    run: r\n    metric: loss\n    paper: 1\n  - id: a\n    run: q\n    metric: loss\n    paper: 2\n",
     "claim 'a': id: duplicate (claims 1 and 2)"),
    ("claims:\n  - id: a\n    run: r\n    run: q\n    metric: loss\n    paper: 1\n", "key 'run' is given twice"),
    ("claims:\n  - id: a\n    run: [r]\n    metric: loss\n    paper: 1\n", "claim 'a': run: must be a single value"),
    ("claims: []\n", "claims: must be a non-empty list"),
    ("claim:\n  - id: a\n", "the file: unknown key 'claim'"),
    ("- id: a\n", "the file: must be a mapping"),
    ("claims:\n  - id: a\n   run: r\n", "not valid YAML (line 3)"),
]


@pytest.mark.parametrize("text, message", BAD, ids=[m.split(":")[-1][:30] for _, m in BAD])
def test_every_bad_claims_file_is_one_line(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "claims.yaml"
    path.write_text(text)
    with pytest.raises(HarnessError) as err:
        load_claims(path)
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"{path}: ") and message in line, line
    assert err.value.exit_code == 2


def test_a_bad_claims_file_exits_2_through_the_cli(fresh_project: Project) -> None:
    path = fresh_project.root / "claims.yaml"
    path.write_text("claims:\n  - id: t1\n    run: r\n    metric: loss\n    paper: 1\n    statistic: mode\n")
    result = fresh_project.cli("verify", "claims.yaml")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip() == ("Error: claims.yaml: claim 't1': statistic: unknown statistic 'mode'; "
                                     "valid: mean, median, min, max")
    assert not (fresh_project.store / "mlflow.db").exists()  # refused before the store was even opened


# --- against a real study ----------------------------------------------------------------------------------


class Study:
    def __init__(self, project: Project, study_id: str) -> None:
        from harness.record.study import load_study
        from harness.store.tracking import Tracker

        self.project, self.id = project, study_id
        tracker = Tracker(project.uri)
        self.members = [m.run_id for m in load_study(tracker, study_id).members]
        records = [tracker.load_record(m) for m in self.members]
        # Computed here independently of harness.verify: numpy over the raw series.
        self.final = [float(r.metrics["loss"][1][np.argmax(r.metrics["loss"][0])]) for r in records]
        self.best = [float(np.min(r.metrics["loss"][1])) for r in records]


@pytest.fixture(scope="module")
def study(project: Project, wide_study: tuple[str, dict[int, str]]) -> Study:
    """conftest's 3-seed study, whose replays under another thread count differ from it by last-bit noise."""
    return Study(project, wide_study[0])


@pytest.fixture(scope="module")
def paper(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the claims files go: outside the session's repository, which they would make dirty."""
    return tmp_path_factory.mktemp("paper")


@pytest.fixture(scope="module")
def checked(study: Study, paper: Path):
    """`harness verify` (no replay) of a true, a noise-level, a misprinted and a percent claim: one verify run.

    The noise-level claim prints a mean half a seed sd away from the recorded one (as a paper written
    from another seed set would), well inside where another 3 seeds' mean lands (+-3.5 sd at N = 3);
    the misprint is 10 sd away.
    """
    mean, sd = float(np.mean(study.final)), float(np.std(study.final, ddof=1))
    true = f"{mean:.3f} ± {sd:.3f}"
    noisy = f"{mean + 0.5 * sd:.3f} ± {sd:.3f}"
    wrong = f"{mean + 10 * sd:.3f} ± {sd:.3f}"
    assert sd > 0.005 and noisy != true, (mean, sd)  # the study's spread shows at 3 decimals
    median_best = float(np.median(study.best)) * 100
    claims = paper / "claims.yaml"
    claims.write_text(
        "claims:\n"
        f"  - id: table1-true\n    text: Final loss, 3 seeds\n    study: {study.id}\n    metric: loss\n"
        f"    paper: \"{true}\"\n"
        f"  - id: table1-typo\n    study: {study.id}\n    metric: loss\n    paper: \"{wrong}\"\n"
        f"  - id: table1-noisy\n    study: {study.id}\n    metric: loss\n    paper: \"{noisy}\"\n"
        f"  - id: best-percent\n    study: {study.id}\n    metric: loss\n    value: min\n    statistic: median\n"
        f"    scale: 100\n    paper: {median_best:.1f}\n"
    )
    result = study.project.harness("verify", "claims.yaml", cwd=paper)
    return claims, result, true, wrong, mean, noisy


def test_verify_holds_a_true_claim_and_catches_a_misprint(study: Study, checked) -> None:
    claims, result, true, wrong, mean, noisy = checked
    assert result.returncode == 1, result.stderr
    lines = result.stdout.strip().splitlines()
    rows = {line.split()[0]: line for line in lines[1:-2]}
    assert rows["table1-true"].endswith("HOLDS") and true in rows["table1-true"]
    assert rows["best-percent"].endswith("HOLDS")
    # MISPRINTED, with both numbers: what the paper prints and what the runs produced.
    assert rows["table1-typo"].endswith("MISPRINTED") and wrong in rows["table1-typo"]
    assert f"{mean:.5f}" in rows["table1-typo"] and "(n=3)" in rows["table1-typo"]
    # Not these runs' digits, but where another 3 seeds' mean could land: the claim stands, said as such.
    assert rows["table1-noisy"].endswith("WITHIN_NOISE") and noisy in rows["table1-noisy"]
    assert lines[-2] == "claims: 3 of 4 hold"
    verify_id = lines[-1]

    client = study.project.client()
    run = client.get_run(verify_id)
    tags = run.data.tags
    assert run.info.status == "FINISHED"
    assert tags["harness.kind"] == "verify" and tags["harness.verdict"] == "3 of 4 hold"  # its row in the UI
    assert tags["harness.verify.claims_file"] == "claims.yaml" and tags["harness.verify.held"] == "3/4"
    assert run.info.experiment_id == client.get_run(study.id).info.experiment_id
    files = {f.path for f in client.list_artifacts(verify_id, "verify")}
    assert files == {"verify/report.md", "verify/report.html", "verify/claims.json", "verify/claims.yaml"}
    assert Path(client.download_artifacts(verify_id, "verify/claims.yaml")).read_bytes() == claims.read_bytes()
    summary = json.loads(Path(client.download_artifacts(verify_id, "verify/claims.json")).read_text())
    by_id = {c["id"]: c for c in summary["claims"]}
    assert by_id["table1-typo"]["outcome"] == "MISPRINTED" and not by_id["table1-typo"]["printed_value_matches"]
    assert by_id["table1-typo"]["printed_spread_matches"]
    lo, hi = by_id["table1-noisy"]["noise_interval"]
    # Three mean claims on the study share one 5% bound: each interval at 1 - 0.05/3.
    half = stats.t.ppf(1 - 0.05 / 3 / 2, 2) * np.std(study.final, ddof=1) * np.sqrt(2 / 3)
    assert (lo, hi) == pytest.approx((mean - half, mean + half)) and not lo <= float(wrong.split()[0]) <= hi
    assert by_id["table1-noisy"]["outcome"] == "WITHIN_NOISE" and by_id["table1-true"]["outcome"] == "HOLDS"
    assert by_id["table1-true"]["values"] == study.final and by_id["table1-true"]["recorded"] == pytest.approx(mean)
    report = Path(client.download_artifacts(verify_id, "verify/report.md")).read_text()
    assert "MISPRINTED" in report and "does NOT print as" in report and "98.33% prediction interval" in report
    assert "the claim stands within the noise" in report and "not within the noise either" in report
    assert f"Report: {run.info.artifact_uri.removeprefix('file://')}/verify/report.html" in result.stderr


def test_html_report_renders_offline_in_a_real_browser(study: Study, checked, tmp_path: Path) -> None:
    from browser import open_page

    verify_id = checked[1].last_line
    page = Path(study.project.client().download_artifacts(verify_id, "verify/report.html"))
    shot = tmp_path / "report.png"
    rendered = open_page(page.as_uri(), shot, tmp_path / "chromium")
    for text in ("table1-true", "table1-typo", "table1-noisy", "best-percent", "HOLDS", "MISPRINTED", "WITHIN_NOISE",
                 "Environment", "gloo"):
        assert text in rendered.text, text
    assert len(rendered.images) == 4 and all(done and width > 0 for done, width in rendered.images), rendered.images
    # Self-contained: the page itself, and data: URIs, nothing else.
    assert rendered.requests[0] == page.as_uri()
    assert all(url.startswith("data:image/png;base64,") for url in rendered.requests[1:]), rendered.requests
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_missing_run_is_one_line_and_records_nothing(study: Study, paper: Path) -> None:
    from harness.commands.options import VerifyOptions
    from harness.commands.verify import verify

    claims = paper / "missing.yaml"
    claims.write_text("claims:\n  - id: ghost\n    run: 0123456789abcdef0123456789abcdef\n    metric: loss\n    paper: 1\n")
    before = len(study.project.all_runs())
    with pytest.raises(HarnessError) as err:
        verify(VerifyOptions(claims, tracking_uri=study.project.uri))
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"{claims}: claim 'ghost': no run "), line
    assert err.value.exit_code == 2 and len(study.project.all_runs()) == before


def test_replay_passes_the_changes_on_and_judges_the_claims_on_the_replays(study: Study, tmp_path: Path) -> None:
    """--replay --members 1 --allow-changes: a study claim (harness replay STUDY_ID, one member drawn) and a
    single-run claim (harness replay RUN), each judged on its replay on "other hardware" (conftest.OTHER_HARDWARE:
    another thread count), which differs from the record by last-bit noise: both claims hold WITHIN_NOISE."""
    mean, sd = float(np.mean(study.final)), float(np.std(study.final, ddof=1))
    member, final = study.members[0], study.final[0]
    claims = tmp_path / "replayed claims.yaml"
    claims.write_text(f"claims:\n  - id: study-mean\n    study: {study.id}\n    metric: loss\n    paper: \"{mean:.3f} ± {sd:.3f}\"\n"
                      f"  - id: seed0\n    run: {member}\n    metric: loss\n    paper: {final:.3f}\n")
    result = study.project.harness("verify", str(claims), "--replay", "--members", "1", *OTHER_HARDWARE)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.strip().splitlines()
    verify_id = lines[-1]
    client = study.project.client()
    summary = json.loads(Path(client.download_artifacts(verify_id, "verify/claims.json")).read_text())
    by_id = {c["id"]: c for c in summary["claims"]}
    study_replay = client.get_run(by_id["study-mean"]["replay_id"]).data.tags
    assert study_replay["harness.kind"] == "study_replay" and study_replay["harness.replay_of"] == study.id
    assert study_replay["harness.replay.changes"] == "threads_per_rank=2" and study_replay["harness.study.n"] == "1"
    single = client.get_run(by_id["seed0"]["replay_id"]).data.tags
    assert single["harness.replay_of"] == member and single["harness.replay.changes"] == "threads_per_rank=2"
    assert single["harness.threads_per_rank"] == "2"
    for claim, tags in ((by_id["study-mean"], study_replay), (by_id["seed0"], single)):
        assert claim["replay_verdict"] == tags["harness.verdict"] == "WITHIN_NOISE", claim
        assert claim["outcome"] == "HOLDS"
        row = next(line for line in lines if line.startswith(claim["id"] + " "))
        assert row.split()[-2:] == ["WITHIN_NOISE", "HOLDS"]
        assert len(claim["replayed_values"]) == 1  # one member drawn; one run
    assert lines[-2] == "claims: 2 of 2 hold"
    assert by_id["seed0"]["replayed_values"][0] != final  # not bit-identical: noise, and judged as such
    # One member of three replayed: the report sets its replay beside that member's own recorded value.
    exp = client.get_run(study.id).info.experiment_id
    (member_replay,) = client.search_runs([exp], f"tags.`harness.study_replay` = '{by_id['study-mean']['replay_id']}'")
    drawn = study.members.index(member_replay.data.tags["harness.replay_of"])
    assert by_id["study-mean"]["recorded_replayed_members"] == study.final[drawn]
    assert by_id["study-mean"]["recorded"] == pytest.approx(mean)
    history = client.get_metric_history(by_id["seed0"]["replay_id"], "loss")
    assert by_id["seed0"]["replayed_values"] == [max(history, key=lambda m: m.step).value]
    assert client.get_run(verify_id).data.tags["harness.replay.changes"] == "threads_per_rank=2"
    report = Path(client.download_artifacts(verify_id, "verify/report.md")).read_text()
    assert "| threads per rank | `1` | `2` |" in report
    assert "harness.threads_per_rank: threads per rank changed" in report  # what kept it from being bitwise


def test_changes_without_replay_are_refused(study: Study, paper: Path) -> None:
    from harness.commands.options import VerifyOptions
    from harness.commands.verify import verify

    claims = paper / "one.yaml"
    claims.write_text(f"claims:\n  - id: x\n    run: {study.members[1]}\n    metric: loss\n    paper: 1\n")
    with pytest.raises(HarnessError, match=r"add --replay\.$"):
        verify(VerifyOptions(claims, ("threads_per_rank=2",), allow_changes=True, tracking_uri=study.project.uri))
    with pytest.raises(HarnessError, match=r"Pass --allow-changes"):
        verify(VerifyOptions(claims, ("threads_per_rank=2",), replay=True, tracking_uri=study.project.uri))


def test_a_claim_finds_its_run_in_a_store_it_was_imported_into(study: Study, tmp_path: Path) -> None:
    """The paper names the run id of the authors' store; an evaluator's import gives it a new id here."""
    from harness.commands.bundle import export, import_bundle
    from harness.commands.options import ExportOptions, ImportOptions, VerifyOptions
    from harness.commands.verify import verify

    member = study.members[2]
    bundle = tmp_path / "run.tar.gz"
    export(ExportOptions(member, bundle, tracking_uri=study.project.uri, repo=study.project.root))
    other = f"sqlite:///{tmp_path / 'evaluator.db'}"
    imported = import_bundle(ImportOptions(bundle, tracking_uri=other, data_dir=tmp_path / "data"))
    assert imported.run_id != member
    claims = tmp_path / "claims.yaml"
    claims.write_text(f"claims:\n  - id: c\n    run: {member}\n    metric: loss\n    paper: {study.final[2]:.4f}\n")
    result = verify(VerifyOptions(claims, tracking_uri=other))
    assert result.held == 1 and result.exit_code == 0
    assert result.verdicts[0].source.run_id == imported.run_id and result.verdicts[0].values == [study.final[2]]


def test_a_claim_on_a_run_no_store_holds_raises_run_not_found_for_that_claim(tmp_path: Path) -> None:
    from harness.commands.options import VerifyOptions
    from harness.commands.verify import verify
    from harness.errors import RunNotFound

    claims = tmp_path / "claims.yaml"
    claims.write_text(f"claims:\n  - id: c\n    run: {'0' * 32}\n    metric: loss\n    paper: 0.5\n")
    with pytest.raises(RunNotFound) as err:
        verify(VerifyOptions(claims, tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}"))
    assert str(err.value).startswith(f"{claims}: claim 'c': no run '{'0' * 32}' in the tracking store ") and \
        err.value.exit_code == 2, err.value
