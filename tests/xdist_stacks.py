"""How `make test` spreads the suite over pytest-xdist workers (`--dist loadscope`, scheduled by
`StackScheduling` through tests/conftest.py's `pytest_xdist_make_scheduler`).

loadscope keeps each test module on one worker, so a module-scoped stack (a scripted engine and
proxy, a Redis server) starts once. The end-to-end tests go further: every test of one vLLM
release (its id, e.g. `[vllm-0.24.0`, in the test's parameters) is one unit, whatever its module,
so each release's real vLLM stacks start on one worker only and the two releases run beside each
other. (xdist's own `loadgroup` marks do not take with pytest 9.2: it rewrites `item._nodeid`,
which pytest 9.2 no longer reads.)"""

from __future__ import annotations

import re

from xdist.scheduler import LoadScopeScheduling

RELEASE = re.compile(r"\[(vllm-\d+(?:\.\d+)+)")


def unit_of(nodeid: str) -> str:
    """The scheduling unit of a test: its vLLM release for an end-to-end test, else its module (the
    path before the first `::`; loadscope's own split, at the last `::`, cut a parameter holding
    one, e.g. `[http://[::1]/x]`, into a unit of its own that started the module's stacks again)."""
    if nodeid.startswith("tests/e2e/"):
        release = RELEASE.search(nodeid)
        if release:
            return "e2e-" + release.group(1)
    return nodeid.split("::", 1)[0]


class StackScheduling(LoadScopeScheduling):
    def _split_scope(self, nodeid: str) -> str:
        return unit_of(nodeid)
