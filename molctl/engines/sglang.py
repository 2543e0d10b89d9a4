"""SGLang: `sglang.launch_server`, adapters selected with `model=<base>:<adapter>`.

SGLang's argument parser cannot be imported on a host without CUDA (its utils import
torchvision/orjson at import time), so the accepted flags are read from the installed
`sglang/srt/server_args.py` source (`add_argument("--...")` calls) without importing SGLang."""

from __future__ import annotations

from molctl.engines.base import Engine, EngineInstall, run_probe_script
from molctl.profiles import Profile

PROBE_SCRIPT = r"""
import importlib.metadata, importlib.util, json, os, re
spec = importlib.util.find_spec("sglang")
out = {"found": spec is not None}
if spec is not None:
    try:
        out["version"] = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        out["version"] = None
    root = list(spec.submodule_search_locations or [])[0]
    src = os.path.join(root, "srt", "server_args.py")
    try:
        text = open(src, encoding="utf-8").read()
        out["flags"] = sorted(set(re.findall(r"add_argument\(\s*[\"']--([a-z0-9][a-z0-9_-]*)[\"']", text)))
    except OSError as exc:
        out["error"] = "cannot read %s: %s" % (src, exc.strerror)
print(json.dumps(out))
"""


class SglangEngine(Engine):
    kind = "sglang"
    package = "sglang"
    launch_module = "sglang.launch_server"
    model_flag = "--model-path"
    lora_flag = "--lora-paths"
    memory_flag = "mem-fraction-static"
    phases = (
        (r"server_args=|ServerArgs\(", "engine config"),
        (r"Load weight begin", "loading model"),
        (r"Loading safetensors checkpoint shards:.*?(\d+)/(\d+)", "shards loaded {0}/{1}"),
        (r"Load weight end", "weights loaded"),
        (r"KV Cache is allocated|Memory pool end", "KV cache"),
        (r"Capture cuda graph|Capturing batches", "graph capture"),
        (r"Uvicorn running|Application startup complete", "warming up"),
        (r"The server is fired up and ready to roll", "serving"),
    )

    def probe_install(self, python: str) -> EngineInstall:
        return run_probe_script(python, PROBE_SCRIPT)

    def adapter_model(self, profile: Profile, route: str) -> str:
        return f"{profile.engine.served_name}:{route}"

    def guided_choice(self, labels: list[str]) -> dict:
        return {"regex": "(" + "|".join(labels) + ")"}


ENGINE = SglangEngine()
