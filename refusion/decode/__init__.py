"""Decoding: `generate(model, tokenizer, prompts, cfg)` for ReFusion and its baselines.

Everything that decodes (CLI, evaluator, server, benchmarks) comes through `generate`,
which validates the request before any compute, batches prompts under a memory budget,
and hands each batch to one method: `refusion` (plan-and-infill, SPEC §3), `ar` or `mdm`
(SPEC §4).
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ..errors import ConfigError, ContextLengthError, MissingMaskTokenError
from ..model import Transformer
from .ar import ARDecoder
from .config import METHODS, PRESETS, DecodeConfig
from .engine import DecodeStats, Forward, GenerationOutput, Progress, TraceEvent, compiled_step
from .mdm import decode_mdm
from .refusion import ReFusionDecoder
from .sampling import Sampler

__all__ = [
    "DecodeConfig", "DecodeStats", "GenerationOutput", "TraceEvent", "METHODS", "PRESETS",
    "generate", "stream", "encode_prompts", "resolve_ids", "check_prompts", "TextDeltas",
    "batch_size_for", "longest_that_fits",
]

Prompt = str | Sequence[int]


def encode_prompts(tokenizer: Any, prompts: Sequence[Prompt], chat: bool = True) -> list[list[int]]:
    """Token ids per prompt: text goes through the chat template (if the tokenizer has
    one and chat=True); a list of ids is taken as it is."""
    out = []
    for p in prompts:
        if isinstance(p, str):
            if tokenizer is None:
                raise ConfigError("text prompts need a tokenizer; pass token ids to decode without one")
            if chat and getattr(tokenizer, "chat_template", None):
                p = tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
                out.append(list(tokenizer(p, add_special_tokens=False)["input_ids"]))
            else:
                out.append(list(tokenizer(p)["input_ids"]))
        else:
            out.append([int(t) for t in p])
    return out


def resolve_ids(model: Transformer, tokenizer: Any, cfg: DecodeConfig) -> tuple[set[int], int | None]:
    """(EOS ids, MASK id): the config's overrides first, then the tokenizer and model config."""
    if cfg.eos_id is not None:
        eos = {cfg.eos_id} if isinstance(cfg.eos_id, int) else set(cfg.eos_id)
    else:
        eos = set(model.config.eos_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(int(tokenizer.eos_token_id))
    mask = cfg.mask_id if cfg.mask_id is not None else model.config.mask_token_id
    if mask is None and tokenizer is not None:
        tid = tokenizer.convert_tokens_to_ids("<|mask|>")
        mask = tid if isinstance(tid, int) and tid != tokenizer.unk_token_id else None
    return eos, mask


def _check_request(model: Transformer, cfg: DecodeConfig, ids: list[list[int]], mask_id: int | None) -> None:
    if not ids:
        raise ConfigError("no prompts given")
    if any(len(p) == 0 for p in ids):
        raise ConfigError("a prompt is empty: give at least one token")
    if cfg.method in ("refusion", "mdm") and mask_id is None:
        raise MissingMaskTokenError(
            f"method {cfg.method!r} needs a MASK token and this model has none: "
            "run `refusion convert BASE OUT` (then train), pass mask_id, or use method='ar'"
        )
    if mask_id is not None and not 0 <= mask_id < model.config.vocab_size:
        raise ConfigError(f"mask_id {mask_id} is outside the vocabulary (size {model.config.vocab_size})")
    gen = {"refusion": cfg.padded_length, "ar": cfg.gen_length, "mdm": -(-cfg.gen_length // cfg.mdm_block_length) * cfg.mdm_block_length}[cfg.method]
    limit = model.config.max_position_embeddings
    longest = max(len(p) for p in ids)
    if longest + gen > limit:
        raise ContextLengthError(
            f"prompt ({longest} tokens) + generation ({gen}) exceeds the model's context of {limit} positions; "
            "shorten the prompt or lower gen_length"
        )


def _bytes_per_entry(model: Transformer, cfg: DecodeConfig) -> int:
    """KV-cache bytes one prompt holds per entry of its rows (ReFusion also forks one cache
    row per selected slot during infilling, so it reserves a row per slot of a block)."""
    c = model.config
    per_entry = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * model.dtype.itemsize
    rows_per_prompt = 1 + (cfg.padded_length // cfg.slot_size // cfg.serial_blocks if cfg.method == "refusion" else 0)
    return per_entry * rows_per_prompt


def batch_size_for(model: Transformer, cfg: DecodeConfig, longest: int) -> int:
    """How many prompts fit the KV-cache memory budget when the longest has `longest` tokens."""
    per_prompt = _bytes_per_entry(model, cfg) * (longest + 2 * cfg.padded_length)
    fits = int(cfg.memory_budget_gb * 2**30 // max(per_prompt, 1))
    return max(1, min(cfg.max_batch_size, fits))


def longest_that_fits(model: Transformer, cfg: DecodeConfig, n_prompts: int) -> int:
    """The longest prompt (tokens) with which n_prompts rows still fit the memory budget:
    a prompt joining a running batch must not be longer, or the batch outgrows it."""
    per_prompt = int(cfg.memory_budget_gb * 2**30 // max(n_prompts, 1))
    return per_prompt // _bytes_per_entry(model, cfg) - 2 * cfg.padded_length


@torch.inference_mode()
def generate(
    model: Transformer,
    tokenizer: Any,
    prompts: Prompt | Sequence[Prompt],
    cfg: DecodeConfig | None = None,
    *,
    chat: bool = True,
    trace: bool = False,
    on_prefix: Callable[[int, list[int], bool], None] | None = None,
    is_cancelled: Callable[[int], bool] | None = None,
    admit: Callable[[int, int], Sequence[Sequence[int]]] | None = None,
) -> list[GenerationOutput]:
    """Decode every prompt; outputs come back in the order given.

    `on_prefix(i, ids, done)` streams prompt i's final left-to-right prefix as it grows;
    `is_cancelled(i)` stops prompt i early (finish_reason "cancelled").

    Methods `ar` and `refusion` batch continuously: a row that finishes frees its place
    for the next prompt at once. `admit(room, max_len)` (a server's queue) is then asked
    between steps for up to `room` more prompts of at most `max_len` tokens each (longer
    ones would outgrow the memory budget: they wait for a later batch), as token ids
    already checked with `check_prompts`; they join the running batch, take the next
    indices (len(prompts), ...) in the callbacks and come back at the end of the list."""
    cfg = (cfg or DecodeConfig()).validate()
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    ids = encode_prompts(tokenizer, prompts, chat)
    eos_ids, mask_id = resolve_ids(model, tokenizer, cfg)
    _check_request(model, cfg, ids, mask_id)
    progress = Progress(len(ids), eos_ids, on_prefix, is_cancelled, trace)
    sampler = Sampler(cfg, len(ids), model.device)
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))  # similar lengths batch together
    longest = max(len(p) for p in ids)
    bs = batch_size_for(model, cfg, longest)
    pad_id = mask_id if mask_id is not None else next(iter(eos_ids), 0)
    fwd = Forward(model, progress, pad_id, compiled_step() if cfg.compile else None)
    if cfg.method == "mdm":  # no KV cache, rows step through blocks together: batch by batch
        for start in range(0, len(order), bs):
            rids = order[start : start + bs]
            decode_mdm(fwd, progress, sampler, cfg, [ids[i] for i in rids], rids, mask_id, eos_ids)
    else:
        # rows in flight at most: the cache reserves storage for them up front (a server's
        # batch may fill to bs; a fixed set of prompts never needs more rows than it has)
        rows = bs if admit is not None else min(bs, len(ids))
        if cfg.method == "refusion":
            decoder: ARDecoder | ReFusionDecoder = ReFusionDecoder(fwd, progress, sampler, cfg, mask_id, eos_ids, max_rows=rows)
        else:
            decoder = ARDecoder(fwd, progress, sampler, cfg, eos_ids, max_rows=rows)
        max_len = max(longest, longest_that_fits(model, cfg, bs))
        _decode_continuous(decoder, ids, deque(order), bs, max_len, progress, sampler, admit)
    return [_output(i, ids[i], progress, tokenizer, eos_ids) for i in range(len(ids))]


def _decode_continuous(decoder: ARDecoder | ReFusionDecoder, ids: list[list[int]], waiting: deque[int], bs: int, max_len: int,
                       progress: Progress, sampler: Sampler, admit: Callable[[int, int], Sequence[Sequence[int]]] | None) -> None:
    """Keep up to `bs` rows decoding: waiting prompts first, then whatever `admit` gives
    (prompts of at most `max_len` tokens: `bs` rows of that length fit the budget)."""
    while True:
        room = bs - decoder.active
        if room > 0 and waiting:
            rids = [waiting.popleft() for _ in range(min(room, len(waiting)))]
            decoder.admit([ids[i] for i in rids], rids)
        room = bs - decoder.active
        if room > 0 and not waiting and admit is not None:
            new = [[int(t) for t in p] for p in admit(room, max_len)]
            if len(new) > room or any(len(p) > max_len for p in new):
                raise ValueError(f"admit returned {len(new)} prompts of up to {max(map(len, new))} tokens; "
                                 f"asked for at most {room} of at most {max_len}")
            if new:
                rids = progress.extend(len(new))
                sampler.extend(len(new))
                ids.extend(new)
                decoder.admit(new, rids)
        if not decoder.active:
            return
        decoder.step()


def check_prompts(model: Transformer, tokenizer: Any, cfg: DecodeConfig, ids: Sequence[Sequence[int]]) -> None:
    """Raise what `generate` would raise for these token-id prompts, before any compute
    (a server checks a request before it joins a running batch)."""
    _, mask_id = resolve_ids(model, tokenizer, cfg)
    _check_request(model, cfg.validate(), [list(p) for p in ids], mask_id)


def _output(i: int, prompt: list[int], progress: Progress, tokenizer: Any, eos_ids: set[int]) -> GenerationOutput:
    toks = progress.output_ids(i)
    stats = progress.stats[i]
    stats.tokens = len(toks)
    if progress.on_prefix is not None:
        progress.on_prefix(i, toks, True)
    reason = "cancelled" if progress.cancelled[i] else "stop" if toks and toks[-1] in eos_ids else "length"
    text = tokenizer.decode(toks, skip_special_tokens=True) if tokenizer is not None else ""
    return GenerationOutput(text, toks, stats, len(prompt), reason, progress.traces[i] if progress.traces else None)


class TextDeltas:
    """Turns growing token prefixes into text deltas; holds back an incomplete UTF-8
    character (decoded as U+FFFD) until the next token completes it."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.sent = ""

    def update(self, ids: list[int], final: bool = False) -> str:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if not final and text.endswith("\ufffd"):
            return ""
        delta = text[len(self.sent):] if text.startswith(self.sent) else ""
        self.sent = text if text.startswith(self.sent) else self.sent
        return delta


def stream(model: Transformer, tokenizer: Any, prompt: Prompt, cfg: DecodeConfig | None = None, *, chat: bool = True) -> Iterator[str]:
    """Yield text as soon as a left-to-right prefix of the generation is final. Slots
    decoded further right show up once the gap before them is filled."""
    q: queue.Queue = queue.Queue()
    deltas = TextDeltas(tokenizer)
    stop = threading.Event()

    def on_prefix(_i: int, ids: list[int], done: bool) -> None:
        d = deltas.update(ids, final=done)
        if d:
            q.put(d)

    def work() -> None:
        try:
            generate(model, tokenizer, [prompt], cfg, chat=chat, on_prefix=on_prefix, is_cancelled=lambda _i: stop.is_set())
            q.put(None)
        except BaseException as e:  # re-raised in the consumer's thread
            q.put(e)

    t = threading.Thread(target=work, daemon=True)
    t.start()
    try:
        while (item := q.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        t.join()
