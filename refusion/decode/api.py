"""`generate` and `stream`: the thinnest drivers of the `Engine` (add requests, step
until done)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from ..errors import ConfigError
from ..model.prompts import Prompt, encode_prompt
from ..model.transformer import Transformer
from ..settings.decode import DecodeConfig, EngineConfig
from .engine import Engine
from .fit import fit_to_room
from .request import RequestOutput


def generate(
    model: Transformer,
    tokenizer,
    prompts: Prompt | Sequence[Prompt],
    cfg: DecodeConfig | Sequence[DecodeConfig] | None = None,
    *,
    engine_config: EngineConfig | None = None,
    chat: bool = True,
    trace: bool | str = False,
    on_output: Callable[[int, RequestOutput], None] | None = None,
) -> list[RequestOutput]:
    """Decode every prompt, with one config for all or one per prompt (None: what the
    checkpoint recommends, its decode_config.json); outputs come back in the order given.
    Every prompt is checked before any compute. `on_output(i, out)` sees prompt i's output
    each time its final left-to-right prefix grows (its text then streams; without it,
    text is decoded once per prompt, at the end)."""
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    if not prompts:
        raise ConfigError("no prompts given")
    cfgs = list(cfg) if isinstance(cfg, Sequence) else [cfg] * len(prompts)
    if len(cfgs) != len(prompts):
        raise ConfigError(
            f"{len(cfgs)} configs for {len(prompts)} prompts: give one config, or one per prompt"
        )
    engine = Engine(model, tokenizer, engine_config)
    ids = [encode_prompt(tokenizer, p, chat) for p in prompts]
    for i in sorted(range(len(ids)), key=lambda i: len(ids[i])):  # similar lengths batch together
        engine.add_request(ids[i], cfgs[i], request_id=str(i), trace=trace, stream=on_output is not None)
    outputs: list[RequestOutput | None] = [None] * len(prompts)
    while engine.has_unfinished():
        for out in engine.step():
            i = int(out.request_id)
            if on_output is not None:
                on_output(i, out)
            if out.finished:
                outputs[i] = out
    return outputs  # type: ignore[return-value]


def fit_to_context(
    model: Transformer, tokenizer, prompts: Sequence[Prompt], cfg: DecodeConfig, *, chat: bool = True
) -> tuple[list[list[int]], list[DecodeConfig], list[int]]:
    """The prompts as token ids, each with `cfg`'s gen_length lowered to what the model's
    context leaves after it (`fit_to_room`), and the lengths of those it lowered. For
    lengths the user did not ask for by number (a preset's 512, a checkpoint's
    recommendation); drivers say in one line that they lowered them (`lowered_note`).
    Raises NoRoomError (a ContextLengthError) for a prompt that leaves no room."""
    context = model.config.max_position_embeddings
    ids = [encode_prompt(tokenizer, p, chat) for p in prompts]
    cfgs = [fit_to_room(cfg, len(i), context) for i in ids]
    return ids, cfgs, [c.gen_length for c in cfgs if c.gen_length < cfg.gen_length]


def lowered_note(
    cfg: DecodeConfig, lowered: Sequence[int], total: int, context: int, preset: str | None
) -> str | None:
    """The one line that says a gen_length was lowered to fit the context (None if none
    was); `lowered` holds the lengths it was lowered to, `preset` the one that set it."""
    if not lowered:
        return None
    source = f"preset {preset}" if preset else "the checkpoint's recommendation or the default"
    to = f"{min(lowered)}" if min(lowered) == max(lowered) else f"{min(lowered)}-{max(lowered)}"
    return (
        f"note: gen_length {cfg.gen_length} ({source}) lowered to {to} "
        f"to fit the model's context of {context} "
        f"positions after the prompt, for {len(lowered)} of {total} prompt{'s' if total > 1 else ''}; "
        "--gen-length N sets it (and errors if it does not fit)"
    )


def stream(
    model: Transformer,
    tokenizer,
    prompt: Prompt,
    cfg: DecodeConfig | None = None,
    *,
    engine_config: EngineConfig | None = None,
    chat: bool = True,
) -> Iterator[str]:
    """Yield text as soon as a left-to-right prefix of the generation is final. Slots
    decoded further right show up once the gap before them is filled."""
    engine = Engine(model, tokenizer, engine_config)
    rid = engine.add_request(prompt, cfg, chat=chat)
    try:
        while engine.has_unfinished():
            for out in engine.step():
                if out.delta:
                    yield out.delta
    finally:
        engine.abort(rid)  # the consumer stopped early: nothing more is computed
