"""CLI speed: `molctl check` of a Venti-sized layout (141 sparse shards of real size, real
headers, 4 adapters) with --skip gpu --skip engine, and `molctl --help` / `molctl profiles`.

Run with `make bench`; prints medians. Whole-process timings (python start-up included)."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.layouts import venti_layout  # noqa: E402

MOLCTL = [sys.executable, "-m", "molctl"]


def timed(argv: list[str], runs: int, env=None) -> tuple[float, int]:
    samples, code = [], 0
    for _ in range(runs):
        t0 = time.perf_counter()
        code = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env).returncode
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples), code


def check_tiny(tmp: Path) -> dict[str, float]:
    """`molctl check tiny` on a `demo init` model (template category included): the first run (engine
    probe and template render not cached yet), later runs (both remembered in STATE/cache), later
    runs with the template result forgotten each time (the render itself), and with --skip template."""
    model, state = tmp / "tiny", tmp / "state-tiny"
    state.mkdir(mode=0o700)  # the engine probe and the template result are remembered in STATE/cache
    env = dict(os.environ, MOLCTL_STATE_DIR=str(state))
    subprocess.run([*MOLCTL, "demo", "init", str(model)], check=True, stdout=subprocess.DEVNULL, env=env)
    argv = [*MOLCTL, "check", "tiny", "--model-root", str(model), "--skip", "port"]
    first, code = timed(argv, 1, env)
    assert code == 0, "check tiny failed"
    later, _ = timed(argv, 7, env)
    samples = []
    for _ in range(7):
        for old in (state / "cache").glob("template-*.json"):
            old.unlink()
        samples.append(timed(argv, 1, env)[0])
    skip, _ = timed([*argv, "--skip", "template"], 7, env)
    return {"first": first, "later": later, "render": statistics.median(samples), "skip": skip}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tiny = check_tiny(Path(tmp))
        root = Path(tmp) / "venti"
        # 141 shards of ~5 GB (744B params in FP8), sparse: headers are real, data is holes.
        # 170 experts x 6 tensors per shard: ~1000 tensors per header, ~145k in all, like GLM-5.
        t0 = time.perf_counter()
        layout = venti_layout(root, hidden=512, sparse=True, shard_scale=40, experts=170)
        build = time.perf_counter() - t0
        size = sum(os.path.getsize(p) for p in layout.shards)
        tensors = len(layout.index()["weight_map"])
        env = dict(os.environ, MOLCTL_STATE_DIR=str(Path(tmp) / "state"))
        check, code = timed(
            [
                *MOLCTL,
                "check",
                "venti",
                "--model-root",
                str(root),
                "--skip",
                "gpu",
                "--skip",
                "engine",
                "--set",
                "engine.port=1",
                "--skip",
                "port",
            ],
            5,
            env,
        )
        assert code == 0, "check of the generated Venti layout failed"
        help_, _ = timed([*MOLCTL, "--help"], 10, env)
        profiles, _ = timed([*MOLCTL, "profiles"], 10, env)
        baseline, _ = timed([sys.executable, "-c", "pass"], 10, env)
    print(f"layout: 141 shards, {tensors} tensors, {size / 1e9:.0f} GB apparent (sparse), built in {build:.1f} s")
    print(f"python start-up alone         median {baseline * 1000:7.1f} ms")
    print(f"molctl check venti (layout)   median {check * 1000:7.1f} ms")
    print(f"molctl --help                 median {help_ * 1000:7.1f} ms")
    print(f"molctl profiles               median {profiles * 1000:7.1f} ms")
    print(
        f"molctl check tiny (--skip port): first run {tiny['first']:.1f} s; later runs median {tiny['later'] * 1000:.0f} ms; "
        f"template result not remembered {tiny['render'] * 1000:.0f} ms; --skip template {tiny['skip'] * 1000:.0f} ms"
    )


if __name__ == "__main__":
    main()
