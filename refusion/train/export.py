"""A LoRA run's adapters written as a directory that loads over its base (`io.adapter`): what
ships a fine-tune in megabytes (docs/own-model.md#shipping-a-fine-tune).

The factors come from a checkpoint's training state, where they are kept apart from the
weights they adapt; the directory is checked by loading it, base and all, and comparing
every weight with the checkpoint's merged model, so a base other than the run's fails
here rather than in a user's hands.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from ..errors import CheckpointError, ConfigError
from ..io.adapter import lora_factors, save_adapter
from ..io.save import check_output_dir
from ..io.staging import follow_umask, make_staging, move_into_place, remove_stale_staging
from .checkpoints import checkpoint_step, list_checkpoints

_NOT_COPIED = {"model.safetensors", "model.safetensors.index.json", "trainer_state.json", "train_state"}


def export_adapter(
    run: Path,
    base: str,
    out: Path,
    step: int | None = None,
    install: str | None = None,
    overwrite: bool = False,
) -> float:
    """Write the adapters of run's checkpoint at `step` (default: its last) into `out`,
    over `base` (as `load` names it, or `package:MODULE/FILE`); `install`: how a user
    gets the base, said when it is missing. Returns the largest difference between a
    weight loaded from `out` and the checkpoint's merged weight (0.0 when the base is
    the run's); a difference above 1e-6 fails, and nothing is left at `out`."""
    from safetensors.torch import load_file

    from ..io import load

    ckpt = _checkpoint(Path(run), step)
    check_output_dir(out, overwrite)
    trained = json.loads((ckpt / "trainer_state.json").read_text())["config"]
    if not trained.get("lora"):
        raise ConfigError(f"{run} was trained without --lora: its weights are whole; ship {ckpt} as it is")
    factors = lora_factors(load_file(str(ckpt / "train_state" / "model.safetensors")), prefix="lm.")
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(out)
    stage = make_staging(out)
    try:
        for f in sorted(ckpt.iterdir()):
            if f.name not in _NOT_COPIED:
                (shutil.copytree if f.is_dir() else shutil.copy2)(f, stage / f.name)
        save_adapter(stage, factors, int(trained["lora_r"]), float(trained["lora_alpha"]), base, install)
        gap = _largest_difference(load(stage)[0], load_file(str(ckpt / "model.safetensors")))
        if gap > 1e-6:
            raise CheckpointError(
                f"{base!r} adapted by {ckpt} differs from the run's merged weights by up to {gap:.3g}: "
                "it is not the base the run was trained on"
            )
        follow_umask(stage)
        move_into_place(stage, out)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return gap


def _checkpoint(run: Path, step: int | None) -> Path:
    ckpts = list_checkpoints(run)
    if not ckpts:
        raise ConfigError(f"{run} has no checkpoints (a run of refusion train writes RUN/checkpoints/step-N)")
    if step is None:
        return ckpts[-1]
    chosen = [c for c in ckpts if checkpoint_step(c) == step]
    if not chosen:
        have = ", ".join(str(checkpoint_step(c)) for c in ckpts)
        raise ConfigError(f"{run} has no checkpoint of step {step}; it has steps {have}")
    return chosen[0]


def _largest_difference(model: torch.nn.Module, merged: dict[str, torch.Tensor]) -> float:
    state = model.state_dict()
    gap = 0.0
    for name, value in merged.items():
        if name not in state:
            raise CheckpointError(f"the adapted model lacks {name}, which the run's merged model has")
        gap = max(gap, float((state[name].float() - value.float()).abs().max()))
    return gap
