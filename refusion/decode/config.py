"""`DecodeConfig` (how one request is decoded) and `EngineConfig` (what the engine that
decodes it may use), the two dataclasses every driver shares: the CLI, the evaluator,
the lm-eval plugin and the server.

Each field's bounds and help are written once, in its metadata (`knob`), and checked in
one place (`check_value`, raising a FieldError that names the field): `validate` runs it,
and the CLI's flags (`cli/flags.py`) and the HTTP request (`serve/protocol.py`) call it
on the values they are given and report its errors in their own terms. Model facts (EOS
and MASK ids, the context length) are not configuration: the engine reads them from the
model.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import reprlib
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError

METHODS = ("refusion", "ar", "mdm")

# The authors' settings (docs/algorithm.md#presets): gen_length 512;
# (slot_size, serial_blocks, slot_threshold, token_threshold).
_PAPER = {
    "gsm8k": (32, 4, 0.9, 0.4),
    "math": (32, 8, 0.8, 0.6),
    "mbpp": (32, 4, 0.9, 0.3),
    "humaneval": (32, 4, 0.9, 0.4),
    "gpqa": (8, 32, 0.8, 0.2),
    "arc_challenge": (8, 64, 0.8, 0.1),
    "mmlu_pro": (16, 4, 0.9, 0.4),
}
PRESETS = tuple(_PAPER)
MAX_STOPS = 16


def knob(
    default: Any,
    help: str,
    *,
    lo: float | None = None,
    hi: float | None = None,
    choices: tuple[str, ...] | None = None,
    most: int | None = None,
    flag: bool = True,
    http: bool = True,
) -> Any:
    """A config field with its bounds (`most`: items of a list field) and help; `flag` /
    `http` say whether the CLI and the HTTP request expose it under its own name."""
    meta = {"help": help, "lo": lo, "hi": hi, "choices": choices, "most": most, "flag": flag, "http": http}
    if isinstance(default, (list, tuple)):
        return field(default_factory=lambda: tuple(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class DecodeConfig:
    """How to decode one request. Fields a method does not use are ignored by it;
    requests with any mix of settings share the engine's batch."""

    method: str = knob("refusion", "decoding method", choices=METHODS)
    gen_length: int = knob(256, "tokens to generate at most", lo=1, hi=2**20, http=False)
    # --- ReFusion (docs/algorithm.md#decoding)
    slot_size: int = knob(8, "ReFusion: tokens per slot", lo=1, hi=4096)
    serial_blocks: int = knob(1, "ReFusion: left-to-right blocks of the generation region", lo=1, hi=4096)
    slot_threshold: float = knob(
        0.9, "ReFusion plan: select every slot whose first-token confidence exceeds this", lo=0.0, hi=1.0
    )
    token_threshold: float = knob(
        0.4, "ReFusion verify: a drafted token passes when its AR probability exceeds this", lo=0.0, hi=1.0
    )
    ar_correction: bool = knob(
        False,
        "ReFusion infill: a token that fails verification is replaced by the AR prediction "
        "from its verify pass (kept) instead of a fresh MASK draft; beyond the paper",
    )
    first_token_check: bool = knob(
        False,
        "ReFusion: a selected slot's first token is checked against the AR prediction "
        "of its left neighbour where that is known, and replaced when it fails; beyond the paper",
    )
    infill_window: int | None = knob(
        None,
        "ReFusion infill: draft and verify at most this many tokens past a slot's accepted "
        "prefix per round (default: the rest of the slot); beyond the paper",
        lo=1,
        hi=4096,
    )
    left_check: bool = knob(
        False,
        "ReFusion: a slot decided while its left neighbour was not final is held and verified "
        "again once it is (kept if it passes, filled again from its first failing token); with "
        "ar_correction, first_token_check and token_threshold >= 0.5, greedy decoding equals greedy AR "
        "for any slot layout; beyond the paper",
    )
    # --- MDM baseline (docs/algorithm.md#mdm): LLaDA-style low-confidence remasking in semi-AR blocks
    mdm_block_length: int = knob(32, "MDM: tokens per semi-autoregressive block", lo=1, hi=4096)
    mdm_steps: int | None = knob(
        None, "MDM: denoising steps over the whole generation (default: one token per step)", lo=1, hi=2**16
    )
    mdm_threshold: float | None = knob(
        None, "MDM: fix every position above this confidence (at least one) instead of top-k", lo=0.0, hi=1.0
    )
    # --- sampling (temperature 0 = greedy)
    temperature: float = knob(0.0, "sampling temperature (0 = greedy)", lo=0.0, hi=100.0)
    top_p: float = knob(
        1.0, "nucleus sampling: keep the smallest set of tokens with this much probability", lo=0.0, hi=1.0
    )
    top_k: int = knob(0, "sample among the k most likely tokens (0 = no filter)", lo=0, hi=2**31 - 1)
    seed: int | None = knob(
        None,
        "sampling seed: the request samples the same tokens alone or in any batch",
        lo=-(2**63),
        hi=2**63 - 1,
    )
    # --- when to stop
    stop: tuple[str, ...] = knob(
        (), "strings that end the text (not included in it)", most=MAX_STOPS, flag=False, http=False
    )
    stop_token_ids: tuple[int, ...] | None = knob(
        None,
        "token ids that end the generation instead of the model's EOS ids "
        "(empty: nothing ends it before gen_length)",
        lo=0,
        hi=2**31 - 1,
    )

    def __post_init__(self) -> None:
        if isinstance(self.stop, (str, list)):
            object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        if isinstance(self.stop_token_ids, (int, list)):
            ids = [self.stop_token_ids] if isinstance(self.stop_token_ids, int) else self.stop_token_ids
            object.__setattr__(self, "stop_token_ids", tuple(ids))
        self.validate()

    def validate(self) -> DecodeConfig:
        """Raise ConfigError (a FieldError naming the field) on any out-of-range value,
        before any compute."""
        check_fields(self)
        return self

    # ------------------------------------------------------------------ derived
    @functools.cached_property  # read per committed token: computed once per config
    def unit(self) -> int:
        """Tokens the method decodes in whole units of: ReFusion whole slots in equal
        blocks, MDM whole blocks, AR single tokens."""
        return {"refusion": self.slot_size * self.serial_blocks, "mdm": self.mdm_block_length, "ar": 1}[
            self.method
        ]

    @functools.cached_property
    def region_length(self) -> int:
        """Positions the method decodes: gen_length rounded up to whole units. The output
        is cut back to gen_length tokens, and a row stops once it has them."""
        return -(-self.gen_length // self.unit) * self.unit

    @functools.cached_property
    def slots_per_block(self) -> int:
        """ReFusion: slots in each of the serial blocks of the region."""
        return self.region_length // self.slot_size // self.serial_blocks

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    # ------------------------------------------------------------------ making one
    @classmethod
    def preset(cls, name: str, base: DecodeConfig | None = None, **overrides: Any) -> DecodeConfig:
        """The authors' settings for a benchmark (docs/algorithm.md#presets) on top of `base` (its sampling
        and stop settings are kept), then `overrides`: `DecodeConfig.preset("gsm8k")`."""
        if name not in _PAPER:
            raise ConfigError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
        s, b, ts, tt = _PAPER[name]
        values = dict(
            method="refusion",
            gen_length=512,
            slot_size=s,
            serial_blocks=b,
            slot_threshold=ts,
            token_threshold=tt,
        )
        return dataclasses.replace(base or cls(), **(values | overrides))

    def replace(self, **changes: Any) -> DecodeConfig:
        """A copy with some fields changed (validated)."""
        return dataclasses.replace(self, **changes)

    def for_max_tokens(self, n: int) -> DecodeConfig:
        """This config generating at most n tokens (a server's max_tokens, lm-eval's
        max_gen_toks): the method's region is n rounded up to whole units."""
        return self.replace(gen_length=n)


@dataclass(frozen=True)
class EngineConfig:
    """What an engine may use: these are resources, shared by every request it runs."""

    device: str | None = knob(None, "device to run on (default: where the model is)", flag=False, http=False)
    max_batch_size: int = knob(16, "requests decoded together at most", lo=1, hi=2**16, http=False)
    memory_budget_gb: float = knob(
        4.0, "KV-cache memory that bounds the batch further (GiB)", lo=1e-6, hi=2**20, http=False
    )
    # AR and ReFusion: every forward with a KV cache as one torch.compile graph (the first
    # uses compile for a minute or so, a few graphs per model); MDM has no cache and runs eagerly
    compile: bool = knob(
        False,
        "AR and ReFusion: run forwards as one torch.compile graph "
        "(a minute or so at first use; needs a C++ compiler on CPU)",
        http=False,
    )
    # docs/algorithm.md#adaptive-widths: each step, the rows whose greedy output cannot depend on
    # draft widths draft as wide as commits the most tokens per second at the batch's load
    adaptive_drafts: bool = knob(
        True,
        "ReFusion: draft widths (plan MASKs, infill window) follow the batch, measured per forward; "
        "only for rows whose output they cannot change (greedy, ar_correction, first_token_check, one "
        "slot per block, token_threshold >= 0.5), other rows draft at their fixed widths",
        http=False,
    )
    # the model split over this many processes, one per device (refusion.parallel)
    tensor_parallel_size: int = knob(
        1,
        "processes (one per device) the model is split over by attention heads and MLP columns",
        lo=1,
        hi=4096,
        http=False,
    )

    def __post_init__(self) -> None:
        check_fields(self)

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)


