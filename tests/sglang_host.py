"""The lifecycle tests' host for SGLang: `SglHost(tmp)`, a Host (tests/lifecycle_host.py) whose
profiles folder also holds `tiny-sglang` (`SGL`): venti-sglang's engine section (same flags, TP 1
and a 2048 window) on tiny's model layout and proxy, run by the scripted fake SGLang
(tests/fake_sglang.py). Used by tests/lifecycle/ (test_lifecycle_sglang, test_adapter_canary)."""

from __future__ import annotations

from pathlib import Path

import psutil
import yaml

from molctl.profiles import builtin_profiles_dir
from tests.lifecycle_host import Host

SGL = "tiny-sglang"


def sglang_profile() -> str:
    tiny = yaml.safe_load((builtin_profiles_dir() / "tiny.yaml").read_text())
    venti = yaml.safe_load((builtin_profiles_dir() / "venti-sglang.yaml").read_text())
    engine = dict(venti["engine"])
    engine["args"] = {
        **venti["engine"]["args"],
        "tp": 1,
        "context-length": 2048,
        "max-lora-rank": 8,
        "max-loras-per-batch": 4,
    }
    engine.update(gpus=0, port=tiny["engine"]["port"], start_timeout_s=600, unset_env=["PYTHONPATH"])
    engine["env"] = {**venti["engine"]["env"], "FAKE_TERM_POLL": "0.5"}  # SGLang polls every 5 s: tests are quicker
    proxy = {**tiny["proxy"], "reasoning": "glm"}
    return yaml.safe_dump(
        {
            **tiny,
            "name": SGL,
            "description": "tiny layout, venti-sglang engine (fake SGLang)",
            "engine": engine,
            "proxy": proxy,
        },
        sort_keys=False,
        allow_unicode=True,
    )


class SglHost(Host):
    def __init__(self, tmp: Path):
        super().__init__(tmp)
        (self.profiles / f"{SGL}.yaml").write_text(sglang_profile())

    def up(self, *extra: str, env: dict | None = None, profile=SGL, **kw):
        return super().up(*extra, env=env, profile=profile, **kw)

    def records(self, profile=SGL):
        return super().records(profile)

    def stack_pids(self, profile=SGL) -> set[int]:
        return super().stack_pids(profile)

    def sglang_children(self) -> list[psutil.Process]:
        """Processes that renamed themselves like SGLang's scheduler/detokenizer and work in this
        host's state dir (the run-dir marker), alive or not yet reaped."""
        out = []
        for p in psutil.process_iter(["cmdline", "cwd", "status"]):
            try:
                title = " ".join(p.info["cmdline"] or [])
                if (
                    title.startswith("sglang::")
                    and str(p.info["cwd"] or "").startswith(str(self.state))
                    and p.info["status"] != psutil.STATUS_ZOMBIE
                ):
                    out.append(p)
            except (psutil.Error, TypeError):
                pass
        return out
