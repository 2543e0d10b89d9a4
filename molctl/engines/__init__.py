"""Engine adapters: everything that differs between vLLM and SGLang lives in one module each.

`get_engine(kind)` returns the module-level `ENGINE` object of `molctl.engines.<kind>`; every
engine offers the same attributes (see `molctl.engines.base.Engine`).
"""

from __future__ import annotations

import importlib

from molctl import profilechecks
from molctl.engines.base import Engine


def get_engine(kind: str) -> Engine:
    module = importlib.import_module(f"molctl.engines.{kind}")
    return module.ENGINE


profilechecks.register("engine", lambda eng: get_engine(eng["kind"]).profile_problem(eng))
