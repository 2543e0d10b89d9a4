"""Start phases, ETA error, and the warm switch, on the real CPU vLLM (issue 44).

    python bench/bench_start_phases.py [--size-mb 2500] [--keep]

1. `molctl demo init --size-mb N` writes a bigger base (default ~2.5 GB: two 1.25 GB shards) in
   a temp dir beside the state dir (deleted at the end unless --keep).
2. Three `up`/`down` rounds of that model (page cache dropped for its files before each, with
   POSIX_FADV_DONTNEED: no root needed), printing each start's phase table and the ETA the
   start was given against what it took.
3. Switches from the small tiny stack to the big one, the big model's files dropped from the page
   cache before each, alternating `--no-prefetch` and the prefetch (molctl.prefetch), `--switch-reps`
   of each: the switch's wall time, its weights phase and its start time.
4. The load step alone, in this process: torch's safetensors load of the big base (what the
   engine's loader reads) from a cold page cache, and after `molctl prefetch`'s reader.
`--read-mbps N` runs it all on storage that reads at N MB/s: the bench (and every process it starts)
joins a cgroup whose block-I/O throttle (cgroup v1 `blkio.throttle.read_bps_device`, v2 `io.max`)
caps reads from the work dir's device, as a network filesystem or a busy array would; pages
already cached are not throttled. Needs root; this machine's disk reads about 1 GB/s otherwise.
Prints a markdown table for BENCHMARKS.md. Needs the CPU vLLM in .venv (make .venv/.stamp-cpu)."""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from molctl.prefetch import drop_from_cache  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Bench:
    def __init__(self, tmp: Path, size_mb: int):
        self.tmp = tmp
        self.state = tmp / "state"
        self.big = tmp / "big"
        self.small = tmp / "small"
        self.profiles = tmp / "profiles"
        self.profiles.mkdir()
        tiny = (ROOT / "profiles" / "tiny.yaml").read_text()
        (self.profiles / "tiny-big.yaml").write_text(tiny.replace("name: tiny", "name: tiny-big"))
        self.ports = {"engine.port": free_port(), "proxy.port": free_port()}
        self.size_mb = size_mb

    def molctl(self, *args: str, check: bool = True) -> dict:
        argv = [sys.executable, "-m", "molctl", "--state-dir", str(self.state), "--profiles-dir", str(self.profiles)]
        r = subprocess.run([*argv, *args], capture_output=True, text=True, cwd=ROOT, timeout=1800)
        if check and r.returncode != 0:
            raise SystemExit(f"molctl {' '.join(args)}: exit {r.returncode}\n{r.stderr[-3000:]}")
        try:
            return json.loads(r.stdout)
        except ValueError:
            return {}

    def start_args(self, root: Path) -> list[str]:
        out = ["--model-root", str(root), "--allow-unauthenticated", "--skip", "adapter-effect", "--json"]
        for k, v in self.ports.items():
            out += ["--set", f"{k}={v}"]
        return out

    def drop_big(self) -> None:
        for f in sorted(self.big.rglob("*.safetensors")):
            drop_from_cache(f)

    def init_models(self) -> None:
        t0 = time.monotonic()
        self.molctl("demo", "init", str(self.big), "--size-mb", str(self.size_mb), "--json")
        self.molctl("demo", "init", str(self.small), "--json")
        size = sum(f.stat().st_size for f in self.big.rglob("*.safetensors"))
        print(f"big model: {size / 2**30:.2f} GiB in {time.monotonic() - t0:.0f} s", flush=True)


def throttle_reads(work_dir: Path, mbps: int) -> str:
    """Join a cgroup that caps block reads from `work_dir`'s device at `mbps` MB/s (children inherit it)."""
    import os

    st = os.stat(work_dir)
    dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    if os.path.exists(f"/sys/dev/block/{dev}/partition"):  # throttles apply to the whole disk
        dev = Path(os.path.realpath(f"/sys/dev/block/{dev}/..")).joinpath("dev").read_text().strip()
    limit = mbps * 1_000_000
    v1, v2 = Path("/sys/fs/cgroup/blkio"), Path("/sys/fs/cgroup")
    try:
        if v1.is_dir():
            group = v1 / "molctl-bench"
            group.mkdir(exist_ok=True)
            (group / "blkio.throttle.read_bps_device").write_text(f"{dev} {limit}")
        else:
            group = v2 / "molctl-bench"
            group.mkdir(exist_ok=True)
            (v2 / "cgroup.subtree_control").write_text("+io")
            (group / "io.max").write_text(f"{dev} rbps={limit}")
        (group / "cgroup.procs").write_text(str(os.getpid()))
    except OSError as exc:
        raise SystemExit(
            f"--read-mbps: cannot set a block-I/O throttle in {group}: {exc.strerror or exc} (needs root)"
        ) from None
    return f"reads from device {dev} capped at {mbps} MB/s (cgroup {group})"


