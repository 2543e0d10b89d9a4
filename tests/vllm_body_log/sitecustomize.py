"""Test instrumentation for the pinned vLLM 0.24.0 (on the engine's PYTHONPATH in tests/e2e only):
the request log's "Request ID JSON body: {...}" DEBUG line, which vLLM 0.32 writes and 0.24 lacks.

vLLM 0.32 logs it in `BaseServing._check_model` (vllm/entrypoints/serve/engine/serving.py), as
`RequestLogger.log_request_body` does (vllm/entrypoints/serve/utils/request_logger.py: at DEBUG,
the request id and `request.model_dump_json(exclude_unset=True)` cut to max_log_len). 0.24.0 has
the same `_check_model` and logger without that line. Once 0.24's serving module is imported,
its `_check_model` writes the same line first; nothing else of the engine changes. The end-to-end
tests read every hop's body from that line on both versions (tests/e2e/test_e2e.py, `Stack.hops`).
"""

import importlib.abc
import importlib.machinery
import logging
import sys

TARGET = "vllm.entrypoints.serve.engine.serving"


def _patch(module) -> None:
    from vllm.entrypoints.serve.utils import request_logger

    original = module.BaseServing._check_model

    async def _check_model(self, request):
        rl = getattr(self, "request_logger", None)
        if rl is not None and request_logger.logger.isEnabledFor(logging.DEBUG):
            request_logger.logger.debug(
                "Request %s JSON body: %s",
                getattr(request, "request_id", "N/A"),
                request.model_dump_json(exclude_unset=True)[: rl.max_log_len],
            )
        return await original(self, request)

    module.BaseServing._check_model = _check_model


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        exec_module = loader.exec_module

        def patched(module):
            exec_module(module)
            _patch(module)

        loader.exec_module = patched
        return spec


sys.meta_path.insert(0, _Finder())
