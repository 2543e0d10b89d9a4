"""The one hop-priority policy: which hop carries the engine's request priority, and when not.

`PriorityPolicy.mark(payload, hop, engine)` sets a hop's priority (`Engine.hop_priorities`);
`refused(exc, url)` records an engine that refused one (`refuses`), so its hops go without for
PRIORITY_RETRY_S; `took(url)` records an engine that ran a route hop with its priority.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from molctl.engines.base import Engine
from molctl.profiles import Profile
from molctl.proxy.affinity import EngineChoice
from molctl.proxy.engine_client import EngineClient
from molctl.proxy.errors import EngineHTTPError

log = logging.getLogger("molctl.proxy")

# How long hops to an engine that refused a priority go without one before it is tried again (an
# engine restarted with the flag gets priorities back without a proxy restart)
PRIORITY_RETRY_S = 600.0


def refuses_priority(exc: EngineHTTPError, engine: Engine) -> bool:
    """The engine refused the request for its priority (`Engine.priority_refusals`)."""
    if exc.status not in (400, 503):
        return False
    message = exc.message().lower()
    return any(m in message for m in engine.priority_refusals)


class PriorityPolicy:
    def __init__(self, profile: Profile, engine: Engine, client: EngineClient, counters: Any):
        self.engine = engine
        self.client = client
        self.counters = counters
        self.priorities = engine.hop_priorities(profile)
        self.refused_at: dict[str, float] = {}  # engine URL -> when it last refused a priority
        self.taken: set[str] = set()  # engine URLs that ran a route hop with its priority
        self.beyond_route = bool(self.priorities.keys() - {"route"})

    def mark(self, payload: dict[str, Any], hop: str, engine: EngineChoice | None) -> None:
        """The hop's priority (`Engine.hop_priorities`) unless the engine the hop goes to refused
        one less than PRIORITY_RETRY_S ago. Answers and summaries (SGLang's explicit 0) only to an
        engine that ran a route hop with its priority: only the route hop is sent again without
        one when refused (a tool-result turn has no route hop, a summary no second chance)."""
        priority = self.priorities.get(hop)
        if priority is None:
            return
        if hop != "route" or self.refused_at:
            url = self.client.target_url(engine)
            if hop != "route" and url not in self.taken:
                return
            refused = self.refused_at.get(url)
            if refused is not None and time.monotonic() - refused < PRIORITY_RETRY_S:
                return
        payload["priority"] = priority

    def took(self, payload: dict[str, Any], engine: EngineChoice | None) -> None:
        """A route hop ran with `payload`: its engine takes priorities on the later hops too."""
        if "priority" in payload and self.beyond_route:
            self.taken.add(self.client.target_url(engine))

    def refuses(self, exc: EngineHTTPError, payload: dict[str, Any]) -> bool:
        """Whether `exc` is the engine refusing the priority `payload` carried."""
        return "priority" in payload and refuses_priority(exc, self.engine)

    def refused(self, exc: EngineHTTPError, engine: EngineChoice | None) -> None:
        """An engine started without the profile's priority scheduling (`molctl proxy PROFILE
        --upstream` in front of another start script, a peer replica's engine) refused a route
        hop's priority: its hops go without one for PRIORITY_RETRY_S, said once per engine."""
        url = self.client.target_url(engine)
        self.taken.discard(url)
        self.counters.inc("route_priority_refusals_total")
        if url not in self.refused_at:
            flag = self.engine.priority_flag
            log.warning(
                "the engine at %s refuses request priorities (%s): its hops are sent without one, tried "
                "again every %.0f s; start it with the profile's %s, or take %s out of the profile",
                url,
                exc.one_line(),
                PRIORITY_RETRY_S,
                flag,
                flag,
            )
        self.refused_at[url] = time.monotonic()
