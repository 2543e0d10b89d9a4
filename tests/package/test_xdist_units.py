"""make test's scheduling units (tests/xdist_stacks.py): each vLLM release's end-to-end tests are
one unit across modules, everything else goes by module (its module-scoped stacks start once)."""

from __future__ import annotations

from tests.xdist_stacks import unit_of


def test_an_end_to_end_test_goes_with_its_release_whatever_its_module():
    a = unit_of("tests/e2e/test_e2e.py::test_chat[vllm-0.24.0-True]")
    b = unit_of("tests/e2e/test_e2e_tracing.py::test_spans[vllm-0.24.0]")
    c = unit_of("tests/e2e/test_e2e.py::test_chat[vllm-0.32.0-True]")
    assert a == b == "e2e-vllm-0.24.0" and c == "e2e-vllm-0.32.0"


def test_other_tests_go_by_module():
    assert unit_of("tests/e2e/test_e2e.py::test_exit_7") == "tests/e2e/test_e2e.py"
    assert unit_of("tests/proxy/test_x.py::test_y[vllm-0.24.0]") == "tests/proxy/test_x.py"
    assert unit_of("tests/proxy/test_x.py::TestZ::test_y") == "tests/proxy/test_x.py"


def test_a_parameter_holding_a_double_colon_stays_with_its_module():
    """An IPv6 address in a test id (`[http://[::1]/x]`) made a unit of its own, which another
    worker could take, starting the module's stacks a second time."""
    from tests.xdist_stacks import StackScheduling

    split = StackScheduling._split_scope
    assert split(None, "tests/proxy/test_x.py::test_url[http://[::1]/x-False]") == "tests/proxy/test_x.py"
    assert split(None, "tests/proxy/test_x.py::test_url[plain]") == "tests/proxy/test_x.py"
