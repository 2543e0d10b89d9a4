"""Host checks: GPUs (NVML), ports, the state dir and security settings."""

from __future__ import annotations

import ipaddress
import os
import stat
from pathlib import Path

from molctl.checks.result import CheckResult, Probes, describe
from molctl.engines import get_engine
from molctl.probes import GpuUnavailable
from molctl.profiles import Profile

GIB = 1024**3


def _selected_devices(profile: Profile, probes: Probes, count: int) -> list[int]:
    """Indices the engine will use: CUDA_VISIBLE_DEVICES (profile env first) or the first N."""
    visible = profile.engine.env.get("CUDA_VISIBLE_DEVICES", probes.environ.get("CUDA_VISIBLE_DEVICES"))
    if visible:
        try:
            return [int(x) for x in visible.split(",") if x.strip()][: profile.engine.gpus]
        except ValueError:
            pass  # UUIDs: fall back to the first N devices
    return list(range(min(count, profile.engine.gpus)))


def _own(profile: Profile, probes: Probes) -> set[str]:
    return {profile.name, *probes.own_profiles}


def _claim_holder(kind: str, key: int, profile: Profile, probes: Probes):
    """(holder, is_own) of the host-wide claim on a port / GPU index, or (None, False) when free."""
    from molctl.claims import HostClaims

    holder = HostClaims().holder(kind, key)
    if holder is None:
        return None, False
    return holder, holder.owns(probes.state_dir, _own(profile, probes))


def run_gpu_claims(profile: Profile, probes: Probes) -> list[CheckResult]:
    from molctl.claims import gpu_indices

    indices = gpu_indices(profile, probes.environ)
    if not indices:
        return []
    taken = []
    for index in indices:
        holder, own = _claim_holder("gpu", index, profile, probes)
        if holder is not None and not own:
            taken.append(f"GPU {index} is claimed by {holder.describe()}; {holder.stop_hint()}")
    if taken:
        return [CheckResult("gpu.lock", "fail", describe(taken, 2))]
    return [
        CheckResult("gpu.lock", "pass", f"GPU(s) {', '.join(map(str, indices))} not claimed by another molctl stack")
    ]


def run_gpu(profile: Profile, probes: Probes) -> list[CheckResult]:
    want = profile.engine.gpus
    if want == 0:
        return [CheckResult("gpu.count", "pass", f"profile {profile.name} needs no GPU")]
    return _run_gpu(profile, probes, want) + run_gpu_claims(profile, probes)


def _run_gpu(profile: Profile, probes: Probes, want: int) -> list[CheckResult]:
    try:
        inv = probes.gpu.inventory()
    except GpuUnavailable as exc:
        return [
            CheckResult(
                "gpu.driver",
                "fail",
                f"{exc}; profile {profile.name} needs {want} GPU(s) (use --skip gpu to stage files on a "
                "host without GPUs)",
            )
        ]
    out = [_driver(profile, probes, inv.driver_version)]
    if len(inv.devices) < want:
        out.append(
            CheckResult(
                "gpu.count",
                "fail",
                f"{len(inv.devices)} GPU(s) visible, profile {profile.name} needs engine.gpus={want}",
            )
        )
        return out
    out.append(CheckResult("gpu.count", "pass", f"{len(inv.devices)} GPU(s), {want} needed"))
    selected = [d for d in inv.devices if d.index in set(_selected_devices(profile, probes, len(inv.devices)))]

    fraction = get_engine(profile.engine.kind).memory_fraction(profile) or 0.9
    own = probes.stack_pids()

    def available(d) -> int:  # free memory plus what this profile's own running stack holds
        return d.free_bytes + sum(p.used_bytes or 0 for p in d.processes if p.pid in own)

    low = [
        f"GPU {d.index}: {d.free_bytes / GIB:.1f} GiB free of {d.total_bytes / GIB:.1f}, needs {fraction * d.total_bytes / GIB:.1f}"
        for d in selected
        if available(d) < fraction * d.total_bytes
    ]
    if low:
        out.append(
            CheckResult(
                "gpu.memory", "fail", f"not enough free memory for a memory fraction of {fraction}: {describe(low, 2)}"
            )
        )
    else:
        out.append(
            CheckResult("gpu.memory", "pass", f"free memory covers a fraction of {fraction} on {len(selected)} GPU(s)")
        )

    foreign = [
        f"GPU {d.index}: pid {p.pid} {p.name} using {_mib(p.used_bytes)}"
        for d in selected
        for p in d.processes
        if p.pid not in own
    ]
    if foreign:
        out.append(
            CheckResult(
                "gpu.processes",
                "fail",
                f"{len(foreign)} foreign compute process(es) hold the GPUs (orphaned engine workers?): "
                f"{describe(foreign, 3)}",
            )
        )
    else:
        out.append(CheckResult("gpu.processes", "pass", "no foreign compute processes on the profile's GPUs"))
    return out


