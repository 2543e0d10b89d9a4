"""Output limits that fit the engine's window, on every engine version.

vLLM 0.24 refuses a chat request whose prompt plus `max_tokens` exceeds max-model-len (400,
"This model's maximum context length is ..."); 0.32 shortens `max_tokens` to the room left
(`Engine.shortens_max_tokens` says which, by the installed version). The proxy sends the same
thing to both: a hop's `max_tokens` (the client's own, `proxy.max_output_tokens`, the route
and summary limits) is checked against a cheap upper bound of the prompt (`prompt_token_bound`);
only when the bound does not leave room is the prompt measured exactly, with the engine's own
template and tokenizer (`Engine.length_request`, vLLM's `/tokenize`), and `max_tokens` cut to the
room left. An answer cut that way ends with `finish_reason: "length"` when it uses all of it,
as on vLLM 0.32. A prompt that fills the window alone is sent as it is: the engine's own
context-length 400 names it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from molctl.engines.base import Engine
from molctl.proxy import fastjson
from molctl.proxy.errors import EngineHTTPError, EngineUnavailable

log = logging.getLogger("molctl.proxy")

# the measurement's own timeout: a render and a tokenization, no generation
MEASURE_TIMEOUT_S = 30.0
# above this many messages the prompt's bound is computed in a worker thread (the event loop stays free)
BIG_MESSAGES = 2000


def prompt_token_bound(messages: list[dict[str, Any]], tools: Any) -> int:
    """An upper bound of the prompt's tokens: the bytes of the messages as JSON (UTF-8 bytes, escapes
    included, >= the text's UTF-8 bytes >= tokens of a byte-level tokenizer; the per-message JSON
    framing outweighs the template's markup). orjson, 1000 messages per call (GIL-friendly steps
    in a worker thread); the standard library's ASCII-escaped text, 40x slower (0.6 ms for a
    260 KiB conversation), was only a looser bound."""
    size = sum(len(fastjson.dumps_bytes(messages[i : i + 1000])) for i in range(0, len(messages), 1000))
    return size + (len(fastjson.dumps_bytes(tools)) if tools else 0) + 64


class WindowFit:
    """Shortens a chat hop's `max_tokens` to the room its prompt leaves in the engine's window."""

    def __init__(self, engine: Engine, client: Any, window: int | None, counters: Any):
        self.engine = engine
        self.client = client
        self.window = window
        self.counters = counters
        self._said: set[str] = set()

    def fits(self, payload: dict[str, Any]) -> bool:
        """Whether the prompt's upper bound plus the payload's `max_tokens` fits (no `max_tokens`,
        or no known window: nothing to check)."""
        want = payload.get("max_tokens")
        if not isinstance(want, int) or self.window is None:
            return True
        return prompt_token_bound(payload["messages"], payload.get("tools")) + want <= self.window

    async def fit(self, payload: dict[str, Any], hop: str, engine: Any = None) -> None:
        """Cut `payload["max_tokens"]` to the room left when it would overflow the window
        (counted in `max_tokens_shortened_total` by hop). A prompt that cannot be measured is
        sent as it is (logged once per cause)."""
        many = len(payload.get("messages") or ()) > BIG_MESSAGES
        if await asyncio.to_thread(self.fits, payload) if many else self.fits(payload):
            return
        prompt = await self.measure(payload, engine)
        if prompt is None or self.window is None:
            return
        room = self.window - prompt
        if 0 < room < payload["max_tokens"]:
            payload["max_tokens"] = room
            self.counters.inc("max_tokens_shortened_total", hop=hop)

    async def measure(self, payload: dict[str, Any], engine: Any) -> int | None:
        """The prompt's exact token count as the engine renders it, or None."""
        body = self.engine.length_request(payload)
        path = self.engine.probe_path
        if body is None or path is None:
            self._once("none", "the engine cannot measure a prompt: an output limit may overflow its window")
            return None
        try:
            answer = await self.client.chat(body, "length", timeout=MEASURE_TIMEOUT_S, path=path, engine=engine)
        except (EngineHTTPError, EngineUnavailable) as exc:
            self._once("failed", f"measuring a prompt failed ({type(exc).__name__}): its output limit is sent as is")
            return None
        return self.engine.length_of(answer)

    def _once(self, cause: str, message: str) -> None:
        if cause not in self._said:
            self._said.add(cause)
            log.warning("%s (said once)", message)
