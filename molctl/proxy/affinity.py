"""Conversation affinity between proxy replicas on a shared store: which engine a conversation's
hops go to (`EngineChoice`). A leaf the store, the engine client and the pipeline all read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class EngineChoice:
    """Conversation affinity (proxy replicas on a shared store): the request's chat hops go to
    `url`, the engine of `replica`, instead of this proxy's own upstream. `failed` is set when
    that engine refused the connection: the remaining hops go to the own engine (a takeover).
    `scheduler`: a scheduler in front of the engines places the hops instead (`url` is then the
    own upstream, the router); its per-request headers (`molctl.proxy.scheduler_hints`)."""

    replica: str
    url: str
    failed: bool = False
    scheduler: Any = None
