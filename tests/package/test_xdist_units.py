"""make test's scheduling units (tests/xdist_stacks.py): each vLLM release's end-to-end tests are
one unit across modules, everything else goes by module (its module-scoped stacks start once)."""

from __future__ import annotations

from tests.xdist_stacks import unit_of


def test_an_end_to_end_test_goes_with_its_release_whatever_its_module():
    a = unit_of("tests/e2e/test_e2e.py::test_chat[vllm-0.24.0-True]", "tests/e2e/test_e2e.py")
    b = unit_of("tests/e2e/test_e2e_tracing.py::test_spans[vllm-0.24.0]", "tests/e2e/test_e2e_tracing.py")
    c = unit_of("tests/e2e/test_e2e.py::test_chat[vllm-0.32.0-True]", "tests/e2e/test_e2e.py")
    assert a == b == "e2e-vllm-0.24.0" and c == "e2e-vllm-0.32.0"


def test_other_tests_go_by_module():
    assert unit_of("tests/e2e/test_e2e.py::test_exit_7", "tests/e2e/test_e2e.py") == "tests/e2e/test_e2e.py"
    assert unit_of("tests/proxy/test_x.py::test_y[vllm-0.24.0]", "tests/proxy/test_x.py") == "tests/proxy/test_x.py"
