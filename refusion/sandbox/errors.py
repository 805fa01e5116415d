"""The sandbox's typed error (a `ReFusionError`: the CLI prints one line, exit 2)."""

from ..errors import ReFusionError


class SandboxError(ReFusionError):
    """The code sandbox cannot run on this system."""
