"""What an API handler may do with its request: `Exchange`, implemented by the app (`http.app`).

Handlers are typed by this Protocol, so the APIs do not import the app that calls them (the
arrows run http -> apis -> pipeline). The body policy lives behind `json_body`: where a body is
parsed and its plan built (on the event loop, or in a worker thread for a big one: `http.body`)
is decided there once, for every API."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from molctl.proxy.pipeline.plan import Plan, RequestState

T = TypeVar("T")


class Exchange(Protocol):
    state: RequestState
    send: Callable[[dict], Awaitable[None]]

    @property
    def tenant(self) -> str: ...

    async def body(self) -> bytes:
        """The raw body, read within the profile's upload bounds (408/413 past them)."""

    async def json_body(self, items_key: str, build: Callable[[Any], T]) -> tuple[T, bool]:
        """The body parsed and `build(body)` run on it, where the body's size says: (its result,
        True when it ran in a worker thread: a body over BIG_BODY bytes, or over BIG_ITEMS entries
        under `items_key`)."""

    def query(self) -> dict[str, list[str]]: ...

    def track(self, plan: Plan) -> None:
        """The request's plan, for its log line and the drain."""

    async def json(self, status: int, body: Any, raw: bytes | None = None) -> None: ...

    async def run(self, plan: Plan, coro: Awaitable[None]) -> None:
        """Run one answer while watching the client."""

    async def stream(self, plan: Plan, chunks: Any, **framing: Any) -> bool:
        """Write `chunks` as SSE; True when the client has all of it."""
