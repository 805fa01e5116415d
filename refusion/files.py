"""Files the user hands us (checkpoints, training data, predictions), opened and parsed so
that a hostile one fails with one line instead of a hang or a traceback.

One place for what every reader of such a file must refuse before building anything from
it: a path that is not a regular file (a FIFO would block the read forever, `/dev/zero`
would fill memory, a symlink loop or a directory would raise), a file larger than its
kind can be, and JSON that Python's parser takes but turns into an exception further on
(nesting deeper than the interpreter's recursion limit, integers of more digits than
`int` converts). Readers call these with their own error class (`CheckpointError`,
`DataError`, ...), so the message names the file and the failure keeps its type.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path
from typing import IO, Any

from .errors import ReFusionError

MAX_JSON_BYTES = 256 * 2**20  # a JSON file we parse whole (configs, indexes, tokenizer files)

_KINDS = {
    stat.S_ISDIR: "a directory",
    stat.S_ISFIFO: "a FIFO (named pipe)",
    stat.S_ISCHR: "a character device",
    stat.S_ISBLK: "a block device",
    stat.S_ISSOCK: "a socket",
}


class JSONProblem(ValueError):
    """Text that is not JSON we can use; the message says why, without the file's name,
    so that a reader of records can skip one record and a reader of a file can fail.
    `kind` is the short reason a reader of records counts skipped records by."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS.items() if test(mode)), "not a regular file")


def _stat_error(path: Path, e: OSError, error: type[ReFusionError], fix: str) -> ReFusionError:
    """The one line for a path that cannot even be looked at."""
    if isinstance(e, FileNotFoundError):
        return error(f"{path} does not exist; {fix}")
    if e.errno == errno.ELOOP:  # a symlink that leads back to itself
        return error(f"{path} is a symlink loop, not a file; {fix}")
    return error(f"cannot open {path} ({e.strerror or type(e).__name__}); {fix}")


def check_regular(path: str | os.PathLike, error: type[ReFusionError], fix: str = "replace it") -> int:
    """The size of `path`, a regular file once symlinks are followed (the Hugging Face
    cache links every file to a blob); `error` naming the path otherwise. For files
    another library opens (safetensors, tokenizers), checked before it does."""
    path = Path(path)
    try:
        st = os.stat(path)
    except OSError as e:
        raise _stat_error(path, e, error, fix) from None
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{path} is {_kind(st.st_mode)}, not a regular file; {fix}")
    return st.st_size


def open_regular(path: str | os.PathLike, error: type[ReFusionError], fix: str = "replace it") -> IO[bytes]:
    """`path` opened for reading in binary, refused unless it is a regular file. Opened
    without blocking and checked on the open descriptor, so a FIFO put in the file's
    place between a check and the open cannot stall the read."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise _stat_error(path, e, error, fix) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise error(f"{path} is {_kind(mode)}, not a regular file; {fix}")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def read_bytes(
    path: str | os.PathLike, error: type[ReFusionError], limit: int = MAX_JSON_BYTES, fix: str = "replace it"
) -> bytes:
    """The whole of a regular file of at most `limit` bytes."""
    with open_regular(path, error, fix) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise error(f"{path} is larger than {limit:,} bytes, more than such a file can be; {fix}")
    return data


def parse_json(text: str | bytes) -> Any:
    """JSON text as Python values; JSONProblem (a ValueError) saying what is wrong:
    bytes that are not UTF-8, invalid JSON, nesting too deep for the parser, an integer
    of more digits than Python converts. NaN and Infinity parse (Python writes them);
    the reader of each field decides whether it takes them."""
    try:
        if isinstance(text, bytes):
            text = text.decode("utf-8-sig")
        return json.loads(text)
    except UnicodeDecodeError as e:
        raise JSONProblem("not UTF-8", f"is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise JSONProblem(
            "invalid JSON", f"is not valid JSON ({e.msg}: line {e.lineno} column {e.colno})"
        ) from None
    except RecursionError:
        raise JSONProblem("nested too deep", "is nested deeper than the JSON reader allows") from None
    except ValueError as e:  # int('9' * 5000): past sys.get_int_max_str_digits()
        raise JSONProblem(
            "number too long", f"holds a number too long to read ({str(e).split(':')[0]})"
        ) from None


def read_json(
    path: str | os.PathLike, error: type[ReFusionError], limit: int = MAX_JSON_BYTES, fix: str = "replace it"
) -> Any:
    """A regular JSON file parsed whole; `error` naming the file and what is wrong. A
    lone surrogate anywhere in it is refused too: no tool that writes these files makes
    one, and it would fail wherever the text is encoded."""
    data = read_bytes(path, error, limit, fix)
    try:
        value = parse_json(data)
    except JSONProblem as e:
        raise error(f"{path} {e}; {fix}") from None
    if lone_surrogate(value):
        raise error(
            f"{path} holds a lone UTF-16 surrogate (an escape such as \\ud800), which is not text; {fix}"
        )
    return value


def lone_surrogate(value: Any) -> bool:
    """Whether a parsed JSON value holds a string with a lone UTF-16 surrogate (`"\\ud800"`
    is valid JSON): such a string cannot be encoded as UTF-8, so a tokenizer, a file
    write or a child process's pipe would fail on it later."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    except (RecursionError, ValueError, TypeError):
        return False
    return False
