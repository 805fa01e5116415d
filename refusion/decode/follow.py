"""Interactive verbs on a split model: rank 0 schedules, the other ranks follow.

`chat` and `serve` take their requests from a terminal or a socket, which only the
process that owns them sees. That process is rank 0 of the tensor-parallel group: its
engine (`LeaderEngine`) sends what it was asked since the last step (requests added,
aborted) to the other ranks with each step, and they apply the same to their engines,
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


class LeaderEngine:
    """An Engine whose every request and abort reaches the following ranks at its next
    step; everything else is the engine's own."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._ops: list[tuple] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def add_request(self, prompt, cfg=None, *, request_id=None, **options) -> str:
        rid = self.engine.add_request(prompt, cfg, request_id=request_id, **options)
        chat = options.get("chat", True)
        self._ops.append(("add", prompt, cfg, rid, chat))
        return rid

    def abort(self, request_id: str) -> bool:
        self._ops.append(("abort", request_id))
        return self.engine.abort(request_id)

    def abort_running(self) -> list[str]:
        self._ops.append(("abort_running",))
        return self.engine.abort_running()

    def step(self):
        ops, self._ops = self._ops, []
        dist.broadcast_object_list([ops], src=0)
        return self.engine.step()

    def close(self) -> None:
        """Let the following ranks go: they leave their loop and exit."""
        _stop_followers()


_stopped = [False]


def _stop_followers() -> None:
    if not _stopped[0]:
        _stopped[0] = True
        dist.broadcast_object_list([STOP], src=0)


def engine_for(model: Any, tokenizer: Any, config: Any = None):
    """The engine a verb drives: an Engine, or on rank 0 of a split model its leader."""
    from .engine import Engine

    engine = Engine(model, tokenizer, config)
    if getattr(model, "tensor_parallel", None) is not None and launched() and dist.get_rank() == 0:
        return LeaderEngine(engine)
    return engine


def follow(args: Any, make_engine: Callable[[Any], Any]) -> int:
    """A following rank: an engine like rank 0's (`make_engine(args)`, a function that
    can be pickled: it loads this rank's share of the model), doing what rank 0 sends
    with each step, until it says stop."""
    engine = make_engine(args)
    while True:
        box = [None]
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
        _, prompt, cfg, rid, chat = op
        engine.add_request(prompt, cfg, request_id=rid, chat=chat, stream=False)
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
