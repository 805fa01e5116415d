"""Typed exceptions: the library raises these, the CLI turns them into one line and exit code 2."""


class ReFusionError(Exception):
    """Base class of every error this package raises on purpose."""


class CheckpointError(ReFusionError):
    """A model file or directory is missing, corrupt or inconsistent."""


class UnsupportedArchitectureError(CheckpointError):
    """The checkpoint's architecture is not one we implement."""


class ConfigError(ReFusionError, ValueError):
    """A configuration value is out of range or inconsistent."""


class PromptError(ConfigError):
    """A prompt the model cannot take: empty, or with token ids outside its vocabulary.
    `code` names which, so that a server can answer in its own terms."""

    def __init__(self, message: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.code = code


class TokenizerError(PromptError):
    """The tokenizer failed on a text: the tokenizers library panicked (a pre-tokenizer
    regex that backtracks past its engine's limit on this text, say)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "tokenizer_failed")


class ChatTemplateError(ConfigError):
    """A checkpoint's chat template failed on a conversation (its own `raise_exception`, or
    an error in the template)."""


class ContextLengthError(ConfigError):
    """A request needs more positions than the model or the cache allows."""


class MissingMaskTokenError(ConfigError):
    """A diffusion method was asked of a model that has no MASK token."""


class DataError(ReFusionError):
    """A data file is missing, unreadable, or holds no usable example."""


class CompileError(ReFusionError):
    """torch.compile could not build a graph (a missing C++ compiler, say): the machine's
    fault, not the request's."""


class MissingExtraError(ReFusionError):
    """An optional dependency (an extra of the package, e.g. `refusion[plot]`) is not installed."""


def first_line(e: BaseException) -> str:
    """A library's exception message cut to its first line (some run on for pages, and an
    error of ours is one line), or the exception's type where it has no message."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
