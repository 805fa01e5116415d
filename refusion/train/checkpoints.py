"""Checkpoints of a run, written so that a run killed at any moment leaves either a whole
checkpoint or none: each goes to a temporary directory renamed when complete. A
checkpoint is a normal model directory plus train_state/ (weights, optimizer, scheduler
and every rank's RNG states, through accelerate) and trainer_state.json (step, data
position, config). The final model goes into OUT itself, config.json last."""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..model.transformer import Transformer
from ..settings.model import ModelConfig
from ..settings.recommended import Recommended
from ..settings.train import TrainConfig, flag_name
from .log import RunLog
from .setup import clean_model, merged_state_dict

_CKPT = re.compile(r"^step-(\d{8})$")

# Settings a resumed run may change freely: where and how often it reports, evaluates and
# saves, and how the machine computes a step (device, recomputed activations). Every other
# field shapes the optimisation trajectory: the data and its held-out split (eval_data,
# eval_fraction and eval_max_examples decide what is held out of training), the model and
# tokenizer, the objective, the schedule, the optimizer, the batch, the precision and the
# seed; resuming with one of those changed needs allow_config_change.
RESUME_FREE = frozenset(
    {
        "out",
        "eval_every",
        "log_every",
        "save_every",
        "keep_checkpoints",
        "resume",
        "allow_config_change",
        "tensorboard",
        "progress",
        "cpu",
        "gradient_checkpointing",
    }
)


def checkpoint_step(path: Path) -> int:
    """The step a checkpoint directory (`step-NNNNNNNN`, from `list_checkpoints`) was saved at."""
    m = _CKPT.match(path.name)
    if m is None:
        raise ConfigError(f"{path} is not a checkpoint directory (step-NNNNNNNN)")
    return int(m.group(1))


def list_checkpoints(out: Path) -> list[Path]:
    """Complete checkpoints, oldest first (temporary directories of a killed save are ignored)."""
    root = out / "checkpoints"
    if not root.is_dir():
        return []
    steps = {
        p: int(m.group(1))
        for p in root.iterdir()
        if (m := _CKPT.match(p.name)) and (p / "trainer_state.json").is_file()
    }
    return sorted(steps, key=steps.__getitem__)


def jsonable(cfg: TrainConfig) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(cfg).items()}


def config_changes(saved: dict[str, Any], cfg: TrainConfig) -> dict[str, tuple[Any, Any]]:
    """name -> (saved value, new value) of the trajectory settings that differ from the
    saved run's. A field the saved config lacks (an older version wrote it) is not compared."""
    new = jsonable(cfg)
    return {k: (saved[k], v) for k, v in new.items() if k not in RESUME_FREE and k in saved and saved[k] != v}


def resume_changes(out: Path, cfg: TrainConfig, log: RunLog) -> dict[str, tuple[Any, Any]]:
    """The settings a resume would change, checked before anything is loaded: refused unless
    cfg.allow_config_change, then named in one line."""
    ckpts = list_checkpoints(out)
    if not (cfg.resume and ckpts):
        return {}
    saved = json.loads((ckpts[-1] / "trainer_state.json").read_text()).get("config", {})
    changes = config_changes(saved, cfg)
    if not changes:
        return {}
    listed = ", ".join(f"{flag_name(k)} {old} -> {new}" for k, (old, new) in changes.items())
    if not cfg.allow_config_change:
        raise ConfigError(
            f"{ckpts[-1]} was trained with other settings ({listed}): pass --allow-config-change "
            "to resume with the new values, or give the old ones to continue the run as it was"
        )
    log.print(f"resume: continuing with changed settings: {listed}")
    return changes


def drop_tied_copies(models: list, weights: list[dict[str, Any]], output_dir: str) -> None:
    """accelerate's save-state hook: the model states it is about to write lose their tied
    output matrix, stored once as in the model directory (`checkpoint.drop_tied_head`);
    loading the state ties it again. Under FSDP and DeepSpeed, which save the model
    themselves, `weights` is empty."""
    from ..io import drop_tied_head

    for state in weights:
        drop_tied_head(state)


