"""The body of one rank, in whatever process it was given (a rank process of harness/runtime/rank/process.py, or a
process torchrun started): rendezvous, seeds, determinism, the experiment's entry function, the teardown."""

from __future__ import annotations

import contextlib
import datetime
import functools
import gc
import inspect
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.config import load_module_function
from harness.configschema import Level
from harness.errors import ExperimentError, HarnessError
from harness.messages import Determinism, RankFacts
from harness.runtime import forkgate, perturb, usermlflow, userseed
from harness.runtime.rank import family
from harness.runtime.rank.facts import device_facts, env_vars, nccl_conf
from harness.runtime.rank.failure import last_line, user_frame, write_failure
from harness.runtime.rank.progress import DONE, TEARDOWN, beat
from harness.runtime.rank.spec import PG_MARGIN_S, RANKS_PREFIX, LaunchSpec, rank_env

if TYPE_CHECKING:  # torch loads only in the processes that run ranks
    import torch


def run_rank(spec: LaunchSpec, local_rank: int, channel: Any, progress: Any = None, store: Any = None) -> None:
    """The body of one rank, in whatever process it was given (spawned here, or started by torchrun):
    rendezvous, seeds, determinism, then the experiment's entry function.

    `channel` (global rank 0 only; others get None) takes rank 0's messages with send() and close().
    `store` is the job's TCPStore when this process already holds it; otherwise the rank connects
    to spec.master_addr:spec.port as a client, or, for ranks this node's launcher spawned with port 0, the first
    of them hosts it (local_store).
    """
    import torch.distributed as dist

    from harness.runtime.groupkeep import keep_default_group

    started = time.time()
    rank = spec.global_rank(local_rank)
    hosts = store is None and not spec.port and progress is not None
    if hosts:
        store = local_store(spec, local_rank, progress)
    if rank != 0 and channel is not None:
        channel.close()
        channel = None
    os.environ.update(rank_env(spec, local_rank))
    run_id = usermlflow.route(os.environ, rank, spec.log_dir, spec.env)
    if run_id:
        usermlflow.keep_run_open(run_id)
    seeds_seen = None
    kept = None
    try:
        settings = _settle(spec, rank)
        here = _join(spec, rank, local_rank, channel, progress, store)
        # The training code's destroy_process_group() waits for harness's end; its init_process_group() gets this group.
        kept = keep_default_group(spec.backend, spec.world_size, rank)
        beat(progress, local_rank, -1)
        os.chdir(spec.code_dir)
        sys.path.insert(0, spec.code_dir)  # the entry may import its sibling modules
        # After harness's seeding, before the entry's import (which may bind `from torch import manual_seed`).
        seeds_seen = userseed.watch(spec.code_dir)
        fn = import_entry(spec)
        beat(progress, local_rank, -1)
        if channel is not None and not spec.members:
            channel.send(Determinism(settings, env_vars()))
            channel.send(RankFacts(device_facts(here.device), nccl_conf()))
        _run_segments(fn, here)
        beat(progress, local_rank, TEARDOWN)  # trained: tearing down, which must end within timeout_s too
        userseed.send_once(seeds_seen, channel.send if channel is not None else None)
        kept.stop()
        # A DDP model in a reference cycle would otherwise be freed by a later collection, after the group below is
        # destroyed: its Reducer then frees the group, joining gloo's threads with the GIL held (groupkeep.py).
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()
        if hosts:
            _leave_store(spec, local_rank, progress)
    except BaseException as err:
        write_failure(spec, rank, err)
        raise
    finally:
        # What the rank started (DataLoader workers, subprocesses and theirs) ends with it, however it ended.
        family.end_descendants(since=started)
        if kept is not None:
            kept.stop()
        if seeds_seen is not None:
            seeds_seen.stop()  # torchrun runs the body in its launcher's process, which lives on
        if channel is not None:
            channel.close()


@dataclass
class _Here:
    """Where this rank runs and how it reaches the others and the launcher: what each segment's context is made of."""

    spec: LaunchSpec
    rank: int
    local_rank: int
    device: torch.device
    channel: Any
    progress: Any
    store: Any
    timeout: datetime.timedelta


def _settle(spec: LaunchSpec, rank: int) -> dict[str, str]:
    """This process as the rank's arithmetic needs it before anything runs: harness's threads, the kernels'
    threads, a calibration member's kernels, the determinism settings (returned as read back) and the seeds."""
    import torch

    from harness.runtime.determinism import seed_everything

    forkgate.start_worker()  # harness's threads exist before the training code can fork (runtime/forkgate.py)
    family.hold_children()  # what the rank forks dies with it
    torch.set_num_threads(spec.threads_per_rank)
    with contextlib.suppress(RuntimeError):  # only settable before the first parallel op
        torch.set_num_interop_threads(1)
    if spec.checkpoints is not None and spec.checkpoints.perturb_seed is not None:
        # A calibration member: on its share of the machine's other kernels, before the settings are read.
        perturb.use_kernels(spec.checkpoints.perturb_seed)
    settings = _determinism(spec)
    seed_everything(spec.rank_seeds[rank])
    return settings


