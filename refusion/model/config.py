"""`ModelConfig`: the architecture facts we need, read from a Hugging Face `config.json`.

One dataclass for the Llama / Qwen2 / Qwen3 family. The family members differ only in
a few switches (qkv bias, q/k norm, rope scaling), so one model file serves all three.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, UnsupportedArchitectureError

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
    head_dim: int | None = None  # defaults to hidden_size // num_attention_heads
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
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from the dict of a Hugging Face config.json (transformers 4.x or 5.x)."""
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedArchitectureError(
                f"unsupported architecture model_type={model_type!r} "
                f"(architectures={d.get('architectures')}); supported: {_supported()}"
            )
        _check_architectures(d.get("architectures"), model_type)
        if d.get("hidden_act", "silu") != "silu":
            raise UnsupportedArchitectureError(f"hidden_act={d['hidden_act']!r}: only 'silu' is supported")
        try:
            rope_theta, rope_scaling = _read_rope(d)
            known = dict(
                model_type=model_type,
                vocab_size=int(d["vocab_size"]),
                hidden_size=int(d["hidden_size"]),
                intermediate_size=int(d["intermediate_size"]),
                num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=int(d["num_attention_heads"]),
                num_key_value_heads=int(d.get("num_key_value_heads") or d["num_attention_heads"]),
                head_dim=d.get("head_dim"),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=True if model_type == "qwen2" else bool(d.get("attention_bias", False)),
                o_bias=model_type == "llama" and bool(d.get("attention_bias", False)),
                mlp_bias=bool(d.get("mlp_bias", False)),
                qk_norm=model_type == "qwen3",
                hidden_act="silu",
                bos_token_id=d.get("bos_token_id"),
                eos_token_id=d.get("eos_token_id"),
                pad_token_id=d.get("pad_token_id"),
                mask_token_id=d.get("mask_token_id"),
                torch_dtype=d.get("torch_dtype") or d.get("dtype"),
            )
        except KeyError as e:
            raise CheckpointError(f"config.json lacks the required key {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"config.json has a value of the wrong type: {e}") from None
        if d.get("use_sliding_window"):
            raise UnsupportedArchitectureError("sliding-window attention is not supported")
        consumed = set(known) | {"rope_parameters", "dtype", "architectures", "transformers_version"}
        extra = {k: v for k, v in d.items() if k not in consumed}
        return cls(**known, extra=extra)

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"no config.json at {path}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path} is not valid JSON: {e}") from None
        if not isinstance(d, dict):
            raise CheckpointError(f"{path} does not hold a JSON object")
        return cls.from_hf_dict(d)

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


def _read_rope(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """RoPE base and scaling from either the 4.x keys or the 5.x `rope_parameters`."""
    params = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or None
    theta = float(d.get("rope_theta", params.get("rope_theta", 10000.0)))
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling is not None:
        scaling = dict(scaling)
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedArchitectureError(
                f"rope scaling {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
            )
        scaling["rope_type"] = rope_type
        scaling.pop("type", None)
        if rope_type == "default":
            scaling = None
    return theta, scaling
