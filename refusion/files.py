"""Files the user hands us (checkpoints, training data, predictions), opened and parsed so
that a hostile one fails with one line instead of a hang or a traceback.

One place for what every reader of such a file must refuse before building anything from
it: a path that is not a regular file (a FIFO would block the read forever, `/dev/zero`
would fill memory, a symlink loop or a directory would raise), a file larger than its
kind can be, and JSON that Python's parser takes but turns into an exception further on
(nesting deeper than the interpreter's recursion limit, integers of more digits than
`int` converts). Readers call these with their own error class (`CheckpointError`,
`DataError`, ...), so the message names the file and the failure keeps its type.

Also the boundary of a checkpoint directory (`checkpoint_file`, `check_checkpoint_dir`):
a file read through the directory must resolve inside it, so that a checkpoint cannot
make a load read (and show, in prompts, `info` or the playground) a file elsewhere on the
machine through a symlink.
"""

from __future__ import annotations

import errno
import fnmatch
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from .errors import CheckpointError, ReFusionError

MAX_JSON_BYTES = 256 * 2**20  # a JSON file we parse whole (indexes, safetensors headers)


@dataclass(frozen=True)
class ParserLimits:
    """The one table of limits on what a parser is given from a file a user hands us, each
    far above what a real checkpoint needs and far below what would hang a load or fill
    the memory: the parsers (the tokenizers library, the gguf package, Jinja) would
    otherwise allocate or loop for whatever a file declares."""

    config_bytes: int = 16 * 2**20  # config.json, decode_config.json
    # tokenizer.json, tokenizer_config.json, vocab.json, ...: the largest real ones (256k-token
    # vocabularies with their merges) are some 35 MB
    tokenizer_json_bytes: int = 64 * 2**20
    tokenizer_merges_per_token: int = 8  # BPE merges per token of the vocabulary (Llama 3's: 2.2)
    tokenizer_other_bytes: int = 64 * 2**20  # tokenizer.model, merges.txt, a chat template file
    # a GGUF header, walked before the gguf package parses it: real files hold a few dozen keys,
    # a few hundred to thousands of tensors, arrays of a vocabulary's size (up to some 260k)
    gguf_pairs: int = 65_536
    gguf_tensors: int = 65_536
    gguf_array: int = 2**19  # elements of one array
    gguf_array_total: int = 2**20  # elements of every array together (Gemma 3 has some 790k)
    # a chat template's render: the loop iterations (of every loop together), the characters
    # of any value it builds or outputs, and the seconds it may take
    template_iterations: int = 1_000_000
    template_chars: int = 4 * 2**20
    template_seconds: float = 5.0


LIMITS = ParserLimits()

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


# ---------------------------------------------------------------------------- the checkpoint boundary
# the files of a checkpoint directory that we or transformers may open, by name, and the
# subfolders transformers reads (a tokenizer's extra chat templates)
CHECKPOINT_PATTERNS = ("*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken", "*.pt")
CHECKPOINT_SUBFOLDERS = ("additional_chat_templates",)


def checkpoint_file(directory: str | os.PathLike, name: str) -> Path:
    """`directory/name`, once it is known to resolve inside the checkpoint directory: the one
    place a checkpoint's files are looked up. A symlink out of the directory (to
    `/etc/shadow`, to another model's weights) is refused, naming the file; a link inside
    it, a file that is absent (its reader says so) and a symlink loop (its reader says
    so) pass. A Hugging Face cache snapshot links every file to a blob of its
    repository's `blobs/` folder, which counts as inside."""
    path = Path(directory) / name
    if not os.path.lexists(path):
        return path
    target = Path(os.path.realpath(path))
    if any(target == root or root in target.parents for root in _roots(Path(directory))):
        return path
    raise CheckpointError(
        f"{path} links to {target}, outside the checkpoint directory: a checkpoint reads only its own "
        "files; copy the file into the directory instead of linking it"
    )


def check_checkpoint_dir(directory: str | os.PathLike) -> None:
    """Every file of `directory` that a load may open (`CHECKPOINT_PATTERNS`, at the top
    and in `CHECKPOINT_SUBFOLDERS`) resolves inside it: checked before a library that opens
    files by its own rules (transformers' tokenizer) is given the directory."""
    for folder in (Path(directory), *(Path(directory) / sub for sub in CHECKPOINT_SUBFOLDERS)):
        if folder != Path(directory):
            checkpoint_file(directory, folder.name)
            if not folder.is_dir():
                continue
        for entry in sorted(os.scandir(folder), key=lambda e: e.name):
            if any(fnmatch.fnmatch(entry.name, p) for p in CHECKPOINT_PATTERNS):
                checkpoint_file(directory, os.path.relpath(entry.path, directory))


def _roots(directory: Path) -> list[Path]:
    """The folders a checkpoint's files may resolve into: the directory itself, and for a
    Hugging Face cache snapshot (`models--ORG--NAME/snapshots/REV`), the repository's blobs."""
    real = Path(os.path.realpath(directory))
    roots = [real]
    if real.parent.name == "snapshots":
        roots.append(real.parent.parent / "blobs")
    return roots
