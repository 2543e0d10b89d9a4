"""`molctl lock`: the run manifest of a profile, what seed 002 says must be pinned before a
multi-LoRA deployment is trusted or measured: the runtime (engine kind, installed version and a
fingerprint of the installed package), the full launch argv and the engine environment (secrets
redacted), the base (config essentials, chat template digest, every file with size, mtime and
SHA-256), every adapter (rank, alpha, target modules, declared base, SHA-256 of each file) and the
capacity flags.

The manifest is JSON (shape in docs/contract.md); `lock` builds it (`build`) and writes it
atomically, by default to `STATE/PROFILE/manifests/lock-<UTC time>.json` (molctl.manifestfile).
`check --verify` (molctl/checks/verify.py) compares a manifest with the host.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
import subprocess
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from molctl.errors import MolctlError
from molctl.hashing import FileChanged, HashCache, HashProgress, HashRun, NotRegularFile, hash_files
from molctl.manifestfile import (
    FORMAT,
    KIND,
    ManifestError,
    _inside,
    _molctl_version,
    default_path,
    prepare_output,
    write_atomic,
)
from molctl.profiles import Profile
from molctl.redaction import redact_value
from molctl.routes import ROUTES

# Ambient variables that change what the engine does (the profile's own engine.env is always pinned).
ENV_PREFIXES = (
    "VLLM_",
    "SGLANG_",
    "CUDA_",
    "NCCL_",
    "HF_",
    "HUGGING_FACE_",
    "TRANSFORMERS_",
    "TORCH",
    "PYTORCH_",
    "TRITON_",
    "FLASHINFER_",
    "TOKENIZERS_",
    "OMP_",
    "MKL_",
    "NVIDIA_",
)
ENV_NAMES = ("LD_LIBRARY_PATH", "LD_PRELOAD", "PYTHONPATH", "PYTHONHOME")
CAPACITY_FLAGS = (
    "max-loras",
    "max-lora-rank",
    "max-cpu-loras",
    "gpu-memory-utilization",
    "mem-fraction-static",
    "max-loras-per-batch",
    "max-loaded-loras",
)
INDEX = "model.safetensors.index.json"


# ------------------------------------------------------------------------------------ the engine
FINGERPRINT_SCRIPT = r"""
import hashlib, importlib.metadata, importlib.util, json, os, sys
name = sys.argv[1]
out = {"python": os.path.realpath(sys.executable), "python_version": sys.version.split()[0]}
spec = importlib.util.find_spec(name)
out["found"] = spec is not None
if spec is not None:
    locs = list(spec.submodule_search_locations or []) or [os.path.dirname(spec.origin or "")]
    root = os.path.realpath(locs[0])
    out["location"] = root
    h = hashlib.sha256()
    found = []
    parent = os.path.dirname(root)
    try:
        infos = sorted(e for e in os.listdir(parent) if e.endswith(".dist-info"))
    except OSError:
        infos = []
    for info in infos:  # top_level.txt names the packages a distribution installs (fast path)
        try:
            with open(os.path.join(parent, info, "top_level.txt")) as fh:
                if name in fh.read().split():
                    found.append(importlib.metadata.PathDistribution.at(os.path.join(parent, info)))
        except OSError:
            continue
    if not found:
        try:
            for dist_name in sorted(set(importlib.metadata.packages_distributions().get(name, []))):
                found.append(importlib.metadata.distribution(dist_name))
        except Exception:
            pass
    for dist in found:
        record = dist.read_text("RECORD")
        if record:
            out.setdefault("dists", []).append("%s %s" % (dist.metadata["Name"], dist.version))
            h.update(b"RECORD\0" + record.encode())
    n = 0
    for d, subdirs, files in os.walk(root):
        subdirs[:] = sorted(s for s in subdirs if s != "__pycache__")
        for f in sorted(files):
            if f.endswith((".pyc", ".pyo")):
                continue
            p = os.path.join(d, f)
            try:
                st = os.lstat(p)
            except OSError:
                continue
            h.update(("%s\0%d\0%d\n" % (os.path.relpath(p, root), st.st_size, st.st_mtime_ns)).encode())
            n += 1
    out["files"] = n
    out["digest"] = h.hexdigest()
