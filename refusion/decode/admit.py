"""A request admitted once: the one preparation every driver calls.

`Admission.prepare` turns what a driver was given (a text prompt, a conversation, token
ids; a `DecodeConfig` or none) into a `PreparedRequest`: the prompt tokenised (through
the chat template when asked), every token checked against the vocabulary, the MASK
token there for the methods that need one, stop strings with a tokenizer to read them,
EOS ids resolved, and gen_length fitted to the room the prompt leaves in the context
(`fit.fit_to_room`, with its advice). The engine trusts a prepared request as it is, so
the server (on a request thread, before anything is queued), the CLI, the evaluator and
`generate` check a request exactly once and the same way.

A prepared request is plain data (no tensors, no tokenizer): a tensor-parallel leader
sends it to its followers as it is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from ..errors import MissingMaskTokenError, PromptError
from ..model.prompts import Prompt, chat_ids, encode_prompt, eos_ids_of, mask_id_of
from ..settings.decode import DecodeConfig
from ..settings.fields import FieldError
from ..settings.model import ModelConfig
from .fit import NoRoomError, fit_to_room
from .grammar import check_grammar, requires_order

# a conversation: OpenAI-style messages ({"role": ..., "content": ...}), rendered by the chat template
Messages = Sequence[Mapping[str, Any]]
# text over the context times the longest token's characters times this cannot fit: refused untokenised
TEXT_SLACK = 2


@dataclass(frozen=True)
class PreparedRequest:
    """A request checked and fitted: what the engine decodes, trusted as it is."""

    ids: tuple[int, ...]  # (P,) the prompt's token ids, as fed
    cfg: DecodeConfig  # gen_length fits the room after the prompt
    eos_ids: frozenset[int]  # the ids that end it: its stop_token_ids, else the model's EOS ids
    asked: int  # the gen_length it came with; cfg.gen_length < asked when it was lowered to fit

    @property
    def lowered(self) -> bool:
        return self.cfg.gen_length < self.asked


class Admission:
    """The model facts a request is checked against (vocabulary, context, EOS and MASK
    ids, the tokenizer), and the default settings of a request that brings none (the
    checkpoint's recommendation)."""

    def __init__(self, config: ModelConfig, tokenizer: Any, default: DecodeConfig) -> None:
        self.tokenizer, self.default = tokenizer, default
        self.vocab, self.context = config.vocab_size, config.max_position_embeddings
        self.eos_ids = frozenset(eos_ids_of(config, tokenizer))
        self.mask_id = mask_id_of(config, tokenizer)
        self._longest: int | None = None

    def prepare(
        self,
        prompt: Prompt | Messages,
        cfg: DecodeConfig | None = None,
        *,
        chat: bool = True,
        length: int | None = None,
        lower: bool = False,
        length_name: str = "gen_length",
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> PreparedRequest:
        """`prompt` tokenised and checked with `cfg` (None: the default), its gen_length
        fitted: `length` (a user's number, `length_name` in the advice: a server's
        max_tokens) must fit as it is; without it, cfg's own gen_length must fit as it
        is, or with `lower` (a preset's or a checkpoint's length, not asked for by number)
        is lowered to the longest that fits. Raises PromptError, MissingMaskTokenError,
        NoRoomError (a ContextLengthError, with advice) or ConfigError, before any compute.
        `tools` (OpenAI's function tools) go to the chat template with a conversation."""
        cfg = cfg or self.default
        self._check_method(cfg)
        ids = self.encode(prompt, chat, tools)
        asked = length if length is not None or lower else cfg.gen_length  # None: lowered to fit
        fitted = fit_to_room(cfg, len(ids), self.context, asked, name=length_name)
        eos = frozenset(cfg.stop_token_ids) if cfg.stop_token_ids is not None else self.eos_ids
        return PreparedRequest(tuple(ids), fitted, eos, cfg.gen_length if length is None else length)

    def encode(
        self, prompt: Prompt | Messages, chat: bool = True, tools: Sequence[Mapping[str, Any]] | None = None
    ) -> list[int]:
        """The prompt's token ids: a conversation through the chat template (with `tools`,
        when given), text as one user message through it (chat=True) or as it is, ids as
        they are; each checked."""
        if isinstance(prompt, str):
            self._check_text_size(len(prompt))
            ids = encode_prompt(self.tokenizer, prompt, chat)
        elif prompt and isinstance(prompt[0], Mapping):
            messages = cast(Messages, prompt)
            self._check_text_size(sum(len(str(m.get("content") or "")) for m in messages))
            if self.tokenizer is None:
                raise PromptError("a conversation needs a tokenizer (its chat template)", "invalid_value")
            options: dict[str, Any] = {"tools": list(tools)} if tools else {}
            ids = chat_ids(self.tokenizer, messages, **options)
        else:
            ids = [int(t) for t in cast("Sequence[int]", prompt)]
            if any(not 0 <= t < self.vocab for t in ids):
                raise PromptError(f"prompt token ids must be in [0, {self.vocab})", "invalid_value")
        if not ids:
            raise PromptError(
                "the prompt is empty after tokenisation: give at least one token", "empty_prompt"
            )
        return ids

    def _check_method(self, cfg: DecodeConfig) -> None:
        top = cfg.logit_bias[-1][0] if cfg.logit_bias else -1  # its pairs are sorted by id
        if top >= self.vocab:
            raise FieldError("logit_bias", f"logit_bias token ids must be in [0, {self.vocab}), got {top}")
        if cfg.stop and self.tokenizer is None:
            raise PromptError("stop strings need a tokenizer (to read the text); pass stop_token_ids instead")
        if cfg.grammar is not None:
            self._check_grammar(cfg)
        if cfg.method in ("refusion", "mdm") and self.mask_id is None:
            raise MissingMaskTokenError(
                f"method {cfg.method!r} needs a MASK token and this model has none: "
                "run `refusion convert BASE OUT` (then train), or use method='ar'"
            )

    def _check_grammar(self, cfg: DecodeConfig) -> None:
        """A grammar needs settings that commit in order (`grammar.requires_order`), a
        tokenizer (the tokens' text), and must compile."""
        assert cfg.grammar is not None
        why = requires_order(cfg)
        if why is not None:
            raise FieldError("grammar", why)
        if self.tokenizer is None:
            raise FieldError("grammar", "a grammar needs the model's tokenizer (the text of its tokens)")
        check_grammar(cfg.grammar)

    def _check_text_size(self, size: int) -> None:
        """Refuse, before tokenising it, text that cannot fit the context: no token spells
        more than the vocabulary's longest token, so text over context x that many (x
        TEXT_SLACK) has more tokens than fit. Tokenising 15 MB would take seconds of CPU
        only to say the same."""
        longest = self.longest_token
        limit = self.context * longest * TEXT_SLACK
        if longest and size > limit:
            raise NoRoomError(
                f"the prompt is {size} characters long, over the {limit} that could fit the context of "
                f"{self.context} tokens (no token of this tokenizer spells more than {longest} "
                "characters); shorten it",
                None,
            )

    @property
    def longest_token(self) -> int:
        """The most characters one token of the vocabulary spells (0, no bound, for a
        tokenizer that does not list its vocabulary); read once, on first use."""
        if self._longest is None:
            try:
                self._longest = max((len(t) for t in self.tokenizer.get_vocab()), default=0)
            except (AttributeError, NotImplementedError):
                self._longest = 0
        return self._longest


def lowered_note(prepared: Sequence[PreparedRequest], context: int, preset: str | None) -> str | None:
    """The one line that says a gen_length was lowered to fit the context (None if none
    was), for drivers that let `prepare` lower it; `preset` names what set it."""
    lowered = [p.cfg.gen_length for p in prepared if p.lowered]
    if not lowered:
        return None
    asked = prepared[0].asked
    source = f"preset {preset}" if preset else "the checkpoint's recommendation or the default"
    to = f"{min(lowered)}" if min(lowered) == max(lowered) else f"{min(lowered)}-{max(lowered)}"
    total = len(prepared)
    return (
        f"note: gen_length {asked} ({source}) lowered to {to} "
        f"to fit the model's context of {context} "
        f"positions after the prompt, for {len(lowered)} of {total} prompt{'s' if total > 1 else ''}; "
        "--gen-length N sets it (and errors if it does not fit)"
    )
