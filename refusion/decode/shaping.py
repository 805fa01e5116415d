"""What a request does with its logits before any row reads them: it records their
log-probabilities (`Logprobs`, when it asks for them), applies its penalties and logit
bias (`Penalties`), then masks what its grammar forbids (`grammar.Constraint`).
`Forward.run` calls its `Shaping` once per forward, on the logits
rows the request asked for, so every reader (a ReFusion plan, its verification, its
infilling, an AR pick, an MDM step) sees the same penalised distribution: greedy
ReFusion with the lossless settings still commits the AR argmax, now of the penalised
distribution. A request that asks for neither has no `Shaping` and pays nothing.

Both need, for each logits row, the generated tokens its context holds (`contexts`): the
committed tokens, overlaid with what the forward feeds before that row and (an
infilling fork) the slot tokens its cache holds; MASKs are no tokens. A row at a real
token predicts the next position (the AR head); a row at a MASK predicts its own (the
denoiser), in a context that holds that MASK.

Log-probabilities are those of the model's own distribution (the raw logits, before
penalties, bias and temperature, as vLLM reports them by default). A token's is read from
the latest forward that predicted its position with exactly the committed tokens before
it as context (`source` "model": what AR decoding computes there, which every token of
an AR row and of a lossless ReFusion row has); failing that, from the forward that
decided it, with MASKs or drafts in its context (`source` "plan": the paper's rule, MDM).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..settings.decode import DecodeConfig
from .grammar import Constraint, Context

if TYPE_CHECKING:
    from .request import Request


@dataclass
class TokenLogprob:
    """One generated token's log-probability and the most likely alternatives at its
    position (`source`: see the module docstring; "none" if no forward predicted it)."""

    token: int
    logprob: float | None
    top: list[tuple[int, float]]  # (token id, log-probability), most likely first
    source: str


def contexts(
    req: Request,
    tokens: Sequence[int],
    positions: Sequence[int],
    want: tuple[int, int],
    mask_id: int | None,
    held: dict[int, int] | None = None,
) -> list[tuple[int, Context, bool]]:
    """Per wanted logits row of one feed: the generation offset it predicts, the generated
    tokens at the offsets before it, and whether it is a MASK's row (see the module
    docstring)."""
    P, (a, e) = len(req.prompt), want
    known: list[int | None] = list(req.filled)
    for o, t in (held or {}).items():
        known[o] = t
    rows = []
    for j in range(e):
        o, is_mask = positions[j] - P, tokens[j] == mask_id
        if not is_mask and 0 <= o < len(known):
            known[o] = tokens[j]
        if j >= a:
            target = o if is_mask else o + 1
            rows.append((target, known[: max(target, 0)], is_mask))
    return rows


class Penalties:
    """OpenAI's presence and frequency penalties over the generated tokens of a row's
    context, the repetition penalty over those and the prompt's (vLLM's and transformers'
    semantics), and the logit bias."""

    def __init__(self, cfg: DecodeConfig, prompt: Sequence[int] = ()) -> None:
        self.presence, self.frequency = cfg.presence_penalty, cfg.frequency_penalty
        self.repetition, self.prompt = cfg.repetition_penalty, sorted(set(prompt))
        self.pairs = cfg.logit_bias
        self.bias: torch.Tensor | None = None  # (V,), made on first use

    def __call__(self, logits: torch.Tensor, rows: list[tuple[int, Context, bool]]) -> torch.Tensor:
        """logits (n, V), one row per entry of `rows`, penalised and biased."""
        if self.pairs and self.bias is None:
            self.bias = torch.zeros(logits.shape[-1], device=logits.device, dtype=logits.dtype)
            ids, values = zip(*self.pairs)
            self.bias[list(ids)] = torch.tensor(values, dtype=logits.dtype, device=logits.device)
        if self.presence or self.frequency:
            r = [i for i, (_, ctx, _) in enumerate(rows) for t in ctx if t is not None]
            c = [t for _, ctx, _ in rows for t in ctx if t is not None]
            if c:
                counts = torch.zeros_like(logits)  # (n, V)
                at = (torch.tensor(r, device=logits.device), torch.tensor(c, device=logits.device))
                counts.index_put_(at, torch.ones(len(c), device=logits.device), accumulate=True)
                logits = logits - self.frequency * counts - self.presence * (counts > 0).to(logits.dtype)
        if self.repetition != 1:
            logits = self._repeated(logits, rows)
        return logits if self.bias is None else logits + self.bias

    def _repeated(self, logits: torch.Tensor, rows: list[tuple[int, Context, bool]]) -> torch.Tensor:
        """logits (n, V) of the tokens in the prompt or a row's context divided by the
        repetition penalty where positive, multiplied by it where negative."""
        seen = torch.zeros_like(logits, dtype=torch.bool)  # (n, V)
        if self.prompt:
            seen[:, self.prompt] = True
        r = [i for i, (_, ctx, _) in enumerate(rows) for t in ctx if t is not None]
        c = [t for _, ctx, _ in rows for t in ctx if t is not None]
        if c:
            seen[torch.tensor(r, device=logits.device), torch.tensor(c, device=logits.device)] = True
        scaled = torch.where(logits > 0, logits / self.repetition, logits * self.repetition)
        return torch.where(seen, scaled, logits)


@dataclass
class _Seen:
    context: tuple | None  # the exact context it was computed in (None: MASKs or gaps in it)
    row: torch.Tensor  # (V,) log-probabilities


@dataclass
class Logprobs:
    """A request's log-probabilities: per position the latest distribution that predicted
    it (an exact one kept over a later inexact one), settled into `tokens` as the final
    prefix grows."""

    top: int
    seen: dict[int, _Seen] = field(default_factory=dict)
    tokens: list[TokenLogprob] = field(default_factory=list)

    def observe(self, logits: torch.Tensor, rows: list[tuple[int, Context, bool]], region: int) -> None:
        """Raw logits (n, V) of a forward, one row per entry of `rows`."""
        chosen: dict[int, tuple[int, tuple | None]] = {}  # target -> (row, exact context)
        for i, (target, ctx, is_mask) in enumerate(rows):
            if not 0 <= target < region:
                continue
            exact = not is_mask and all(t is not None for t in ctx)
            before = chosen.get(target, (0, self.seen[target].context if target in self.seen else None))
            if exact or before[1] is None:
                chosen[target] = (i, tuple(ctx) if exact else None)
        if chosen:
            lp = torch.log_softmax(logits[[i for i, _ in chosen.values()]].float(), dim=-1)  # (k, V)
            for (target, (_, context)), row in zip(chosen.items(), lp):
                self.seen[target] = _Seen(context, row)

    def settle(self, filled: Sequence[int | None], start: int, end: int) -> None:
        """The final prefix grew over offsets [start, end): their tokens' log-probabilities."""
        for o in range(start, end):
            token = filled[o]
            assert token is not None  # the final prefix holds tokens only
            seen = self.seen.pop(o, None)
            if seen is None:
                self.tokens.append(TokenLogprob(token, None, [], "none"))
                continue
            exact = seen.context is not None and seen.context == tuple(filled[:o])
            values, ids = torch.topk(seen.row, min(self.top, seen.row.shape[-1]))
            top = list(zip(ids.tolist(), values.tolist()))
            self.tokens.append(TokenLogprob(token, float(seen.row[token]), top, "model" if exact else "plan"))


