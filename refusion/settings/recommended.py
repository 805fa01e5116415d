"""What a checkpoint recommends for itself: `decode_config.json` beside `config.json`, as
`generation_config.json` travels with a `transformers` checkpoint.

The decode settings a model was tuned for belong to its weights, not to the command that
happens to run them: `generate`, `chat`, `serve`, `eval` and `bench` start from them when
the user gives none, `refusion info` shows them, and a save writes them back. The file
also says what the model is for (`about`), whether it knows single turns only
(`single_turn`: `chat` then keeps no history), whether it knows text only through its chat
template (`chat_only`: a raw text prompt continued without it gives noise, so the server's
`/v1/completions` says so in a `warning`) and gives prompts to try (`examples`, label ->
prompt). Every key is optional; a checkpoint without the file gets
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
from ..files import LIMITS, checkpoint_file, read_json
from .decode import DecodeConfig
from .fields import shown

FILE = "decode_config.json"
_KEYS = {"decode", "about", "single_turn", "chat_only", "examples"}
_FIX = "fix or delete the file"


@dataclass(frozen=True)
class Recommended:
    """A checkpoint's own settings (all optional). `decode` holds `DecodeConfig` fields."""

    decode: dict[str, Any] = field(default_factory=dict)
    about: str = ""
    single_turn: bool = False
    chat_only: bool = False
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
        path = checkpoint_file(directory, FILE)
        if not (path.exists() or path.is_symlink()):
            return cls()
        data = read_json(path, CheckpointError, limit=LIMITS.config_bytes, fix=_FIX)
        return cls.from_dict(data, where=str(path))

    @classmethod
    def from_dict(cls, data: Any, where: str = FILE) -> Recommended:
        """The settings in a parsed `decode_config.json`, every field checked for its type
        (a JSON null is a field not given): a wrong one is a CheckpointError naming the
        file and the field, never an exception from whatever uses the value later."""
        if not isinstance(data, dict) or not set(data) <= _KEYS:
            unknown = sorted(set(data) - _KEYS) if isinstance(data, dict) else type(data).__name__
            raise CheckpointError(
                f"{where}: expected an object with keys among {sorted(_KEYS)}, got {unknown}; {_FIX}"
            )
        given = {k: v for k, v in data.items() if v is not None}
        rec = cls(
            decode=_field(given, "decode", dict, "an object of decode settings", where),
            about=_field(given, "about", str, "a string", where),
            single_turn=_field(given, "single_turn", bool, "true or false", where),
            chat_only=_field(given, "chat_only", bool, "true or false", where),
            examples=_field(given, "examples", dict, "an object of label -> prompt", where),
        )
        _check_decode(rec, where)
        if not all(isinstance(k, str) and isinstance(v, str) and v.strip() for k, v in rec.examples.items()):
            raise CheckpointError(f'{where}: "examples" maps labels to non-empty prompt strings; {_FIX}')
        return rec

    def write(self, directory: str | Path) -> None:
        """Write the file into `directory` (nothing when there is nothing to say)."""
        if not self.empty:
            (Path(directory) / FILE).write_text(json.dumps(self.as_dict(), indent=2) + "\n")


def _field(data: dict[str, Any], key: str, kind: type, want: str, where: str) -> Any:
    """`data[key]` if it is a `kind` (the field's default when absent); a CheckpointError
    naming the field otherwise."""
    value = data.get(key, _DEFAULTS[key])
    if not isinstance(value, kind):
        raise CheckpointError(f'{where}: "{key}" must be {want}, got {shown(value)}; {_FIX}')
    return dict(value) if isinstance(value, dict) else value


def _check_decode(rec: Recommended, where: str) -> None:
    """The "decode" settings name DecodeConfig's fields, each of its type and within its bounds."""
    names = {f.name for f in dataclasses.fields(DecodeConfig)}
    unknown = sorted(k for k in rec.decode if k not in names)
    if unknown:
        raise CheckpointError(
            f'{where}: its "decode" settings are not a valid DecodeConfig: it has no setting '
            f"{', '.join(map(shown, unknown))}; {_FIX}"
        )
    try:
        rec.decode_config()
    except ConfigError as e:
        raise CheckpointError(
            f'{where}: its "decode" settings are not a valid DecodeConfig: {e}; {_FIX}'
        ) from None


_DEFAULTS: dict[str, Any] = {
    "decode": {},
    "about": "",
    "single_turn": False,
    "chat_only": False,
    "examples": {},
}


def recommended_of(model: Any) -> Recommended:
    """The settings a loaded model came with (`load` attaches them); empty for a model
    built in code."""
    return getattr(model, "recommended", None) or Recommended()
