"""The command line: `refusion <verb>` (dispatch.py), one module per verb in
commands/, and the flags derived from the configs (flags.py). `python -m refusion.cli`
runs it too (torchrun and accelerate launch it that way)."""

from .dispatch import main

__all__ = ["main"]