def _driver(profile: Profile, probes: Probes, driver: str) -> CheckResult:
    """gpu.driver: the driver NVML reports against the CUDA runtime of engine.python's torch
    (molctl.cudacompat: NVIDIA's minimum driver per CUDA version)."""
    import subprocess

    from molctl.cudacompat import driver_verdict

    python = profile.engine_python
    try:
        build = probes.torch_build(python)
    except (OSError, ValueError, subprocess.TimeoutExpired) as exc:
        return CheckResult(
            "gpu.driver", "warn", f"NVIDIA driver {driver}; the CUDA runtime under engine.python is unknown: {exc}"
        )
    if build is None:
        return CheckResult(
            "gpu.driver",
            "warn",
            f"NVIDIA driver {driver}; engine.python {python} has no torch: no CUDA runtime to compare",
        )
    if build.cuda is None:
        return CheckResult(
            "gpu.driver",
            "warn",
            f"NVIDIA driver {driver}; torch {build.version} under {python} is a CPU build: the engine will not use the GPUs",
        )
    status, why = driver_verdict(driver, build.cuda)
    return CheckResult("gpu.driver", status, f"{why} (torch {build.version} under {python})")


def _mib(value: int | None) -> str:
    return "? MiB" if value is None else f"{value // (1024 * 1024)} MiB"


def run_ports(profile: Profile, probes: Probes) -> list[CheckResult]:
    """The engine's, the proxy's and (when set) the proxy's metrics port: free, or held by this stack."""
    out = []
    own = None
    wanted = [
        ("engine", "engine", "engine.port", profile.engine.host, profile.engine.port),
        ("proxy", "proxy", "proxy.port", profile.proxy.host, profile.proxy.port),
    ]
    if profile.proxy.metrics_port:
        wanted.append(
            ("metrics", "proxy", "proxy.metrics_port", profile.proxy.metrics_host, profile.proxy.metrics_port)
        )
    for name, component, field, host, port in wanted:
        cid = f"port.{name}"
        claim, own_claim = _claim_holder("port", port, profile, probes)
        free = probes.ports.is_free(host, port)
        if not free and claim is None:  # claimed between the two looks (another `up` racing this one)?
            claim, own_claim = _claim_holder("port", port, profile, probes)
        if claim is not None and not own_claim:
            out.append(
                CheckResult(
                    cid,
                    "fail",
                    f"{name} port {host}:{port} ({field}) is claimed by {claim.describe()}; {claim.stop_hint()}",
                )
            )
            continue
        if free:
            out.append(CheckResult(cid, "pass", f"{host}:{port} is free"))
            continue
        holder = probes.ports.holder(port)
        if own is None:
            own = probes.stack_pids()
        if holder and holder[0] in own:
            out.append(
                CheckResult(
                    cid, "pass", f"{host}:{port} is held by this profile's running {component} (pid {holder[0]})"
                )
            )
        elif holder:
            out.append(
                CheckResult(
                    cid, "fail", f"{name} port {host}:{port} ({field}) is held by pid {holder[0]} ({holder[1]})"
                )
            )
        else:
            out.append(
                CheckResult(
                    cid, "fail", f"{name} port {host}:{port} ({field}) is in use by a process molctl cannot see"
                )
            )
    return out


def run_state(profile: Profile, probes: Probes) -> list[CheckResult]:
    if probes.state_dir is None:
        return [
            CheckResult("state.dir", "skip", "no state dir given"),
            CheckResult("state.store", "skip", "no state dir given"),
        ]
    return _run_state_dir(probes.state_dir) + [_state_store(profile, probes.state_dir)]


