"""Log-probabilities in OpenAI's two shapes: chat's `{"content": [...]}` and the legacy
completions' parallel lists (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`).

Each token also carries `logprob_source` (an extension, see `decode/shaping.py`):
"model" when its log-probability is the model's own next-token distribution given
exactly the tokens before it (every token of AR and of lossless ReFusion settings),
"plan" when it is the distribution that decided the token under the paper's rule or MDM
(MASKs or unverified drafts in its context). A token no forward predicted ("none") gets
OpenAI's floor of -9999.0. Tokens are spelled one at a time by the tokenizer, and
`bytes` are those of that spelling.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...decode.shaping import TokenLogprob

FLOOR = -9999.0  # OpenAI's log-probability of a token it has none for


class Speller:
    """Token ids as text, each spelled once per request."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.known: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        if token not in self.known:
            self.known[token] = self.tokenizer.decode([token]) if self.tokenizer is not None else str(token)
        return self.known[token]


def _value(lp: float | None) -> float:
    return FLOOR if lp is None else max(lp, FLOOR)


def chat_logprobs(spell: Speller, tokens: Sequence[TokenLogprob]) -> dict[str, Any]:
    """A chat choice's (or chunk's) `logprobs`."""

    def entry(token: int, lp: float | None) -> dict[str, Any]:
        text = spell(token)
        return {"token": text, "logprob": _value(lp), "bytes": list(text.encode("utf-8"))}

    content = [
        entry(t.token, t.logprob)
        | {"top_logprobs": [entry(i, v) for i, v in t.top], "logprob_source": t.source}
        for t in tokens
    ]
    return {"content": content, "refusal": None}


def completion_logprobs(spell: Speller, tokens: Sequence[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """A completion choice's (or chunk's) `logprobs`; `offset`: characters of the choice's
    text before these tokens."""
    texts = [spell(t.token) for t in tokens]
    starts = []
    for text in texts:
        starts.append(offset)
        offset += len(text)
    return {
        "tokens": texts,
        "token_logprobs": [_value(t.logprob) for t in tokens],
        "top_logprobs": [{spell(i): _value(v) for i, v in t.top} for t in tokens],
        "text_offset": starts,
        "logprob_source": [t.source for t in tokens],
    }


def choice_logprobs(
    kind: str, spell: Speller, tokens: Sequence[TokenLogprob] | None, offset: int = 0
) -> dict[str, Any] | None:
    """A choice's `logprobs` in the shape of its route (None: not asked for)."""
    if tokens is None:
        return None
    return chat_logprobs(spell, tokens) if kind == "chat" else completion_logprobs(spell, tokens, offset)
