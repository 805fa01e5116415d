"""What a checkpoint recommends for itself: `decode_config.json` beside `config.json`, as
`generation_config.json` travels with a `transformers` checkpoint.

The decode settings a model was tuned for belong to its weights, not to the command that
happens to run them: `generate`, `chat`, `serve`, `eval` and `bench` start from them when
the user gives none, `refusion info` shows them, and a save writes them back. The file
also says what the model is for (`about`), whether it knows single turns only
(`single_turn`: `chat` then keeps no history) and gives prompts to try (`examples`,
label -> prompt). Every key is optional; a checkpoint without the file gets
`DecodeConfig()`'s defaults. Nothing here imports torch.

    {"decode": {"slot_size": 8, "serial_blocks": 4, "slot_threshold": 0.7},
     "about": "...", "single_turn": true, "examples": {"lists": "Find the largest number: 3, 9, 4"}}
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, ConfigError
from ..files import read_json
from .decode import DecodeConfig

FILE = "decode_config.json"
_KEYS = {"decode", "about", "single_turn", "examples"}


@dataclass(frozen=True)
class Recommended:
    """A checkpoint's own settings (all optional). `decode` holds `DecodeConfig` fields."""

    decode: dict[str, Any] = field(default_factory=dict)
    about: str = ""
    single_turn: bool = False
    examples: dict[str, str] = field(default_factory=dict)

    def decode_config(self, **overrides: Any) -> DecodeConfig:
        """The recommended DecodeConfig, with `overrides` on top."""
        return DecodeConfig(**(self.decode | overrides))

    @property
    def empty(self) -> bool:
        return self == Recommended()

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v}

    @classmethod
    def read(cls, directory: str | Path) -> Recommended:
        """The settings in `directory/decode_config.json`; empty when there is no such file.
        A malformed file is a CheckpointError that names it."""
        path = Path(directory) / FILE
        if not (path.exists() or path.is_symlink()):
            return cls()
        data = read_json(path, CheckpointError, limit=2**24, fix="fix or delete the file")
        return cls.from_dict(data, where=str(path))

    @classmethod
    def from_dict(cls, data: Any, where: str = FILE) -> Recommended:
        if not isinstance(data, dict) or not set(data) <= _KEYS:
            unknown = sorted(set(data) - _KEYS) if isinstance(data, dict) else type(data).__name__
            raise CheckpointError(
                f"{where}: expected an object with keys among {sorted(_KEYS)}, got {unknown}"
            )
        rec = cls(
            decode=dict(data.get("decode") or {}),
            about=str(data.get("about") or ""),
            single_turn=bool(data.get("single_turn", False)),
            examples=dict(data.get("examples") or {}),
        )
        try:
            rec.decode_config()
        except (ConfigError, TypeError) as e:
            raise CheckpointError(
                f'{where}: its "decode" settings are not a valid DecodeConfig: {e}'
            ) from None
        if not all(isinstance(k, str) and isinstance(v, str) and v.strip() for k, v in rec.examples.items()):
            raise CheckpointError(f'{where}: "examples" maps labels to non-empty prompt strings')
        return rec

    def write(self, directory: str | Path) -> None:
        """Write the file into `directory` (nothing when there is nothing to say)."""
        if not self.empty:
            (Path(directory) / FILE).write_text(json.dumps(self.as_dict(), indent=2) + "\n")


def recommended_of(model: Any) -> Recommended:
    """The settings a loaded model came with (`load` attaches them); empty for a model
    built in code."""
    return getattr(model, "recommended", None) or Recommended()
