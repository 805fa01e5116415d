"""The replicas together: started together (each with its share of the cores, or GPUs of
its own), ready together; which one takes a request (the least loaded); the front's watch
over them (started again when they exit); and their drain and stop."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import httpx

from ...errors import ConfigError, ReFusionError
from .metrics import FrontMetrics
from .process import MAX_FAILED_STARTS, Replica

log = logging.getLogger("refusion.serve")


class ReplicaPool:
    """The replica processes: started together, ready together, stopped together."""

    def __init__(self, replicas: list[Replica], root: str, api_key: str | None = None) -> None:
        self.all, self.root, self.api_key = replicas, root, api_key
        self.metrics = FrontMetrics()
        self.closing = False
        self.all_gone = False  # every replica exited before the front was asked to stop
        for r in replicas:
            self.metrics.dispatched.inc(0, str(r.index))
            self.metrics.restarts.inc(0, str(r.index))

    def pick(self) -> Replica | None:
        """The ready replica with the fewest requests in flight (the lowest index on a tie)."""
        live = [r for r in self.all if r.alive and r.ready]
        return min(live, key=lambda r: r.in_flight) if live else None

    @property
    def drained(self) -> bool:
        """Every replica has exited (after the first signal: its drain is over)."""
        return not any(r.alive for r in self.all)

    async def tend(self) -> None:
        """One round of the front's watch: note replicas that exited (and when each
        starts again), start those whose wait is over, and mark started ones ready once
        their /health answers 200."""
        for r in self.all:
            if self.closing:
                return
            if r.alive:
                if not r.ready and await r.answers_health():
                    r.mark_ready()
                    if r.restarts:
                        log.warning("replica %d is back (started %d time(s) again)", r.index, r.restarts)
            elif r.left:
                continue
            elif r.restart_at is None:
                self._note_exit(r)
            elif time.monotonic() >= r.restart_at:
                await r.client.aclose()
                r.restart_at = None
                r.restarts += 1
                self.metrics.restarts.inc(1, str(r.index))
                r.start()

    def _note_exit(self, r: Replica) -> None:
        code = r.proc.returncode
        delay = r.exited()
        if delay is None:
            log.error(
                "replica %d exited (code %s) %d times in a row before it was ready: not started again",
                r.index,
                code,
                MAX_FAILED_STARTS,
            )
        else:
            log.warning("replica %d exited (code %s): starting it again in %.0f s", r.index, code, delay)

    @property
    def all_left(self) -> bool:
        """No replica is running or due to start again."""
        return all(r.left for r in self.all)

    def wait_ready(self, poll: float = 0.2) -> None:
        """Block until every replica answers /health with 200; a replica that exits first
        ends the wait with its exit code."""
        waiting = list(self.all)
        while waiting:
            for r in list(waiting):
                if not r.alive:
                    raise ReFusionError(
                        f"replica {r.index} exited with code {r.proc.returncode} before it was ready "
                        "(its error is above)"
                    )
                try:
                    with httpx.Client(transport=httpx.HTTPTransport(uds=r.socket), timeout=2.0) as c:
                        if c.get("http://replica/health").status_code == 200:
                            waiting.remove(r)
                            r.mark_ready()
                except httpx.HTTPError:
                    pass
            if waiting:
                time.sleep(poll)

    def terminate(self, _timeout: float | None = None) -> None:
        """The first signal: every replica begins its drain (once)."""
        if not self.closing:
            self.closing = True
            for r in self.all:
                r.signal(signal.SIGUSR1)

    def exit_now(self, sig: int) -> None:
        """A second signal: passed on, so the replicas (and their ranks) exit at once too."""
        for r in self.all:
            r.signal(sig, group=True)
        shutil.rmtree(self.root, ignore_errors=True)

    def stop(self, wait: float = 10.0) -> None:
        """Terminate the replicas, give them `wait` seconds to drain and exit, kill what is
        left, and remove their sockets' directory."""
        self.terminate()
        deadline = time.monotonic() + wait
        for r in self.all:
            try:
                r.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("replica %d did not exit in time: killed", r.index)
                r.signal(signal.SIGKILL, group=True)
                r.proc.wait()
        shutil.rmtree(self.root, ignore_errors=True)

    async def aclose(self) -> None:
        for r in self.all:
            await r.client.aclose()


def start_replicas(
    argv: list[str], size: int, tensor_parallel_size: int = 1, device: str = "cpu", api_key: str | None = None
) -> ReplicaPool:
    """Start `size` replicas of the `refusion serve` that `argv` (its arguments after
    `refusion`) describes, each on a socket of its own, with this machine's cores (or
    GPUs, `tensor_parallel_size` each) shared between them."""
    import torch

    gpus = _gpus_per_replica(device, size, tensor_parallel_size)
    root = tempfile.mkdtemp(prefix="refusion-replicas-")  # 0700: only this user reaches the sockets
    threads = max(1, torch.get_num_threads() // size)
    replicas = []
    for i in range(size):
        path = os.path.join(root, f"{i}.sock")
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[i])
        cmd = [
            sys.executable,
            "-m",
            "refusion.cli",
            *argv,
            "--data-parallel-size",
            "1",
            "--replica-socket",
            path,
        ]
        replicas.append(Replica(i, path, cmd, env))
    return ReplicaPool(replicas, root, api_key)


def _gpus_per_replica(device: str, size: int, tensor_parallel_size: int) -> list[list[str]] | None:
    """Each replica's GPUs (CUDA_VISIBLE_DEVICES), consecutive ones; None on the CPU."""
    if not str(device).startswith("cuda"):
        return None
    import torch

    if str(device) != "cuda":
        raise ConfigError(
            f"--device {device} names one GPU; with --data-parallel-size give --device cuda "
            "(each replica takes GPUs of its own)"
        )
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = (
        [x for x in visible.split(",") if x.strip()]
        if visible
        else [str(i) for i in range(torch.cuda.device_count())]
    )
    need = size * tensor_parallel_size
    if len(ids) < need:
        raise ConfigError(
            f"--data-parallel-size {size} x --tensor-parallel-size {tensor_parallel_size} needs {need} GPUs; "
            f"this machine shows {len(ids)}"
        )
    return [ids[i * tensor_parallel_size : (i + 1) * tensor_parallel_size] for i in range(size)]
