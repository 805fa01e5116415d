"""Typed errors of the evaluation harness (all `ReFusionError`s: the CLI prints one line, exit 2)."""

from ..errors import ConfigError, ReFusionError


class DatasetUnavailableError(ReFusionError):
    """A benchmark's data could not be loaded (offline and no --data file, bad file, bad fields)."""


class UnknownTaskError(ConfigError):
    """No benchmark of that name."""


class PredictionsError(ReFusionError):
    """A --predictions file is missing, unreadable, or matches none of the task's samples."""


class ResumeMismatchError(ConfigError):
    """The output directory holds a run made with other settings."""


class ResultsError(ReFusionError):
    """The results directory (--out) cannot be written or read: a full or read-only disk,
    a path that is not a directory, a damaged run.json."""
