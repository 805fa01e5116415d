"""Training, on `accelerate`: one CPU, one GPU, or many GPUs (DDP, FSDP, DeepSpeed) with the
same code. `train(TrainConfig(...))` is the entry point; `refusion train` is a thin
wrapper over it.

The parts: `refusion.settings.train` (TrainConfig, no torch), `engine.py` (the Accelerator for the
launch config's DDP / FSDP / DeepSpeed, also on CPU processes), `setup.py` (model, LoRA, optimizer,
schedule, micro-batch inputs), `data.py` (datasets, stream, micro-batches), `run.py` (one
optimizer step, the held-out evaluation), `checkpoints.py`, `lock.py` (one trainer per
output directory), `log.py`, `loop.py`.

A step: take the next window of the seeded index stream (data.py), build the objective's
batch on the CPU (objective.py) and copy it to the device, run the model up to the logits
of the labelled tokens only, weight their cross-entropy, clip, step AdamW with warmup +
cosine, log.

The output directory:

    OUT/                  the final model: config.json, model.safetensors, tokenizer files
    OUT/log.jsonl         one JSON record per log step, eval and event
    OUT/.train.lock       flock'd by the trainer writing OUT while it runs (a second one is refused)
    OUT/tensorboard/      the same scalars, when tensorboard is installed
    OUT/checkpoints/step-00000500/
                          a normal model directory too, plus train_state/ (weights,
                          optimizer, scheduler, RNG states of every rank, via accelerate)
                          and trainer_state.json (step, data position, config)

Checkpoints are written to a temporary directory and renamed when complete, so a run
killed at any moment leaves either a whole checkpoint or none; `resume=True` continues
from the latest, with the settings it was trained with (a changed learning rate, schedule,
batch, ... is refused unless `allow_config_change=True`; checkpoints.RESUME_FREE lists
what may change freely). Randomness that shapes a step (data order, objective draws) is a
pure function of (seed, step, rank), so a resumed run repeats the uninterrupted one
bitwise on the same machine and process count.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_attributes

_WHERE = {
    "TrainConfig": ".settings.train",
    "config_fields": ".settings.train",
    "DTYPE_NAMES": ".settings.train",
    "OBJECTIVES": ".settings.train",
    "PRECISIONS": ".settings.train",
    "LORA_TARGETS": ".settings.train",
    "AR_REDUCTIONS": ".settings.train",
    "train": "loop",
    "TrainResult": "loop",
    "list_checkpoints": "checkpoints",
    "LossModel": "setup",
    "init_weights": "setup",
    "step_generator": "setup",
    "step_inputs": "setup",
    "DTYPES": "setup",
    "load_model_and_tokenizer": "setup",
    "clean_model": "setup",
    "merged_state_dict": "setup",
    "lr_factor": "setup",
}
__all__ = [
    "AR_REDUCTIONS",
    "DTYPES",
    "DTYPE_NAMES",
    "LORA_TARGETS",
    "LossModel",
    "OBJECTIVES",
    "PRECISIONS",
    "TrainConfig",
    "TrainResult",
    "clean_model",
    "config_fields",
    "init_weights",
    "list_checkpoints",
    "load_model_and_tokenizer",
    "lr_factor",
    "merged_state_dict",
    "step_generator",
    "step_inputs",
    "train",
]

if TYPE_CHECKING:
    from ..settings.train import (
        AR_REDUCTIONS,
        DTYPE_NAMES,
        LORA_TARGETS,
        OBJECTIVES,
        PRECISIONS,
        TrainConfig,
        config_fields,
    )
    from .checkpoints import list_checkpoints
    from .loop import TrainResult, train
    from .setup import (
        DTYPES,
        LossModel,
        clean_model,
        init_weights,
        load_model_and_tokenizer,
        lr_factor,
        merged_state_dict,
        step_generator,
        step_inputs,
    )

__getattr__, __dir__ = lazy_attributes(__name__, _WHERE, __all__)
