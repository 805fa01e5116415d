"""A GGUF file's header walked and bounded before `transformers` (through the `gguf`
package) parses it: every count and length it declares must fit in the bytes the file
has, or the parser allocates arrays of absurd sizes, loops for hours, or raises deep
inside numpy; and the counts of keys, tensors and array elements must be within
`files.LIMITS` whatever the file's size, since the parser (and transformers after it) turns
each one into a Python object: a 30 MB array or two million keys would take minutes.
Reads the header only, never the tensor data.

The layout walked (GGUF versions 2 and 3, either byte order): magic `GGUF`, version
(u32), tensor count and key-value count (u64 each), then each key-value pair (a string
key, a u32 value type, the value) and each tensor's description (a string name, u32
dimension count, u64 dimensions, u32 type, u64 offset). A string is a u64 length and
its bytes; an array a u32 element type, a u64 count and its elements.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import IO

from ..errors import CheckpointError
from ..files import LIMITS, check_regular, open_regular

_FIX = "download or convert the GGUF file again"
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_VERSIONS = (2, 3)
_MAX_DIMS = 4  # GGML's own limit on a tensor's dimensions
_MAX_NESTING = 8  # arrays of arrays: no GGUF key needs more
_LEAST_KV = 8 + 4 + 1  # key length, value type, the smallest value
_LEAST_TENSOR = 8 + 4 + 4 + 8  # name length, dimension count, type, offset


class _Header:
    """A cursor over the header that refuses to read past the end of the file."""

    def __init__(self, fh: IO[bytes], size: int, file: Path) -> None:
        self.fh, self.size, self.file, self.pos, self.order = fh, size, file, 0, "<"
        self.elements = 0  # array elements so far, of every array

    def damaged(self, detail: str) -> CheckpointError:
        return CheckpointError(f"{self.file}: the GGUF header is damaged: {detail}; {_FIX}")

    def left(self) -> int:
        return self.size - self.pos

    def skip(self, n: int, what: str) -> None:
        if n > self.left():
            raise self.damaged(f"{what} declares {n:,} bytes, but {self.left():,} are left in the file")
        self.fh.seek(n, 1)
        self.pos += n

    def take(self, n: int, what: str) -> bytes:
        if n > self.left():
            raise self.damaged(f"{what} declares {n:,} bytes, but {self.left():,} are left in the file")
        self.pos += n
        return self.fh.read(n)

    def u32(self, what: str) -> int:
        return struct.unpack(self.order + "I", self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return struct.unpack(self.order + "Q", self.take(8, what))[0]

    def count(self, what: str, least_bytes: int, most: int) -> int:
        """A count of items of at least `least_bytes` each, which the rest of the file must
        hold, and of at most `most` (a limit of `files.LIMITS`)."""
        n = self.u64(what)
        if n * least_bytes > self.left():
            raise self.damaged(f"{what}={n:,} is more than the {self.left():,} bytes left can hold")
        if n > most:
            raise CheckpointError(
                f"{self.file}: the GGUF header's {what}={n:,} is over the {most:,} a model file needs "
                f"(a limit of this reader); {_FIX}"
            )
        return n

    def array_length(self, what: str, least_bytes: int) -> int:
        """An array's length, within the limit for one array and for all of them together."""
        n = self.count(f"the length of {what}", least_bytes, LIMITS.gguf_array)
        self.elements += n
        if self.elements > LIMITS.gguf_array_total:
            raise CheckpointError(
                f"{self.file}: the GGUF header's arrays hold over {LIMITS.gguf_array_total:,} elements "
                f"together, more than a model file needs (a limit of this reader); {_FIX}"
            )
        return n

    def string(self, what: str) -> str:
        raw = self.take(self.u64(f"the length of {what}"), what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.damaged(f"{what} is not UTF-8 text") from None

    def value(self, kind: int, what: str, depth: int = 0) -> None:
        if kind in _SCALAR_BYTES:
            self.skip(_SCALAR_BYTES[kind], what)
        elif kind == _STRING:
            self.skip(self.u64(f"the length of {what}"), what)
        elif kind == _ARRAY:
            if depth >= _MAX_NESTING:
                raise self.damaged(f"{what} nests arrays more than {_MAX_NESTING} deep")
            item = self.u32(f"the element type of {what}")
            if item in _SCALAR_BYTES:
                self.skip(self.array_length(what, _SCALAR_BYTES[item]) * _SCALAR_BYTES[item], what)
                return
            for i in range(self.array_length(what, 8 if item == _STRING else 12)):
                self.value(item, f"{what}[{i}]", depth + 1)
        else:
            raise self.damaged(f"{what} has the unknown value type {kind}")


def check_gguf_header(file: Path) -> None:
    """Refuse a GGUF file whose header does not fit in the file (see the module's note)."""
    size = check_regular(file, CheckpointError, fix=_FIX)
    with open_regular(file, CheckpointError, fix=_FIX) as fh:
        h = _Header(fh, size, file)
        if h.take(4, "the magic number") != b"GGUF":
            raise CheckpointError(f"{file} is not a GGUF file (it does not start with GGUF); {_FIX}")
        version = h.u32("the version")
        if version & 0xFFFF == 0:  # written on a machine of the other byte order
            h.order, version = ">", struct.unpack(">I", struct.pack("<I", version))[0]
        if version not in _VERSIONS:
            raise h.damaged(f"version {version} is not one of {', '.join(map(str, _VERSIONS))}")
        tensors = h.count("tensor_count", _LEAST_TENSOR, LIMITS.gguf_tensors)
        pairs = h.count("kv_count", _LEAST_KV, LIMITS.gguf_pairs)
        for i in range(pairs):
            key = h.string(f"key {i}")
            h.value(h.u32(f"the value type of {key!r}"), repr(key))
        for i in range(tensors):
            name = h.string(f"the name of tensor {i}")
            dims = h.u32(f"the dimension count of {name!r}")
            if dims > _MAX_DIMS:
                raise h.damaged(f"tensor {name!r} has {dims:,} dimensions, more than GGUF's {_MAX_DIMS}")
            h.skip(8 * dims + 4 + 8, f"the description of tensor {name!r}")
