"""Processes for parallel runs: one per device, in a `torch.distributed` group (gloo on
CPU, NCCL on CUDA), started by `spawn` (the command's own `--tensor-parallel-size N`) or
by `torchrun`, whose environment `process_group` reads."""

from __future__ import annotations

import os
import pickle
import queue
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..errors import ConfigError
from ..model.tensor_parallel import Shard


def backend_for(device: str | torch.device) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


# a replica may wait at the end of a run for the slowest: far longer than a collective's default
WAIT = timedelta(hours=24)


def launched() -> bool:
    """Whether this process is one of a group already (torchrun, or `spawn`)."""
    return dist.is_available() and dist.is_initialized()


def join_torchrun(device: str | torch.device = "cpu") -> bool:
    """Under torchrun (its RANK and WORLD_SIZE in the environment), join its group; True
    when this process is then one of several."""
    if not launched() and int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ:
        own_device(backend_for(device), int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend_for(device), timeout=WAIT)
    return launched()


def own_device(backend: str, local_rank: int) -> None:
    """With NCCL, this process's GPU is its local rank's: "cuda" then means that one."""
    if backend == "nccl":
        torch.cuda.set_device(local_rank % torch.cuda.device_count())


def is_main() -> bool:
    """Whether this process prints and writes files: rank 0, or a process on its own."""
    return not launched() or dist.get_rank() == 0


_GROUPS: dict[int, list[Any]] = {}  # tensor-parallel size -> its groups of consecutive ranks


