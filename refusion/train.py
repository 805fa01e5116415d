"""The training loop, on `accelerate`: one CPU, one GPU, or many GPUs (DDP, FSDP, DeepSpeed)
with the same code. `train(TrainConfig(...))` is the entry point; `refusion train` is a
thin wrapper over it.

A step: take the next window of the seeded index stream (data.py), build the objective's
batch on the CPU (objective.py) and copy it to the device, run the model up to the logits
of the labelled tokens only, weight their cross-entropy, clip, step AdamW with warmup +
cosine, log.

The output directory:

    OUT/                  the final model: config.json, model.safetensors, tokenizer files
    OUT/log.jsonl         one JSON record per log step, eval and event
    OUT/tensorboard/      the same scalars, when tensorboard is installed
    OUT/checkpoints/step-00000500/
                          a normal model directory too, plus train_state/ (weights,
                          optimizer, scheduler, RNG states of every rank, via accelerate)
                          and trainer_state.json (step, data position, config)

Checkpoints are written to a temporary directory and renamed when complete, so a run
killed at any moment leaves either a whole checkpoint or none; `resume=True` continues
from the latest. Randomness that shapes a step (data order, objective draws) is a pure
function of (seed, step, rank), so a resumed run repeats the uninterrupted one bitwise on
the same machine and process count.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from .config import ModelConfig
from .data import IndexStream, TokenizedDataset, collate, load_dataset, split_eval
from .errors import ConfigError, MissingMaskTokenError
from .model import Transformer, rope_inv_freq
from .train_config import DTYPE_NAMES, LORA_TARGETS, TrainConfig, config_fields  # noqa: F401 (re-exported)
from .objective import LossTargets, ObjectiveConfig, TrainBatch, ar_batch, loss_targets, refusion_batch, weighted_loss

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}
_CKPT = re.compile(r"^step-(\d{8})$")
_EVAL_KEY = 2**31 - 1  # seeds the eval draws, apart from every training step


@dataclass
class TrainResult:
    step: int  # optimizer steps done
    out_dir: Path
    history: list[dict[str, Any]] = field(default_factory=list)  # the log records
    model: Transformer | None = None  # this process's trained model (LoRA not merged)


class LossModel(nn.Module):
    """What accelerate wraps: the language model run up to the logits of the labelled tokens
    only, so DDP / FSDP / DeepSpeed see one forward and the vocabulary projection is not
    paid for the prompt."""

    def __init__(self, lm: Transformer) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, flat_index: torch.Tensor) -> torch.Tensor:
        h = self.lm.hidden(input_ids, position_ids)  # (B, T, hidden)
        return self.lm.lm_head(h.flatten(0, 1)[flat_index])  # (N, vocab)


# ------------------------------------------------------------------------------ set-up
def load_model_and_tokenizer(cfg: TrainConfig) -> tuple[Transformer, Any]:
    """The base model (or a random one from init_config) and its tokenizer, MASK checked."""
    dtype = DTYPES[cfg.dtype]
    if cfg.init_config is not None:
        from transformers import AutoTokenizer

        from .prompts import mask_id_of

        config = ModelConfig.from_json(cfg.init_config)
        tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer)
        if config.vocab_size < len(tokenizer):
            raise ConfigError(f"vocab_size {config.vocab_size} < the tokenizer's {len(tokenizer)} tokens")
        config.mask_token_id = mask_id_of(config, tokenizer)
        if config.eos_token_id is None:
            config.eos_token_id = tokenizer.eos_token_id
        torch.manual_seed(cfg.seed)
        model = init_weights(Transformer(config), float(config.extra.get("initializer_range", 0.02)))
        model = model.to(dtype)
    else:
        from .checkpoint import load

        model, tokenizer = load(cfg.model, device="cpu", dtype=dtype)
        if cfg.tokenizer is not None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer)
    if cfg.objective == "refusion" and model.config.mask_token_id is None:
        if not cfg.add_mask_token:
            raise MissingMaskTokenError(
                f"{cfg.model or cfg.init_config} has no MASK token (<|mask|>), which the refusion objective "
                "needs: run `refusion convert` on it first, or pass --add-mask-token to add it here"
            )
        from .checkpoint import add_mask_token

        add_mask_token(model, tokenizer)
    return model, tokenizer


@torch.no_grad()
def init_weights(model: Transformer, std: float = 0.02) -> Transformer:
    """Random initialisation for training from scratch: N(0, std) matrices and embeddings,
    zero biases, unit norms."""
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.normal_(0.0, std)
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
    return model


def apply_lora(model: Transformer, cfg: TrainConfig) -> Transformer:
    """Inject LoRA adapters; everything else is frozen."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError:
        raise ConfigError("lora=True needs peft: pip install 'refusion[train]'") from None
    lc = LoraConfig(
        r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout, target_modules=list(cfg.lora_targets)
    )
    return inject_adapter_in_model(lc, model)


