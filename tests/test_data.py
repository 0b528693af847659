"""Declared data: hashing, the cache, manifests and their diff (pure), then real runs and replays that check it."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from conftest import Project
from harness.record import data as D
from harness.errors import ConfigError, DataChanged, ExperimentError, HarnessError

# --------------------------------------------------------------------------------------------------
# Pure: no harness run


def _tree(base: Path) -> Path:
    folder = base / "shards"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.bin").write_bytes(os.urandom(3 * D.CHUNK + 17))  # several chunks and a tail
    (folder / "b.bin").write_bytes(b"")  # empty files hash too
    (folder / "sub" / "c.txt").write_bytes(b"line\r\n\xff\xfe")  # bytes, never decoded
    return folder


def _settle() -> None:
    """Let files just written age past the cache's racy window (a hash of a file changed in it is not kept)."""
    time.sleep(D.RACY_S + 0.05)


def test_file_hash_equals_sha256sum(tmp_path: Path) -> None:
    folder = _tree(tmp_path)
    for f in ("a.bin", "b.bin", "sub/c.txt"):
        out = subprocess.run(["sha256sum", str(folder / f)], capture_output=True, text=True, check=True, timeout=60)
        assert D.sha256_file(folder / f) == out.stdout.split()[0]


def test_manifest_of_a_folder_and_a_file(tmp_path: Path) -> None:
    folder = _tree(tmp_path)
    single = tmp_path / "table.csv"
    single.write_bytes(b"x,y\n1,2\n")
    cache = D.HashCache(tmp_path / "cache.sqlite")
    manifest = D.build_manifest(D.resolve({"shards": str(folder), "table": "../table.csv"}, tmp_path / "exp"), cache)
    shards, table = manifest["entries"]["shards"], manifest["entries"]["table"]
    assert shards["kind"] == "folder" and table["kind"] == "file"
    assert [f["path"] for f in shards["files"]] == ["a.bin", "b.bin", "sub/c.txt"]  # sorted, relative
    assert table["path"] == str(single) and table["declared"] == "../table.csv"  # relative to the experiment folder
    assert table["sha256"] == hashlib.sha256(single.read_bytes()).hexdigest()
    assert shards["sha256"] == D.folder_digest(list(reversed(shards["files"])))  # order-independent input
    assert shards["size"] == sum(f["size"] for f in shards["files"])
    assert D.loads(D.dumps(manifest)) == manifest and D.dumps(manifest) == D.dumps(D.loads(D.dumps(manifest)))


def test_cache_rereads_only_what_changed_its_stat(tmp_path: Path) -> None:
    folder = _tree(tmp_path)
    cache = D.HashCache(tmp_path / "cache.sqlite")
    entries = D.resolve({"shards": str(folder)}, tmp_path)
    _settle()
    first = D.HashStats()
    m1 = D.build_manifest(entries, cache, first)
    assert first.hashed == first.files == 3
    again = D.HashStats()
    assert D.build_manifest(entries, cache, again) == m1 and again.hashed == 0
    os.utime(folder / "a.bin", ns=(time.time_ns(), time.time_ns() - 10**9))  # new mtime, same bytes
    _settle()
    touched = D.HashStats()
    assert D.build_manifest(entries, cache, touched) == m1
    assert touched.hashed_paths == [str(folder / "a.bin")]
    # Rewritten with the same size and then given back its old mtime: ctime still tells.
    st = os.stat(folder / "sub" / "c.txt")
    (folder / "sub" / "c.txt").write_bytes(b"LINE\r\n\xff\xfe")
    os.utime(folder / "sub" / "c.txt", ns=(st.st_atime_ns, st.st_mtime_ns))
    _settle()
    sneaky = D.HashStats()
    changed = D.build_manifest(entries, cache, sneaky)
    assert sneaky.hashed_paths == [str(folder / "sub" / "c.txt")]
    assert [c.line() for c in D.diff(m1, changed)] == [
        f"data 'shards': 'sub/c.txt' changed (sha256 {m1['entries']['shards']['files'][2]['sha256'][:12]}, 8 bytes "
        f"recorded; now {changed['entries']['shards']['files'][2]['sha256'][:12]}, 8 bytes)"
    ]