def _determinism(spec: LaunchSpec) -> dict[str, str]:
    """The determinism settings set and read back, watched from here on (setters name the user's line)."""
    from harness.runtime.determinism import set_determinism, start_watch

    settings = set_determinism(Level(spec.determinism))
    start_watch(Level(spec.determinism), settings)
    settings["world_size_invariant"] = str(spec.invariant_shards > 0)
    settings["shards"] = str(spec.invariant_shards or "none")
    return settings


def _join(spec: LaunchSpec, rank: int, local_rank: int, channel: Any, progress: Any, store: Any) -> _Here:
    """The rank's device, and the job's default process group joined on its store."""
    import torch
    import torch.distributed as dist

    if spec.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    timeout = datetime.timedelta(seconds=spec.timeout_s + PG_MARGIN_S)
    if store is None:  # every rank is a client of the launcher's store (node 0's across nodes): one port per job
        store = dist.TCPStore(spec.master_addr, spec.port, is_master=False, timeout=timeout)
    dist.init_process_group(
        spec.backend, store=dist.PrefixStore(RANKS_PREFIX, store), rank=rank, world_size=spec.world_size,
        timeout=timeout, **device_id(device),
    )
    return _Here(spec, rank, local_rank, device, channel, progress, store, timeout)


def _context(here: _Here, plan: Any) -> Any:
    """The Context that `train(ctx)` receives for one segment (`plan`: its launch plan)."""
    from omegaconf import OmegaConf

    from harness.runtime.context import Context

    spec = here.spec
    return Context(
        rank=here.rank,
        world_size=spec.world_size,
        local_rank=here.local_rank,
        device=here.device,
        cfg=OmegaConf.create(spec.train_cfg),
        seed=spec.seed,
        rank_seed=spec.rank_seeds[here.rank],
        fingerprint_every=spec.fingerprint_every,
        channel=here.channel,
        checkpoints=plan,
        invariant_shards=spec.invariant_shards,
        progress=functools.partial(beat, here.progress, here.local_rank),
        output_dir=spec.output_dir,
        data=spec.data,
        run_id=spec.run_id,
        code_dir=spec.code_dir,
        profile=spec.profile,
    )


def _run_segments(fn: Callable[[Any], Any], here: _Here) -> None:
    """The entry function once per segment (once for a run; once per audit segment or calibration member), each
    with a context of its own."""
    import torch

    from harness.runtime.context import StopSegment
    from harness.runtime.determinism import seed_everything

    spec = here.spec
    own_kernels = (bool(torch.backends.mkldnn.enabled), torch.get_num_threads())
    for index, plan in enumerate(spec.segments or [spec.checkpoints]):
        if index:
            # Each segment starts as a fresh rank does: what train() draws before the checkpoint is loaded
            # (nanoGPT's first batch) must come out as in the process that will resume from it.
            seed_everything(spec.rank_seeds[here.rank])
        ctx = _context(here, plan)
        usermlflow.notify_with(ctx._notice)
        if spec.members:
            beat(here.progress, here.local_rank, -1)  # the launcher counts this member's steps from its start
            # A member's record says the settings it ran on, as a member launched alone reads them at its start.
            settings = member_kernels(spec, plan.perturb_seed, own_kernels)
            ctx.announce_segment(index, Determinism(settings, env_vars()),
                                 RankFacts(device_facts(here.device), nccl_conf()))
        elif spec.segments:
            ctx.announce_segment(index)
        try:
            _train(fn, ctx)
            regroup(spec, here.rank, here.store, here.timeout, here.device)
            ctx.finish()
        except StopSegment:  # an audit segment (or replay --steps K) ended: every rank stops at the same step
            if not spec.segments or spec.members:  # replay --steps K: the run ends there, wrapped up as at an end
                ctx.finish_stopped()
        finally:
            ctx.close()  # rank 0's buffered metrics reach the launcher, also when fn raised


def member_kernels(spec: LaunchSpec, seed: int | None, own: tuple[bool, int]) -> dict[str, str]:
    """Calibration member `seed`'s kernels in this process (the run's own first, then its share: perturb.py), and
    the determinism settings read back as a rank launched for it alone reads them, watched from here on."""
    import torch

    torch.backends.mkldnn.enabled = own[0]  # type: ignore[assignment]  # a module property (ContextProp)
    torch.set_num_threads(own[1])
    if seed is not None:
        perturb.use_kernels(seed)
    return _determinism(spec)


