"""One training run's parts, put together: the accelerator, the model, optimizer and
schedule (`setup`), the data (`RunData`), one optimizer step (`train_step`), the
held-out evaluation (`evaluate`), checkpoints (`Checkpoints`) and the records (`RunLog`)."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError
from ..settings.recommended import recommended_of
from ..settings.train import TrainConfig
from .checkpoints import Checkpoints, drop_tied_copies, list_checkpoints, resume_changes
from .data import RunData
from .engine import configure_deepspeed, make_accelerator
from .lock import OutLock
from .log import RunLog
from .objective import weighted_loss
from .setup import (
    LossModel,
    apply_lora,
    apply_settings,
    has_accelerator,
    load_model_and_tokenizer,
    lr_factor,
    make_optimizer,
    precision,
    step_generator,
    step_inputs,
)

_EVAL_KEY = 2**31 - 1  # seeds the eval draws, apart from every training step


class Run:
    """State of one training run: the prepared objects and the loop's counters."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.out = Path(cfg.out)
        gpu = has_accelerator()
        # on the engine the launch config names (DDP, FSDP, DeepSpeed), on the CPU too
        self.acc = make_accelerator(
            cfg.cpu or not gpu,
            gpu,
            mixed_precision=precision(cfg),
            gradient_accumulation_steps=cfg.grad_accum,
        )
        self.main = self.acc.is_main_process
        self.rank, self.world = self.acc.process_index, self.acc.num_processes
        self.obj_cfg = cfg.objective_config()
        self.log = RunLog(self.out, self.main)
        self.lock = OutLock(self.out)  # taken by the main process only, in setup
        self.step = 0
        self.samples = 0  # global stream position: examples consumed by all processes

    # ---- set-up
    def setup(self) -> None:
        cfg, acc = self.cfg, self.acc
        self._lock_out()
        if list_checkpoints(self.out) and not cfg.resume:
            raise ConfigError(
                f"{self.out} holds checkpoints of an earlier run: "
                "pass --resume to continue it, or choose another --out"
            )
        changes = resume_changes(self.out, cfg, self.log)  # refused here, before anything is loaded
        self.lm, tokenizer = load_model_and_tokenizer(cfg)
        self.mask_id = self.lm.config.mask_token_id
        eos = tokenizer.eos_token_id
        if eos is None and self.lm.config.eos_ids:
            eos = self.lm.config.eos_ids[0]
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos or 0)
        self.data = RunData(cfg, tokenizer, self.lm.config, eos, pad_id, self.log)
        self.lm.gradient_checkpointing = cfg.gradient_checkpointing
        if cfg.lora:
            apply_lora(self.lm, cfg)
        per_step = cfg.batch_size * cfg.grad_accum * self.world
        self.total_steps = cfg.max_steps or max(1, math.ceil(cfg.epochs * len(self.data.train) / per_step))
        warmup = (
            cfg.warmup_steps if cfg.warmup_steps is not None else int(cfg.warmup_ratio * self.total_steps)
        )
        self.warmup = max(1, warmup)
        self._prepare_model()
        self.data.start_stream()
        self.checkpoints = Checkpoints(
            acc, self.out, cfg, tokenizer, self.lm.config, self.log, recommended_of(self.lm)
        )
        restored = self.checkpoints.prepare()
        if restored is not None:
            self.step, self.samples = restored
            if changes:
                apply_settings(self.scheduler, cfg)
                # accelerate syncs gradients when its micro-batch count is a multiple of
                # grad_accum: count as if the run had always used the new one
                acc.step = self.step * cfg.grad_accum
        self.log.open_tensorboard(cfg.tensorboard)

    def _lock_out(self) -> None:
        """Refuse to write OUT while another trainer writes it. Only the main process takes
        the lock (the other ranks of this run write there in step with it); every process
        learns the answer, so that all of them stop together."""
        from accelerate.utils import broadcast_object_list

        problem = None
        if self.main:
            try:
                holder = self.lock.acquire()
            except OSError as e:
                problem = f"cannot write {self.out} ({e}): choose another --out"
            else:
                if holder is not None:
                    problem = (
                        f"another trainer (pid {holder}) is writing {self.out}: wait for it to finish, "
                        "or choose another --out"
                    )
        problem = broadcast_object_list([problem])[0]
        if problem is not None:
            raise ConfigError(problem)

    def release(self) -> None:
        """Let another trainer write OUT (also done by the kernel when the process dies)."""
        self.lock.release()

    def _prepare_model(self) -> None:
        """The loss model and AdamW through accelerate; the LR schedule beside them."""
        cfg, acc = self.cfg, self.acc
        model = LossModel(self.lm)
        optimizer = make_optimizer(model, cfg)
        if acc.state.deepspeed_plugin is not None:
            configure_deepspeed(acc.state.deepspeed_plugin.deepspeed_config, cfg, self.world)
        self.model, self.optimizer = acc.prepare(model, optimizer)
        # Not prepared: accelerate would step it once per process. Saved with the state.
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            torch_optimizer(self.optimizer),
            lambda s: lr_factor(s, self.total_steps, self.warmup, cfg.min_lr_ratio),
        )
        acc.register_for_checkpointing(self.scheduler)
        acc.register_save_state_pre_hook(drop_tied_copies)

    # ---- one optimizer step
    def train_step(self, timed: bool) -> dict[str, Any]:
        cfg, acc = self.cfg, self.acc
        sums = torch.zeros(3, device=acc.device)  # total, ar, mdm (summed over micro-batches)
        tokens_seen = 0
        t_obj = 0.0
        t0 = _clock(timed, acc.device)
        for k in range(cfg.grad_accum):
            tokens, prompt_lens, lengths = self.data.micro_batch(self.samples, k, self.rank, self.world)
            tokens_seen += int(lengths.sum())
            t1 = time.perf_counter()
            gen = step_generator(cfg.seed, self.step, k, self.rank)
            ids, pos, targets = step_inputs(
                cfg.objective, tokens, prompt_lens, lengths, self.mask_id, self.obj_cfg, gen, acc.device
            )
            t_obj += time.perf_counter() - t1
            with acc.accumulate(self.model):
                logits = self.model(ids, pos, targets.flat_index)
                parts = weighted_loss(logits, targets)
                acc.backward(parts.total)
                grad_norm = None
                if acc.sync_gradients and cfg.max_grad_norm > 0:
                    grad_norm = acc.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
            sums += torch.stack([parts.total.detach(), parts.ar.detach(), parts.mdm.detach()])
        self.scheduler.step()
        self.samples += cfg.grad_accum * cfg.batch_size * self.world
        self.step += 1
        t_step = _clock(timed, acc.device) - t0
        return {
            "sums": sums / cfg.grad_accum,
            "tokens": tokens_seen,
            "grad_norm": grad_norm,
            "t_obj": t_obj,
            "t_step": t_step,
        }

    # ---- evaluation
    @torch.no_grad()
    def evaluate(self) -> dict[str, float] | None:
        """The held-out losses, averaged over examples across every process."""
        if self.data.eval is None:
            return None
        cfg, acc = self.cfg, self.acc
        self.model.eval()
        sums = torch.zeros(4, device=acc.device)  # total, ar, mdm weighted by examples; examples
        for i, count, (tokens, prompt_lens, lengths) in self.data.eval_batches(self.rank, self.world):
            gen = step_generator(cfg.seed, _EVAL_KEY, i)  # the same draws at every evaluation
            ids, pos, targets = step_inputs(
                cfg.objective, tokens, prompt_lens, lengths, self.mask_id, self.obj_cfg, gen, acc.device
            )
            parts = weighted_loss(self.model(ids, pos, targets.flat_index), targets)
            one = torch.ones((), device=acc.device)
            sums += torch.stack([parts.total, parts.ar, parts.mdm, one]) * count
        self.model.train()
        sums = acc.reduce(sums, reduction="sum")
        total = float(sums[3].clamp(min=1))
        names = ("eval_loss", "eval_ar_loss", "eval_mdm_loss")
        return {name: float(sums[i]) / total for i, name in enumerate(names)}

    def log_eval(self) -> None:
        metrics = self.evaluate()
        if metrics is not None:
            self.log.log({"step": self.step, **metrics})
            self.log.print(f"step {self.step}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))

    def save_checkpoint(self) -> Path:
        return self.checkpoints.save(self.model, self.step, self.samples)


def torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's wrapper (and DeepSpeed's ZeRO optimizer, one
    level further in): the LR schedule must act on the param_groups the update reads."""
    while not isinstance(optimizer, torch.optim.Optimizer) and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


def _clock(sync: bool, device: torch.device) -> float:
    if sync and device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
