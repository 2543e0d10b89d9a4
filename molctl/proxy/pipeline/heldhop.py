"""A speculative answer hop held while the route hop runs (`HeldHop`, started by
`speculative.Speculation`): its engine events kept, at most HELD_EVENTS_MAX ahead of the reader,
until the route decides whether it is the answer. Apart from the plan, which holds it
(`plan.SpeculationOutcome`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from molctl.engines.base import AnswerTokens, Engine
from molctl.proxy.errors import EngineHTTPError, EngineUnavailable, ProxyError

# A held stream's events buffered ahead of its reader, at most: past it the hop stops reading the
# engine's stream, which backs up into the engine as a routed stream's slow client does (unbounded,
# a slow reader on a hit made the proxy hold 90 MB for a 100k-token answer). The route decides
# within a few events (a 2-token decode), so the engine is not held back before it.
HELD_EVENTS_MAX = 256


class _End:
    """The held stream's end: normal (`error` None) or the engine's failure."""

    def __init__(self, error: BaseException | None = None):
        self.error = error


class HeldHop:
    """One speculative answer hop: a task sending the answer hop's request on `adapter`, its
    output (a stream's events, or the whole completion) held until `events` / `result`."""

    def __init__(self, adapter: str, engine: Engine):
        self.adapter = adapter
        self.engine = engine
        self.view: list[dict[str, Any]] = []
        self.payload: dict[str, Any] | None = None
        self.sent_at: float | None = None  # when its request went to the engine
        self.first_at: float | None = None  # its first event (stream) or its whole body
        self.done_at: float | None = None
        self.tokens = AnswerTokens()
        self.generated = 0  # events with generated output (a stream without token ids: ~1 token each)
        self.usage: dict[str, Any] | None = None
        self.queue: asyncio.Queue[Any] = asyncio.Queue(HELD_EVENTS_MAX)
        self.body: dict[str, Any] | None = None
        self.error: BaseException | None = None
        self.task: asyncio.Task | None = None
        self.preempted = False  # closed before the route decided: a request took the slot it counted on
        self.ready = asyncio.Event()  # `view` and `payload` are built (payload None: the build refused)

    def start(self, run: Callable[[HeldHop], Awaitable[None]]) -> None:
        self.task = asyncio.ensure_future(run(self))

    async def pump(self, upstream: AsyncIterator[dict[str, Any]]) -> None:
        """Buffer a stream's events, at most HELD_EVENTS_MAX ahead of the reader (then the
        client's pace holds the engine back, as on a routed stream), and how the stream ended:
        the reader (`events`) raises its failure, whatever it was."""
        try:
            async for event in upstream:
                if self.first_at is None:
                    self.first_at = time.monotonic()
                self._count(event)
                await self.queue.put(event)
        except Exception as exc:  # any failure reaches the reader: it never waits on a queue nobody fills
            await self.queue.put(_End(exc))
        else:
            await self.queue.put(_End())
        finally:
            self.done_at = time.monotonic()
            await upstream.aclose()  # not read whole: the connection closes, the engine aborts it

    async def whole(self, answer: Awaitable[dict[str, Any]]) -> None:
        """Hold a non-streamed answer's body (or its failure)."""
        try:
            self.body = await answer
            self.usage = self.body.get("usage") if isinstance(self.body.get("usage"), dict) else None
            self.tokens = self.engine.answer_tokens(self.body)
        except (EngineHTTPError, EngineUnavailable, ProxyError) as exc:
            self.error = exc
        finally:
            self.first_at = self.done_at = time.monotonic()

    def _count(self, event: dict[str, Any]) -> None:
        self.engine.stream_tokens(event, self.tokens)
        if isinstance(event.get("usage"), dict):
            self.usage = event["usage"]
        for choice in event.get("choices") or ():
            delta = choice.get("delta") if isinstance(choice, dict) else None
            if isinstance(delta, dict) and any(delta.get(k) for k in ("content", "reasoning", "tool_calls")):
                self.generated += 1

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """The held stream, from its first event on (the hit's answer); closing it cancels the hop."""
        try:
            while True:
                item = await self.queue.get()
                if isinstance(item, _End):
                    if item.error is not None:
                        raise item.error
                    return
                yield item
        finally:
            await self.cancel()

    async def result(self) -> dict[str, Any]:
        """The held completion (the hit's answer), once the engine sent it."""
        try:
            await asyncio.shield(self.task)  # type: ignore[arg-type]
        finally:
            await self.cancel()  # a no-op once done; the request cancelled: the hop with it
        if self.error is not None:
            raise self.error
        return self.body  # type: ignore[return-value]

    async def cancel(self) -> None:
        """Close the engine request now (a cancelled read closes its connection)."""
        if self.task is not None and not self.task.done():
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)

    def wasted(self) -> tuple[int, int]:
        """(prompt, generated) tokens the engine spent on this hop, as far as it reported them:
        the usage when it finished, else the prompt's token ids (vLLM's first stream event) and the
        generated token ids (or the generating events). 0 where nothing was reported."""
        usage = self.usage or {}
        prompt = usage.get("prompt_tokens") or len(self.tokens.prompt or ())
        generated = usage.get("completion_tokens") or len(self.tokens.output or ()) or self.generated
        return int(prompt), int(generated)