def _train(fn: Callable[[Any], Any], ctx: Any) -> None:
    """The experiment's entry function. sys.exit(0) (or sys.exit()) in it ends it as a return does: SystemExit
    unwinds like one, and Python calls that status a success; the rank then finishes as a rank that returned (its
    metrics flushed, its end-of-run checks and final fingerprint). Any other status is raised: the rank failed."""
    try:
        fn(ctx)
    except SystemExit as err:
        if err.code not in (None, 0):
            raise


def local_store(spec: LaunchSpec, local_rank: int, progress: Any) -> Any:
    """The job's store on a single node: the first rank hosts it on a free port (as torch's env:// rendezvous
    has rank 0 do) and publishes the port in the shared progress array; the others wait for it and connect.
    MASTER_PORT, set from spec.port, is then the store's."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=spec.timeout_s + PG_MARGIN_S)
    slot = 2 * spec.local_ranks
    if local_rank == 0:
        try:
            store = dist.TCPStore(spec.master_addr, 0, is_master=True, wait_for_workers=False, timeout=timeout)
        except Exception as err:  # torch raises DistNetworkError / RuntimeError with a C++ message
            raise HarnessError(f"cannot listen on {spec.master_addr} for the job's rendezvous "
                               f"({last_line(str(err))}). Check that the loopback interface is up.") from err
        progress[slot] = store.port
    else:
        # The launcher ends every rank if the first one dies before it publishes: this wait needs no deadline of
        # its own beyond the job's.
        deadline = time.monotonic() + timeout.total_seconds()
        while not progress[slot]:
            if time.monotonic() > deadline:
                raise HarnessError(f"rank 0 did not host the job's store within {timeout.total_seconds():g} s. "
                                   "Raise timeout_s if its start-up can take longer.")
            time.sleep(0.005)
        store = dist.TCPStore(spec.master_addr, int(progress[slot]), is_master=False, timeout=timeout)
    spec.port = int(progress[slot])
    return store


def _leave_store(spec: LaunchSpec, local_rank: int, progress: Any) -> None:
    """The rank that hosts the store exits only once every other rank has finished with it (or the margin passed:
    a rank that failed is the launcher's to report)."""
    progress[2 * local_rank] = DONE
    if local_rank != 0:
        return
    deadline = time.monotonic() + PG_MARGIN_S
    while time.monotonic() < deadline and any(progress[2 * r] != DONE for r in range(1, spec.local_ranks)):
        progress[1] = time.monotonic()  # a bounded wait of its own: the others' progress is judged on theirs
        time.sleep(0.005)


_REGROUPS = "regroup-"  # the ranks' keys for a re-created default group: ranks/regroup-<n>/...
_regrouped = 0  # default groups re-created in this process so far


def device_id(device: torch.device) -> dict[str, Any]:
    """init_process_group's `device_id` for a rank on a GPU ({} on the CPU, or where torch lacks it): NCCL then
    binds the communicator to that device and forms it at once, so a bad GPU or NCCL set-up fails at start-up,
    not at the first collective, and the invariant mode's first batch_isend_irecv comes after a formed
    communicator."""
    import torch.distributed as dist

    if device.type != "cuda" or "device_id" not in inspect.signature(dist.init_process_group).parameters:
        return {}
    return {"device_id": device}


def regroup(spec: LaunchSpec, rank: int, store: Any, timeout: datetime.timedelta, device: torch.device) -> None:
    """A default process group for harness's end-of-run collectives (the replica check) when the training code
    destroyed harness's own past the deferring wrapper (harness.runtime.groupkeep), e.g. through a reference to
    torch's function taken before the wrap.

    Every rank re-creates it on the job's store under a prefix no earlier group used (each rank counts alike:
    they all ran the same code), so no key of the destroyed group is read again.
    """
    import torch.distributed as dist

    global _regrouped
    if dist.is_initialized() or spec.world_size == 1:
        return
    _regrouped += 1
    prefix = f"{RANKS_PREFIX}{_REGROUPS}{_regrouped}/"
    dist.init_process_group(
        spec.backend, store=dist.PrefixStore(prefix, store), rank=rank, world_size=spec.world_size, timeout=timeout,
        **device_id(device),
    )


def import_entry(spec: LaunchSpec) -> Any:
    """The entry function; an import error becomes one line naming the file and line, not a wall of traceback."""
    path = Path(spec.code_dir) / spec.entry_file
    try:
        fn = load_module_function(path, spec.entry_func)
    except Exception as err:
        where = user_frame(err, spec.code_dir) or spec.entry_file
        if isinstance(err, SyntaxError) and err.filename:
            where = f"{os.path.relpath(err.filename, spec.code_dir)}, line {err.lineno}"
        raise ExperimentError(f"entry import failed: {type(err).__name__}: {err} ({where})") from err
    if not callable(fn):
        raise ExperimentError(f"entry {spec.entry_file}:{spec.entry_func} is not a function. Fix 'entry' in experiment.yaml.")
    return fn

