"""Fitting a request to the room the model's context leaves after its prompt, and the
advice when it does not fit.

One rule serves every driver: the engine's check before any compute, the library's and
the CLI's lowered gen_length, chat's dropping of old turns and the server's max_tokens.
A method decodes its region, gen_length rounded up to whole units (ReFusion: whole slots
in equal blocks), so the region must fit, not just gen_length. A refusal names one change
that makes the request fit, and the setting it changes (`NoRoomError.setting`), so the
server can point at it; no torch here.
"""

from __future__ import annotations

from ..errors import ContextLengthError
from ..settings.decode import DecodeConfig
from .methods import method_of


class NoRoomError(ContextLengthError):
    """A request that does not fit the room its prompt leaves. `setting` names what the
    first piece of advice changes (None: the prompt)."""

    def __init__(self, message: str, setting: str | None) -> None:
        super().__init__(message)
        self.setting = setting


def fits(cfg: DecodeConfig, prompt_len: int, context: int) -> bool:
    """Whether `cfg` decodes its whole region after a prompt of `prompt_len` tokens."""
    return cfg.region_length <= context - prompt_len


def longest_fitting(cfg: DecodeConfig, room: int) -> int:
    """The longest gen_length whose region fits in `room` positions (0: none does)."""
    return max(room, 0) // cfg.unit * cfg.unit


def fit_to_room(
    cfg: DecodeConfig, prompt_len: int, context: int, length: int | None = None, *, name: str = "gen_length"
) -> DecodeConfig:
    """`cfg` with a gen_length that fits the room a `prompt_len`-token prompt leaves in a
    `context`-position model, or NoRoomError with advice.

    `length` is a length asked for by number (a user's gen_length, a request's max_tokens;
    `name` is what the advice calls it): it must fit as it is, since cutting it silently
    would cut the answer asked for. Without it, cfg's own gen_length (a preset's, a
    checkpoint's recommendation) is lowered to the longest that fits."""
    room = context - prompt_len
    if length is None and room >= cfg.unit:
        return cfg if cfg.region_length <= room else cfg.replace(gen_length=longest_fitting(cfg, room))
    if length is not None and room >= 1 and _region(cfg, length) <= room:
        return cfg if length == cfg.gen_length else cfg.replace(gen_length=length)
    raise _no_room(cfg, prompt_len, context, length, name)


def _region(cfg: DecodeConfig, length: int) -> int:
    return -(-length // cfg.unit) * cfg.unit


def _no_room(cfg: DecodeConfig, prompt_len: int, context: int, length: int | None, name: str) -> NoRoomError:
    """Why the request does not fit, and what to change: a length that fits with this
    unit, else a smaller unit; a shorter prompt where that alone would do."""
    room, unit = context - prompt_len, cfg.unit
    need = unit if length is None else _region(cfg, length)  # the fewest positions it can run in
    shorter = [f"shorten the prompt to at most {context - need} tokens"] if context - need >= 1 else []
    left = f"only {room} are left after the {prompt_len}-token prompt (context {context})"
    if room < 1:
        return NoRoomError(
            f"the prompt has {prompt_len} tokens and the model's context is {context} positions, which "
            f"leaves no room to generate; {(shorter or ['shorten the prompt'])[0]}",
            None,
        )
    if length is None:  # not even one unit fits
        unit_fix = _smaller_unit(cfg, room)
        return NoRoomError(
            f"{_unit_text(cfg)}, but {left}; "
            + ", or ".join([f"lower {_said(unit_fix, 'at most ')}", *shorter]),
            next(iter(unit_fix)),
        )
    longest = longest_fitting(cfg, room)
    if length > room:
        advice = f"lower {name} to {longest}"
        if not longest:  # a smaller unit too, and the longest length that fits with it
            unit_fix = _smaller_unit(cfg, room)
            advice = f"lower {name} to {longest_fitting(cfg.replace(**unit_fix), room)} and {_said(unit_fix)}"
        return NoRoomError(
            f"this model's maximum context length is {context} positions; the {prompt_len}-token prompt "
            f"and {name} {length} need {prompt_len + length}: " + ", or ".join([advice, *shorter]),
            name,
        )
    unit_fix = _smaller_unit(cfg, room - length + 1)
    lower = [f"lower {name} to {longest}"] if longest else []
    return NoRoomError(
        f"{name} {length} needs {need} positions: {_unit_text(cfg)}, and {left}; "
        + ", or ".join([*lower, f"lower {_said(unit_fix, 'at most ')}", *shorter]),
        name if longest else next(iter(unit_fix)),
    )


def _unit_text(cfg: DecodeConfig) -> str:
    return method_of(cfg).unit_text(cfg)


def _smaller_unit(cfg: DecodeConfig, slack: int) -> dict[str, int]:
    """The settings that make the unit at most `slack` (>= 1) positions, the first being
    the one to name. Any length n fits in a room r with any unit u <= r - n + 1: n
    rounded up to whole units is at most n + u - 1."""
    return method_of(cfg).smaller_unit(cfg, slack)


def _said(changes: dict[str, int], bound: str = "") -> str:
    """'slot_size to at most 4 and serial_blocks to 1': the first setting bounded (any
    smaller value does too), the others set."""
    first, *rest = changes.items()
    return " and ".join([f"{first[0]} to {bound}{first[1]}", *(f"{k} to {v}" for k, v in rest)])