print(json.dumps(out))
"""


FINGERPRINT_TIMEOUT_S = 60


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the fingerprint's session (its own, see processes.kill_fresh) and wait until it is gone."""
    from molctl.processes import kill_fresh

    kill_fresh(proc)


def engine_fingerprint(python: str, package: str) -> dict[str, Any]:
    """A fingerprint of the engine package installed under `python`, without importing it (SGLang
    cannot be imported on a host without CUDA): the SHA-256 over its distributions' RECORD files
    (every installed file's hash, as installed) and over every file of the package folder (path,
    size, mtime_ns; bytecode caches left out), so an upgrade, a reinstall or an edited file changes it."""
    where = f"cannot fingerprint {package} under engine.python {python}"
    try:
        # its own session: a wrapper script's children are stopped with it (timeout, Ctrl-C), none is orphaned
        proc = subprocess.Popen(
            [python, "-c", FINGERPRINT_SCRIPT, package],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
    except OSError as exc:
        raise ManifestError(f"{where}: {exc.strerror or exc}") from None
    try:
        stdout, stderr = proc.communicate(timeout=FINGERPRINT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        raise ManifestError(f"{where}: no answer within {FINGERPRINT_TIMEOUT_S} s") from None
    except BaseException:
        _kill_group(proc)
        raise
    try:
        data = json.loads(stdout.strip().splitlines()[-1])
        if not isinstance(data, dict):
            raise ValueError(data)
    except (ValueError, IndexError):
        last = (stderr.strip().splitlines() or ["no output"])[-1][:200]
        raise ManifestError(f"{where}: it printed no fingerprint (exit {proc.returncode}: {last})") from None
    if not data.get("found"):
        raise ManifestError(
            f"{package} is not installed under engine.python {python} (molctl lock pins the installed engine)"
        )
    return data


def engine_section(profile: Profile, state_dir: Path | None) -> dict[str, Any]:
    """kind, package, python, version (as the engine check reads it, cached alike) and fingerprint."""
    from molctl.engines import get_engine
    from molctl.engines.base import probe_install_cached

    engine = get_engine(profile.engine.kind)
    python = profile.engine_python
    cache = Path(state_dir) / "cache" if state_dir is not None and Path(state_dir).is_dir() else None
    fp = engine_fingerprint(python, engine.package)
    install = probe_install_cached(engine, python, cache)
    if not install.found:
        raise ManifestError(f"{install.error or engine.package + ' is not importable'} (engine.python = {python})")
    return {
        "kind": engine.kind,
        "package": engine.package,
        "python": python,
        "python_real": fp.get("python"),
        "python_version": fp.get("python_version"),
        "version": install.version,
        "fingerprint": fp["digest"],
        "location": fp.get("location"),
        "dists": fp.get("dists", []),
        "package_files": fp.get("files", 0),
    }


def pinned_env(profile: Profile, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The engine environment as `up` builds it (molctl.lifecycle.launch.engine_env), restricted to what can
    change the engine's behaviour: the profile's `engine.env` plus ambient engine, CUDA, NCCL,
    Hugging Face, torch and library-path variables; secrets redacted (`redact_value`)."""
    base = dict(os.environ if environ is None else environ)
    env = {k: v for k, v in base.items() if k not in profile.engine.unset_env}
    env.update(profile.engine.env)
    env.pop("MOLCTL_API_KEY", None)
    keep = {k: v for k, v in env.items() if k in profile.engine.env or k in ENV_NAMES or k.startswith(ENV_PREFIXES)}
    return {k: redact_value(k, v) for k, v in sorted(keep.items())}


def launch_argv(profile: Profile) -> list[str]:
    from molctl.engines import get_engine

    return get_engine(profile.engine.kind).launch_argv(profile)


def capacity(profile: Profile) -> dict[str, Any]:
    return {flag: profile.engine.args.get(flag) for flag in CAPACITY_FLAGS if flag in profile.engine.args}


# ------------------------------------------------------------------------------------- the model
def _read_json_object(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ManifestError(f"{path} is missing") from None
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: JSON nested too deep
        raise ManifestError(f"{path}: {exc.strerror if isinstance(exc, OSError) and exc.strerror else exc}") from None
    if not isinstance(data, dict):
        raise ManifestError(f"{path} is not a JSON object")
    return data


def config_essentials(profile: Profile) -> dict[str, Any]:
    """model_type, dtype (torch_dtype or dtype), quantization_config.quant_method and
    max_position_embeddings of `base/config.json` (from `text_config` when the top level lacks them)."""
    cfg = _read_json_object(profile.base_dir / "config.json")
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}

    def get(*keys: str) -> Any:
        for src in (cfg, text):
            for k in keys:
                if k in src:
                    return src[k]
        return None

    quant = get("quantization_config")
    return {
        "model_type": cfg.get("model_type"),
        "dtype": get("torch_dtype", "dtype"),
        "quant_method": quant.get("quant_method") if isinstance(quant, dict) else None,
        "max_position_embeddings": get("max_position_embeddings"),
    }


def template_digest(profile: Profile) -> dict[str, Any] | None:
    """The chat template the engine will use (molctl.checks.template.find_template) as a source
    and a SHA-256 over its texts; None when there is none."""
    from molctl.checks.template import NotFound, find_template

    try:
        tpl = find_template(profile)
    except NotFound:
        return None
    except ValueError as exc:
        raise ManifestError(str(exc)) from None
    text = json.dumps(tpl.texts, sort_keys=True, ensure_ascii=False)
    return {"source": tpl.source, "names": sorted(tpl.texts), "sha256": hashlib.sha256(text.encode()).hexdigest()}


def shard_names(profile: Profile) -> list[str]:
    index = _read_json_object(profile.base_dir / INDEX)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ManifestError(f"{profile.base_dir / INDEX} has no 'weight_map' (run `molctl check {profile.name}`)")
    for name in weight_map.values():  # a shard is a file of base/, never a path out of it (/etc/passwd, ../x)
        if not isinstance(name, str) or not _inside(name):
            raise ManifestError(
                f"{profile.base_dir / INDEX} names the shard {name!r}, not a file inside "
                f"{profile.base_dir} (run `molctl check {profile.name}`)"
            )
    return sorted(set(weight_map.values()))


def _not_regular(path: Path) -> ManifestError:
    """A dangling symlink, a symlink loop, a FIFO, a device or a socket where the layout has files."""
    from molctl.hashing import file_kind

    try:
        return ManifestError(
            f"{path} is {file_kind(os.stat(path).st_mode)}, not a regular file "
            f"(the engine cannot load it; remove it or replace it with the file)"
        )
    except OSError as exc:
        if not os.path.islink(path):
            return ManifestError(f"{path} cannot be read: {exc.strerror or exc}")
        target = os.readlink(path)
        if exc.errno == errno.ELOOP:
            return ManifestError(f"{path} is a symlink loop (to {target}), not a regular file")
        if exc.errno == errno.ENOENT:
            return ManifestError(f"{path} is a dangling symlink (to {target})")
        return ManifestError(f"{path} cannot be read: {exc.strerror or exc} (a symlink to {target})")


def base_files(profile: Profile, shards: list[str], strict: bool = True) -> list[str]:
    """Every file directly in base/ that is not a shard (config, index, tokenizer, ...); folders and
    hidden names left out. Anything else (a dangling symlink, a FIFO, a device) is refused when
    `strict`, else listed (`check --verify` then reports it as unreadable)."""
    try:
        entries = sorted(os.scandir(profile.base_dir), key=lambda e: e.name)
    except OSError as exc:
        raise ManifestError(f"{profile.base_dir}: {exc.strerror}") from None
    skip = set(shards)
    out = []
    for e in entries:
        if e.name in skip or e.name.startswith("."):
            continue
        try:
            is_dir, is_file = e.is_dir(), e.is_file()
        except OSError:  # a symlink loop (ELOOP) raises here: neither
            is_dir = is_file = False
        if is_dir:
            continue
        if not is_file and strict:
            raise _not_regular(Path(e.path))
        out.append(e.name)
    return out


def adapter_files(directory: Path, strict: bool = True) -> list[str]:
    """Every file under an adapter folder, relative, sorted (hidden files included: a file the
    engine might load is a file to pin). Anything but a regular file is refused when `strict`, else
    listed (as in `base_files`). A folder that cannot be read is refused when `strict` (its files
    would be left out of the manifest unseen), else skipped."""

    def unreadable(exc: OSError) -> None:
        if strict:
            raise ManifestError(
                f"{exc.filename} cannot be read: {exc.strerror or exc} (every file under {directory} is pinned)"
            )

    out = []
    for d, subdirs, files in os.walk(directory, onerror=unreadable):
        subdirs.sort()
        for f in sorted(files):  # the first bad file named is always the same one
            p = Path(d) / f
            try:
                regular = stat.S_ISREG(os.stat(p).st_mode)
            except OSError:
                regular = False
            if not regular and strict:
                raise _not_regular(p)
            out.append(str(p.relative_to(directory)))
    return sorted(out)


def adapter_meta(directory: Path) -> dict[str, Any]:
    cfg = _read_json_object(directory / "adapter_config.json")
    return {
        "r": cfg.get("r"),
        "lora_alpha": cfg.get("lora_alpha"),
        "target_modules": cfg.get("target_modules"),
        "base_model_name_or_path": cfg.get("base_model_name_or_path"),
    }


def adapter_moe_layout(directory: Path) -> dict[str, Any] | None:
    """Seed 002: an MoE adapter's checkpoint layout belongs in the manifest. From the weights'
    header: how many LoRA tensors sit under `.experts.` and their ranks (2D per expert, 3D fused);
    None when there are none or the header is unreadable (the adapter checks report that)."""
    from molctl.safetensors import HeaderError, read_header

    try:
        header = read_header(directory / "adapter_model.safetensors")
    except (HeaderError, OSError):
        return None
    experts = [t for n, t in header.tensors.items() if ".lora_" in n and ".experts." in n]
    if not experts:
        return None
    return {"expert_tensors": len(experts), "dims": sorted({len(t["shape"]) for t in experts})}


# ----------------------------------------------------------------------------------------- build
@dataclass
class ManifestResult:
    manifest: dict[str, Any]
    path: Path | None = None

    def summary(self) -> dict[str, Any]:
        s = self.manifest["summary"]
        return {
            "profile": self.manifest["profile"],
            "manifest": str(self.path) if self.path else None,
            "engine": {"kind": self.manifest["engine"]["kind"], "version": self.manifest["engine"]["version"]},
            **s,
        }


def file_entry(path: Path, name: str, run: HashRun) -> dict[str, Any]:
    """The file as it was hashed (the stat its digest belongs to, not a later one); `real_path` when
    the layout reaches it through a symlink (where the bytes really are)."""
    st = run.stats[str(path)]
    entry = {"name": name, "path": str(path), "size": st.size, "mtime_ns": st.mtime_ns, "sha256": run.sha256[str(path)]}
    if st.real != os.path.abspath(path):
        entry["real_path"] = st.real
    return entry


def build(
    profile: Profile,
    state_dir: Path | None,
    jobs: int | None = None,
    progress: HashProgress | None = None,
    hasher=None,
    environ: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The manifest of `profile` on this host (every file hashed, through the hash cache)."""
    t0 = time.monotonic()
    if not profile.model_root.is_dir():
        raise ManifestError(f"model root {profile.model_root} is not a directory")
    engine = engine_section(profile, state_dir)
    shards = shard_names(profile)
    base = base_files(profile, shards)
    adapters: dict[str, dict[str, Any]] = {}
    for route in ROUTES:
        d = profile.adapter_dir(route)
        if not d.is_dir():
            raise ManifestError(f"adapter directory {d} is missing")
        adapters[route] = {"path": str(d), **adapter_meta(d), "moe": adapter_moe_layout(d), "files": adapter_files(d)}
    paths = [profile.base_dir / n for n in shards + base]
    paths += [profile.adapter_dir(r) / f for r in ROUTES for f in adapters[r]["files"]]
    run = _hash_all(profile, paths, state_dir, jobs, progress, hasher)
    shard_entries = [file_entry(profile.base_dir / n, n, run) for n in shards]
    base_entries = [file_entry(profile.base_dir / n, n, run) for n in base]
    for route, a in adapters.items():
        d = profile.adapter_dir(route)
        a["files"] = [file_entry(d / f, f, run) for f in a["files"]]
    return {
        "format": FORMAT,
        "kind": KIND,
        "created_at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "molctl_version": _molctl_version(),
        "profile": profile.name,
        "source": str(profile.source) if profile.source else None,
        "model_root": str(profile.model_root),
        "engine": engine,
        "argv": launch_argv(profile),
        "env": pinned_env(profile, environ),
        "unset_env": list(profile.engine.unset_env),
        "config": config_essentials(profile),
        "template": template_digest(profile),
        "capacity": capacity(profile),
        "base_files": base_entries,
        "shards": shard_entries,
        "adapters": adapters,
        "summary": {
            "files": run.files,
            "bytes": run.bytes,
            "hashed_files": run.hashed_files,
            "hashed_bytes": run.hashed_bytes,
            "cached_files": run.files - run.hashed_files,
            "seconds": round(time.monotonic() - t0, 3),
        },
    }


def _hash_all(
    profile: Profile, paths: list[Path], state_dir: Path | None, jobs: int | None, progress, hasher
) -> HashRun:
    """Every file hashed (through the hash cache); a file that is missing, not regular, changing
    or unreadable is a ManifestError naming it."""
    try:
        return hash_files(paths, HashCache.in_state_dir(state_dir), jobs, progress, hasher)
    except FileNotFoundError as exc:
        if exc.filename and os.path.islink(exc.filename):
            raise _not_regular(Path(exc.filename)) from None
        raise ManifestError(f"{exc.filename} is missing (run `molctl check {profile.name}`)") from None
    except NotRegularFile as exc:
        raise ManifestError(f"{exc.filename} {exc.strerror}") from None
    except FileChanged as exc:
        raise ManifestError(
            f"{exc.filename} {exc.strerror}: run `molctl lock {profile.name}` again once it is "
            f"stable (the files hashed so far are cached)"
        ) from None
    except OSError as exc:
        if exc.filename and os.path.islink(exc.filename):  # a symlink loop, a link into a folder we cannot enter
            raise _not_regular(Path(exc.filename)) from None
        raise ManifestError(f"cannot read {exc.filename}: {exc.strerror}") from None


def lock(
    profile: Profile,
    state_dir: Path,
    output: Path | None = None,
    jobs: int | None = None,
    progress: HashProgress | None = None,
    hasher=None,
) -> ManifestResult:
    """`molctl lock`: build the manifest and write it (atomically). Where it goes is checked before
    anything is hashed: a 700 GB run must not end on an unwritable --output."""
    path = prepare_output(output or default_path(state_dir, profile.name))
    manifest = build(profile, state_dir, jobs, progress, hasher)
    try:  # a default name taken meanwhile (another lock) moves on to -N; an --output given is replaced
        path = write_atomic(path, manifest, replace=output is not None)
    except OSError as exc:
        raise MolctlError(f"cannot write the manifest {path}: {exc.strerror or exc}") from None
    return ManifestResult(manifest, path)