def tensor_shard(size: int) -> Shard | None:
    """This process's shard of a tensor-parallel group of `size` ranks (None for size 1).
    The processes (from `spawn` or torchrun) are world = replicas x size, consecutive
    ranks forming one group; every rank must ask, as torch.distributed makes groups
    collectively."""
    if size == 1:
        return None
    if not launched():
        raise ConfigError(
            f"tensor_parallel_size {size} needs {size} processes in a torch.distributed group: "
            f"run through the command line (--tensor-parallel-size {size}), or under "
            f"`torchrun --nproc-per-node {size}`, or in refusion.parallel.spawn"
        )
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % size:
        raise ConfigError(
            f"tensor_parallel_size {size} in a group of {world} processes: launch a multiple of {size}"
        )
    if world == size:
        return Shard(rank, size)
    if size not in _GROUPS:
        _GROUPS[size] = [dist.new_group(list(range(g * size, (g + 1) * size))) for g in range(world // size)]
    return Shard(rank % size, size, _GROUPS[size][rank // size])


def barrier() -> None:
    if launched():
        dist.barrier()


def work_counter(leader: int, group: Any = None, group_size: int = 1) -> Callable[[], int]:
    """A counter all processes share: each call returns the next number (0, 1, 2, ...)
    that no process has taken. Only the `leader` of each tensor-parallel group (of
    `group_size` ranks, `group`; None: the default group) takes numbers; it hands each to
    the other ranks of its group, which call as often as it does. Made collectively:
    every process calls this once."""
    path: list[Any] = [tempfile.mktemp(prefix="refusion-claims-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    store = dist.FileStore(path[0], dist.get_world_size())
    takes = dist.get_rank() == leader

    def take() -> int:
        number: list[Any] = [store.add("taken", 1) - 1 if takes else None]
        if group_size > 1:
            dist.broadcast_object_list(number, src=leader, group=group)
        return int(number[0])

    return take


def replica_claims(model: Any) -> tuple[int, Callable[[], int], bool] | None:
    """This process's share of work split over data-parallel replicas, each a
    tensor-parallel group of `model`'s split (consecutive ranks): (replicas, claim, leads).
    `claim()` returns the next unclaimed chunk number of the run, shared by all replicas
    (a replica whose chunks are quick takes more); `leads`: the first rank of its group
    (the others repeat its work). None in a process on its own. Collective: every rank
    calls it once per run."""
    if not launched():
        return None
    shard = getattr(model, "tensor_parallel", None)
    size = shard.world if shard is not None else 1
    leader = dist.get_rank() - dist.get_rank() % size
    claim = work_counter(leader, shard.group if shard is not None else None, size)
    return dist.get_world_size() // size, claim, dist.get_rank() == leader


def gather_to_main(obj: Any) -> list[Any] | None:
    """Every rank's `obj`, in rank order, on rank 0 (None elsewhere); [obj] on its own."""
    if not launched():
        return [obj]
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def spawn(
    size: int, fn: Callable[..., Any], *args: Any, device: str = "cpu", quiet_others: bool = True
) -> Any:
    """Run fn(*args) in `size` new processes that form one group (rank 0's result comes
    back); each gets an equal share of this machine's cores. The other ranks' output is
    dropped when `quiet_others`, but for the traceback of an error that is not ours. When
    a rank fails, the others get ten seconds to report, then are ended (a rank waiting in
    an NCCL collective would otherwise wait for hours)."""
    procs, results, rendezvous = start_ranks(range(size), size, fn, args, device, quiet_others)
    outcome: tuple[bool, Any] | None = None
    reported: set[int] = set()
    give_up: float | None = None
    while len(reported) < size:
        if (
            give_up is not None and time.monotonic() > give_up
        ):  # a rank failed: the rest may wait in a collective
            break
        try:
            rank, ok, value = results.get(timeout=1.0)
        except queue.Empty:  # a rank that died without a word (a signal, os._exit) ends the run
            dead = [r for r, p in enumerate(procs) if r not in reported and p.exitcode is not None]
            if dead and outcome is None:
                for p in procs:
                    p.kill()
                raise RuntimeError(
                    f"rank {dead[0]} of {size} exited with code {procs[dead[0]].exitcode} and no result"
                ) from None
            continue
        reported.add(rank)
        try:
            value = pickle.loads(value)
        except Exception as e:  # an error that pickles but does not rebuild
            value = RuntimeError(f"rank {rank} failed; its error could not be rebuilt here ({e})")
        if not ok and give_up is None:
            give_up = time.monotonic() + 10.0
        if rank == 0 or not ok:
            outcome = outcome if (outcome is not None and not outcome[0]) else (ok, value)
    for p in procs:
        if give_up is not None and p.is_alive():
            p.join(timeout=1.0)
            if p.is_alive():
                p.kill()
    for p in procs:
        p.join()
    if os.path.exists(rendezvous):
        os.unlink(rendezvous)
    assert outcome is not None  # rank 0 reported, or a rank that failed did
    ok, value = outcome
    if not ok:
        raise value if isinstance(value, BaseException) else RuntimeError(value)
    return value


def start_ranks(
    ranks,
    size: int,
    fn: Callable[..., Any],
    args: tuple,
    device: str = "cpu",
    quiet_others: bool = True,
    rendezvous: str | None = None,
) -> tuple[list, Any, str]:
    """Start processes for `ranks` of a group of `size` that meet at `rendezvous` (a new
    FileStore path by default: no port to race for), each running fn(*args) with an
    equal share of this machine's cores; returns them, the queue their results come
    on, and the rendezvous."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    rendezvous = rendezvous or tempfile.mktemp(prefix="refusion-rendezvous-")
    threads = max(1, torch.get_num_threads() // size)
    procs = [
        ctx.Process(
            target=_child,
            args=(rank, size, rendezvous, backend_for(device), threads, quiet_others, results, fn, args),
            daemon=False,
        )
        for rank in ranks
    ]
    for p in procs:
        p.start()
    return procs, results, rendezvous


def _child(rank, world, rendezvous, backend, threads, quiet, results, fn, args) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(threads)
    real_stderr = sys.stderr
    if quiet and rank != 0:  # rank 0 reports (another replica's notes would repeat its own)
        sys.stdout = sys.stderr = open(os.devnull, "w")
    try:
        own_device(backend, rank)
        dist.init_process_group(
            backend, init_method=f"file://{rendezvous}", rank=rank, world_size=world, timeout=WAIT
        )
        value = fn(*args)
        # plain pickle, by value: torch's queue would share tensors through this process's
        # file descriptors, gone once it exits
        results.put((rank, True, pickle.dumps(value if rank == 0 else None)))
    except BaseException as e:  # reported to the parent, which raises it
        from ..errors import ReFusionError

        if not isinstance(e, (ReFusionError, KeyboardInterrupt)):
            print(f"rank {rank}:", file=real_stderr)
            traceback.print_exc(file=real_stderr)
        try:
            results.put((rank, False, pickle.dumps(e)))
        except Exception:  # an unpicklable error: its text
            results.put((rank, False, pickle.dumps(f"{type(e).__name__}: {e}")))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