class Shaping:
    """A request's hook on its logits: `Logprobs` when asked for, `Penalties` when set, its
    grammar's `Constraint` when it has one (which needs the tokenizer's token texts)."""

    def __init__(
        self,
        cfg: DecodeConfig,
        tokenizer: Any = None,
        eos_ids: Iterable[int] = (),
        prompt: Sequence[int] = (),
    ) -> None:
        self.region = cfg.region_length
        self.logprobs = Logprobs(cfg.logprobs) if cfg.logprobs is not None else None
        self.penalties = Penalties(cfg, prompt) if cfg.penalised else None
        self.constraint = Constraint(cfg.grammar, tokenizer, eos_ids) if cfg.grammar else None

    def __call__(
        self,
        req: Request,
        logits: torch.Tensor,
        feed: tuple[Sequence[int], Sequence[int], tuple[int, int]],
        mask_id: int | None,
        held: dict[int, int] | None,
    ) -> torch.Tensor:
        """The logits (n, V) of one feed (tokens, positions, wanted rows) as its rows read them."""
        rows = contexts(req, *feed, mask_id, held)
        if self.logprobs is not None:
            self.logprobs.observe(logits, rows, self.region)
        if self.penalties is not None:
            logits = self.penalties(logits, rows)
        if self.constraint is not None:
            t0 = time.perf_counter()
            logits = self.constraint(logits, rows)
            req.stats.grammar_time += time.perf_counter() - t0
        return logits

    def settle(self, req: Request, filled: Sequence[int | None], start: int, end: int) -> None:
        """The final prefix grew over offsets [start, end)."""
        if self.logprobs is not None:
            self.logprobs.settle(filled, start, end)
        if self.constraint is not None:
            t0 = time.perf_counter()
            self.constraint.advance(filled, start, end)
            req.stats.grammar_time += time.perf_counter() - t0


def shaping_of(
    cfg: DecodeConfig, tokenizer: Any = None, eos_ids: Iterable[int] = (), prompt: Sequence[int] = ()
) -> Shaping | None:
    """A request's shaping (None: it asks for nothing that needs one)."""
    if not cfg.shapes and cfg.logprobs is None:
        return None
    return Shaping(cfg, tokenizer, eos_ids, prompt)
