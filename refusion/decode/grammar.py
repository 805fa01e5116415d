"""Structured outputs: a request's grammar enforced on its logits (docs/structured-outputs.md).

A grammar is Lark text in llguidance's dialect, which embeds a JSON schema (`%json {...}`)
and regular expressions (`/.../`); JSON schemas, JSON objects, regexes and choice lists are
written as such a grammar (`json_schema_grammar`, ...), so one field of `DecodeConfig`
(`grammar`) carries every kind and one mechanism enforces it.

`Constraint` keeps an llguidance matcher at the request's final prefix. `Shaping` hands it
each forward's logits rows with their contexts (`shaping.contexts`): a row whose context
is all known tokens (the final prefix, then what the feed holds before it: an AR step, a
verification's drafts, an infilling fork's slot) gets every token the grammar forbids
there masked to -inf, for every reader of the row. A row with MASKs in its context (the
plan's drafts past the first undecoded position) is left as it is: a draft it proposes
that leaves the grammar is rejected at verification, whose rows are masked. So AR
decoding and ReFusion's lossless settings commit only tokens the grammar allows, and the
lossless settings commit exactly what AR commits under the same grammar (greedily token
for token, sampled in distribution). Settings that commit out of left-to-right order or
without an AR check (the paper's rule, MDM) are refused (`requires_order`).
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ..settings.decode import DecodeConfig
from ..settings.fields import FieldError

Context = list  # per logits row: the generated tokens before the position it predicts (None: unknown)


# ---------------------------------------------------------------------------- writing a grammar
# JSON written as `json.dumps` writes it, one space after "," and ":" and none elsewhere: a
# grammar that allows any whitespace lets a small model emit whitespace until max_tokens
COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def json_schema_grammar(schema: Mapping[str, Any] | bool) -> str:
    """The grammar of JSON text that validates against `schema`, written compactly
    (`COMPACT`) unless the schema sets llguidance's own "x-guidance" options."""
    if isinstance(schema, Mapping) and "x-guidance" not in schema:
        schema = {**schema, "x-guidance": COMPACT}
    elif schema is True:
        schema = {"x-guidance": COMPACT}
    return f"start: %json {json.dumps(schema)}"


def json_object_grammar() -> str:
    """The grammar of any JSON object (OpenAI's JSON mode)."""
    return json_schema_grammar({"type": "object"})


def regex_grammar(pattern: str) -> str:
    """The grammar of text that the regular expression matches in full."""
    import llguidance

    return f"start: /{llguidance.regex_to_lark(pattern)}/"


def choice_grammar(options: Sequence[str]) -> str:
    """The grammar of exactly one of `options`."""
    return "start: " + " | ".join(json.dumps(o) for o in options)


def check_grammar(grammar: str) -> None:
    """FieldError("grammar") with llguidance's own message if the grammar does not compile
    (a bad schema, an unknown rule name, a regex it cannot read)."""
    llguidance = _llguidance()
    error = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(grammar))
    if error:
        raise FieldError("grammar", f"the grammar does not compile: {error.strip()}")


def requires_order(cfg: DecodeConfig) -> str | None:
    """Why these settings cannot take a grammar (None: they can). A grammar constrains
    each token given the tokens before it, so the method must commit left to right, each
    token checked against the AR distribution of its exact context: AR, and ReFusion's
    lossless settings at this temperature."""
    if cfg.lossless_now:
        return None
    return (
        f"a grammar (structured output) is enforced by AR decoding and by ReFusion's lossless "
        f"settings (ar_correction, first_token_check, token_threshold >= 0.5 and one slot per block, "
        f"or left_check at temperature 0), which commit left to right; these settings (method "
        f"{cfg.method}) {'commit out of order' if cfg.method == 'mdm' else 'do not'}: use "
        f"method ar, or those ReFusion settings"
    )


def _llguidance() -> Any:
    try:
        import llguidance
        import llguidance.hf  # noqa: F401  (the tokenizer bridge)
    except ImportError:  # pragma: no cover - a dependency of the package
        raise FieldError(
            "grammar", "structured outputs need llguidance: pip install 'llguidance>=1.0'"
        ) from None
    return llguidance


# ---------------------------------------------------------------------------- the matcher's tokenizer
_TOKENIZERS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def ll_tokenizer(tokenizer: Any) -> Any:
    """llguidance's view of a `transformers` tokenizer (made once per tokenizer: it reads
    every token's bytes)."""
    made = _TOKENIZERS.get(tokenizer)
    if made is None:
        made = _TOKENIZERS[tokenizer] = _llguidance().hf.from_tokenizer(tokenizer)
    return made