def phase_row(label: str, result: dict, wall: float) -> str:
    t = result["timings"]
    eta = result["eta"]["expected_total_s"]
    actual = t["start_s"]
    err = "no history" if eta is None else f"{(eta - actual) / actual * 100:+.0f}%"
    phases = " ".join(f"{p} {s:.1f}" for p, s in t["phases"].items())
    return f"| {label} | {wall:.1f} | {actual:.1f} | {eta if eta is not None else '-'} | {err} | {phases} |"


def load_timing(bench: Bench, reps: int = 3) -> None:
    """torch's safetensors load of the big base, cold and after the prefetch reader (medians)."""
    import statistics

    from safetensors.torch import load_file

    def load(path: Path) -> None:  # load_file maps the file: clone() reads every page, as a loader copies
        for tensor in load_file(path).values():
            tensor.clone()

    from molctl.prefetch import Prefetcher

    files = sorted((bench.big / "base").glob("*.safetensors"))
    cold, warm, reads = [], [], []
    for _ in range(reps):
        bench.drop_big()
        t0 = time.monotonic()
        for f in files:
            load(f)
        cold.append(time.monotonic() - t0)
        bench.drop_big()
        res = Prefetcher(files, margin_bytes=2 << 30).run()
        reads.append(res.seconds)
        t0 = time.monotonic()
        for f in files:
            load(f)
        warm.append(time.monotonic() - t0)
    med = statistics.median
    print("| load of the base (safetensors.torch.load_file, 2 shards) | median of 3 |")
    print("|---|---|")
    print(f"| cold page cache | {med(cold):.2f} s |")
    print(f"| after molctl's prefetch (which took {med(reads):.2f} s) | {med(warm):.2f} s |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-mb", type=int, default=2500)
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--ups", type=int, default=3, help="cold `up` rounds (the ETA's error from the 2nd on)")
    parser.add_argument("--switch-reps", type=int, default=1)
    parser.add_argument("--load-only", action="store_true", help="only step 4 (the load step, cold and prefetched)")
    parser.add_argument("--dir", type=Path, default=None, help="work dir (default: a temp dir under /tmp)")
    parser.add_argument("--read-mbps", type=int, default=0, help="storage that reads at this many MB/s (root)")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="molctl-bench-phases-", dir=args.dir))
    if args.read_mbps:
        print(throttle_reads(tmp, args.read_mbps), flush=True)
    bench = Bench(tmp, args.size_mb)
    rows: list[str] = []
    try:
        bench.init_models()
        if args.load_only:
            load_timing(bench)
            return
        print("| start | wall s | start_s | ETA given s | ETA error | phases (s) |", flush=True)
        print("|---|---|---|---|---|---|", flush=True)
        for i in range(args.ups):
            bench.drop_big()
            t0 = time.monotonic()
            res = bench.molctl("up", "tiny-big", *bench.start_args(bench.big))
            rows.append(phase_row(f"up #{i + 1} (cold page cache)", res, time.monotonic() - t0))
            print(rows[-1], flush=True)
            bench.molctl("down")
        switch_rows, by_mode = [], {False: [], True: []}
        for prefetch in [False, True] * args.switch_reps:
            bench.molctl("up", "tiny", *bench.start_args(bench.small))
            bench.drop_big()
            t0 = time.monotonic()
            extra = [] if prefetch else ["--no-prefetch"]
            res = bench.molctl("switch", "tiny-big", *bench.start_args(bench.big), *extra)
            wall = time.monotonic() - t0
            t = res["timings"]
            pf = res.get("prefetch") or {}
            switch_rows.append(
                f"| switch tiny -> tiny-big, {'prefetch' if prefetch else '--no-prefetch'} | {wall:.1f} | "
                f"{t['stop_s']:.1f} | {t['phases'].get('weights', 0):.1f} | {t['start_s']:.1f} | "
                f"{pf.get('bytes_read', 0) / 2**30:.2f} GiB in {pf.get('seconds', 0):.1f} s |"
            )
            print(switch_rows[-1], flush=True)
            by_mode[prefetch].append((wall, t["phases"].get("weights", 0.0)))
            bench.molctl("down")
        print()
        print("| switch | wall s | stop_s | weights phase s | start_s | prefetched |")
        print("|---|---|---|---|---|---|")
        for row in switch_rows:
            print(row)
        for prefetch, runs in by_mode.items():
            if runs:
                import statistics

                wall_med = statistics.median(w for w, _ in runs)
                weights_med = statistics.median(x for _, x in runs)
                print(
                    f"| median of {len(runs)}, {'prefetch' if prefetch else '--no-prefetch'} | "
                    f"{wall_med:.1f} | | {weights_med:.1f} | | |"
                )
        print()
        load_timing(bench)
    finally:
        bench.molctl("down", check=False)
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
