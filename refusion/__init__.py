"""ReFusion: diffusion language models decoded by parallel autoregressive slots."""

from .checkpoint import load
from .config import ModelConfig
from .decode import DecodeConfig, GenerationOutput, generate, stream
from .errors import ReFusionError
from .model import Transformer

__version__ = "0.1.0"
__all__ = [
    "DecodeConfig", "GenerationOutput", "ModelConfig", "ReFusionError", "Transformer",
    "__version__", "generate", "load", "stream",
]