def merged_state_dict(state: dict[str, torch.Tensor], cfg: TrainConfig, prefix: str = "lm.") -> dict[str, torch.Tensor]:
    """Hugging Face names and plain weights from the wrapped model's state dict, with LoRA
    adapters folded in: W + (alpha / r) * B @ A."""
    state = {k[len(prefix) :] if k.startswith(prefix) else k: v for k, v in state.items()}
    out = {}
    scale = cfg.lora_alpha / cfg.lora_r
    for name, value in state.items():
        if ".lora_A." in name or ".lora_B." in name:
            continue
        if ".base_layer." in name:
            module, leaf = name.split(".base_layer.")
            if leaf == "weight" and f"{module}.lora_A.default.weight" in state:
                a = state[f"{module}.lora_A.default.weight"].float()
                b = state[f"{module}.lora_B.default.weight"].float()
                value = (value.float() + scale * (b @ a)).to(value.dtype)
            name = f"{module}.{leaf}"
        out[name] = value
    return out


def clean_model(config: ModelConfig, state: dict[str, torch.Tensor]) -> Transformer:
    """A plain `Transformer` holding `state` (no copy), for saving."""
    with torch.device("meta"):
        model = Transformer(config)
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(config)
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise RuntimeError(f"state dict lacks {missing[:3]}")
    return model


def lr_factor(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine down to min_ratio at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)


def make_batch(
    objective: str,
    tokens: torch.Tensor,
    prompt_lens: torch.Tensor,
    lengths: torch.Tensor,
    mask_id: int | None,
    obj_cfg: ObjectiveConfig,
    generator: torch.Generator | None,
) -> TrainBatch:
    if objective == "ar":
        return ar_batch(tokens, prompt_lens, lengths)
    return refusion_batch(tokens, prompt_lens, lengths, mask_id, obj_cfg, generator)


def step_inputs(
    objective: str,
    tokens: torch.Tensor,  # (B, T) on the CPU, as collate returns them
    prompt_lens: torch.Tensor,
    lengths: torch.Tensor,
    mask_id: int | None,
    obj_cfg: ObjectiveConfig,
    generator: torch.Generator | None,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, LossTargets]:
    """(input_ids, position_ids, loss targets) on `device` for one micro-batch.

    Built on the CPU and copied asynchronously from pinned memory: the transform has
    data-dependent shapes (nonzero), which on a GPU would stall the queue every step; on
    the CPU it runs while the GPU still works on the previous step."""
    batch = make_batch(objective, tokens, prompt_lens, lengths, mask_id, obj_cfg, generator)
    targets = loss_targets(batch, obj_cfg.ar_reduction)
    if device.type != "cuda":
        return batch.input_ids.to(device), batch.position_ids.to(device), targets.to(device)
    ids, pos = (x.pin_memory().to(device, non_blocking=True) for x in (batch.input_ids, batch.position_ids))
    pinned = LossTargets(**{k: v.pin_memory() for k, v in vars(targets).items()})
    return ids, pos, pinned.to(device, non_blocking=True)


def step_generator(seed: int, *key: int) -> torch.Generator:
    """A CPU generator seeded from (seed, *key): the objective's draws of one micro-batch."""
    state = np.random.SeedSequence([seed, *key]).generate_state(2, np.uint64)
    return torch.Generator().manual_seed(int(state[0] >> np.uint64(1)))


# ------------------------------------------------------------------------------ checkpoints
def list_checkpoints(out: Path) -> list[Path]:
    """Complete checkpoints, oldest first (temporary directories of a killed save are ignored)."""
    root = out / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _CKPT.match(p.name) and (p / "trainer_state.json").is_file()]
    return sorted(found, key=lambda p: int(_CKPT.match(p.name).group(1)))


def _has_accelerator() -> bool:
    accel = getattr(torch, "accelerator", None)  # torch >= 2.6
    return accel.is_available() if accel is not None else torch.cuda.is_available()