def _state_store(profile: Profile, state_dir: Path) -> CheckResult:
    """The proxy's response store (proxy.store): openable, writable, a schema this molctl knows."""
    from molctl.proxy.store.base import StoreError
    from molctl.proxy.store.factory import resolve_store
    from molctl.proxy.store.sqlite.schema import SCHEMA_VERSION
    from molctl.proxy.store.sqlite.store import SqliteResponseStore

    kind, path = resolve_store(profile.proxy.store, state_dir, profile.name)
    if kind == "redis":
        return _redis_store(profile)
    if kind == "memory":
        return CheckResult(
            "state.store", "pass", "proxy.store is memory: stored responses are lost when the proxy restarts"
        )
    if not path.exists():
        parent = next((p for p in (path.parent, *path.parent.parents) if p.exists()), None)
        if parent is not None and os.path.isdir(parent) and os.access(parent, os.W_OK | os.X_OK):
            return CheckResult("state.store", "pass", f"{path} will be created (mode 0600)")
        return CheckResult("state.store", "fail", f"response store {path} does not exist and {parent} is not writable")
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        return CheckResult("state.store", "fail", f"response store {path} is not a regular file")
    if st.st_mode & 0o077:
        return CheckResult(
            "state.store",
            "fail",
            f"response store {path} has mode {stat.S_IMODE(st.st_mode):04o}: readable by "
            f"group/others (chmod 600 {path})",
        )
    if not os.access(path, os.R_OK | os.W_OK):
        return CheckResult("state.store", "fail", f"response store {path} is not readable and writable by you")
    try:
        store = SqliteResponseStore(path, create=False, busy_timeout_s=1.0, migrate=False)
    except StoreError as exc:
        return CheckResult("state.store", "fail", str(exc))
    try:
        n = store.stats()["responses"]
    except StoreError as exc:
        return CheckResult("state.store", "fail", str(exc))
    finally:
        store.close()
    pending = (
        f" (schema {store.file_version}: migrated when the proxy starts)" if store.file_version < SCHEMA_VERSION else ""
    )
    return CheckResult(
        "state.store", "pass", f"{path}: writable, schema version known{pending}, {n} stored response(s)"
    )


def _redis_store(profile: Profile) -> CheckResult:
    """A shared Redis store: the password readable, the server answering PING within 2 s, and
    its eviction policy (volatile-lru or allkeys-lru recommended: molctl keys all have TTLs)."""
    from molctl.proxy.store.redis.admin import describe
    from molctl.proxy.store.redis.target import RedisConfigError, parse_redis_url, read_password

    target = parse_redis_url(profile.proxy.store)
    password_file = profile.proxy.store_password_file
    if password_file:
        try:
            st = os.stat(Path(password_file).expanduser())
        except OSError:
            st = None  # read_password names the problem
        if st is not None and st.st_mode & 0o077:
            return CheckResult(
                "state.store",
                "fail",
                f"proxy.store_password_file {password_file} has mode "
                f"{stat.S_IMODE(st.st_mode):04o}: readable by group/others "
                f"(chmod 600 {password_file})",
            )
    try:
        info = describe(target, read_password(password_file), profile.name)
    except RedisConfigError as exc:
        return CheckResult("state.store", "fail", str(exc))
    if info.get("role") == "slave":
        return CheckResult(
            "state.store",
            "fail",
            f"proxy.store {target.address} is a read-only replica of "
            f"{info['primary']}: every write would be refused (no response "
            "stored, no conversation state shared); name the primary",
        )
    policy = info["maxmemory_policy"]
    bound = (
        "no maxmemory set: memory is bounded by the TTLs and proxy.store_max_entries only"
        if not info["maxmemory"]
        else f"maxmemory {info['maxmemory']} bytes, maxmemory-policy {policy}"
    )
    status = "pass"
    if info["maxmemory"] and policy == "noeviction":  # at the limit every write is refused, nothing expires early
        status, advice = (
            "warn",
            (
                ": at the limit Redis refuses every write (no response stored, no conversation state "
                "shared) until TTLs free memory; set maxmemory-policy volatile-lru"
            ),
        )
    else:
        advice = (
            ""
            if policy in ("volatile-lru", "allkeys-lru", "volatile-lfu", "allkeys-lfu") or not info["maxmemory"]
            else " (volatile-lru recommended)"
        )
    return CheckResult(
        "state.store",
        status,
        f"proxy.store {target.address} reachable (Redis {info['redis_version']}), "
        f"{info['responses']} stored response(s), {len(info['replicas'])} replica(s) "
        f"registered; {bound}{advice}",
    )


