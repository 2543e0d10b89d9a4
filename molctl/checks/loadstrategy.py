"""`model.load-strategy`: how the engine should read the checkpoint on this host, by the storage
the model root is on (/proc/mounts: a network filesystem or a local disk) and the memory free for
the page cache. Advice, never a failure; a warning when the profile sets a strategy that works
against this host.

vLLM's `--safetensors-load-strategy` (vllm/config/load.py, in the 0.24 and 0.32 parsers;
https://docs.vllm.ai/en/latest/configuration/engine_args.html): the default (None) memory-maps
(lazy) and, since 0.32, prefetches by itself on NFS/Lustre when the checkpoint fits in 90% of the
RAM; `lazy` is "highly efficient for models on local storage"; `eager` reads whole files into CPU
memory first, recommended on network filesystems, at the cost of RAM; `prefetch` reads the files
into the page cache before the workers load them, "useful on network or high-latency storage".
SGLang has no such flag: `molctl prefetch PROFILE` (and the warm `switch`) warm the page cache
for either engine."""

from __future__ import annotations

from pathlib import Path

from molctl.checks.result import CheckResult
from molctl.engines import get_engine
from molctl.prefetch import total_size

NETWORK_FS = ("nfs", "nfs4", "lustre", "cifs", "smb3", "smbfs", "ceph", "glusterfs", "beegfs", "gpfs", "9p", "virtiofs")
GIB = 1 << 30


def mount_of(path: Path, mounts_text: str) -> tuple[str, str]:
    """(mount point, fs type) of the longest mount point that holds `path` in a /proc/mounts text."""
    best = ("/", "unknown")
    target = str(path)
    for line in mounts_text.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        point = parts[1].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best[0]):
            best = (point, parts[2])
    return best


def is_network(fstype: str) -> bool:
    return fstype in NETWORK_FS or fstype.startswith("fuse.") or fstype == "fuse"


def run(profile, probes) -> list[CheckResult]:
    files = sorted(profile.base_dir.glob("*.safetensors"))
    if not files:
        return []  # model.index says what is missing
    size = total_size(files)  # a dangling link, a link loop counts 0: model.shards says what is wrong with it
    point, fstype = mount_of(profile.model_root.resolve(), probes.mounts())
    available = probes.available_memory()
    network = is_network(fstype)
    where = f"{profile.model_root} is on {'a network filesystem' if network else 'local storage'} ({fstype} at {point})"
    fits = size <= 0.9 * available
    mem = f"checkpoint {size / GIB:.1f} GiB, {available / GIB:.1f} GiB of memory available"
    flag = get_engine(profile.engine.kind).load_strategy_flag
    set_to = profile.engine.args.get(flag) if flag else None
    if flag is None:
        return [
            CheckResult(
                "model.load-strategy",
                "pass",
                f"{where}; {mem}; {profile.engine.kind} has no load-strategy flag: "
                + ("`molctl prefetch` warms the page cache first" if fits else "too large to prefetch into memory"),
            )
        ]
    if network and fits:
        advice, good = (
            "prefetch (reads the checkpoint into the page cache in large sequential reads)",
            {"prefetch", "eager", None},
        )
    elif network:
        advice, good = "lazy; better: copy the checkpoint to local NVMe (it does not fit in memory)", {"lazy", None}
    else:
        advice, good = "lazy (the default memory map: local storage serves random reads well)", {"lazy", None}
    detail = f"{where}; {mem}; advised --safetensors-load-strategy {advice} (vllm/config/load.py)"
    if set_to not in good:
        return [
            CheckResult("model.load-strategy", "warn", f"engine.args.safetensors-load-strategy is {set_to}: {detail}")
        ]
    return [CheckResult("model.load-strategy", "pass", detail)]