def _precision(cfg: TrainConfig) -> str:
    if cfg.precision != "auto":
        return cfg.precision
    gpu = torch.cuda.is_available() and not cfg.cpu
    return "bf16" if gpu and torch.cuda.is_bf16_supported() else "no"


# ------------------------------------------------------------------------------ the run
class _Run:
    """State of one training run: the prepared objects and the loop's counters."""

    def __init__(self, cfg: TrainConfig) -> None:
        from accelerate import Accelerator

        self.cfg = cfg
        self.out = Path(cfg.out)
        # cpu=True also when no accelerator exists: that is what makes accelerate join a
        # torchrun / accelerate-launch process group on the CPU (gloo) instead of ignoring it.
        cpu = cfg.cpu or not _has_accelerator()
        self.acc = Accelerator(cpu=cpu, mixed_precision=_precision(cfg), gradient_accumulation_steps=cfg.grad_accum)
        self.main = self.acc.is_main_process
        self.rank, self.world = self.acc.process_index, self.acc.num_processes
        self.obj_cfg = cfg.objective_config()
        self.history: list[dict[str, Any]] = []
        self.step = 0
        self.samples = 0  # global stream position: examples consumed by all processes

    # ---- set-up
    def setup(self) -> None:
        cfg, acc = self.cfg, self.acc
        if list_checkpoints(self.out) and not cfg.resume:
            raise ConfigError(
                f"{self.out} holds checkpoints of an earlier run: pass --resume to continue it, or choose another --out"
            )
        self.lm, self.tokenizer = load_model_and_tokenizer(cfg)
        self.model_config = self.lm.config
        self.mask_id = self.model_config.mask_token_id
        eos = self.tokenizer.eos_token_id
        if eos is None and self.model_config.eos_ids:
            eos = self.model_config.eos_ids[0]
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else (eos or 0)
        self.train_ds, self.eval_ds = self._load_data(eos)
        self.lm.gradient_checkpointing = cfg.gradient_checkpointing
        if cfg.lora:
            apply_lora(self.lm, cfg)
        per_step = cfg.batch_size * cfg.grad_accum * self.world
        self.total_steps = cfg.max_steps or max(1, math.ceil(cfg.epochs * len(self.train_ds) / per_step))
        warmup = cfg.warmup_steps if cfg.warmup_steps is not None else int(cfg.warmup_ratio * self.total_steps)
        self.warmup = max(1, warmup)
        model = LossModel(self.lm)
        optimizer = make_optimizer(model, cfg)
        ds = acc.state.deepspeed_plugin
        if ds is not None:  # we batch ourselves: tell DeepSpeed what a step is
            ds.deepspeed_config["train_micro_batch_size_per_gpu"] = cfg.batch_size
            ds.deepspeed_config["gradient_accumulation_steps"] = cfg.grad_accum
        self.model, self.optimizer = acc.prepare(model, optimizer)
        # Not prepared: accelerate would step it once per process. Saved with the state.
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer.optimizer if hasattr(self.optimizer, "optimizer") else self.optimizer,
            lambda s: lr_factor(s, self.total_steps, self.warmup, cfg.min_lr_ratio),
        )
        acc.register_for_checkpointing(self.scheduler)
        self.stream = IndexStream(len(self.train_ds), cfg.seed)
        self._prepare_out()
        self.writer = self._tensorboard()

    def _load_data(self, eos: int | None) -> tuple[TokenizedDataset, TokenizedDataset | None]:
        cfg = self.cfg
        max_length = min(cfg.max_length, self.model_config.max_position_embeddings)
        if max_length < cfg.max_length:
            self.print(f"max_length {cfg.max_length} capped at the model's context, {max_length}")
        ds, stats = load_dataset(cfg.data, self.tokenizer, max_length, eos)
        self.print(stats.summary())
        self.data_summary = {"data": stats.summary()}
        if cfg.eval_data:
            eval_ds, eval_stats = load_dataset(cfg.eval_data, self.tokenizer, max_length, eos)
            self.print(eval_stats.summary())
            return ds, eval_ds
        return split_eval(ds, cfg.eval_fraction, cfg.eval_max_examples, cfg.seed)

    def _prepare_out(self) -> None:
        ckpts = list_checkpoints(self.out)
        if self.main:
            (self.out / "checkpoints").mkdir(parents=True, exist_ok=True)
        self.acc.wait_for_everyone()
        if self.cfg.resume:
            if ckpts:
                self._load_checkpoint(ckpts[-1])
            else:
                self.print(f"resume: no checkpoint in {self.out / 'checkpoints'}, starting from step 0")

    def _tensorboard(self):
        if not (self.main and self.cfg.tensorboard):
            return None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            return None
        return SummaryWriter(str(self.out / "tensorboard"))

    def print(self, text: str) -> None:
        if self.main:
            print(text, file=sys.stderr, flush=True)

    # ---- one optimizer step
    def micro_batch(self, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Micro-batch k of this process: its share of the k-th global window of the stream."""
        B = self.cfg.batch_size
        start = self.samples + k * B * self.world + self.rank * B
        return collate(self.train_ds, self.stream.take(start, B), self.pad_id)

    def train_step(self, timed: bool) -> dict[str, float]:
        cfg, acc = self.cfg, self.acc
        sums = torch.zeros(3, device=acc.device)  # total, ar, mdm (summed over micro-batches)
        tokens_seen = 0
        t_obj = 0.0
        t0 = _clock(timed, acc.device)
        for k in range(cfg.grad_accum):
            tokens, prompt_lens, lengths = self.micro_batch(k)
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
        if self.eval_ds is None:
            return None
        cfg, acc = self.cfg, self.acc
        self.model.eval()
        sums = torch.zeros(4, device=acc.device)  # total, ar, mdm weighted by examples; examples
        n = len(self.eval_ds)
        n_batches = math.ceil(n / cfg.batch_size)
        # every process runs the same number of forwards (a collective under FSDP / DeepSpeed);
        # the padding batches repeat batch 0 and count for nothing
        for i in range(self.rank, math.ceil(n_batches / self.world) * self.world, self.world):
            start = (i if i < n_batches else 0) * cfg.batch_size
            idx = np.arange(start, min(n, start + cfg.batch_size))
            tokens, prompt_lens, lengths = collate(self.eval_ds, idx, self.pad_id)
            gen = step_generator(cfg.seed, _EVAL_KEY, i)  # the same draws at every evaluation
            ids, pos, targets = step_inputs(
                cfg.objective, tokens, prompt_lens, lengths, self.mask_id, self.obj_cfg, gen, acc.device
            )
            parts = weighted_loss(self.model(ids, pos, targets.flat_index), targets)
            one = torch.ones((), device=acc.device)
            sums += torch.stack([parts.total, parts.ar, parts.mdm, one]) * (len(idx) if i < n_batches else 0)
        self.model.train()
        sums = acc.reduce(sums, reduction="sum")
        count = float(sums[3].clamp(min=1))
        names = ("eval_loss", "eval_ar_loss", "eval_mdm_loss")
        return {name: float(sums[i]) / count for i, name in enumerate(names)}

    # ---- checkpoints and the final model
    def _hf_model(self) -> Transformer | None:
        """A plain Transformer with the trained (LoRA-merged) weights, on the main process."""
        state = self.acc.get_state_dict(self.model)  # a collective under FSDP / DeepSpeed
        if not self.main:
            return None
        return clean_model(self.model_config, merged_state_dict(state, self.cfg))

    def save_checkpoint(self) -> Path:
        from .checkpoint import save_pretrained

        root = self.out / "checkpoints"
        final = root / f"step-{self.step:08d}"
        tmp = root / f".tmp-step-{self.step:08d}"
        hf = self._hf_model()
        if self.main:
            shutil.rmtree(tmp, ignore_errors=True)
            save_pretrained(hf, self.tokenizer, tmp)
        self.acc.wait_for_everyone()
        self.acc.save_state(str(tmp / "train_state"))
        self.acc.wait_for_everyone()
        if self.main:
            state = {"step": self.step, "samples": self.samples, "world_size": self.world}
            (tmp / "trainer_state.json").write_text(json.dumps({**state, "config": _jsonable(self.cfg)}, indent=1))
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            self._prune()
        self.acc.wait_for_everyone()
        return final

    def _prune(self) -> None:
        keep = self.cfg.keep_checkpoints
        ckpts = list_checkpoints(self.out)
        for old in ckpts[: -keep] if keep else []:
            shutil.rmtree(old, ignore_errors=True)

    def _load_checkpoint(self, path: Path) -> None:
        state = json.loads((path / "trainer_state.json").read_text())
        self.acc.load_state(str(path / "train_state"))
        self.step, self.samples = int(state["step"]), int(state["samples"])
        if state.get("world_size") != self.world:
            self.print(f"resume: the checkpoint was written by {state.get('world_size')} processes, now {self.world}")
        self.print(f"resumed from {path} at step {self.step}")

    def save_final(self) -> None:
        """The final model into OUT itself, next to checkpoints/ and the logs: written whole
        into a temporary directory, then its files moved in, config.json last (a reader
        that finds config.json finds a complete model)."""
        from .checkpoint import save_pretrained

        hf = self._hf_model()
        if self.main:
            staging = self.out / ".final.partial"
            shutil.rmtree(staging, ignore_errors=True)
            save_pretrained(hf, self.tokenizer, staging)
            (self.out / "config.json").unlink(missing_ok=True)
            names = sorted(p.name for p in staging.iterdir())
            for name in [n for n in names if n != "config.json"] + ["config.json"]:
                os.replace(staging / name, self.out / name)
            staging.rmdir()
        self.acc.wait_for_everyone()

    # ---- logging
    def log(self, record: dict[str, Any]) -> None:
        record = {k: v for k, v in record.items() if v is not None}
        self.history.append(record)
        if not self.main:
            return
        with (self.out / "log.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self.writer.add_scalar(key, value, record.get("step", 0))


def _clock(sync: bool, device: torch.device) -> float:
    if sync and device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _jsonable(cfg: TrainConfig) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(cfg).items()}


def train(cfg: TrainConfig, on_step: Callable[[int], None] | None = None) -> TrainResult:
    """Run a training job as configured; returns when `total_steps` optimizer steps are done.

    `on_step(step)` is called on every process after each optimizer step (tests use it)."""
    with torch.enable_grad():  # also when called from a no_grad context
        return _train(cfg, on_step)


def _train(cfg: TrainConfig, on_step: Callable[[int], None] | None) -> TrainResult:
    cfg.validate()
    from accelerate.utils import set_seed

    run = _Run(cfg)
    set_seed(cfg.seed)
    run.setup()
    start_step = last_saved = run.step
    if run.main:
        run.log({"event": "start", "step": run.step, "total_steps": run.total_steps, "world_size": run.world,
                 "train_examples": len(run.train_ds), "eval_examples": len(run.eval_ds or []),
                 "parameters": run.lm.num_parameters(), **run.data_summary, "config": _jsonable(cfg)})
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
            run.log(record)
            if bar is not None:
                bar.set_postfix(loss=f"{record['loss']:.3f}", ar=f"{record['ar_loss']:.3f}",
                                mdm=f"{record['mdm_loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
            window = _Window(run.acc.device)
        t_pause = time.perf_counter()
        if cfg.eval_every and run.step % cfg.eval_every == 0 and run.step < run.total_steps:
            _log_eval(run)
        if cfg.save_every and run.step % cfg.save_every == 0 and run.step < run.total_steps:
            run.save_checkpoint()
            last_saved = run.step
        window.paused += time.perf_counter() - t_pause
        if on_step is not None:
            on_step(run.step)
    if bar is not None:
        bar.close()
    _log_eval(run)
    if run.step != last_saved or not list_checkpoints(run.out):
        run.save_checkpoint()
    run.save_final()
    if run.writer is not None:
        run.writer.close()
    if run.main:
        run.log({"event": "end", "step": run.step, "elapsed_s": round(time.perf_counter() - t_start, 3)})
    run.acc.wait_for_everyone()
    return TrainResult(run.step, run.out, run.history, run.lm)


def _progress(cfg: TrainConfig, run: _Run, start: int):
    if not (cfg.progress and run.main):
        return None
    from tqdm.auto import tqdm

    return tqdm(total=run.total_steps, initial=start, desc=f"train ({cfg.objective})", unit="step", dynamic_ncols=True)


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

    def record(self, run: _Run, out: dict[str, Any], t_start: float, start_step: int) -> dict[str, Any]:
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
            "epoch": run.samples / len(run.train_ds),
            "elapsed_s": round(now - t_start, 3),
            "eta_s": round(per_step * (run.total_steps - run.step), 1),
        }


def _log_eval(run: _Run) -> None:
    metrics = run.evaluate()
    if metrics is not None:
        run.log({"step": run.step, **metrics})
        if run.main:
            run.print(f"step {run.step}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
