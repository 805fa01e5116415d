"""Interactive verbs on a split model: rank 0 schedules, the other ranks follow.

`chat` and `serve` take their requests from a terminal or a socket, which only the
process that owns them sees. That process is rank 0 of the tensor-parallel group: its
engine's `Followers` send what it was asked since the last step (prepared requests
added, aborts) to the other ranks with each step, and they apply the same to their engines,
then step with it. The engines therefore stay identical, and every forward's
all-reduces meet.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from ..parallel.launch import WAIT, backend_for, launched, own_device, start_ranks

STOP = "stop"


class Followers:
    """Rank 0's link to the other ranks of its tensor-parallel group: what its engine was
    asked since the last step (prepared requests added, aborts) goes to them with each
    step (`Engine.followers`)."""

    def __init__(self) -> None:
        self._ops: list[tuple] = []

    def add(self, prepared: Any, request_id: str, trace: bool | str, stream: bool) -> None:
        self._ops.append(("add", prepared, request_id))

    def abort(self, request_id: str) -> None:
        self._ops.append(("abort", request_id))

    def abort_running(self) -> None:
        self._ops.append(("abort_running",))

    def step(self) -> None:
        """Send what was asked since the last step; the ranks apply it, then step too."""
        ops, self._ops = self._ops, []
        dist.broadcast_object_list([ops], src=0)


_stopped = [False]


def _stop_followers() -> None:
    if not _stopped[0]:
        _stopped[0] = True
        dist.broadcast_object_list([STOP], src=0)


def engine_for(model: Any, tokenizer: Any, config: Any = None):
    """The engine a verb drives; on rank 0 of a split model, one that leads its followers."""
    from .engine import Engine

    engine = Engine(model, tokenizer, config)
    if getattr(model, "tensor_parallel", None) is not None and launched() and dist.get_rank() == 0:
        engine.followers = Followers()
    return engine


def follow(args: Any, make_engine: Callable[[Any], Any]) -> int:
    """A following rank: an engine like rank 0's (`make_engine(args)`, a function that
    can be pickled: it loads this rank's share of the model), doing what rank 0 sends
    with each step, until it says stop."""
    engine = make_engine(args)
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        if box[0] == STOP:
            return 0
        for op in box[0]:
            _apply(engine, op)
        try:
            engine.step()
        except Exception:  # rank 0 failed the same step; its abort_running comes next
            continue


def _apply(engine: Any, op: tuple) -> None:
    kind = op[0]
    if kind == "add":
        _, prepared, rid = op
        engine.add_request(prepared, request_id=rid, stream=False)
    elif kind == "abort":
        engine.abort(op[1])
    elif kind == "abort_running":
        engine.abort_running()


def lead(size: int, args: Any, make_engine: Callable[[Any], Any], device: str = "cpu") -> list:
    """Make this process rank 0 of `size` and start ranks 1.. as followers of `args`'s
    verb (each builds its engine with `make_engine(args)`); returns their processes (join
    them after the verb's engine is closed)."""
    import torch

    procs, _, rendezvous = start_ranks(range(1, size), size, follow, (args, make_engine), device)
    torch.set_num_threads(max(1, torch.get_num_threads() // size))
    backend = backend_for(device)
    os.environ.update(RANK="0", WORLD_SIZE=str(size), LOCAL_RANK="0")
    own_device(backend, 0)
    dist.init_process_group(
        backend, init_method=f"file://{rendezvous}", rank=0, world_size=size, timeout=WAIT
    )
    return procs


def release(procs: list) -> None:
    """Tell the following ranks to stop, wait for them, and leave the group."""
    try:
        _stop_followers()
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
        dist.destroy_process_group()
