"""The checks that need a real NVIDIA GPU, run by hand on a GPU host (not collected by pytest: CI
has no GPU, and everything here also has a test against injected probes in the suite).

    python -m tests.gpu_host_check [--out report.json]

What it runs, against the host's real driver through NVML (nvidia-ml-py) and a fake vLLM whose
EngineCore-like child holds real CUDA memory (tests/fake_engine.py, FAKE_CHILD=gpu, needs torch):
  1. inventory: molctl's NvmlProbe against `nvidia-smi --query-gpu` (names, memory, driver);
  2. `molctl check tall`: a host with fewer GPUs than engine.gpus fails gpu.count (exit 2);
  3. the same with engine.gpus set to the host's count: gpu.driver/count/memory/processes pass;
  4. a foreign CUDA process holding memory: gpu.processes fails naming its pid, gpu.memory fails
     when what is left is under the memory fraction;
  5. `molctl up` with engine.gpus=1 (preflight on the real GPU, host-wide GPU claim), the engine's
     child holding GPU memory: `check` run beside the running stack does not call it foreign;
     `molctl down` exits 0 and NVML lists none of the stack's processes afterwards;
  6. the orphaned-worker case: the engine leader SIGKILLed, its GPU child left behind: `down`
     stops the orphan and NVML shows the memory freed.
Each step's outcome goes to the report; the exit status is 1 when any expectation failed.
Results of the runs are written down in docs/gpu-host-check.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from molctl.errors import ExitStatus
from molctl.probes import NvmlProbe
from tests.helpers import Molctl, free_ports
from tests.layouts import make_layout
from tests.procs import fake_engine_python

CHECK_SKIPS = [
    "--skip",
    "model",
    "--skip",
    "adapter",
    "--skip",
    "template",
    "--skip",
    "engine",
    "--skip",
    "port",
    "--skip",
    "state",
    "--skip",
    "security",
    "--json",
]


class Report:
    def __init__(self):
        self.steps: list[dict] = []

    def expect(self, step: str, ok: bool, **facts) -> bool:
        self.steps.append({"step": step, "ok": bool(ok), **facts})
        print(f"[{'ok' if ok else 'FAIL'}] {step}: {json.dumps(facts, default=str)[:600]}", flush=True)
        return ok


def smi() -> list[dict]:
    out = subprocess.run(
        [
            "nvidia-smi",
            "--query-gpu=index,name,memory.total,memory.free,driver_version",
            "--format=csv,noheader,nounits",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    rows = []
    for line in out.strip().splitlines():
        index, name, total, free, driver = [x.strip() for x in line.split(",")]
        rows.append(
            {"index": int(index), "name": name, "total_mib": int(total), "free_mib": int(free), "driver": driver}
        )
    return rows


def gpu_pids() -> set[int]:
    return {p.pid for d in NvmlProbe().inventory().devices for p in d.processes}


def wait_gpu(predicate, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate(gpu_pids()):
            return True
        time.sleep(0.25)
    return False


def checks(result) -> dict[str, dict]:
    try:
        return {c["id"]: c for c in result.json()["checks"]}
    except (ValueError, KeyError, TypeError):
        return {}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rep = Report()
    tmp = Path(tempfile.mkdtemp(prefix="molctl-gpu-"))
    state, model = tmp / "state", tmp / "model"
    make_layout(model, model_type="llama", shards=2, rank=8, base_name="tiny-mol-llama")
    cli = Molctl(state)
    python = fake_engine_python(tmp / "fake-python")
    engine_port, proxy_port = free_ports(2)

    # 1. inventory
    inv = NvmlProbe().inventory()
    rows = smi()
    same = len(rows) == len(inv.devices) and all(
        r["name"] == d.name and r["total_mib"] == d.total_bytes // 2**20 and r["driver"] == inv.driver_version
        for r, d in zip(rows, inv.devices, strict=True)
    )
    rep.expect(
        "inventory: NvmlProbe agrees with nvidia-smi",
        same,
        nvml=[
            {
                "index": d.index,
                "name": d.name,
                "total_mib": d.total_bytes // 2**20,
                "free_mib": d.free_bytes // 2**20,
                "processes": [p.pid for p in d.processes],
            }
            for d in inv.devices
        ],
        driver=inv.driver_version,
        smi=rows,
    )
    count = len(inv.devices)

    # 2. too few GPUs for the profile's engine.gpus
    r = cli("check", "tall", *CHECK_SKIPS)
    c = checks(r).get("gpu.count", {})
    rep.expect(
        "check tall (engine.gpus=8): gpu.count fails, exit 3 (check failed)",
        r.exit_code == ExitStatus.CHECK_FAILED
        and c.get("status") == "fail"
        and f"{count} GPU(s) visible" in c.get("detail", ""),
        exit=int(r.exit_code),
        check=c,
        stderr=r.stderr[-300:],
    )

    # 3. the host's own count
    gpus = ["--set", f"engine.gpus={count}"]
    r = cli("check", "tall", *gpus, *CHECK_SKIPS)
    cs = checks(r)
    rep.expect(
        "check tall (engine.gpus=host count): every gpu.* passes",
        r.exit_code == 0
        and all(
            cs.get(i, {}).get("status") == "pass"
            for i in ("gpu.driver", "gpu.count", "gpu.memory", "gpu.processes", "gpu.lock")
        ),
        exit=int(r.exit_code),
        checks={k: v for k, v in cs.items() if k.startswith("gpu.")},
    )

    # 4. a foreign CUDA process
    total_gib = inv.devices[0].total_bytes / 2**30
    hold = int(total_gib * 0.2)  # leaves under the 0.9 fraction free
    foreign = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time, torch; "
            f"x = torch.empty({hold} * 2 ** 30, dtype=torch.uint8, device='cuda:0'); "
            "torch.cuda.synchronize(); time.sleep(300)",
        ],
        start_new_session=True,
    )
    try:
        seen = wait_gpu(lambda pids: foreign.pid in pids)
        r = cli("check", "tall", *gpus, *CHECK_SKIPS)
        cs = checks(r)
        rep.expect(
            f"foreign CUDA process ({hold} GiB): gpu.processes fails naming it, gpu.memory fails",
            seen
            and r.exit_code == ExitStatus.CHECK_FAILED
            and cs.get("gpu.processes", {}).get("status") == "fail"
            and f"pid {foreign.pid}" in cs["gpu.processes"]["detail"]
            and cs.get("gpu.memory", {}).get("status") == "fail",
            nvml_saw_it=seen,
            exit=int(r.exit_code),
            checks={k: v for k, v in cs.items() if k.startswith("gpu.")},
        )
    finally:
        os.killpg(foreign.pid, signal.SIGKILL)
        foreign.wait()
    rep.expect("foreign process gone from NVML after SIGKILL", wait_gpu(lambda pids: foreign.pid not in pids))

    # 5. up / check beside it / down, the engine's child holding GPU memory
    up_args = [
        "--set",
        f"engine.python={python}",
        "--set",
        f"engine.port={engine_port}",
        "--set",
        f"proxy.port={proxy_port}",
        "--set",
        "engine.gpus=1",
        "--set",
        "engine.env.FAKE_CHILD=gpu",
        "--set",
        "engine.env.FAKE_GPU_GIB=2",
        "--model-root",
        str(model),
        "--skip",
        "engine",
        "--allow-unauthenticated",
        "--timeout",
        "120",
        "--json",
    ]

    def up():
        t0 = time.monotonic()
        res = cli("up", "tiny", *up_args, timeout=180)
        return res, time.monotonic() - t0

    def stack() -> set[int]:
        from molctl.processes import members
        from molctl.state import read_records

        return {p.pid for rec in read_records(state, "tiny").values() for p in members(rec)}

    r, took = up()
    ok = r.exit_code == 0
    rep.expect(
        "up tiny with engine.gpus=1 (real preflight, GPU claim)",
        ok,
        exit=int(r.exit_code),
        seconds=round(took, 1),
        stderr=r.stderr[-400:],
    )
    if ok:
        on_gpu = wait_gpu(lambda pids: bool(pids & stack()))
        held = sorted(gpu_pids() & stack())
        rep.expect("the stack's engine child is on the GPU (NVML)", on_gpu, pids=held)
        r = cli(
            "check",
            "tiny",
            "--set",
            "engine.gpus=1",
            "--set",
            f"engine.port={engine_port}",
            "--set",
            f"proxy.port={proxy_port}",
            "--model-root",
            str(model),
            "--skip",
            "engine",
            "--json",
        )
        cs = checks(r)
        rep.expect(
            "check beside the running stack: its GPU process and claim are its own",
            cs.get("gpu.processes", {}).get("status") == "pass" and cs.get("gpu.lock", {}).get("status") == "pass",
            exit=int(r.exit_code),
            checks={k: v for k, v in cs.items() if k.startswith(("gpu.", "port."))},
        )
        s = cli("status", "--json")
        rep.expect("status while running", s.exit_code == 0, status=s.stdout[-800:])
        t0 = time.monotonic()
        d = cli("down", timeout=120)
        rep.expect(
            "down: exit 0, NVML shows none of the stack's processes",
            d.exit_code == 0 and not (gpu_pids() & set(held)),
            exit=int(d.exit_code),
            seconds=round(time.monotonic() - t0, 1),
            stderr=d.stderr[-400:],
            left=sorted(gpu_pids() & set(held)),
        )

    # 6. orphaned worker: the leader SIGKILLed, its GPU child left
    r, took = up()
    if rep.expect("up again", r.exit_code == 0, exit=int(r.exit_code), stderr=r.stderr[-400:]):
        from molctl.state import read_records

        leader = read_records(state, "tiny")["engine"].pid
        wait_gpu(lambda pids: bool(pids & stack()))
        held = sorted(gpu_pids() & stack())
        os.kill(leader, signal.SIGKILL)
        time.sleep(1.0)
        orphan_alive = bool(held) and all(Path(f"/proc/{p}").exists() for p in held)
        st = cli("status", "--json")
        d = cli("down", timeout=120)
        freed = wait_gpu(lambda pids: not (pids & set(held)), timeout=30)
        rep.expect(
            "orphaned GPU worker after the leader's SIGKILL: down stops it and NVML frees it",
            orphan_alive and d.exit_code == 0 and freed,
            orphan=held,
            orphan_alive=orphan_alive,
            status=st.stdout[-400:],
            exit=int(d.exit_code),
            stderr=d.stderr[-400:],
        )

    cli("down", "--force", "--stop-timeout", "2", timeout=60)
    report = {
        "host": os.uname().nodename,
        "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "steps": rep.steps,
        "ok": all(s["ok"] for s in rep.steps),
    }
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    print("ALL OK" if report["ok"] else "SOME CHECKS FAILED", flush=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
