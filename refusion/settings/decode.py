"""`DecodeConfig` (how one request is decoded) and `EngineConfig` (what the engine that
decodes it may use), the two dataclasses every driver shares: the CLI, the evaluator,
the lm-eval plugin and the server.

Each field's bounds and help are written once, in its metadata (`fields.knob`), and checked
in one place (`fields.check_value`): `validate` runs it, and the CLI's flags
(`cli/flags.py`) and the HTTP request (`serve/protocol/requests.py`, through
`serve/protocol/checks.py`) call it on the values they are given and report its errors in
their own terms. Model facts (EOS and MASK ids, the context length) are not
configuration: the engine reads them from the model.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from .fields import check_fields, check_value, knob

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
MAX_BIASES = 300  # logit_bias entries, OpenAI's limit
MAX_TOP_LOGPROBS = 20  # alternatives per token, OpenAI's limit


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
    # --- shaping the distribution (OpenAI's semantics), applied to every forward's logits of the
    # request (`decode/shaping.py`), so that ReFusion drafts and verifies with the same distribution
    presence_penalty: float = knob(
        0.0, "subtract this from the logit of every token already generated (OpenAI's)", lo=-2.0, hi=2.0
    )
    frequency_penalty: float = knob(
        0.0, "subtract this times its count from the logit of each token already generated", lo=-2.0, hi=2.0
    )
    repetition_penalty: float = knob(
        1.0,
        "divide the positive logits (multiply the negative ones) of every token in the prompt or "
        "already generated by this (vLLM's and transformers'; 1 = off)",
        lo=0.01,
        hi=100.0,
    )
    logit_bias: tuple[tuple[int, float], ...] = knob(
        (),
        "(token id, bias) pairs: the bias is added to that token's logit",
        lo=-100.0,
        hi=100.0,
        most=MAX_BIASES,
        flag=False,
        http=False,
    )
    # --- structured outputs (`decode/grammar.py`, docs/structured-outputs.md)
    grammar: str | None = knob(
        None,
        "constrain the output to this grammar: Lark text in llguidance's dialect, which embeds "
        "JSON schemas and regexes (docs/structured-outputs.md); AR and ReFusion's lossless settings",
        http=False,
    )
    # --- what the outputs carry
    logprobs: int | None = knob(
        None,
        "report each generated token's log-probability and this many most likely alternatives",
        lo=0,
        hi=MAX_TOP_LOGPROBS,
        flag=False,
        http=False,
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
        if self.logit_bias:  # a dict (JSON's string keys too) stored as sorted (id, bias) pairs
            object.__setattr__(self, "logit_bias", check_value(_field("logit_bias"), self.logit_bias))
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
    def shapes(self) -> bool:
        """Whether its logits are changed before anything reads them (penalties, a bias, a grammar)."""
        return bool(self.penalised or self.grammar)

    @property
    def penalised(self) -> bool:
        """Whether it has a penalty or a logit bias."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1 or self.logit_bias
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @functools.cached_property
    def lossless(self) -> str | None:
        """Whether these settings decode exactly what AR decoding of the same weights does,
        and where (docs/algorithm.md#lossless), the one place that says so:

        - "any temperature": AR itself; and ReFusion with ar_correction, first_token_check,
          token_threshold >= 0.5 and one slot per block: greedy, every accepted token is the
          AR argmax; sampled, verification is speculative sampling, so the text has AR
          sampling's distribution (at any temperature, top-k, top-p);
        - "temperature 0": those options with several slots per block and the left check:
          greedy decoding equals greedy AR; sampled, it is not exact;
        - None: the paper's rule and every other setting (MDM too)."""
        if self.method == "ar":
            return "any temperature"
        options = self.ar_correction and self.first_token_check and self.token_threshold >= 0.5
        if self.method != "refusion" or not options:
            return None
        if self.slots_per_block == 1:
            return "any temperature"
        return "temperature 0" if self.left_check else None

    @property
    def lossless_now(self) -> bool:
        """Whether this request, at its own temperature, decodes what AR decoding does."""
        return self.lossless == "any temperature" or (self.lossless == "temperature 0" and self.greedy)

    # ------------------------------------------------------------------ making one
    @classmethod
    def preset(cls, name: str, base: DecodeConfig | None = None, **overrides: Any) -> DecodeConfig:
        """The authors' settings for a benchmark (docs/algorithm.md#presets) on top of `base` (its sampling
        and stop settings are kept), then `overrides`: `DecodeConfig.preset("gsm8k")`."""
        if name not in _PAPER:
            raise ConfigError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
        s, b, ts, tt = _PAPER[name]
        values: dict[str, Any] = dict(
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


def _field(name: str) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(DecodeConfig) if f.name == name)


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
        "slot per block, token_threshold >= 0.5); other rows draft at their settings' widths, and a "
        "row alone at them while its own drafting blocks beat AR blocks (default: on; the server's "
        "startup line says which is in force)",
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
