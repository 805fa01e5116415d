"""GGUF files in: de-quantised by `transformers` (which needs the `gguf` package), then
moved into our model and checked as a safetensors checkpoint is.

Apart because it is the one reader that goes through `transformers` models, imported
inside the functions so that importing `refusion.io` stays cheap.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError
from ..model.config import ModelConfig
from ..model.transformer import Transformer, stored_shapes
from .dtypes import config_dtype
from .metadata import settle_vocabulary
from .weights import check_tensors, fill_model


def load_gguf(file: Path, device: torch.device, wanted: torch.dtype | None) -> tuple[Transformer, Any]:
    """De-quantise with transformers, then move its weights into our model."""
    from transformers import AutoModelForCausalLM

    try:
        hf_model = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name)
    except ImportError as e:
        raise CheckpointError(
            f"reading GGUF needs the gguf package (pip install 'refusion[gguf]'): {e}"
        ) from None
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise CheckpointError(f"cannot import the GGUF file {file}: {e}") from None
    config = ModelConfig.from_hf_dict(_plain_hf_dict(hf_model.config))
    tokenizer = _gguf_tokenizer(file)
    settle_vocabulary(config, tokenizer, where=str(file))
    model = Transformer.meta(config)
    hf_state = hf_model.state_dict()
    check_tensors(model, {k: (None, tuple(v.shape)) for k, v in hf_state.items()}, where=str(file))
    dtype = wanted or config_dtype(config, device)
    state = {k: hf_state[k].to(device=device, dtype=dtype) for k in stored_shapes(model)}
    return fill_model(model, state, device), tokenizer


def gguf_metadata(file: Path) -> tuple[ModelConfig, Any]:
    """The config (with the MASK id resolved) and tokenizer of a GGUF file, read by
    transformers without de-quantising the weights."""
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(file.parent, gguf_file=file.name)
    except (OSError, ValueError, KeyError, ImportError) as e:
        raise CheckpointError(f"cannot read the GGUF file {file}: {e}") from None
    config = ModelConfig.from_hf_dict(_plain_hf_dict(hf_config))
    tokenizer = _gguf_tokenizer(file)
    settle_vocabulary(config, tokenizer, where=str(file))
    return config, tokenizer


def _gguf_tokenizer(file: Path) -> Any:
    """The tokenizer transformers rebuilds from the GGUF file's vocabulary."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"cannot read the tokenizer of the GGUF file {file}: {e}") from None


def _plain_hf_dict(hf_config: Any) -> dict[str, Any]:
    """The config as a plain checkpoint would have it: without the GGUF quantisation
    record (which would make transformers treat our saved copy as quantised) or
    transformers' private keys."""
    d = hf_config.to_dict()
    return {k: v for k, v in d.items() if k != "quantization_config" and not k.startswith("_")}