def test_a_file_changed_just_now_is_not_cached(tmp_path: Path) -> None:
    (tmp_path / "x.bin").write_bytes(b"1")
    cache = D.HashCache(tmp_path / "cache.sqlite")
    entries = D.resolve({"x": "x.bin"}, tmp_path)
    counts = []
    for _ in range(2):
        stats = D.HashStats()
        D.build_manifest(entries, cache, stats)
        counts.append(stats.hashed)
    _settle()
    for _ in range(2):
        stats = D.HashStats()
        D.build_manifest(entries, cache, stats)
        counts.append(stats.hashed)
    assert counts == [1, 1, 1, 0]  # racy: read again until its stat is older than the clock's tick


def test_cache_shared_by_concurrent_processes(tmp_path: Path) -> None:
    """Two processes filling one cache at once: both finish, and the cache answers for every file."""
    folder = tmp_path / "many"
    folder.mkdir()
    for i in range(300):
        (folder / f"{i:04d}").write_bytes(i.to_bytes(4, "little"))
    _settle()
    code = ("import sys; from pathlib import Path; from harness.record import data as D; "
            "D.build_manifest(D.resolve({'m': sys.argv[1]}, Path('.')))")
    env = {**os.environ, D.ENV_CACHE_DIR: str(tmp_path / "cache")}
    procs = [subprocess.Popen(["python", "-c", code, str(folder)], env=env) for _ in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    stats = D.HashStats()
    cache = D.HashCache(tmp_path / "cache" / D.CACHE_FILE)
    D.build_manifest(D.resolve({"m": str(folder)}, tmp_path), cache, stats)
    assert stats.files == 300 and stats.hashed == 0


def test_diff_names_changed_missing_added_renamed(tmp_path: Path) -> None:
    folder = _tree(tmp_path)
    cache = D.HashCache(None)  # no cache: every build reads everything
    entries = D.resolve({"shards": str(folder)}, tmp_path)
    before = D.build_manifest(entries, cache)
    (folder / "a.bin").rename(folder / "a2.bin")  # renamed: same sha256 under another path
    (folder / "b.bin").write_bytes(b"now some bytes")  # changed
    (folder / "sub" / "c.txt").unlink()  # missing
    (folder / "new.txt").write_bytes(b"new")  # added
    lines = [c.line() for c in D.diff(before, D.build_manifest(entries, cache))]
    assert lines[0] == "data 'shards': 'a.bin' was renamed to 'a2.bin' (same sha256)"
    assert lines[1].startswith("data 'shards': 'b.bin' changed (sha256 e3b0c44298fc, 0 bytes recorded; now ")
    assert lines[2:] == ["data 'shards': 'new.txt' was added (3 bytes)", "data 'shards': 'sub/c.txt' is missing"]
    assert D.diff(before, before) == []
    assert [c.line() for c in D.diff(before, None)] == ["data 'shards': the whole entry was declared in the record, not now"]


def test_resolve_relative_env_and_bad_declarations(tmp_path: Path) -> None:
    (tmp_path / "exp").mkdir()
    (tmp_path / "exp" / "d.txt").write_text("x")
    (tmp_path / "elsewhere").mkdir()
    got = D.resolve({"in": "d.txt", "out": "$ROOT_X/elsewhere"}, tmp_path / "exp", tmp_path / "exp",
                    environ={"ROOT_X": str(tmp_path)})
    assert [(e.name, e.path, e.in_repository) for e in got] == [
        ("in", tmp_path / "exp" / "d.txt", True), ("out", tmp_path / "elsewhere", False)]
    with pytest.raises(ConfigError, match=r"^data 'out': '\$NOPE/x' uses \$NOPE, which is not set\. Set NOPE"):
        D.resolve({"out": "$NOPE/x"}, tmp_path, environ={})
    with pytest.raises(ConfigError, match=rf"^data 'gone': {tmp_path}/nothing does not exist \(declared as 'nothing'\)"):
        D.resolve({"gone": "nothing"}, tmp_path)
    with pytest.raises(ConfigError, match="data name 'a b' is not valid"):
        D.resolve({"a b": "x"}, tmp_path)


def test_symlinks_are_followed_and_loops_refused(tmp_path: Path) -> None:
    folder = _tree(tmp_path)
    (folder / "link.bin").symlink_to(folder / "a.bin")
    manifest = D.build_manifest(D.resolve({"s": str(folder)}, tmp_path), D.HashCache(None))
    files = {f["path"]: f["sha256"] for f in manifest["entries"]["s"]["files"]}
    assert files["link.bin"] == files["a.bin"]
    (folder / "sub" / "loop").symlink_to(folder)
    with pytest.raises(HarnessError, match="is a symlink loop inside"):
        D.build_manifest(D.resolve({"s": str(folder)}, tmp_path), D.HashCache(None))


def test_verify_refuses_or_reports(tmp_path: Path) -> None:
    folder = _tree(tmp_path)
    recorded = D.build_manifest(D.resolve({"s": str(folder)}, tmp_path), D.HashCache(None))
    assert D.verify({"s": str(folder)}, recorded, tmp_path, None, run_id="R", allow_changes=False).changes == []
    shutil.rmtree(folder)
    with pytest.raises(DataChanged) as err:
        D.verify({"s": str(folder)}, recorded, tmp_path, None, run_id="R", allow_changes=False)
    assert str(err.value) == (
        f"data 's': the whole entry ({folder}, declared as '{folder}') does not exist since run R was recorded. "
        "Restore the data as recorded, or pass --allow-data-changes to go on with the data as it is now "
        "(the verdict cannot be BITWISE)."
    )
    check = D.verify({"s": str(folder)}, recorded, tmp_path, None, run_id="R", allow_changes=True)
    assert [c.kind for c in check.changes] == ["missing"] and check.paths == {"s": str(folder)}


def test_ctx_data_names_the_declared_entries() -> None:
    from harness.runtime.context import DataPaths

    paths = DataPaths({"train": Path("/d/train")})
    assert paths["train"] == Path("/d/train")
    with pytest.raises(ExperimentError, match=r"ctx.data\['tset'\]: no data named 'tset' is declared \(declared: train\)"):
        paths["tset"]


def test_data_change_rules_out_bitwise() -> None:
    from harness.judge.delta import environment_delta
    from harness.store.tracking import RunRecord

    def record(run_id: str, sha: str) -> RunRecord:
        manifest = {"format": 1, "entries": {"t": {"kind": "folder", "sha256": sha * 64, "files": [
            {"path": "x.bin", "size": 1, "sha256": sha * 64}]}}}
        return RunRecord(run_id, "e", "FINISHED", {"harness.data.t": sha * 64}, [], {}, {}, None, {}, data=manifest)

    delta = environment_delta(record("a", "0"), record("b", "1"))
    assert [(d.name, d.breaks_bitwise) for d in delta] == [("harness.data.t", True), ("data:t/x.bin", False)]
    assert delta[0].note == "data 't' changed: the training read other bytes"
    assert delta[1].note.startswith("data 't': 'x.bin' changed (sha256 000000000000")
    assert environment_delta(record("a", "0"), record("b", "0")) == []


# --------------------------------------------------------------------------------------------------
# Real runs: one original, reused by every case below (3 training runs in all)

TRAIN = '''"""linear_ddp, reading its declared data through ctx.data."""

import json

import torch
from torch import nn


def train(ctx):
    sizes = {name: sum(p.stat().st_size for p in ([path] if path.is_file() else sorted(path.rglob("*"))))
             for name, path in ctx.data.items()}
    if ctx.is_main:
        (ctx.output_dir / "data.json").write_text(json.dumps({k: str(v) for k, v in ctx.data.items()}))
        ctx.print(f"data sizes {sizes}")
    data = torch.randn(40, 10, generator=torch.Generator().manual_seed(ctx.seed))
    loader = ctx.loader(data, batch_size=10)
    model = ctx.ddp(nn.Linear(10, 5))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for epoch in ctx.epochs(1):
        for batch in loader:
            optimizer.zero_grad()
            loss = ctx.backward(batch, lambda b: nn.functional.mse_loss(model(b), torch.randn(len(b), 5)))
            optimizer.step()
            ctx.log({"loss": loss}, ctx.step)
'''


@pytest.fixture(scope="module")
def outside(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Data outside the repository (a path with a space), and its own hash cache."""
    base = tmp_path_factory.mktemp("data outside")
    folder = base / "shards"
    folder.mkdir()
    for i in range(4):
        (folder / f"part-{i}.bin").write_bytes(bytes([i]) * (1000 + i))
    (base / "table.csv").write_bytes(b"a,b\n1,2\n")
    return base


@pytest.fixture(scope="module")
def env(outside: Path) -> dict[str, str]:
    return {"HARNESS_TEST_DATA": str(outside), D.ENV_CACHE_DIR: str(outside.parent / "cache")}


@pytest.fixture(scope="module")
def data_run(project: Project, outside: Path, env: dict[str, str]) -> str:
    yaml = f"data:\n  shards: {json.dumps(str(outside / 'shards'))}\n  table: $HARNESS_TEST_DATA/table.csv\n  notes: train.py\n"
    project.add_experiment("data_ddp", train_py=TRAIN, yaml_extra=yaml)
    result = project.harness("run", "experiments/data_ddp", env=env)
    assert result.returncode == 0, result.stderr
    assert "data: 6 files checked, 6 read in full" in result.stderr
    return result.last_line


def _replays(project: Project, run_id: str) -> list:
    return [r for r in project.all_runs() if r.data.tags.get("harness.replay_of") == run_id]


def test_run_records_manifest_tags_and_dataset_inputs(project: Project, data_run: str, outside: Path) -> None:
    client = project.client()
    run = client.get_run(data_run)
    manifest = json.loads(Path(client.download_artifacts(data_run, "data/manifest.json")).read_text())
    entries = manifest["entries"]
    assert entries["shards"]["path"] == str(outside / "shards") and entries["shards"]["kind"] == "folder"
    assert entries["table"]["declared"] == "$HARNESS_TEST_DATA/table.csv"  # the declaration, and where it resolved
    assert entries["table"]["path"] == str(outside / "table.csv") and not entries["table"]["in_repository"]
    assert entries["notes"]["in_repository"] and entries["notes"]["path"].endswith("experiments/data_ddp/train.py")
    for name, entry in entries.items():
        assert run.data.tags[f"harness.data.{name}"] == entry["sha256"]
    inputs = {d.dataset.name: d.dataset for d in run.inputs.dataset_inputs}
    assert set(inputs) == {"notes", "shards", "table"}
    assert inputs["shards"].digest == entries["shards"]["sha256"][:32]
    assert json.loads(inputs["table"].source) == {"uri": (outside / "table.csv").as_uri()}
    seen = json.loads(Path(client.download_artifacts(data_run, "outputs/data.json")).read_text())
    assert seen == {name: entry["path"] for name, entry in entries.items()}  # ctx.data in the ranks


def test_missing_data_at_run_start_records_nothing(project: Project, data_run: str, env: dict[str, str]) -> None:
    before = len(project.all_runs())
    result = project.cli("run", "experiments/data_ddp", "data.table=$HARNESS_TEST_DATA/nope.csv", env=env)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"Error: data 'table': {env['HARNESS_TEST_DATA']}/nope.csv does not exist (declared as "
        "'$HARNESS_TEST_DATA/nope.csv'). Create it, or fix data.table in experiment.yaml (relative paths are "
        "relative to the experiment folder)."
    ]
    assert len(project.all_runs()) == before


def test_replay_after_touch_is_bitwise_and_rereads_only_that_file(
    project: Project, data_run: str, outside: Path, env: dict[str, str]
) -> None:
    os.utime(outside / "shards" / "part-2.bin", ns=(time.time_ns(), time.time_ns() + 5 * 10**9))
    result = project.harness("replay", data_run, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-2].startswith("verdict: BITWISE")
    assert "data: 6 files checked, 1 read in full (0.0 MiB), 5 unchanged since last hashed (cache)" in result.stderr


@pytest.mark.parametrize("case", ["changed", "missing", "renamed"])
def test_replay_refuses_changed_data_before_launch(
    project: Project, data_run: str, outside: Path, env: dict[str, str], case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    part = outside / "shards" / "part-1.bin"
    original = part.read_bytes()
    expected = {
        "changed": "data 'shards': 'part-1.bin' changed (sha256 ",
        "missing": "data 'shards': 'part-1.bin' is missing since run ",
        "renamed": "data 'shards': 'part-1.bin' was renamed to 'part-9.bin' (same sha256) since run ",
    }[case]
    way = ("Restore the data as recorded, or pass --allow-data-changes to go on with the data as it is now "
           "(the verdict cannot be BITWISE).")
    before = len(_replays(project, data_run))
    try:
        if case == "changed":  # through the CLI: exit code and the one line
            part.write_bytes(original[:-1] + b"\x00")  # same size
            result = project.cli("replay", data_run, env=env)
            assert result.returncode == 2
            assert result.stderr.strip().splitlines()[-1].startswith(f"Error: {expected}"), result.stderr
            assert result.stderr.strip().endswith(way)
        else:  # the same library call in this process (no interpreter start-up to pay)
            from harness.commands.options import ReplayOptions
            from harness.commands.replay import replay

            if case == "missing":
                part.unlink()
            else:
                part.rename(outside / "shards" / "part-9.bin")
            for key, value in env.items():
                monkeypatch.setenv(key, value)
            with pytest.raises(DataChanged) as err:
                replay(ReplayOptions(data_run, tracking_uri=project.uri, repo=project.root))
            assert str(err.value).startswith(expected) and str(err.value).endswith(way)
            assert err.value.exit_code == 2
    finally:
        (outside / "shards" / "part-9.bin").unlink(missing_ok=True)
        part.write_bytes(original)
    assert len(_replays(project, data_run)) == before  # refused before any replay run was created


def test_allow_data_changes_replays_and_reports_the_file(
    project: Project, data_run: str, outside: Path, env: dict[str, str]
) -> None:
    table = outside / "table.csv"
    original = table.read_bytes()
    table.write_bytes(b"a,b\n1,3\n")
    try:
        result = project.harness("replay", data_run, "--allow-data-changes", env=env)
    finally:
        table.write_bytes(original)
    assert result.returncode == 0, result.stderr
    verdict = result.stdout.strip().splitlines()[-2]
    # The same numbers: BITWISE is what was observed, the changed data named beside it.
    assert verdict.startswith("verdict: BITWISE") and "bitwise despite 1 environment change: harness.data.table" in verdict, verdict
    assert "Warning: data 'table': 'table.csv' changed" in result.stderr
    assert " ! harness.data.table: " in result.stdout
    assert "data:table/table.csv: " in result.stdout and "data 'table': 'table.csv' changed (sha256 " in result.stdout
    replay = project.client().get_run(result.last_line)
    assert replay.data.tags["harness.replay.data_changes"].startswith("data 'table': 'table.csv' changed")
    assert replay.data.tags["harness.data.table"] == hashlib.sha256(b"a,b\n1,3\n").hexdigest()
