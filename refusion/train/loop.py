"""`train(TrainConfig(...))`: the training loop over a `Run` (see the package docstring)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..model.transformer import Transformer
from ..settings.train import TrainConfig
from .checkpoints import jsonable, list_checkpoints
from .run import Run


@dataclass
class TrainResult:
    step: int  # optimizer steps done
    out_dir: Path
    history: list[dict[str, Any]] = field(default_factory=list)  # the log records
    model: Transformer | None = None  # this process's trained model (LoRA not merged)


def train(cfg: TrainConfig, on_step: Callable[[int], None] | None = None) -> TrainResult:
    """Run a training job as configured; returns when `total_steps` optimizer steps are done.

    `on_step(step)` is called on every process after each optimizer step (tests use it)."""
    with torch.enable_grad():  # also when called from a no_grad context
        return _train(cfg, on_step)


def _train(cfg: TrainConfig, on_step: Callable[[int], None] | None) -> TrainResult:
    cfg.validate()
    from accelerate.utils import set_seed

    run = Run(cfg)
    try:
        set_seed(cfg.seed)
        run.setup()
        return _loop(run, on_step)
    except BaseException:
        _leave_process_group()
        raise
    finally:
        run.release()  # OUT is free for the next trainer, also when this one failed


def _leave_process_group() -> None:
    """A failed rank leaves its process group before the error propagates: a process that
    exits with gloo's threads still running aborts ("terminate called without an active
    exception", SIGABRT) instead of reporting its error."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _loop(run: Run, on_step: Callable[[int], None] | None) -> TrainResult:
    cfg = run.cfg
    start_step = last_saved = run.step
    if run.main:
        run.log.log(
            {
                "event": "start",
                "step": run.step,
                "total_steps": run.total_steps,
                "world_size": run.world,
                "train_examples": len(run.data.train),
                "eval_examples": len(run.data.eval or []),
                "parameters": run.lm.num_parameters(),
                **run.data.summary,
                "config": jsonable(cfg),
            }
        )
    bar = _progress(cfg, run, start_step)
    t_start = time.perf_counter()
    window = _Window(run.acc.device)
    run.model.train()
    while run.step < run.total_steps:
        # on a GPU, time (and synchronise) only the steps that are logged
        timed = run.acc.device.type != "cuda" or (run.step + 1) % cfg.log_every == 0
        out = run.train_step(timed)
        window.add(out, timed)
        if bar is not None:
            bar.update(1)
        if run.step % cfg.log_every == 0 or run.step == run.total_steps:
            record = window.record(run, out, t_start, start_step)
            run.log.log(record)
            if bar is not None:
                bar.set_postfix(
                    loss=f"{record['loss']:.3f}",
                    ar=f"{record['ar_loss']:.3f}",
                    mdm=f"{record['mdm_loss']:.3f}",
                    tok_s=f"{record['tokens_per_s']:.0f}",
                )
            window = _Window(run.acc.device)
        t_pause = time.perf_counter()
        if cfg.eval_every and run.step % cfg.eval_every == 0 and run.step < run.total_steps:
            run.log_eval()
        if cfg.save_every and run.step % cfg.save_every == 0 and run.step < run.total_steps:
            run.save_checkpoint()
            last_saved = run.step
        window.paused += time.perf_counter() - t_pause
        if on_step is not None:
            on_step(run.step)
    if bar is not None:
        bar.close()
    run.log_eval()
    if run.step != last_saved or not list_checkpoints(run.out):
        run.save_checkpoint()
    run.checkpoints.save_final(run.model)
    run.log.close()
    if run.main:
        run.log.log({"event": "end", "step": run.step, "elapsed_s": round(time.perf_counter() - t_start, 3)})
    run.acc.wait_for_everyone()
    return TrainResult(run.step, run.out, run.log.history, run.lm)


def _progress(cfg: TrainConfig, run: Run, start: int):
    if not (cfg.progress and run.main):
        return None
    from tqdm.auto import tqdm

    return tqdm(
        total=run.total_steps, initial=start, desc=f"train ({cfg.objective})", unit="step", dynamic_ncols=True
    )


class _Window:
    """What happened since the last log record."""

    def __init__(self, device: torch.device) -> None:
        self.sums = torch.zeros(3, device=device)  # loss, AR part, MDM part, summed over steps
        self.tokens = self.steps = 0
        self.t_obj = self.t_timed = 0.0  # transform time and step time over the timed steps
        self.paused = 0.0  # eval and checkpoint time, not training
        self.t0 = time.perf_counter()

    def add(self, out: dict[str, Any], timed: bool) -> None:
        self.sums += out["sums"]
        self.tokens += out["tokens"]
        self.steps += 1
        if timed:
            self.t_obj += out["t_obj"]
            self.t_timed += out["t_step"]

    def record(self, run: Run, out: dict[str, Any], t_start: float, start_step: int) -> dict[str, Any]:
        acc = run.acc
        sums = acc.reduce(self.sums / max(1, self.steps), reduction="mean")
        tokens = int(acc.reduce(torch.tensor(self.tokens, device=acc.device), reduction="sum"))
        now = time.perf_counter()
        per_step = (now - t_start) / max(1, run.step - start_step)
        grad_norm = out["grad_norm"]
        return {
            "step": run.step,
            "loss": float(sums[0]),
            "ar_loss": float(sums[1]),
            "mdm_loss": float(sums[2]),
            "lr": run.scheduler.get_last_lr()[0],
            "grad_norm": float(grad_norm) if grad_norm is not None else None,
            "tokens_per_s": tokens / max(1e-9, now - self.t0 - self.paused),  # all processes
            # CPU time building the objective's batch / wall time of the step
            "objective_share": self.t_obj / self.t_timed if self.t_timed > 0 else None,
            "samples": run.samples,
            "epoch": run.samples / len(run.data.train),
            "elapsed_s": round(now - t_start, 3),
            "eta_s": round(per_step * (run.total_steps - run.step), 1),
        }
