"""Noticing a client that goes away before its response has begun.

A plain completion's response is sent only when it is whole, and a replica's answer
passed on only once it starts, so nothing else would notice a client that left
meanwhile (a `StreamingResponse` listens for the disconnect itself). `DisconnectWatch`
races what the response waits for against the client's `http.disconnect`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable
from contextlib import aclosing
from typing import TypeVar

from starlette.requests import Request

from ..client import Outputs

T = TypeVar("T")


class ClientGone(Exception):
    """The client closed its connection before its response began."""


class DisconnectWatch:
    """Watches one request's connection from its creation until `close`."""

    def __init__(self, request: Request) -> None:
        self._gone = asyncio.ensure_future(_disconnected(request))

    async def race(self, awaitable: Awaitable[T]) -> T:
        """The awaitable's result, unless the client disconnects first: then it is
        cancelled (and waited for, so what it holds is let go) and `ClientGone` raised."""
        work = asyncio.ensure_future(awaitable)
        await asyncio.wait({work, self._gone}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            work.cancel()
            try:
                await work
            except BaseException:
                pass
            raise ClientGone()
        return work.result()

    async def guard(self, items: Outputs[T]) -> AsyncGenerator[T, None]:
        """`items` as they come, until the client disconnects (`ClientGone`); closed
        however it ends."""
        async with aclosing(items):
            while True:
                try:
                    item = await self.race(anext(items))
                except StopAsyncIteration:
                    return
                yield item

    def close(self) -> None:
        self._gone.cancel()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
