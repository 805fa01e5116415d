"""ReFusion: diffusion language models decoded by parallel autoregressive slots."""

from .config import ModelConfig
from .errors import ReFusionError
from .model import Transformer

__version__ = "0.1.0"
__all__ = ["ModelConfig", "ReFusionError", "Transformer", "__version__"]
