"""What a training run is made of before its first step: the model and tokenizer (MASK
checked, LoRA applied), the optimizer and its schedule, the loss-computing wrapper
accelerate prepares, and the seeded inputs of each micro-batch."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import nn

from ..errors import ConfigError, MissingMaskTokenError
from ..io.adapter import fold, lora_factors
from ..model.transformer import Transformer, rope_inv_freq
from ..settings.model import ModelConfig
from ..settings.train import DTYPE_NAMES, TrainConfig
from .objective import (
    LossTargets,
    ObjectiveConfig,
    TrainBatch,
    ar_batch,
    loss_targets,
    refusion_batch,
)

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


class LossModel(nn.Module):
    """What accelerate wraps: the language model run up to the logits of the labelled tokens
    only, so DDP / FSDP / DeepSpeed see one forward and the vocabulary projection is not
    paid for the prompt."""

    def __init__(self, lm: Transformer) -> None:
        super().__init__()
        self.lm = lm

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, flat_index: torch.Tensor
    ) -> torch.Tensor:
        h = self.lm.hidden(input_ids, position_ids)  # (B, T, hidden)
        return self.lm.lm_head(h.flatten(0, 1)[flat_index])  # (N, vocab)


# ------------------------------------------------------------------------------ set-up
def load_model_and_tokenizer(cfg: TrainConfig) -> tuple[Transformer, Any]:
    """The base model (or a random one from init_config) and its tokenizer, MASK checked."""
    dtype = DTYPES[cfg.dtype]
    if cfg.init_config is not None:
        from ..io.metadata import load_tokenizer
        from ..model.prompts import mask_id_of

        config = ModelConfig.from_json(cfg.init_config)
        assert cfg.tokenizer is not None  # TrainConfig requires one with init_config
        tokenizer = load_tokenizer(cfg.tokenizer)
        if config.vocab_size < len(tokenizer):
            raise ConfigError(f"vocab_size {config.vocab_size} < the tokenizer's {len(tokenizer)} tokens")
        config.mask_token_id = mask_id_of(config, tokenizer)
        if config.eos_token_id is None:
            config.eos_token_id = tokenizer.eos_token_id
        torch.manual_seed(cfg.seed)
        model = init_weights(Transformer(config), float(config.extra.get("initializer_range", 0.02)))
        model = model.to(dtype)
    else:
        from ..io import load

        model, tokenizer = load(cfg.model, device="cpu", dtype=dtype)
        if cfg.tokenizer is not None:
            from ..io.metadata import load_tokenizer

            tokenizer = load_tokenizer(cfg.tokenizer)
    if cfg.objective == "refusion" and model.config.mask_token_id is None:
        if not cfg.add_mask_token:
            raise MissingMaskTokenError(
                f"{cfg.model or cfg.init_config} has no MASK token (<|mask|>), which the refusion objective "
                "needs: run `refusion convert` on it first, or pass --add-mask-token to add it here"
            )
        from ..io import add_mask_token

        add_mask_token(model, tokenizer)
    return model, tokenizer


@torch.no_grad()
def init_weights(model: Transformer, std: float = 0.02) -> Transformer:
    """Random initialisation for training from scratch: N(0, std) matrices and embeddings,
    zero biases, unit norms."""
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.normal_(0.0, std)
            bias = getattr(module, "bias", None)  # an Embedding has none
            if bias is not None:
                bias.zero_()
    return model


def apply_lora(model: Transformer, cfg: TrainConfig) -> Transformer:
    """Inject LoRA adapters; everything else is frozen."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError:
        raise ConfigError("lora=True needs peft: pip install 'refusion[train]'") from None
    lc = LoraConfig(
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=list(cfg.lora_targets),
    )
    inject_adapter_in_model(lc, model)  # in place: the model keeps its class, its layers gain adapters
    return model


def merged_state_dict(
    state: dict[str, torch.Tensor], cfg: TrainConfig, prefix: str = "lm."
) -> dict[str, torch.Tensor]:
    """Hugging Face names and plain weights from the wrapped model's state dict, with LoRA
    adapters folded in: W + (alpha / r) * B @ A (`io.adapter.fold`, as loading adapters does)."""
    state = {k[len(prefix) :] if k.startswith(prefix) else k: v for k, v in state.items()}
    factors = lora_factors(state)
    out = {}
    scale = cfg.lora_alpha / cfg.lora_r
    for name, value in state.items():
        if ".lora_A." in name or ".lora_B." in name:
            continue
        if ".base_layer." in name:
            module, leaf = name.split(".base_layer.")
            if leaf == "weight" and f"{module}.lora_A" in factors:
                value = fold(value, factors[f"{module}.lora_A"], factors[f"{module}.lora_B"], scale)
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


def group_settings(cfg: TrainConfig) -> list[dict[str, Any]]:
    """AdamW's settings of its two parameter groups: matrices decay, norms and biases do not."""
    common = {"lr": cfg.lr, "betas": (cfg.adam_beta1, cfg.adam_beta2), "eps": cfg.adam_eps}
    return [{**common, "weight_decay": cfg.weight_decay}, {**common, "weight_decay": 0.0}]


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    settings = group_settings(cfg)
    return torch.optim.AdamW([{"params": decay, **settings[0]}, {"params": no_decay, **settings[1]}])


def apply_settings(scheduler: torch.optim.lr_scheduler.LambdaLR, cfg: TrainConfig) -> None:
    """Put cfg's optimizer settings into an optimizer and schedule restored from a checkpoint.
    Loading their state brings back the saved lr, betas, eps and weight decay, which a
    resume with changed settings must replace; the learning rate becomes the new peak
    times the new schedule's factor at the restored step."""
    groups = scheduler.optimizer.param_groups
    for group, settings in zip(groups, group_settings(cfg)):
        group.update(settings, initial_lr=cfg.lr)
    scheduler.base_lrs = [cfg.lr] * len(groups)
    for group, base, factor in zip(groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in groups]


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
    assert mask_id is not None  # load_model_and_tokenizer gave the refusion objective a MASK id
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


def has_accelerator() -> bool:
    accel = getattr(torch, "accelerator", None)  # torch >= 2.6
    return accel.is_available() if accel is not None else torch.cuda.is_available()


def precision(cfg: TrainConfig) -> str:
    if cfg.precision != "auto":
        return cfg.precision
    gpu = torch.cuda.is_available() and not cfg.cpu
    return "bf16" if gpu and torch.cuda.is_bf16_supported() else "no"
