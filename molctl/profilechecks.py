"""Profile checks owned by a higher layer, registered by their owner.

A few profile rules are not the profile's to know: which base names an engine can serve adapters
under and which of its flags tracing sets (`molctl.engines`), the grammar of a `proxy.store` URL
(`molctl.proxy.store.factory`), what a collector URL may look like (`molctl.proxy.tracing`). Each
owner registers its check here when it is imported, and `molctl.profiles` runs the checks while
it validates a profile; so the profile layer imports none of its owners (the arrows run one way,
tests/package/test_import_graph.py).

Every check `OWNERS` names must be registered before a profile is loaded: a missing one is a
RuntimeError naming the module to import, never a check silently skipped. The programs import
the owners at their entry (`molctl.cli`, the proxy server, `molctl.lifecycle.waitready`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

# (the section's values as read from YAML) -> (the dotted field at fault, what is wrong) or None
SectionCheck = Callable[[Mapping[str, Any]], "tuple[str, str] | None"]

# the checks a profile's validation runs, and the module that registers each
OWNERS: dict[str, str] = {
    "engine": "molctl.engines",
    "proxy.store": "molctl.proxy.store.factory",
    "proxy.otlp_endpoint": "molctl.proxy.tracing",
}

_registered: dict[str, SectionCheck] = {}


def register(name: str, check: SectionCheck) -> None:
    """Called by the owner named in OWNERS, at its import."""
    if name not in OWNERS:
        raise ValueError(f"no profile check named {name!r}: expected one of {', '.join(OWNERS)}")
    _registered[name] = check


def problem(name: str, section: Mapping[str, Any]) -> tuple[str, str] | None:
    """The registered check `name` run on `section`: (field, what is wrong) or None."""
    check = _registered.get(name)
    if check is None:
        raise RuntimeError(
            f"the profile check {name!r} is not registered: import {OWNERS[name]} before loading a profile"
        )
    return check(section)
