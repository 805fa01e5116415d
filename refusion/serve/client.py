"""The engine as the event loop sees it: an async client of the engine loop (vLLM's
`AsyncLLM.generate`).

`EngineClient.generate` queues a request's prompts on the engine loop, one `Job` per
choice, all of them or none (a full queue refuses the request whole), and returns a
`Generation`: an async iterator of the choices' `ChoiceOutput`s, merged in the order the
engine made them, until every choice has finished. The engine loop's thread hands each
output to the event loop (`call_soon_threadsafe`), so nothing here blocks the event
loop, and closing a generation (its client went away) cancels the choices still running:
the engine drops their rows before its next step.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Protocol, TypeVar

from ..decode.admit import PreparedRequest
from .jobs import ChoiceOutput, Job
from .loop import EngineLoop

T_co = TypeVar("T_co", covariant=True)


class Outputs(Protocol[T_co]):
    """An async iterator that can be closed before its end (a `Generation`, or an async
    generator over one): closing it cancels the choices still running."""

    def __aiter__(self) -> AsyncIterator[T_co]: ...

    def __anext__(self) -> Awaitable[T_co]: ...

    def aclose(self) -> Awaitable[None]: ...


class RequestFailed(Exception):
    """A choice failed on the engine loop: the request's own fault (a library error), a
    failed step, or the server stopping under it (`ShuttingDown`); `error` says which."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


class Generation:
    """The outputs of one request's choices, as they come. Iterating raises
    `RequestFailed` when a choice fails; `aclose` cancels what has not finished (it is
    an async iterator that can be closed as an async generator is: `aclosing` works)."""

    def __init__(self, jobs: list[Job], outputs: asyncio.Queue) -> None:
        self._jobs, self._outputs, self._open = jobs, outputs, len(jobs)

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> ChoiceOutput:
        if not self._open:
            raise StopAsyncIteration
        out = await self._outputs.get()
        if isinstance(out, BaseException):
            raise RequestFailed(out)
        if out.finished:
            self._open -= 1
        return out

    async def aclose(self) -> None:
        for job in self._jobs:
            if not job.finished:
                job.cancel()


class EngineClient:
    """Requests into the engine loop, outputs back onto the event loop."""

    def __init__(self, engine_loop: EngineLoop) -> None:
        self.engine_loop = engine_loop

    def generate(self, prompts: Sequence[PreparedRequest], *, slots: bool = False) -> Generation:
        """Queue `prompts`, the choices of one request, and return their outputs (with
        `slots`, each step's slot events too). Raises `QueueFull` when the queue has no
        room for them all, `ShuttingDown` once the server is stopping. Call it on the
        event loop."""
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()

        def notify(item: ChoiceOutput | BaseException) -> None:  # the engine loop's thread
            loop.call_soon_threadsafe(outputs.put_nowait, item)

        jobs = [Job(p, notify, index=i, slots=slots) for i, p in enumerate(prompts)]
        self.engine_loop.submit(jobs)
        return Generation(jobs, outputs)