# ---------------------------------------------------------------------------- enforcing it
class Constraint:
    """A request's grammar at its final prefix: masks the logits rows whose contexts extend
    that prefix (`__call__`) and follows the prefix as it grows (`advance`)."""

    def __init__(self, grammar: str, tokenizer: Any, eos_ids: Iterable[int]) -> None:
        llguidance = _llguidance()
        words = ll_tokenizer(tokenizer)
        self.matcher = llguidance.LLMatcher(words, llguidance.LLMatcher.grammar_from_lark(grammar))
        self.words = words.vocab_size  # the tokens llguidance knows: the model's may be more (padding)
        self.eos = sorted(eos_ids)
        self.prefix: list[int] = []  # the final prefix the matcher has consumed
        self.broken: str | None = None  # why the final prefix left the grammar (never, where it is enforced)

    def __call__(self, logits: torch.Tensor, rows: list[tuple[int, Context, bool]]) -> torch.Tensor:
        """logits (n, V), one row per entry of `rows` (target, context, is MASK), in position
        order, with the tokens the grammar forbids after each row's context at -inf.

        A context must extend the final prefix. Where it holds MASKs of the same feed, each
        counts as the token its row would draft greedily (the argmax of its row, masked in
        turn): so a plan's or an infilling's drafts follow the grammar through a whole slot,
        exactly so when greedy. That guess only shapes the drafts; verification, whose
        contexts are the drafts themselves, decides what is committed."""
        if self.broken is not None:
            return logits
        n = len(self.prefix)
        extra: list[int] = []  # tokens consumed past the prefix, a stack shared by consecutive rows
        guess: dict[int, int] = {}  # target offset -> the token its MASK row drafts greedily
        values = logits.detach().float().cpu().numpy()  # (n, V), read for the guesses
        masked, masks = [], []
        for i, (target, ctx, is_mask) in enumerate(rows):
            known = [guess.get(j) if t is None else t for j, t in enumerate(ctx)]
            exact = len(known) >= n and None not in known and known[:n] == self.prefix
            allowed = None
            if exact and self._move(extra, known[n:]):  # type: ignore[arg-type]
                allowed = self._allowed(logits.shape[-1])
                masked.append(i)
                masks.append(allowed)
            if is_mask:
                row = values[i] if allowed is None else np.where(allowed, values[i], -np.inf)
                guess[target] = int(row.argmax())
        self.matcher.rollback(len(extra))
        if not masked:
            return logits
        out = logits.clone()
        forbidden = ~torch.from_numpy(np.stack(masks)).to(logits.device)  # (m, V)
        out[masked] = out[masked].masked_fill(forbidden, float("-inf"))
        return out

    def _move(self, extra: list[int], want: list[int]) -> bool:
        """The matcher moved from prefix + `extra` to prefix + `want` (rolling back to their
        common part, then consuming the rest); False, and left at the common part, if a
        token of `want` leaves the grammar."""
        common = 0
        for a, b in zip(extra, want):
            if a != b:
                break
            common += 1
        if len(extra) > common:
            self.matcher.rollback(len(extra) - common)
            del extra[common:]
        rest = want[common:]
        took = self.matcher.try_consume_tokens(rest) if rest else 0
        extra.extend(rest[:took])
        return took == len(rest)

    def _allowed(self, vocab: int) -> np.ndarray:
        """(vocab,) bool: the tokens the grammar allows next; its end-of-text is any of the
        request's end tokens (its EOS ids), which end it only where it is complete."""
        # the mask's little-endian 32-bit words: bit j of word w is token 32 w + j, so its bytes
        # unpacked little-endian bit by bit are the tokens in order
        packed = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        known = min(vocab, self.words)
        bits = np.zeros(vocab, dtype=bool)
        bits[:known] = np.unpackbits(packed, bitorder="little")[:known]
        eos = [t for t in self.eos if t < vocab]
        if eos:
            bits[eos] = bool(bits[eos].any() or self.matcher.is_accepting())
        if not bits.any():  # nothing may follow (a grammar that neither continues nor ends)
            bits[:] = True
        return bits

    def advance(self, filled: Sequence[int | None], start: int, end: int) -> None:
        """The final prefix grew over offsets [start, end): the matcher consumes them (an end
        token ends the text: nothing after it is read)."""
        for o in range(start, end):
            token = filled[o]
            assert token is not None  # the final prefix holds tokens only
            self.prefix.append(token)
            if self.broken is None and token not in self.eos and not self.matcher.consume_token(token):
                self.broken = f"the token at offset {o} leaves the grammar"
