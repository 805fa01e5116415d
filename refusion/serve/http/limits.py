"""Limits on what a client sends, checked before the OpenAI protocol reads it: the body's
size (a 413 as soon as it is over, not once it is all in), its JSON (a 400 whatever the
bytes, never a 500; nesting no field needs is refused), and the few request threads that
parse and tokenise bodies, so a huge prompt delays only itself and not the event loop
(/health, other clients). The limits on a request's head (its headers' size, the time
they take to arrive) are the HTTP server's (`serve/server.py`)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from starlette.requests import Request

from ..protocol.errors import APIError, bad

T = TypeVar("T")

MAX_BODY = 16 * 2**20
# nesting of a JSON body; OpenAI's deepest field (a message's tool call's function) is 6 levels down
MAX_DEPTH = 32
# threads that parse and tokenise requests: a few at once (the tokenizer releases the GIL), the
# rest wait their turn without holding up the event loop
REQUEST_THREADS = 4


class RequestThreads:
    """The threads a request's CPU work runs on (parsing, tokenising), never the event loop."""

    def __init__(self, n: int = REQUEST_THREADS) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(n, thread_name_prefix="refusion-request")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def shutdown(self) -> None:
        """Stop at once: work not yet begun is dropped (the server is going)."""
        self._pool.shutdown(wait=False, cancel_futures=True)


async def read_body(request: Request) -> bytes:
    """The request's bytes, at most MAX_BODY of them: a 413 as soon as more is declared
    or has arrived (a chunked body has no length to check first), not once it is all in."""
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > MAX_BODY:
        raise _too_large()
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > MAX_BODY:
            raise _too_large()
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large() -> APIError:
    return APIError(
        413, f"the request body is over {MAX_BODY} bytes; send a shorter prompt", code="request_too_large"
    )


def parse_json(raw: bytes) -> Any:
    """The body as JSON no deeper than `MAX_DEPTH`, or a 400."""
    body = _loads(raw)
    if _deeper_than(body, MAX_DEPTH):
        raise _too_deep()
    return body


def _loads(raw: bytes) -> Any:
    """The body as JSON, or a 400 (never a 500) whatever the bytes."""
    try:
        return json.loads(raw)
    except RecursionError:  # nesting deeper than the parser's stack
        raise _too_deep() from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, and an integer over Python's digit limit
        if "integer string conversion" in str(e):
            raise bad(
                f"the request body has an integer of more than {sys.get_int_max_str_digits()} digits; "
                "no field takes one that long",
                None,
                "invalid_json",
            ) from None
        raise bad(f"the request body is not valid JSON: {e}", None, "invalid_json") from None


def _too_deep() -> APIError:
    return bad(
        f"the request body nests arrays and objects more than {MAX_DEPTH} deep; "
        "no field of this API needs more than a few levels",
        None,
        "invalid_json",
    )


def _deeper_than(obj: Any, limit: int) -> bool:
    """Whether `obj` nests lists and dicts more than `limit` deep, found without
    recursion (a check made recursively would itself overflow on the bodies it is for).
    A scalar (a body of `null` or `5`) is not nested at all."""
    level, depth = ([obj] if isinstance(obj, (list, dict)) else []), 0
    while level:
        depth += 1
        if depth > limit:
            return True
        level = [
            v
            for x in level
            for v in (x.values() if isinstance(x, dict) else x)
            if isinstance(v, (list, dict))
        ]
    return False
