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

from ..config import ModelConfig
from ..model import Transformer
from .config import TrainConfig
from .log import RunLog
from .setup import clean_model, merged_state_dict

_CKPT = re.compile(r"^step-(\d{8})$")


def list_checkpoints(out: Path) -> list[Path]:
    """Complete checkpoints, oldest first (temporary directories of a killed save are ignored)."""
    root = out / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _CKPT.match(p.name) and (p / "trainer_state.json").is_file()]
    return sorted(found, key=lambda p: int(_CKPT.match(p.name).group(1)))


def jsonable(cfg: TrainConfig) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(cfg).items()}


class Checkpoints:
    def __init__(self, acc: Any, out: Path, cfg: TrainConfig, tokenizer: Any, model_config: ModelConfig, log: RunLog) -> None:
        self.acc, self.out, self.cfg, self.tokenizer, self.model_config, self.log = acc, out, cfg, tokenizer, model_config, log
        self.main, self.world = acc.is_main_process, acc.num_processes

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
        from ..checkpoint import save_pretrained

        root = self.out / "checkpoints"
        final = root / f"step-{step:08d}"
        tmp = root / f".tmp-step-{step:08d}"
        hf = self._hf_model(model)
        if self.main:
            shutil.rmtree(tmp, ignore_errors=True)
            save_pretrained(hf, self.tokenizer, tmp)
        self.acc.wait_for_everyone()
        self.acc.save_state(str(tmp / "train_state"))
        self.acc.wait_for_everyone()
        if self.main:
            state = {"step": step, "samples": samples, "world_size": self.world}
            (tmp / "trainer_state.json").write_text(json.dumps({**state, "config": jsonable(self.cfg)}, indent=1))
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
        from ..checkpoint import save_pretrained

        hf = self._hf_model(model)
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

    def _hf_model(self, model: Any) -> Transformer | None:
        """A plain Transformer with the trained (LoRA-merged) weights, on the main process."""
        state = self.acc.get_state_dict(model)  # a collective under FSDP / DeepSpeed
        if not self.main:
            return None
        return clean_model(self.model_config, merged_state_dict(state, self.cfg))

    def _prune(self) -> None:
        keep = self.cfg.keep_checkpoints
        ckpts = list_checkpoints(self.out)
        for old in ckpts[: -keep] if keep else []:
            shutil.rmtree(old, ignore_errors=True)

    def _load(self, path: Path) -> tuple[int, int]:
        state = json.loads((path / "trainer_state.json").read_text())
        self.acc.load_state(str(path / "train_state"))
        if state.get("world_size") != self.world:
            self.log.print(f"resume: the checkpoint was written by {state.get('world_size')} processes, now {self.world}")
        self.log.print(f"resumed from {path} at step {int(state['step'])}")
        return int(state["step"]), int(state["samples"])
