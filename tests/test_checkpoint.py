"""Checkpoints against real torch training, real files and real DataLoader workers."""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import random
import stat
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from harness import events
from harness.commands.resume import _hold_to_checkpoint, _provable_step
from harness.executors.base import SegmentReport
from harness.record.checkpoints import CheckpointStore
from harness.rundata import RunRecord
from harness.runtime import checkpoint as ck, loaders
from harness.errors import HarnessError
from harness.runtime.fingerprint import fingerprint

TOTAL_STEPS = 12
CHECKPOINT_AT = 5  # steps completed when the checkpoint is taken


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


Parts = tuple[Net, torch.optim.SGD, torch.optim.lr_scheduler.StepLR, torch.amp.GradScaler]


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def make_parts(seed: int) -> Parts:
    seed_all(seed)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    # growth_interval=2: the scale changes during the run, so a lost scaler state would show.
    scaler = torch.amp.GradScaler("cpu", growth_interval=2)
    return model, optimizer, scheduler, scaler


def train_step(parts: Parts) -> str:
    """One step drawing from torch (data, dropout), numpy and python; the loss's exact bits."""
    model, optimizer, scheduler, scaler = parts
    x = torch.randn(16, 8)
    # 17 normals: an odd count leaves numpy's cached gaussian in play at the checkpoint.
    noise = torch.from_numpy(np.random.standard_normal(17)[:16].astype(np.float32)).unsqueeze(1)
    y = x.sum(dim=1, keepdim=True) * (0.5 + random.random()) + 0.1 * noise + 0.01 * random.gauss(0.0, 1.0)
    optimizer.zero_grad()
    loss = F.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    scheduler.step()
    return float(loss.item()).hex()


EPOCH_START = torch.Generator().manual_seed(5).get_state()


def position_at(step: int) -> ck.TrainingPosition:
    return ck.TrainingPosition(step=step, epoch=1, batch_in_epoch=step - 2, epoch_start_generator=EPOCH_START)


