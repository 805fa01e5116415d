"""`fit_to_room`: one request fitted to the room its prompt leaves in the context, and the
advice when it does not fit (the engine's check, the library's and the CLI's lowered
gen_length, chat's prompt and the server's max_tokens all use it)."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refusion.decode.fit import NoRoomError, fit_to_room, fits
from refusion.errors import ContextLengthError
from refusion.settings.decode import DecodeConfig

CONTEXT = 512
LOWER = re.compile(r"lower (\w+) to (?:at most )?(\d+)((?: and \w+ to \d+)*)")
SHORTER = re.compile(r"shorten the prompt to at most (\d+) tokens")


def refusal(
    cfg: DecodeConfig, prompt: int, length: int | None = None, name: str = "gen_length"
) -> NoRoomError:
    with pytest.raises(NoRoomError) as e:
        fit_to_room(cfg, prompt, CONTEXT, length, name=name)
    return e.value


def changes(message: str) -> list[dict[str, int]]:
    """The settings each "lower ..." of an advice changes, in order."""
    return [
        {knob: int(value)} | {k: int(v) for k, v in re.findall(r" and (\w+) to (\d+)", rest)}
        for knob, value, rest in LOWER.findall(message)
    ]


def test_a_request_that_fits_is_kept_as_it_is():
    cfg = DecodeConfig(gen_length=64, slot_size=8, serial_blocks=2)
    assert fit_to_room(cfg, 10, CONTEXT) is cfg
    assert fit_to_room(cfg, 10, CONTEXT, 64) is cfg
    fitted = fit_to_room(
        cfg, 10, CONTEXT, 10, name="max_tokens"
    )  # a length asked for: the region is rounded up
    assert (fitted.gen_length, fitted.region_length) == (10, 16)
    assert fits(cfg, CONTEXT - 64, CONTEXT) and not fits(cfg, CONTEXT - 63, CONTEXT)


def test_a_length_not_asked_for_is_lowered_to_whole_units():
    cfg = DecodeConfig(gen_length=512, slot_size=8, serial_blocks=2)
    fitted = fit_to_room(cfg, 470, CONTEXT)
    assert (fitted.gen_length, fitted.region_length) == (32, 32)  # 42 left: two whole units


def test_a_length_asked_for_is_refused_with_one_that_fits():
    cfg = DecodeConfig(gen_length=64, slot_size=8, serial_blocks=2)
    err = refusal(cfg, 470, 64)
    assert isinstance(err, ContextLengthError) and err.setting == "gen_length"
    assert "maximum context length is 512" in str(err) and "lower gen_length to 32" in str(err)
    assert "shorten the prompt to at most 448 tokens" in str(err)
    assert fit_to_room(cfg, 470, CONTEXT, 32).gen_length == 32 and fit_to_room(cfg, 448, CONTEXT, 64) is cfg
    err = refusal(cfg, 470, 64, name="max_tokens")  # the server's name for it
    assert (
        err.setting == "max_tokens" and "lower max_tokens to 32" in str(err) and "gen_length" not in str(err)
    )


def test_a_unit_too_large_for_the_length_asks_for_fewer_serial_blocks():
    """Slots of 2 in 16 blocks: 8 tokens need 32 positions; 14 are left. Slots cannot get
    smaller across 16 blocks, so the advice is fewer blocks, and they fit."""
    cfg = DecodeConfig(gen_length=8, slot_size=2, serial_blocks=16)
    err = refusal(cfg, CONTEXT - 14, 8)
    assert err.setting == "serial_blocks"
    assert "gen_length 8 needs 32 positions" in str(err) and "lower serial_blocks to at most 3" in str(err)
    assert fit_to_room(cfg.replace(serial_blocks=3), CONTEXT - 14, CONTEXT, 8).region_length <= 14


def test_a_unit_larger_than_the_room_asks_for_smaller_slots():
    cfg = DecodeConfig.preset("gsm8k")  # 32 x 4 = 128 positions a unit
    err = refusal(cfg, 500)
    assert err.setting == "slot_size" and "lower slot_size to at most 3" in str(err)
    assert "shorten the prompt to at most 384 tokens" in str(err)
    assert fit_to_room(cfg.replace(slot_size=3), 500, CONTEXT).region_length <= 12


@pytest.mark.parametrize("length", [None, 16])
def test_a_prompt_that_fills_the_context_fits_nothing(length):
    cfg = DecodeConfig(gen_length=64, slot_size=8, serial_blocks=2)
    err = refusal(cfg, CONTEXT, length)
    assert err.setting is None and "leaves no room to generate" in str(err)
    assert "shorten the prompt to at most 496 tokens" in str(err)
    assert fit_to_room(cfg, 496, CONTEXT, length).region_length == 16


@settings(max_examples=500, deadline=None)
@given(
    method=st.sampled_from(["refusion", "mdm", "ar"]),
    size=st.integers(1, 600),
    blocks=st.integers(1, 64),
    mdm_block=st.integers(1, 600),
    prompt=st.integers(1, 600),
    length=st.one_of(st.none(), st.integers(1, 700)),
)
def test_every_refusal_names_changes_that_fit(method, size, blocks, mdm_block, prompt, length):
    """Whatever the request, it fits, or each change the refusal offers makes it fit: each
    "lower ..." (with the length it names, if any), and the shorter prompt; the error's
    setting is the one the first of them changes."""
    cfg = DecodeConfig(
        method=method, slot_size=size, serial_blocks=blocks, mdm_block_length=mdm_block, gen_length=256
    )
    try:
        fitted = fit_to_room(cfg, prompt, CONTEXT, length)
    except NoRoomError as e:
        err = e
    else:
        assert fitted.region_length <= CONTEXT - prompt and (length is None or fitted.gen_length == length)
        return
    message = str(err)
    if shorter := SHORTER.search(message):
        assert fit_to_room(cfg, int(shorter[1]), CONTEXT, length).region_length <= CONTEXT - int(shorter[1])
    if err.setting is None:
        assert prompt >= CONTEXT
        return
    options = changes(message)
    assert options and err.setting == next(iter(options[0]))
    for change in options:
        asked = change.pop("gen_length", length)
        fitted = fit_to_room(cfg.replace(**change), prompt, CONTEXT, asked)
        assert fitted.region_length <= CONTEXT - prompt, (message, change)
