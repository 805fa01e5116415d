"""`generate` and `stream`: the thinnest drivers of the `Engine` (add requests, step
until done)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import cast

from ..errors import ConfigError
from ..model.prompts import Prompt
from ..model.transformer import Transformer
from ..settings.decode import DecodeConfig, EngineConfig
from ..settings.recommended import recommended_of
from .admit import Admission, PreparedRequest
from .engine import Engine
from .request import RequestOutput


def generate(
    model: Transformer,
    tokenizer,
    prompts: Prompt | PreparedRequest | Sequence[Prompt | PreparedRequest],
    cfg: DecodeConfig | Sequence[DecodeConfig] | None = None,
    *,
    engine_config: EngineConfig | None = None,
    chat: bool = True,
    trace: bool | str = False,
    on_output: Callable[[int, RequestOutput], None] | None = None,
) -> list[RequestOutput]:
    """Decode every prompt, with one config for all or one per prompt (None: what the
    checkpoint recommends, its decode_config.json); outputs come back in the order given.
    Prompts may come prepared (`prepare`: then without configs). Every prompt is checked
    before any compute. `on_output(i, out)` sees prompt i's output each time its final
    left-to-right prefix grows (its text then streams; without it, text is decoded once
    per prompt, at the end)."""
    many = _as_list(prompts)
    if not many:
        raise ConfigError("no prompts given")
    cfgs = list(cfg) if isinstance(cfg, Sequence) else [cfg] * len(many)
    if len(cfgs) != len(many):
        raise ConfigError(f"{len(cfgs)} configs for {len(many)} prompts: give one config, or one per prompt")
    engine = Engine(model, tokenizer, engine_config)
    ready = [_prepared(engine, p, c, chat) for p, c in zip(many, cfgs)]
    for i in sorted(range(len(ready)), key=lambda i: len(ready[i].ids)):  # similar lengths batch together
        engine.add_request(ready[i], request_id=str(i), trace=trace, stream=on_output is not None)
    outputs: list[RequestOutput | None] = [None] * len(many)
    while engine.has_unfinished():
        for out in engine.step():
            i = int(out.request_id)
            if on_output is not None:
                on_output(i, out)
            if out.finished:
                outputs[i] = out
    return outputs  # type: ignore[return-value]


def _as_list(
    prompts: Prompt | PreparedRequest | Sequence[Prompt | PreparedRequest],
) -> list[Prompt | PreparedRequest]:
    """One prompt (text, token ids, prepared) as a list of one; a list of them as it is."""
    if isinstance(prompts, (str, PreparedRequest)) or (prompts and isinstance(prompts[0], int)):
        return [cast("Prompt | PreparedRequest", prompts)]
    return list(cast("Sequence[Prompt | PreparedRequest]", prompts))


def _prepared(
    engine: Engine, prompt: Prompt | PreparedRequest, cfg: DecodeConfig | None, chat: bool
) -> PreparedRequest:
    if isinstance(prompt, PreparedRequest):
        if cfg is not None:
            raise ConfigError("prepared prompts carry their own configs: pass cfg=None with them")
        return prompt
    return engine.prepare(prompt, cfg, chat=chat)


def prepare(
    model: Transformer,
    tokenizer,
    prompts: Sequence[Prompt],
    cfg: DecodeConfig | None = None,
    *,
    chat: bool = True,
    lower: bool = True,
) -> list[PreparedRequest]:
    """Each prompt checked and fitted once (`Admission.prepare`), to pass to `generate`
    as it is: with `lower`, cfg's gen_length (a preset's, a checkpoint's recommendation:
    not asked for by number) is lowered to what the model's context leaves after each
    prompt, and `admit.lowered_note` says so in one line. Raises NoRoomError (a
    ContextLengthError) for a prompt that leaves no room."""
    admission = Admission(model.config, tokenizer, recommended_of(model).decode_config())
    return [admission.prepare(p, cfg, chat=chat, lower=lower) for p in prompts]


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