# ---------------------------------------------------------------------- field checks
class FieldError(ConfigError):
    """A value that one field cannot take. `field` names it and `wrong_type` says whether
    the value had the wrong type (else it was out of range), so that a driver can point
    at the field in its own terms (the server: its `param` and `code`)."""

    def __init__(self, field: str, message: str, *, wrong_type: bool = False) -> None:
        super().__init__(message)
        self.field, self.wrong_type = field, wrong_type


def check_fields(cfg: Any) -> None:
    """Check every field of a config dataclass against its `knob` metadata."""
    for f in dataclasses.fields(cfg):
        check_value(f, getattr(cfg, f.name))


def check_value(f: dataclasses.Field, value: Any) -> Any:
    """`value` checked against field f's type and bounds, as the field stores it (a list
    as a tuple, a lone string for a list of strings as a 1-tuple, a float field's integer
    as a float); FieldError naming the field otherwise."""
    if value is None and "None" in str(f.type):
        return value
    kind = field_kind(f)
    if kind == "tuple":
        return _check_items(f, value)
    value = check_scalar(
        f.name,
        kind,
        value,
        lo=f.metadata.get("lo"),
        hi=f.metadata.get("hi"),
        choices=f.metadata.get("choices"),
    )
    return float(value) if kind == "float" else value


