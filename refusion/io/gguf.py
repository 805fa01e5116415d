"""GGUF files in: de-quantised by `transformers` (which needs the `gguf` package), then
moved into our model and checked as a safetensors checkpoint is.

Apart because it is the one reader that goes through `transformers` models, imported
inside the functions so that importing `refusion.io` stays cheap.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError, MissingExtraError, first_line
from ..model.transformer import Transformer, stored_shapes
from ..settings.model import ModelConfig
from .dtypes import config_dtype
from .gguf_header import check_gguf_header
from .metadata import settle_vocabulary
from .weights import check_config_fits, check_finite, check_tensors, fill_model


def load_gguf(
    file: Path, device: torch.device, wanted: torch.dtype | None, allow_nonfinite: bool = False
) -> tuple[Transformer, Any]:
    """De-quantise with transformers, then move its weights into our model: the header,
    config and tokenizer checked first (`gguf_metadata`), so that nothing is built from
    a file that claims more than it holds."""
    from transformers import AutoModelForCausalLM

    config, tokenizer = gguf_metadata(file)
    try:
        hf_model = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name)
    except ImportError as e:
        raise MissingExtraError(f"{_NEEDS_GGUF} ({first_line(e)})") from None
    except _PARSE_ERRORS as e:
        raise CheckpointError(f"cannot import the GGUF file {file}: {first_line(e)}") from None
    model = Transformer.meta(config)
    hf_state = hf_model.state_dict()
    check_tensors(model, {k: (None, tuple(v.shape)) for k, v in hf_state.items()}, where=str(file))
    dtype = wanted or config_dtype(config, device)
    state = {}
    for name in stored_shapes(model):
        if not allow_nonfinite:
            check_finite(name, hf_state[name], str(file))
        state[name] = hf_state[name].to(device=device, dtype=dtype)
    return fill_model(model, state, device), tokenizer


_NEEDS_GGUF = (
    "reading a GGUF file needs the gguf package (the gguf extra): pip install 'refusion[gguf]', "
    "or scripts/setup.sh gguf in a checkout"
)


def _require_gguf() -> None:
    """The `gguf` package, asked for by its extra's name before transformers is given the
    file (without it, transformers' own error names a package but not our extra)."""
    if importlib.util.find_spec("gguf") is None:
        raise MissingExtraError(_NEEDS_GGUF)


# what the gguf package and transformers raise on a file they cannot take
_PARSE_ERRORS = (OSError, ValueError, KeyError, TypeError, IndexError, RuntimeError, NotImplementedError)


def gguf_metadata(file: Path) -> tuple[ModelConfig, Any]:
    """The config (with the MASK id resolved) and tokenizer of a GGUF file, read by
    transformers without de-quantising the weights, once its header is known to fit in
    the file; the config is weighed against the file's size."""
    from transformers import AutoConfig

    _require_gguf()
    check_gguf_header(file)
    try:
        hf_config = AutoConfig.from_pretrained(file.parent, gguf_file=file.name)
    except (ImportError, *_PARSE_ERRORS) as e:
        raise CheckpointError(f"cannot read the GGUF file {file}: {first_line(e)}") from None
    config = ModelConfig.from_hf_dict(_plain_hf_dict(hf_config), where=str(file))
    check_config_fits(config, [file], bits_per_value=1)  # quantised: a weight may take a bit
    tokenizer = _gguf_tokenizer(file)
    settle_vocabulary(config, tokenizer, where=str(file))
    return config, tokenizer


def _gguf_tokenizer(file: Path) -> Any:
    """The tokenizer transformers rebuilds from the GGUF file's vocabulary."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    except _PARSE_ERRORS as e:
        raise CheckpointError(f"cannot read the tokenizer of the GGUF file {file}: {first_line(e)}") from None


def _plain_hf_dict(hf_config: Any) -> dict[str, Any]:
    """The config as a plain checkpoint would have it: without the GGUF quantisation
    record (which would make transformers treat our saved copy as quantised) or
    transformers' private keys."""
    d = hf_config.to_dict()
    return {k: v for k, v in d.items() if k != "quantization_config" and not k.startswith("_")}