@pytest.fixture(scope="module")
def original(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The uninterrupted run, checkpointed after CHECKPOINT_AT steps."""
    path = ck.path_for(tmp_path_factory.mktemp("ckpt"), CHECKPOINT_AT, 0)
    parts = make_parts(0)
    losses = []
    numpy_state = None
    for step in range(TOTAL_STEPS):
        if step == CHECKPOINT_AT:
            numpy_state = np.random.get_state()
            model, optimizer, scheduler, scaler = parts
            ckpt = ck.build(model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
                            position=position_at(step), extra={"note": "mid-run"},
                            loader_generators={"val": torch.Generator().manual_seed(9)})
            ck.save_atomic(ckpt, path)
        losses.append(train_step(parts))
    model, optimizer, scheduler, scaler = parts
    return {
        "path": path, "losses": losses, "fingerprint": fingerprint(model), "numpy_state": numpy_state,
        "scaler": scaler.state_dict(), "lr": optimizer.param_groups[0]["lr"],
    }


def resume(path: Path, *, restore_rng: bool = True, reseed: str | None = None) -> tuple[list[str], Parts]:
    parts = make_parts(123)  # other initial weights and RNG: everything must come from the file
    model, optimizer, scheduler, scaler = parts
    ckpt = ck.load(path)
    assert ckpt["rng"]["cuda"] == [] or "cuda_devices" not in ckpt["rng"], "a CPU run's checkpoint holds a CUDA state"
    position = ck.restore(ckpt, model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler)
    assert position.step == CHECKPOINT_AT
    assert (position.epoch, position.batch_in_epoch) == (1, CHECKPOINT_AT - 2)
    assert torch.equal(position.epoch_start_generator, EPOCH_START)
    if restore_rng:
        ck.set_rng_state(ckpt["rng"])
    if reseed == "torch":
        torch.manual_seed(1)
    elif reseed == "numpy":
        np.random.seed(1)
    elif reseed == "python":
        random.seed(1)
    return [train_step(parts) for _ in range(position.step, TOTAL_STEPS)], parts


def test_resumed_run_is_bitwise_identical(original: dict[str, Any]) -> None:
    losses, (model, optimizer, _, scaler) = resume(original["path"])
    assert losses == original["losses"][CHECKPOINT_AT:]
    assert fingerprint(model) == original["fingerprint"]
    assert scaler.state_dict() == original["scaler"]
    assert optimizer.param_groups[0]["lr"] == original["lr"]


@pytest.mark.parametrize("reseed", [None, "torch", "numpy", "python"])
def test_resume_without_each_rng_diverges(original: dict[str, Any], reseed: str | None) -> None:
    # The control: every generator the step draws from must come back, or the losses change.
    losses, (model, *_) = resume(original["path"], restore_rng=reseed is not None, reseed=reseed)
    assert losses != original["losses"][CHECKPOINT_AT:]
    assert fingerprint(model) != original["fingerprint"]


def test_checkpoint_is_weights_only_and_numpy_state_is_exact(original: dict[str, Any]) -> None:
    raw = torch.load(original["path"], weights_only=True)
    assert raw[ck.FORMAT_KEY] == ck.FORMAT_VERSION
    assert raw["extra"] == {"note": "mid-run"}
    assert torch.equal(raw["loader_generators"]["val"], torch.Generator().manual_seed(9).get_state())
    assert raw["rng"]["numpy"]["has_gauss"] == 1  # the cached gaussian is part of what must survive
    assert raw["rng"]["python"]["gauss_next"] is not None
    np.random.seed(99)
    ck.set_rng_state(raw["rng"])
    name, key, pos, has_gauss, cached = np.random.get_state()
    want = original["numpy_state"]
    assert name == want[0] and np.array_equal(key, want[1]) and key.dtype == np.uint32
    assert (pos, has_gauss, cached) == tuple(want[2:])


def test_rng_state_round_trips_through_weights_only_save() -> None:
    seed_all(3)
    buffer = io.BytesIO()
    torch.save(ck.rng_state(), buffer)
    expected = (torch.rand(4), np.random.rand(4), random.random())
    seed_all(4)
    ck.set_rng_state(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
    got = (torch.rand(4), np.random.rand(4), random.random())
    assert torch.equal(got[0], expected[0]) and np.array_equal(got[1], expected[1]) and got[2] == expected[2]


# A CUDA generator's state as torch.cuda.get_rng_state returns it: 16 bytes (seed, offset). Made up here: no GPU.
def crafted_cuda_state(seed: int) -> torch.Tensor:
    return torch.tensor(list(seed.to_bytes(8, "little")) + [0] * 8, dtype=torch.uint8)


def test_cpu_run_checkpointed_on_a_host_with_8_gpus_resumes_here_bit_identically(
        original: dict[str, Any], tmp_path: Path) -> None:
    """The layout earlier versions wrote: one CUDA state per visible GPU, also for a device=cpu run."""
    ckpt = ck.load(original["path"])
    ckpt["rng"]["cuda"] = [crafted_cuda_state(i) for i in range(8)]
    ckpt["rng"].pop("cuda_devices")
    path = tmp_path / "rank0.pt"
    ck.save_atomic(ckpt, path)
    losses, (model, *_) = resume(path)
    assert losses == original["losses"][CHECKPOINT_AT:]
    assert fingerprint(model) == original["fingerprint"]


def test_rng_state_holds_the_cuda_state_of_the_ranks_own_device_only(monkeypatch: pytest.MonkeyPatch) -> None:
    assert (ck.rng_state()["cuda"], ck.rng_state(torch.device("cpu"))["cuda_devices"]) == ([], [])
    # No GPU here: torch.cuda's getter is replaced by one answering for device 3 only.
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda index: crafted_cuda_state(100 + index))
    state = ck.rng_state(torch.device("cuda", 3))
    assert state["cuda_devices"] == [3] and len(state["cuda"]) == 1
    assert torch.equal(state["cuda"][0], crafted_cuda_state(103))


@pytest.mark.parametrize("devices, index, expected", [
    (None, 5, 5),  # earlier layout: one state per visible GPU, the rank takes its own index's
    ([2], 0, 2),  # this layout: the rank's own state, wherever the rank runs now
    ([0, 1], 1, 1),
])
def test_gpu_rank_restores_only_the_state_of_its_device(
        monkeypatch: pytest.MonkeyPatch, devices: list[int] | None, index: int, expected: int) -> None:
    state = ck.rng_state()
    state["cuda"] = [crafted_cuda_state(i) for i in (devices if devices is not None else range(8))]
    if devices is None:
        state.pop("cuda_devices")
    else:
        state["cuda_devices"] = devices
    # No GPU here: torch.cuda's setter records what it is given instead of setting a generator.
    restored: list[tuple[torch.Tensor, int]] = []
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, i: restored.append((s, i)))
    ck.set_rng_state(state, torch.device("cuda", index))
    assert len(restored) == 1 and restored[0][1] == index
    assert torch.equal(restored[0][0], crafted_cuda_state(expected))
    restored.clear()
    ck.set_rng_state(state, torch.device("cpu"))
    ck.set_rng_state(state)
    assert restored == [], "a CPU rank restored a CUDA generator"


@pytest.mark.parametrize("states, devices, index, said", [
    (2, None, 3, "the checkpoint holds CUDA RNG states for 2 device(s), none for cuda:3, this rank's device. "
                 "Resume with the GPUs of the checkpointed run visible (at least 4)."),
    (0, [], 0, "the checkpoint holds no CUDA RNG state (its rank ran on the cpu) but this rank runs on cuda:0. "
               "Resume with device=cpu, as the checkpointed run did."),
    (2, [0, 1], 2, "the checkpoint holds CUDA RNG states for devices [0, 1], none for cuda:2, this rank's device. "
                   "Resume on the devices of the checkpointed run."),
])
def test_gpu_rank_missing_its_cuda_state_is_refused_in_one_line(
        states: int, devices: list[int] | None, index: int, said: str) -> None:
    # Refused before torch.cuda is touched, so this runs as it would on a GPU host.
    state = ck.rng_state()
    state["cuda"] = [crafted_cuda_state(i) for i in range(states)]
    if devices is None:
        state.pop("cuda_devices")
    else:
        state["cuda_devices"] = devices
    before = torch.get_rng_state()
    with pytest.raises(HarnessError) as err:
        ck.set_rng_state(state, torch.device("cuda", index))
    assert str(err.value) == said
    assert torch.equal(torch.get_rng_state(), before), "a refused state changed a generator"


def test_malformed_rng_state_changes_nothing() -> None:
    state = ck.rng_state()
    state["python"]["internal"] = [1, 2, 3]
    before = torch.get_rng_state()
    with pytest.raises(HarnessError):
        ck.set_rng_state(state)
    assert torch.equal(torch.get_rng_state(), before)


def test_restore_refuses_a_missing_optimizer(original: dict[str, Any]) -> None:
    model, _, scheduler, scaler = make_parts(0)
    with pytest.raises(HarnessError, match="optimizer"):
        ck.restore(ck.load(original["path"]), model=model, scheduler=scheduler, scaler=scaler)


def test_restore_refuses_a_model_that_casts_the_weights(original: dict[str, Any]) -> None:
    model, optimizer, scheduler, scaler = make_parts(0)
    model.to(torch.float16)  # load_state_dict would silently round the fp32 weights
    with pytest.raises(HarnessError, match="fingerprint"):
        ck.restore(ck.load(original["path"]), model=model, optimizer=optimizer, scheduler=scheduler,
                   scaler=scaler)


def test_build_refuses_objects_weights_only_cannot_load() -> None:
    model = Net()
    with pytest.raises(HarnessError, match="numpy"):
        ck.build(model=model, position=position_at(0), extra={"table": np.zeros(3)})


def test_build_snapshots_instead_of_aliasing_live_parameters() -> None:
    model = Net()
    ckpt = ck.build(model=model, position=position_at(0))
    with torch.no_grad():
        model.body[0].weight.add_(1.0)
    assert not torch.equal(ckpt["model"]["body.0.weight"], model.body[0].weight)
    assert ckpt["model"]._metadata == model.state_dict()._metadata  # module versions travel along


# -- atomic writes and loading -------------------------------------------------------------------------
def small_checkpoint(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    return ck.build(model=Net(), position=position_at(seed))


def test_failed_replace_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = ck.path_for(tmp_path, 10, 0)
    old = small_checkpoint(1)
    ck.save_atomic(old, path)

    def crash(*args: Any) -> None:
        raise OSError("simulated crash before the rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="simulated"):
        ck.save_atomic(small_checkpoint(2), path)
    monkeypatch.undo()
    assert ck.load(path)["fingerprint"] == old["fingerprint"]
    assert sorted(p.name for p in path.parent.iterdir()) == ["rank0.pt"]


def test_crash_mid_write_leaves_no_partial_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = ck.path_for(tmp_path, 10, 0)
    old = small_checkpoint(1)
    ck.save_atomic(old, path)
    real_save = torch.save

    def half_then_crash(obj: Any, fh: Any) -> None:
        buffer = io.BytesIO()
        real_save(obj, buffer)
        fh.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
        raise RuntimeError("simulated crash mid-write")

    monkeypatch.setattr(torch, "save", half_then_crash)
    with pytest.raises(RuntimeError, match="simulated"):
        ck.save_atomic(small_checkpoint(2), path)
    with pytest.raises(RuntimeError, match="simulated"):
        ck.save_atomic(small_checkpoint(2), path.with_name("rank1.pt"))
    monkeypatch.undo()
    assert ck.load(path)["fingerprint"] == old["fingerprint"]
    assert sorted(p.name for p in path.parent.iterdir()) == ["rank0.pt"]


def test_save_is_durable_before_and_after_the_rename(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = ck.path_for(tmp_path, 10, 0)
    events: list[tuple[str, int, bool]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def spy_fsync(fd: int) -> None:
        info = os.fstat(fd)
        events.append(("fsync", info.st_ino, stat.S_ISDIR(info.st_mode)))
        real_fsync(fd)

    def spy_replace(src: Any, dst: Any) -> None:
        events.append(("replace", os.stat(src).st_ino, False))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", spy_fsync)
    monkeypatch.setattr(os, "replace", spy_replace)
    ck.save_atomic(small_checkpoint(1), path)
    monkeypatch.undo()
    file_ino, dir_ino = path.stat().st_ino, path.parent.stat().st_ino
    replaced = events.index(("replace", file_ino, False))
    # The data reaches the disk before the new name points at it, and the new name after.
    assert ("fsync", file_ino, False) in events[:replaced]
    assert ("fsync", dir_ino, True) in events[replaced:]


def write_bytes(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def saved_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize("kind, message", [
    ("missing", "no checkpoint"),
    ("empty", "truncated or corrupt"),
    ("truncated", "truncated or corrupt"),
    ("foreign", "not a harness checkpoint"),
    ("pickled_object", "weights_only"),
    ("future_version", "format 99"),
])
def test_load_rejects_bad_files_in_one_line(tmp_path: Path, kind: str, message: str) -> None:
    good = saved_bytes(small_checkpoint(1))
    path = tmp_path / "rank0.pt"
    if kind == "empty":
        write_bytes(path, b"")
    elif kind == "truncated":
        write_bytes(path, good[: len(good) // 2])
    elif kind == "foreign":
        write_bytes(path, saved_bytes({"weight": torch.zeros(2)}))
    elif kind == "pickled_object":
        write_bytes(path, saved_bytes({ck.FORMAT_KEY: ck.FORMAT_VERSION, "table": np.zeros(2)}))
    elif kind == "future_version":
        write_bytes(path, saved_bytes({ck.FORMAT_KEY: 99}))
    with pytest.raises(HarnessError) as info:
        ck.load(path)
    text = str(info.value)
    assert message in text and "\n" not in text and str(path) in text


# -- layout ------------------------------------------------------------------------------------------
def touch_ranks(directory: Path, step: int, ranks: range) -> None:
    for rank in ranks:
        target = ck.path_for(directory, step, rank)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(b"x")


def test_complete_steps_need_every_rank_and_the_marker(tmp_path: Path) -> None:
    assert ck.complete_steps(tmp_path / "absent", 2) == []
    assert ck.latest_complete(tmp_path, 2) is None
    assert ck.path_for(tmp_path, 120, 1) == tmp_path / "step-00000120" / "rank1.pt"
    touch_ranks(tmp_path, 5, range(2))
    ck.mark_complete(tmp_path, 5)
    touch_ranks(tmp_path, 120, range(2))
    ck.mark_complete(tmp_path, 120, world_size=2)
    touch_ranks(tmp_path, 200, range(2))  # no marker: a rank may still be writing
    touch_ranks(tmp_path, 300, range(1))  # marker but rank 1's file missing
    ck.mark_complete(tmp_path, 300)
    touch_ranks(tmp_path, 400, range(2))  # marked by a run with another world size
    ck.mark_complete(tmp_path, 400, world_size=4)
    (tmp_path / "step-bogus").mkdir()
    (tmp_path / "notes.txt").write_text("x")
    assert ck.complete_steps(tmp_path, 2) == [5, 120]
    assert ck.latest_complete(tmp_path, 2) == 120
    assert ck.complete_steps(tmp_path, 1) == [5, 300]
    assert ck.complete_steps(tmp_path, 3) == []


# -- DataLoader ----------------------------------------------------------------------------------------
class SeedEcho(Dataset):
    """Each item is (index, the seed of the process that loaded it)."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> tuple[int, int]:
        return index, torch.initial_seed()


class Augmented(Dataset):
    """Each item draws from the global torch RNG, as an augmentation in the main process does."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([float(index)]) + torch.rand(1)


def make_loader(dataset: Dataset, seed: int, num_workers: int = 0, **kwargs: Any) -> DataLoader:
    generator = torch.Generator()
    generator.manual_seed(seed)
    if num_workers and "fork" in mp.get_all_start_methods():
        kwargs.setdefault("multiprocessing_context", "fork")  # spawn would re-import torch: seconds
    return DataLoader(dataset, batch_size=2, shuffle=True, num_workers=num_workers, generator=generator,
                      **kwargs)


def as_pairs(batches: list[Any]) -> list[tuple[list[int], list[int]]]:
    return [(b[0].tolist(), b[1].tolist()) for b in batches]


def test_resumed_epoch_has_same_order_and_worker_seed() -> None:
    loader = make_loader(SeedEcho(), seed=7, num_workers=1)
    epoch0 = as_pairs(list(loader))
    start1 = ck.generator_state(loader.generator)  # epoch 1 starts: before its iterator exists
    epoch1 = as_pairs(list(loader))
    end_state = ck.generator_state(loader.generator)
    assert {s for _, seeds in epoch0 for s in seeds} != {s for _, seeds in epoch1 for s in seeds}

    resumed = make_loader(SeedEcho(), seed=99, num_workers=1)
    position = ck.TrainingPosition(step=8, epoch=1, batch_in_epoch=2, epoch_start_generator=start1)
    rest = as_pairs(list(loaders.resume_iterator(resumed, position)))
    assert rest == epoch1[2:]
    assert torch.equal(ck.generator_state(resumed.generator), end_state)

    control = make_loader(SeedEcho(), seed=99, num_workers=1)
    assert as_pairs(list(control))[2:] != epoch1[2:]


def test_rng_restored_after_fast_forward_reproduces_main_process_augmentation() -> None:
    torch.manual_seed(0)
    loader = make_loader(Augmented(), seed=7)
    start = ck.generator_state(loader.generator)
    iterator = iter(loader)
    consumed = [next(iterator) for _ in range(2)]
    assert len(consumed) == 2
    rng = ck.rng_state()  # the step boundary after two batches
    expected = list(iterator)
    position = ck.TrainingPosition(step=2, epoch=0, batch_in_epoch=2, epoch_start_generator=start)

    def resumed(rng_first: bool) -> list[torch.Tensor]:
        torch.manual_seed(5)
        fresh = make_loader(Augmented(), seed=11)
        if rng_first:
            ck.set_rng_state(rng)
        rest = loaders.resume_iterator(fresh, position)  # loading the skipped batches draws from the RNG
        if not rng_first:
            ck.set_rng_state(rng)
        return list(rest)

    assert all(torch.equal(a, b) for a, b in zip(resumed(rng_first=False), expected, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(resumed(rng_first=True), expected, strict=True))


def test_resume_iterator_refuses_persistent_workers_and_overlong_positions() -> None:
    start = ck.generator_state(torch.Generator())
    persistent = make_loader(SeedEcho(), seed=1, num_workers=1, persistent_workers=True)
    with pytest.raises(HarnessError, match="persistent_workers"):
        loaders.resume_iterator(persistent, ck.TrainingPosition(0, 0, 0, start))
    with pytest.raises(HarnessError, match="only 6 batches"):
        loaders.resume_iterator(make_loader(SeedEcho(), seed=1), ck.TrainingPosition(9, 0, 9, start))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none exists on CPU-only CI machines)")
def test_cuda_generators_and_models_round_trip() -> None:
    torch.cuda.manual_seed_all(3)
    device = torch.device("cuda", torch.cuda.current_device())
    saved = saved_bytes(ck.rng_state(device))
    expected = torch.rand(4, device="cuda")
    torch.cuda.manual_seed_all(4)
    ck.set_rng_state(torch.load(io.BytesIO(saved), weights_only=True), device)
    assert torch.equal(torch.rand(4, device="cuda"), expected)
    model = Net().cuda()
    ckpt = ck.build(model=model, position=position_at(0))
    assert all(t.device.type == "cpu" for t in ckpt["model"].values())
    other = Net().cuda()
    ck.restore(ckpt, model=other)
    assert fingerprint(other) == fingerprint(model)


def _record(checkpoints: dict[int, str], tensors: dict[int, dict] | None) -> RunRecord:
    return RunRecord(run_id="R", experiment="e", status="FAILED", facts={}, lock=[], metrics={}, fingerprints={},
                     final_fingerprint=None, config={}, checkpoints=checkpoints, checkpoint_tensors=tensors)


def _digests(sha: str) -> dict[str, Any]:
    return {"sha256": sha, "tensors": {"0.weight": sha + "w", "0.bias": sha + "b"}, "ranks": [sha + "r"] * 2}


def test_the_marker_holds_the_checkpoints_digests_and_a_resume_takes_them_where_the_record_lacks_them(
    tmp_path: Path,
) -> None:
    """Rank 0 killed between a step's marker and the message carrying its digests: the marker, written in one atomic
    write with them, gives them to the resume; a marker without any (an older harness) is skipped, and said."""
    store = CheckpointStore(None, "R", tmp_path, remote=False)  # type: ignore[arg-type]  # a local store: no tracker
    for step, digests in ((5, _digests("a")), (10, _digests("b"))):
        touch_ranks(tmp_path, step, range(2))
        ck.mark_complete(tmp_path, step, world_size=2, digests=digests)
    assert ck.saved_digests(tmp_path, 10) == _digests("b")
    assert ck.complete_steps(tmp_path, 2) == [5, 10] and ck.complete_steps(tmp_path, 3) == []  # world size still read
    record = _record({5: "a"}, {5: {"tensors": _digests("a")["tensors"], "ranks": _digests("a")["ranks"]}})
    assert _provable_step(record, store, 10, 2) == 10
    assert record.checkpoints == {5: "a", 10: "b"}
    assert record.checkpoint_tensors[10] == {"tensors": _digests("b")["tensors"], "ranks": _digests("b")["ranks"]}

    touch_ranks(tmp_path, 15, range(2))
    ck.mark_complete(tmp_path, 15, world_size=2)  # no digests: as a harness before markers held them wrote it
    assert ck.saved_digests(tmp_path, 15) is None
    said: list[events.Event] = []
    with events.listening(said.append):
        assert _provable_step(record, store, 15, 2) == 10
    assert any("The checkpoint of step 15 holds no digests" in e.line() for e in said), said
    nothing = _record({}, None)  # no step recorded anywhere: resumed from the last, proven on its logged values
    assert _provable_step(nothing, CheckpointStore(None, "R", tmp_path / "none", remote=False), 15, 2) == 15  # type: ignore[arg-type]


def test_a_proof_that_misses_the_recorded_tensors_names_the_first_and_counts_them_all() -> None:
    recorded = {"0.bias": "x", "0.weight": "y"}
    record = _record({10: "sha"}, {10: {"tensors": recorded, "ranks": []}})
    report = SegmentReport(end=(10, "other"), tensors={"0.bias": "x", "0.weight": "z", "1.weight": "q"})
    with pytest.raises(HarnessError) as err:
        _hold_to_checkpoint(report, record, 5, 10, "resume refused", "Fix it.")
    assert "'0.weight' differs (and 1 more of 3 tensors)" in str(err.value), err.value
    # A run from before per-tensor digests were recorded: held to its weights' fingerprint, never to "0 tensors".
    old = _record({10: "sha"}, None)
    with pytest.raises(HarnessError) as err:
        _hold_to_checkpoint(report, old, 5, 10, "resume refused", "Fix it.")
    assert "ended with weights other" in str(err.value) and "tensors" not in str(err.value).split("Fix")[0], err.value


@pytest.mark.parametrize("digests", [{}, {0: "00" * 8, 1: "ff" * 8, 7: "0123456789abcdef"}])
def test_the_data_order_rides_in_a_weights_only_checkpoint(tmp_path: Path, digests: dict[int, str]) -> None:
    """A run resumed from a checkpoint records the data order of the steps before it: the digests are in the file,
    which a weights_only load still reads when there are none (a loop without ctx.loader)."""
    path = tmp_path / "rank0.pt"
    ck.save_atomic({ck.FORMAT_KEY: ck.FORMAT_VERSION, "extra": {"data_order": ck.pack_digests(digests)}}, path)
    assert ck.unpack_digests(ck.load(path)["extra"]["data_order"]) == digests
    assert ck.unpack_digests(None) == {}  # a checkpoint written before the data order rode along