def check_scalar(
    name: str,
    kind: str,
    value: Any,
    *,
    lo: float | None = None,
    hi: float | None = None,
    choices: tuple[str, ...] | None = None,
) -> Any:
    """`value` checked to be a `kind` ('bool', 'int', 'float', 'str') within the bounds or
    choices; FieldError naming `name` otherwise. Fields and the server's own request
    fields (max_tokens, stream) share it, so every such error reads the same."""
    if not _is_kind(kind, value):
        raise FieldError(name, f"{name} must be {_WANT[kind]}, got {_what(value)}", wrong_type=True)
    if choices and value not in choices:
        raise FieldError(name, f"{name} must be one of {', '.join(choices)}, got {shown(value)}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise FieldError(name, f"{name} must be {bounds_text(lo, hi)}, got {shown(value)}")
    return value


_WANT = {"bool": "a boolean", "int": "an integer", "float": "a finite number", "str": "a string"}


def _is_kind(kind: str, value: Any) -> bool:
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if kind == "float":
        return (is_int or isinstance(value, float)) and math.isfinite(value)
    return {"bool": isinstance(value, bool), "int": is_int, "str": isinstance(value, str)}[kind]


def _check_items(f: dataclasses.Field, value: Any) -> tuple:
    """A list field: a list or tuple (a lone string, where it holds strings) of at most
    `most` items, each of its item type within its bounds. Strings must not be empty: an
    empty stop string would end every text before it starts."""
    name, meta, most = f.name, f.metadata, f.metadata.get("most")
    strings = "str" in str(f.type)
    items = (value,) if strings and isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(
        _is_kind("str" if strings else "int", v) for v in items
    ):
        want = "a string or a list of strings" if strings else "a list of integers"
        raise FieldError(name, f"{name} must be {want}, got {_what(value)}", wrong_type=True)
    if (most is not None and len(items) > most) or (strings and not all(items)):
        limit = f"at most {most} " if most is not None else ""
        raise FieldError(
            name, f"{name} takes {limit}{'non-empty strings' if strings else 'items'}, got {shown(value)}"
        )
    for v in items:
        check_scalar(name, "str" if strings else "int", v, lo=meta.get("lo"), hi=meta.get("hi"))
    return tuple(items)


def field_kind(f: dataclasses.Field) -> str:
    """'bool', 'int', 'float', 'str' or 'tuple', from the field's annotation."""
    t = str(f.type)
    for kind in ("tuple", "bool", "float", "int", "str"):
        if t.startswith(kind):
            return kind
    raise TypeError(f"field {f.name} has an unsupported type {t}")


def bounds_text(lo: float | None, hi: float | None) -> str:
    if lo is not None and hi is not None:
        return f"between {lo} and {hi}"
    return f">= {lo}" if lo is not None else f"<= {hi}"


_short = reprlib.Repr()
_short.maxstring, _short.maxother, _short.maxlevel = 60, 60, 3


def shown(value: Any) -> str:
    """A value quoted in an error, cut short: a request's value may be megabytes long, or
    an integer of thousands of digits."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**30:
        return f"an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    return _short.repr(value)


def _what(value: Any) -> str:
    """A value of the wrong type, for "x must be ..., got ...": quoted with its type, or
    named where JSON's non-finite numbers would print as Python's (nan, inf)."""
    if isinstance(value, float) and not math.isfinite(value):
        return (
            "NaN"
            if math.isnan(value)
            else f"{'-' if value < 0 else ''}Infinity (or a number too large for a double)"
        )
    return f"{shown(value)} ({type(value).__name__})"
