"""A run's records: one JSON line per log step, eval and event in OUT/log.jsonl, the same
scalars in TensorBoard when it is installed, messages on stderr (main process only)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter


class RunLog:
    def __init__(self, out: Path, main: bool) -> None:
        self.out, self.main = out, main
        self.history: list[dict[str, Any]] = []  # every record, on every process
        self.writer: SummaryWriter | None = None

    def open_tensorboard(self, enabled: bool) -> None:
        if not (self.main and enabled):
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            return
        self.writer = SummaryWriter(str(self.out / "tensorboard"))

    def print(self, text: str) -> None:
        if self.main:
            print(text, file=sys.stderr, flush=True)

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

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
