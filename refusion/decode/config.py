"""`DecodeConfig`: every knob of every decoding method, one dataclass shared by the CLI,
the evaluator and the server; the authors' per-benchmark settings are named presets."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError

METHODS = ("refusion", "ar", "mdm")

# The authors' settings (SPEC §3): gen_length 512; (slot_size, serial_blocks, slot_threshold, token_threshold).
_PAPER = {
    "gsm8k": (32, 4, 0.9, 0.4),
    "math": (32, 8, 0.8, 0.6),
    "mbpp": (32, 4, 0.9, 0.3),
    "humaneval": (32, 4, 0.9, 0.4),
    "gpqa": (8, 32, 0.8, 0.2),
    "arc_challenge": (8, 64, 0.8, 0.1),
    "mmlu_pro": (16, 4, 0.9, 0.4),
}


@dataclass
class DecodeConfig:
    """How to decode. Fields not used by a method are ignored by it."""

    method: str = "refusion"  # refusion | ar | mdm
    gen_length: int = 256  # tokens to generate at most (ReFusion rounds up to a multiple of slot_size)
    # --- ReFusion (SPEC §3)
    slot_size: int = 8  # tokens per slot
    serial_blocks: int = 1  # the generation region is decoded in this many left-to-right blocks
    slot_threshold: float = 0.9  # plan: select every slot whose first-token confidence exceeds this
    token_threshold: float = 0.4  # verify: a drafted token passes when its AR probability exceeds this
    # --- MDM baseline (SPEC §4): LLaDA-style low-confidence remasking in semi-AR blocks
    mdm_block_length: int = 32  # tokens per semi-autoregressive block
    mdm_steps: int | None = None  # denoising steps over the whole gen_length; None = gen_length (one token per step)
    mdm_threshold: float | None = None  # Fast-dLLM style: fix every position above this (at least one) instead of top-k
    # --- sampling (temperature 0 = greedy)
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k filter
    seed: int | None = None
    # --- ids (None = from the tokenizer / model config)
    eos_id: int | list[int] | None = None
    mask_id: int | None = None
    # --- batching
    max_batch_size: int = 16  # prompts decoded together at most
    memory_budget_gb: float = 4.0  # KV-cache budget that bounds the batch size further
    # --- engine
    # AR and ReFusion: run every forward with a KV cache as one torch.compile graph
    # (decode.engine.CompiledStep; the first uses compile for a minute or so, a few graphs
    # per model; pays off on long generations and servers). MDM has no cache: it runs
    # eagerly whatever this says.
    compile: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> "DecodeConfig":
        """Raise ConfigError on any out-of-range value, before any compute."""
        if self.method not in METHODS:
            raise ConfigError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        _positive("gen_length", self.gen_length)
        _positive("slot_size", self.slot_size)
        _positive("serial_blocks", self.serial_blocks)
        _positive("mdm_block_length", self.mdm_block_length)
        _positive("max_batch_size", self.max_batch_size)
        for name in ("slot_threshold", "token_threshold", "top_p"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"{name} must be in [0, 1], got {value}")
        if self.mdm_threshold is not None and not 0.0 <= self.mdm_threshold <= 1.0:
            raise ConfigError(f"mdm_threshold must be in [0, 1], got {self.mdm_threshold}")
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0, got {self.top_k}")
        if self.mdm_steps is not None:
            _positive("mdm_steps", self.mdm_steps)
        if self.memory_budget_gb <= 0:
            raise ConfigError(f"memory_budget_gb must be > 0, got {self.memory_budget_gb}")
        if self.method == "refusion":
            n_slots = self.padded_length // self.slot_size
            if n_slots % self.serial_blocks:
                raise ConfigError(
                    f"gen_length {self.gen_length} (rounded up to {self.padded_length}) holds {n_slots} slots of "
                    f"{self.slot_size}, which do not split into {self.serial_blocks} equal blocks: "
                    "choose serial_blocks dividing the slot count, or adjust gen_length"
                )
        return self

    @property
    def padded_length(self) -> int:
        """gen_length rounded up to a whole number of slots (ReFusion's generation region)."""
        s = self.slot_size
        return -(-self.gen_length // s) * s

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "DecodeConfig":
        """The authors' settings for a benchmark (SPEC §3), e.g. `DecodeConfig.preset("gsm8k")`."""
        if name not in _PAPER:
            raise ConfigError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
        s, b, ts, tt = _PAPER[name]
        values = dict(method="refusion", gen_length=512, slot_size=s, serial_blocks=b, slot_threshold=ts, token_threshold=tt)
        values.update(overrides)
        return cls(**values)

    def replace(self, **changes: Any) -> "DecodeConfig":
        """A copy with some fields changed (validated)."""
        return dataclasses.replace(self, **changes)


PRESETS = tuple(_PAPER)


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