def _run_state_dir(d: Path) -> list[CheckResult]:
    if not d.exists():
        parent = next((p for p in d.parents if p.exists()), None)
        if parent is not None and os.access(parent, os.W_OK | os.X_OK):
            return [CheckResult("state.dir", "pass", f"{d} will be created with mode 0700")]
        return [CheckResult("state.dir", "fail", f"state dir {d} does not exist and {parent} is not writable")]
    st = os.stat(d)
    if not stat.S_ISDIR(st.st_mode):
        return [CheckResult("state.dir", "fail", f"state dir {d} is not a directory")]
    if st.st_mode & 0o077:
        return [
            CheckResult(
                "state.dir",
                "fail",
                f"state dir {d} has mode {stat.S_IMODE(st.st_mode):04o}, expected 0700 (chmod 700 {d})",
            )
        ]
    if st.st_uid != os.geteuid():
        return [
            CheckResult(
                "state.dir", "fail", f"state dir {d} is owned by uid {st.st_uid}, not by you (uid {os.geteuid()})"
            )
        ]
    if not os.access(d, os.W_OK | os.X_OK):
        return [CheckResult("state.dir", "fail", f"state dir {d} is not writable")]
    return [CheckResult("state.dir", "pass", f"{d} is writable, mode 0700")]


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


RUNTIME_LORA = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def run_security(profile: Profile, probes: Probes) -> list[CheckResult]:
    out = []
    host = profile.engine.host
    if _is_loopback(host):
        out.append(CheckResult("security.engine_host", "pass", f"engine binds {host} (loopback only)"))
    else:
        out.append(
            CheckResult(
                "security.engine_host",
                "warn",
                f"engine.host is {host}: the engine (no auth, adapter control) is reachable beyond this host; expose only "
                "the proxy",
            )
        )
    sources = (("the environment", probes.environ), (f"{profile.source} engine.env", profile.engine.env))
    where = [w for w, env in sources if RUNTIME_LORA in env]
    if where:
        out.append(
            CheckResult(
                "security.runtime_lora",
                "fail",
                f"{RUNTIME_LORA} is set in {' and '.join(where)}: anyone reaching the engine could load or unload "
                "adapters; unset it",
            )
        )
    else:
        out.append(CheckResult("security.runtime_lora", "pass", f"{RUNTIME_LORA} is not set"))
    out.append(_engine_args_secrets(profile))
    out.append(_api_key_file(probes.api_key_file))
    return out


def _engine_args_secrets(profile: Profile) -> CheckResult:
    """An engine flag carrying a secret (`api-key`, `hf-token`, a URL with credentials) lands on
    the engine's command line, which every local user reads (`ps`, /proc/PID/cmdline)."""
    from molctl.redaction import secret_engine_args

    found = secret_engine_args(profile.engine.args)
    if not found:
        return CheckResult("security.engine_args", "pass", "no engine flag carries a secret")
    flag, why = found[0]
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    return CheckResult(
        "security.engine_args",
        "warn",
        f"engine.args.{flag}{more}: {why}; on the engine's command line every local user can read it "
        "(ps): give it through the engine's environment instead (engine.env, e.g. VLLM_API_KEY for "
        "--api-key, HF_TOKEN)",
    )


def _api_key_file(path: Path | None) -> CheckResult:
    cid = "security.api_key_file"
    if path is None:
        return CheckResult(cid, "skip", "no API key file given")
    try:
        st = os.stat(path)
    except OSError as exc:
        return CheckResult(cid, "fail", f"API key file {path}: {exc.strerror}")
    if not stat.S_ISREG(st.st_mode):
        return CheckResult(cid, "fail", f"API key file {path} is not a regular file")
    if st.st_mode & 0o077:
        return CheckResult(
            cid,
            "fail",
            f"API key file {path} has mode {stat.S_IMODE(st.st_mode):04o}: readable by group/others (chmod 600 {path})",
        )
    from molctl.keys import load_keys

    try:
        keys = load_keys(path)  # as the proxy reads it (comments, BOM)
    except OSError as exc:
        return CheckResult(cid, "fail", f"API key file {path}: {exc.strerror}")
    except UnicodeDecodeError:
        return CheckResult(cid, "fail", f"API key file {path} is not UTF-8 text (expected one key per line)")
    if not keys:
        return CheckResult(cid, "fail", f"API key file {path} holds no key (expected one key per line)")
    if st.st_uid not in (os.geteuid(), 0):  # its owner decides which keys the proxy accepts
        from molctl.state import user_name

        owner = user_name(st.st_uid) or f"uid {st.st_uid}"
        return CheckResult(
            cid,
            "warn",
            f"API key file {path} is owned by {owner}, neither you nor root: that user decides "
            f"which keys the proxy accepts (chown it to yourself or root)",
        )
    return CheckResult(cid, "pass", f"{path}: {len(keys)} key(s), mode {stat.S_IMODE(st.st_mode):04o}")
