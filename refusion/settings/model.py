"""`ModelConfig`: the architecture facts we need, read from a Hugging Face `config.json`.

One dataclass for the Llama / Qwen2 / Qwen3 family. The family members differ only in
a few switches (qkv bias, q/k norm, rope scaling), so one model file serves all three.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from ..errors import CheckpointError, UnsupportedArchitectureError
from ..files import LIMITS, read_json
from .fields import FieldError, check_scalar, shown

_UNSET: Any = object()
# ModelConfig.head_dim's default: None, which __post_init__ replaces, so readers see an int
_FROM_HEADS: Any = None

DTYPE_NAMES = ("float32", "bfloat16", "float16")  # the dtypes checkpoints load and save in

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_ARCHITECTURE_NAMES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


@dataclass
class ModelConfig:
    """Architecture of a decoder-only transformer of the Llama / Qwen2 / Qwen3 family."""

    model_type: str = "qwen3"
    vocab_size: int = 32000
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    head_dim: int = _FROM_HEADS  # None: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # rope scaling as Hugging Face writes it: {"rope_type": "llama3", "factor": ..., ...}
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v bias (Qwen2 always has it)
    o_bias: bool = False  # bias on the output projection (Llama's attention_bias adds it)
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    mask_token_id: int | None = None
    torch_dtype: str | None = None
    # keys of config.json we do not interpret, kept so that save() writes them back
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )

    @property
    def eos_ids(self) -> list[int]:
        """All end-of-sequence ids (Hugging Face allows a list)."""
        if self.eos_token_id is None:
            return []
        if isinstance(self.eos_token_id, int):
            return [self.eos_token_id]
        return list(self.eos_token_id)

    # ------------------------------------------------------------------ reading
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], where: str = "config.json") -> ModelConfig:
        """Build from the dict of a Hugging Face config.json (transformers 4.x or 5.x),
        every field checked first (`where` names the file in the errors)."""
        model_type = d.get("model_type")
        if not isinstance(model_type, str) or model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedArchitectureError(
                f"{where}: unsupported architecture model_type={shown(model_type)} "
                f"(architectures={shown(d.get('architectures'))}); supported: {_supported()}"
            )
        _check_architectures(d.get("architectures"), model_type)
        if d.get("hidden_act", "silu") != "silu":
            raise UnsupportedArchitectureError(
                f"{where}: hidden_act={shown(d['hidden_act'])}: only 'silu' is supported"
            )
        missing = [k for k in _REQUIRED if k not in d]
        if missing:
            raise CheckpointError(f"{where} lacks the required key {missing[0]!r}")
        check = _FieldCheck(d, where)
        vocab_size = check.size("vocab_size")
        heads = check.size("num_attention_heads")
        rope_theta, rope_scaling = _read_rope(d, check)
        known: dict[str, Any] = dict(
            model_type=model_type,
            vocab_size=vocab_size,
            hidden_size=check.size("hidden_size"),
            intermediate_size=check.size("intermediate_size"),
            num_hidden_layers=check.size("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=check.size("num_key_value_heads", d.get("num_key_value_heads") or heads),
            head_dim=None if d.get("head_dim") is None else check.size("head_dim"),
            rms_norm_eps=check.number("rms_norm_eps", d.get("rms_norm_eps", 1e-6), lo=0.0, hi=1.0),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=check.size(
                "max_position_embeddings", d.get("max_position_embeddings", 2048)
            ),
            tie_word_embeddings=check.flag("tie_word_embeddings"),
            attention_bias=True if model_type == "qwen2" else check.flag("attention_bias"),
            o_bias=model_type == "llama" and check.flag("attention_bias"),
            mlp_bias=check.flag("mlp_bias"),
            qk_norm=model_type == "qwen3",
            hidden_act="silu",
            bos_token_id=check.token_id("bos_token_id", vocab_size),
            eos_token_id=check.eos_ids(vocab_size),
            pad_token_id=check.token_id("pad_token_id", vocab_size, inside=False),
            mask_token_id=check.token_id("mask_token_id", vocab_size),
            torch_dtype=check.text("torch_dtype", d.get("torch_dtype") or d.get("dtype")),
        )
        if d.get("use_sliding_window"):
            raise UnsupportedArchitectureError("sliding-window attention is not supported")
        _check_heads(known, where)
        consumed = set(known) | {"rope_parameters", "dtype", "architectures", "transformers_version"}
        extra = {k: v for k, v in d.items() if k not in consumed}
        return cls(**known, extra=extra)

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        """The checkpoint's config.json: a regular file holding a JSON object."""
        path = Path(path)
        if not path.exists() and not path.is_symlink():
            raise CheckpointError(f"no config.json at {path}")
        d = read_json(path, CheckpointError, limit=LIMITS.config_bytes, fix=FIX_CONFIG)
        if not isinstance(d, dict):
            raise CheckpointError(f"{path} does not hold a JSON object; {FIX_CONFIG}")
        return cls.from_hf_dict(d, where=str(path))

    # ------------------------------------------------------------------ writing
    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json that `transformers.AutoModelForCausalLM` reads back."""
        d = dict(self.extra)
        own = asdict(self)
        for k in ("extra", "qk_norm", "o_bias"):
            own.pop(k)
        if self.model_type == "llama":
            own["attention_bias"] = self.o_bias
        elif self.model_type == "qwen2":
            own.pop("attention_bias")
        d.update({k: v for k, v in own.items() if v is not None or k == "rope_scaling"})
        d["architectures"] = [_ARCHITECTURE_NAMES[self.model_type]]
        # both spellings: transformers 4.x reads rope_theta/rope_scaling, 5.x rope_parameters
        params = {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta}
        d["rope_parameters"] = params
        return d


def _supported() -> str:
    return ", ".join(f"{t} ({_ARCHITECTURE_NAMES[t]})" for t in SUPPORTED_MODEL_TYPES)


def _check_architectures(architectures: Any, model_type: str) -> None:
    """`architectures` names the class `transformers` builds for the weights, and so says
    what they are: a class we do not implement (a classification head, another family)
    or one that disagrees with model_type means the weights are not the model that
    model_type alone would have us build. A config without the key (or with an empty
    list) makes no such claim, and model_type decides."""
    if not architectures:
        return
    names = [architectures] if isinstance(architectures, str) else architectures
    expected = _ARCHITECTURE_NAMES[model_type]
    if not isinstance(names, list) or any(name != expected for name in names):
        raise UnsupportedArchitectureError(
            f"config.json's architectures={architectures!r} "
            f"does not agree with its model_type={model_type!r} "
            f"(which is {expected}); supported: {_supported()}; fix config.json or use a supported checkpoint"
        )


def _read_rope(d: dict[str, Any], check: _FieldCheck) -> tuple[float, dict[str, Any] | None]:
    """RoPE base and scaling from either the 4.x keys or the 5.x `rope_parameters`."""
    params = d.get("rope_parameters") or {}
    if not isinstance(params, dict):
        check.refuse("rope_parameters", params, "must be an object")
    theta = check.number("rope_theta", d.get("rope_theta", params.get("rope_theta", 10000.0)), lo=1.0)
    scaling = d.get("rope_scaling") or None
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling is None:
        return theta, None
    if not isinstance(scaling, dict):
        check.refuse(
            "rope_scaling", scaling, 'must be an object such as {"rope_type": "linear", "factor": 2.0}'
        )
    scaling = dict(scaling)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if not isinstance(rope_type, str) or rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedArchitectureError(
            f"{check.where}: rope scaling {shown(rope_type)} is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    scaling["rope_type"] = rope_type
    scaling.pop("type", None)
    if rope_type == "default":
        return theta, None
    for key, value in scaling.items():  # factor, low_freq_factor, original_max_position_embeddings, ...
        if key != "rope_type" and not isinstance(value, bool):
            check.number(f"rope_scaling.{key}", value, lo=_TINY)
    return theta, scaling


_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
MAX_SIZE = 2**31 - 1  # a size past int32 indexes no real tensor, and 5,000-digit ones stop here
_TINY = 1e-30  # the least a value that must be positive may be
FIX_CONFIG = "use the config.json the checkpoint was saved with"  # what to do about a bad config


class _FieldCheck:
    """Checks of config.json's fields by kind (sizes, numbers, flags, token ids), each
    refusing with one line that names the file, the field, the value and what it takes.
    The type and bounds test is DecodeConfig's (`check_scalar`), so a config field and a
    decoding flag are judged and worded alike."""

    def __init__(self, d: dict[str, Any], where: str) -> None:
        self.d, self.where = d, where

    def refuse(self, name: str, value: Any, what: str) -> NoReturn:
        raise CheckpointError(f"{self.where}: {name}={shown(value)} {what}; {FIX_CONFIG}")

    def _scalar(self, name: str, kind: str, value: Any, **bounds: Any) -> Any:
        try:
            return check_scalar(name, kind, value, **bounds)
        except FieldError as e:
            raise CheckpointError(f"{self.where}: {e}; {FIX_CONFIG}") from None

    def size(self, name: str, value: Any = _UNSET) -> int:
        """A positive integer (a dimension or a count) of at most MAX_SIZE."""
        value = self.d[name] if value is _UNSET else value
        return self._scalar(name, "int", value, lo=1, hi=MAX_SIZE)

    def number(self, name: str, value: Any, lo: float, hi: float | None = None) -> float:
        """A finite number within [lo, hi] (NaN and infinities are refused)."""
        return float(self._scalar(name, "float", value, lo=lo, hi=hi))

    def flag(self, name: str) -> bool:
        """true or false; absent or null is false."""
        value = self.d.get(name)
        return False if value is None else self._scalar(name, "bool", value)

    def text(self, name: str, value: Any) -> str | None:
        return None if value is None else self._scalar(name, "str", value)

    def token_id(self, name: str, vocab_size: int, value: Any = _UNSET, inside: bool = True) -> int | None:
        """None, or an integer id (`_id`)."""
        value = self.d.get(name) if value is _UNSET else value
        return None if value is None else self._id(name, vocab_size, value, inside)

    def _id(self, name: str, vocab_size: int, value: Any, inside: bool = True) -> int:
        """An integer id; `inside`: one of the vocabulary's, 0 .. vocab_size - 1 (an id
        past the embedding fails only when the model first meets it)."""
        hi = vocab_size - 1 if inside else None
        lo = 0 if inside else None
        checked = self._scalar(name, "int", value, lo=lo, hi=hi)
        if inside or abs(checked) <= MAX_SIZE:
            return checked
        self.refuse(name, value, f"is outside the vocabulary (0 to {vocab_size - 1})")

    def eos_ids(self, vocab_size: int) -> int | list[int] | None:
        """eos_token_id: one id or a list of them, each inside the vocabulary (a null in
        the list is refused: every reader takes the list for ids)."""
        value = self.d.get("eos_token_id")
        if isinstance(value, list):
            return [self._id("eos_token_id", vocab_size, v) for v in value]
        return self.token_id("eos_token_id", vocab_size, value)


def _check_heads(known: dict[str, Any], where: str) -> None:
    """Heads that share the hidden size out: KV heads dividing the query heads, and a
    head dimension that RoPE can rotate (even, and at least 2)."""
    heads, kv_heads = known["num_attention_heads"], known["num_key_value_heads"]
    if heads % kv_heads:
        raise CheckpointError(
            f"{where}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}; "
            + FIX_CONFIG
        )
    head_dim = known["head_dim"] or known["hidden_size"] // heads
    if head_dim < 2 or head_dim % 2:
        raise CheckpointError(
            f"{where}: head_dim={head_dim} (hidden_size / num_attention_heads when not given) is not an even "
            f"number of at least 2, which rotary embeddings need; {FIX_CONFIG}"
        )