class Checkpoints:
    def __init__(
        self,
        acc: Any,
        out: Path,
        cfg: TrainConfig,
        tokenizer: Any,
        model_config: ModelConfig,
        log: RunLog,
        recommended: Recommended | None = None,
    ) -> None:
        self.acc, self.out, self.cfg, self.tokenizer, self.model_config, self.log = (
            acc,
            out,
            cfg,
            tokenizer,
            model_config,
            log,
        )
        self.main, self.world = acc.is_main_process, acc.num_processes
        # the base model's decode_config.json travels to every checkpoint of its fine-tune
        self.recommended = recommended or Recommended()

    def prepare(self) -> tuple[int, int] | None:
        """Make OUT/checkpoints; with resume, load the latest checkpoint's state and return
        its (step, samples)."""
        ckpts = list_checkpoints(self.out)
        if self.main:
            (self.out / "checkpoints").mkdir(parents=True, exist_ok=True)
        self.acc.wait_for_everyone()
        if not self.cfg.resume:
            return None
        if not ckpts:
            self.log.print(f"resume: no checkpoint in {self.out / 'checkpoints'}, starting from step 0")
            return None
        return self._load(ckpts[-1])

    def save(self, model: Any, step: int, samples: int) -> Path:
        from ..io import save_pretrained

        root = self.out / "checkpoints"
        final = root / f"step-{step:08d}"
        tmp = root / f".tmp-step-{step:08d}"
        hf = self._hf_model(model)
        if hf is not None:  # the main process
            shutil.rmtree(tmp, ignore_errors=True)
            save_pretrained(hf, self.tokenizer, tmp)
        self.acc.wait_for_everyone()
        self.acc.save_state(str(tmp / "train_state"))
        self.acc.wait_for_everyone()
        if self.main:
            state = {"step": step, "samples": samples, "world_size": self.world}
            (tmp / "trainer_state.json").write_text(
                json.dumps({**state, "config": jsonable(self.cfg)}, indent=1)
            )
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            self._prune()
        self.acc.wait_for_everyone()
        return final

    def save_final(self, model: Any) -> None:
        """The final model into OUT itself, next to checkpoints/ and the logs: written whole
        into a temporary directory, then its files moved in, config.json last (a reader
        that finds config.json finds a complete model)."""
        from ..io import save_pretrained

        hf = self._hf_model(model)
        if hf is not None:  # the main process
            staging = self.out / ".final.partial"
            shutil.rmtree(staging, ignore_errors=True)
            save_pretrained(hf, self.tokenizer, staging)
            (self.out / "config.json").unlink(missing_ok=True)
            names = sorted(p.name for p in staging.iterdir())
            for name in [n for n in names if n != "config.json"] + ["config.json"]:
                os.replace(staging / name, self.out / name)
            staging.rmdir()
        self.acc.wait_for_everyone()

    def _hf_model(self, model: Any) -> Transformer | None:
        """A plain Transformer with the trained (LoRA-merged) weights, on the main process."""
        state = self.acc.get_state_dict(model)  # a collective under FSDP / DeepSpeed
        if not self.main:
            return None
        model = clean_model(self.model_config, merged_state_dict(state, self.cfg))
        model.recommended = self.recommended
        return model

    def _prune(self) -> None:
        keep = self.cfg.keep_checkpoints
        ckpts = list_checkpoints(self.out)
        for old in ckpts[:-keep] if keep else []:
            shutil.rmtree(old, ignore_errors=True)

    def _load(self, path: Path) -> tuple[int, int]:
        state = json.loads((path / "trainer_state.json").read_text())
        self.acc.load_state(str(path / "train_state"))
        if state.get("world_size") != self.world:
            self.log.print(
                f"resume: the checkpoint was written by {state.get('world_size')} processes, now {self.world}"
            )
        self.log.print(f"resumed from {path} at step {int(state['step'])}")
        return int(state["step"]), int(state["samples"])
