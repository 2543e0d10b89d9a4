"""The `lock` category (`check --verify`, `up --verify`): the host compared with a manifest of
`molctl lock` (molctl/manifest.py). Every difference is a failing check naming the item, the
pinned value and the one found; seed 002's adapter trust boundary: an adapter file swapped for
another of the same name fails here, before the engine loads it.

Files: size and mtime_ns always; SHA-256 with `--full-hash` (every file read, the hash cache
bypassed), or for any file whose size or mtime changed (a file whose mtime alone changed but
whose content is the pinned one is a warning). Passing files are summed up in one row per group
(`lock.shards`, `lock.base`, `lock.adapter.Lk`); each bad one is its own failing row
(`lock.shard.<file>`, `lock.base.<file>`, `lock.adapter.Lk.<file>`).
"""

from __future__ import annotations

import difflib
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from molctl.checks.result import CheckResult, Probes, describe
from molctl.hashing import file_kind
from molctl.manifestfile import ManifestError, manifest_dir, newest
from molctl.manifestfile import read as read_manifest
from molctl.profiles import Profile
from molctl.routes import ROUTES


@dataclass
class Verify:
    """What `--verify` asks for: a manifest (None: the profile's newest) and whether to read every file."""

    manifest: Path | None = None
    full_hash: bool = False
    jobs: int | None = None
    hasher: Any = None  # tests inject one


def run(profile: Profile, probes: Probes) -> list[CheckResult]:

    verify: Verify = getattr(probes, "verify", None) or Verify()
    path = verify.manifest
    if path is None:
        path = newest(probes.state_dir, profile.name) if probes.state_dir is not None else None
        if path is None:
            where = manifest_dir(probes.state_dir, profile.name) if probes.state_dir is not None else "the state dir"
            return [
                CheckResult(
                    "lock.manifest",
                    "fail",
                    f"no manifest of {profile.name} in {where}: run `molctl lock {profile.name}` first "
                    f"(or pass --manifest PATH)",
                )
            ]
    try:
        pinned = read_manifest(path)
    except ManifestError as exc:
        return [CheckResult("lock.manifest", "fail", str(exc))]
    if pinned.get("profile") != profile.name:
        return [
            CheckResult("lock.manifest", "fail", f"{path} pins profile {pinned.get('profile')!r}, not {profile.name!r}")
        ]
    out = [CheckResult("lock.manifest", "pass", f"{path} (locked {pinned.get('created_at')})")]
    out += _engine(profile, probes, pinned)
    out += _launch(profile, probes, pinned)
    out += _model(profile, pinned)
    out += _files(profile, probes, pinned, verify)
    return out


# ---------------------------------------------------------------------------------------- engine
def _engine(profile: Profile, probes: Probes, pinned: dict) -> list[CheckResult]:
    from molctl import manifest as mf

    want = pinned.get("engine") or {}
    try:
        found = mf.engine_section(profile, probes.state_dir)
    except ManifestError as exc:
        return [
            CheckResult(
                "lock.engine.version", "fail", f"pinned {want.get('package')} {want.get('version')}, found: {exc}"
            )
        ]
    out = []
    for key, cid in (
        ("kind", "lock.engine.kind"),
        ("version", "lock.engine.version"),
        ("fingerprint", "lock.engine.fingerprint"),
    ):
        if want.get(key) == found.get(key):
            out.append(CheckResult(cid, "pass", f"{found['package']} {key} {_short(found.get(key))} as pinned"))
        else:
            extra = ""
            if key == "fingerprint":
                extra = (
                    f" ({found.get('location')}: {found.get('package_files')} files, "
                    f"{', '.join(found.get('dists') or []) or 'no dist-info RECORD'}; reinstalled, upgraded or edited)"
                )
            out.append(
                CheckResult(
                    cid,
                    "fail",
                    f"{found['package']} {key}: pinned {_short(want.get(key))}, "
                    f"found {_short(found.get(key))} under {found['python']}{extra}",
                )
            )
    return out


def _short(value: Any) -> str:
    if isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value):
        return value[:16]
    return str(value)


# ------------------------------------------------------------------------------- argv, env, capacity
def _launch(profile: Profile, probes: Probes, pinned: dict) -> list[CheckResult]:
    from molctl import manifest as mf

    out = []
    want_argv, argv = pinned.get("argv") or [], mf.launch_argv(profile)
    if want_argv == argv:
        out.append(CheckResult("lock.argv", "pass", f"{len(argv)} arguments as pinned"))
    else:
        out.append(CheckResult("lock.argv", "fail", f"launch argv differs: {argv_diff(want_argv, argv)}"))

    want_env, env = pinned.get("env") or {}, mf.pinned_env(profile, dict(probes.environ))
    diff = [
        f"{k}: pinned {_env_value(want_env, k)}, found {_env_value(env, k)}"
        for k in sorted(set(want_env) | set(env))
        if want_env.get(k) != env.get(k)
    ]
    if diff:
        out.append(CheckResult("lock.env", "fail", f"engine environment differs: {describe(diff, 4)}"))
    else:
        out.append(CheckResult("lock.env", "pass", f"{len(env)} engine variables as pinned"))

    want_cap, cap = pinned.get("capacity") or {}, mf.capacity(profile)
    for flag in sorted(set(want_cap) | set(cap)):
        if want_cap.get(flag) != cap.get(flag):
            out.append(
                CheckResult(
                    f"lock.capacity.{flag}",
                    "fail",
                    f"--{flag}: pinned {_flag_value(want_cap, flag)}, found {_flag_value(cap, flag)}",
                )
            )
    return out


def _env_value(env: dict, key: str) -> str:
    return repr(env[key]) if key in env else "unset"


def _flag_value(flags: dict, key: str) -> str:
    return repr(flags[key]) if key in flags else "not set"


def argv_diff(pinned: list[str], found: list[str], limit: int = 3) -> str:
    """'pinned `--max-model-len 2048`, found `--max-model-len 4096`; ...': the differing spans,
    a changed value shown with its flag."""
    parts = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=pinned, b=found, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        first = pinned[i1] if i1 < i2 else (found[j1] if j1 < j2 else "")
        if i1 > 0 and j1 > 0 and pinned[i1 - 1].startswith("--") and not first.startswith("--"):
            i1, j1 = i1 - 1, j1 - 1
        a, b = " ".join(pinned[i1:i2]) or "nothing", " ".join(found[j1:j2]) or "nothing"
        parts.append(f"pinned `{a}`, found `{b}`")
    shown = "; ".join(parts[:limit])
    return shown + (f"; and {len(parts) - limit} more" if len(parts) > limit else "")


# ----------------------------------------------------------------------------- config and template
def _model(profile: Profile, pinned: dict) -> list[CheckResult]:
    from molctl import manifest as mf

    out = []
    try:
        cfg = mf.config_essentials(profile)
    except ManifestError as exc:
        out.append(CheckResult("lock.config", "fail", str(exc)))
    else:
        want = pinned.get("config") or {}
        diff = [
            f"{k}: pinned {want.get(k)!r}, found {cfg.get(k)!r}"
            for k in sorted(set(want) | set(cfg))
            if want.get(k) != cfg.get(k)
        ]
        out.append(
            CheckResult("lock.config", "fail", f"{profile.base_dir / 'config.json'}: {'; '.join(diff)}")
            if diff
            else CheckResult("lock.config", "pass", ", ".join(f"{k} {v}" for k, v in cfg.items() if v is not None))
        )
    try:
        tpl = mf.template_digest(profile)
    except ManifestError as exc:
        return [*out, CheckResult("lock.template", "fail", str(exc))]
    want_t = pinned.get("template")
    if (want_t or {}).get("sha256") == (tpl or {}).get("sha256"):
        out.append(
            CheckResult("lock.template", "pass", f"chat template {_short((tpl or {}).get('sha256', 'none'))} as pinned")
        )
    else:

        def show(t):
            return f"{_short(t['sha256'])} ({t['source']})" if t else "no template"

        out.append(CheckResult("lock.template", "fail", f"chat template: pinned {show(want_t)}, found {show(tpl)}"))
    return out


# ------------------------------------------------------------------------------------------ files
@dataclass
class _Pinned:
    group: str  # lock.shards / lock.base / lock.adapter.L2
    cid: str  # the failing row's id
    path: Path
    entry: dict | None  # None: a file on the host that the manifest does not pin
    meta: dict | None = None  # an adapter_config.json: the pinned r, lora_alpha, target_modules, base


def _files(profile: Profile, probes: Probes, pinned: dict, verify: Verify) -> list[CheckResult]:
    items, groups = _pinned_items(profile, pinned)
    results: dict[str, CheckResult] = {}
    to_hash: list[_Pinned] = []
    changed: dict[str, str] = {}
    for item in items:
        problem, what = _stat_compare(profile, item)
        if problem is not None:
            results[item.cid] = problem
            continue
        if what:
            changed[item.cid] = ", ".join(what)
        if what or verify.full_hash:
            to_hash.append(item)
    if to_hash:
        results.update(_hash_compare(profile, probes, verify, to_hash, changed))
    return _grouped(items, groups, results, verify)


def _pinned_items(profile: Profile, pinned: dict) -> tuple[list[_Pinned], dict[str, str]]:
    """Every file the manifest pins or the host has, and the groups of the summary rows."""
    from molctl import manifest as mf

    items: list[_Pinned] = []
    groups: dict[str, str] = {}  # group id -> what it is
    try:
        shards_now = set(mf.shard_names(profile))
    except ManifestError:
        shards_now = set()
    want_shards = {e["name"]: e for e in pinned.get("shards") or []}
    groups["lock.shards"] = "shards"
    for name in sorted(set(want_shards) | shards_now):
        items.append(_Pinned("lock.shards", f"lock.shard.{name}", profile.base_dir / name, want_shards.get(name)))
    want_base = {e["name"]: e for e in pinned.get("base_files") or []}
    try:
        base_now = set(mf.base_files(profile, sorted(shards_now | set(want_shards)), strict=False))
    except ManifestError:
        base_now = set()
    groups["lock.base"] = "base files"
    for name in sorted(set(want_base) | base_now):
        items.append(_Pinned("lock.base", f"lock.base.{name}", profile.base_dir / name, want_base.get(name)))
    for route in ROUTES:
        d = profile.adapter_dir(route)
        pinned_adapter = (pinned.get("adapters") or {}).get(route) or {}
        want = {e["name"]: e for e in pinned_adapter.get("files", [])}
        try:
            now = set(mf.adapter_files(d, strict=False)) if d.is_dir() else set()
        except OSError:
            now = set()
        group = f"lock.adapter.{route}"
        groups[group] = f"{route} files"
        for name in sorted(set(want) | now):
            meta = pinned_adapter if name == "adapter_config.json" else None
            items.append(_Pinned(group, f"{group}.{name}", d / name, want.get(name), meta))
    return items, groups


def _stat_compare(profile: Profile, item: _Pinned) -> tuple[CheckResult | None, list[str]]:
    """A failing row for a file that is not pinned, missing or not a regular file; else what its
    stat says changed since the pin (nothing: as pinned, unless --full-hash reads otherwise)."""
    if item.entry is None:
        return CheckResult(
            item.cid,
            "fail",
            f"{item.path} is not pinned by the manifest (added since `molctl lock {profile.name}`)",
        ), []
    try:
        st = os.stat(item.path)
    except FileNotFoundError:
        dangling = f" (a dangling symlink to {os.readlink(item.path)})" if os.path.islink(item.path) else ""
        return CheckResult(
            item.cid,
            "fail",
            f"{item.path} is missing{dangling} (pinned: {item.entry['size']} "
            f"bytes, sha256 {_short(item.entry['sha256'])})",
        ), []
    except OSError as exc:
        dangling = f" (a dangling symlink to {os.readlink(item.path)})" if os.path.islink(item.path) else ""
        return CheckResult(item.cid, "fail", f"{item.path}: {exc.strerror}{dangling}"), []
    if not stat.S_ISREG(st.st_mode):  # never opened: a FIFO would block, /dev/zero never ends
        return CheckResult(
            item.cid,
            "fail",
            f"{item.path} is {file_kind(st.st_mode)}, not a regular file (pinned: {item.entry['size']} bytes)",
        ), []
    what = []
    real, abspath = os.path.realpath(item.path), os.path.abspath(item.path)
    if item.entry.get("real_path", abspath) != real:
        what.append(
            f"now {'a symlink to ' + real if real != abspath else 'no longer a symlink'}"
            f" (pinned: {item.entry.get('real_path', 'not a symlink')})"
        )
    if st.st_size != item.entry["size"]:
        what.append(f"size {item.entry['size']} -> {st.st_size}")
    if st.st_mtime_ns != item.entry["mtime_ns"]:
        what.append("mtime changed")
    return None, what


def _hash_compare(
    profile: Profile, probes: Probes, verify: Verify, to_hash: list[_Pinned], changed: dict[str, str]
) -> dict[str, CheckResult]:
    """The rows of the files read: unreadable, content other than pinned, or pinned content whose
    stat changed (a warning)."""
    from molctl.hashing import HashCache, hash_files

    results: dict[str, CheckResult] = {}
    hashed: dict[str, str] = {}
    if to_hash:
        # --full-hash reads every file (a file replaced with its size and mtime restored is caught);
        # a changed file is read in any case. The fresh results update the hash cache.
        cache = HashCache.in_state_dir(probes.state_dir)
        errors: dict[
            str, OSError
        ] = {}  # a file that cannot be read fails alone; the others are hashed in the same pass
        hashed = hash_files(
            [str(i.path) for i in to_hash], cache, verify.jobs, None, verify.hasher, use_cache=False, errors=errors
        ).sha256
        for item in to_hash:
            exc = errors.get(str(item.path))
            if exc is not None:
                results[item.cid] = CheckResult(item.cid, "fail", f"{item.path} cannot be read: {exc.strerror or exc}")
        to_hash = [i for i in to_hash if i.cid not in results]
    for item in to_hash:
        digest = hashed.get(str(item.path))
        if digest != item.entry["sha256"]:
            why = f" ({changed[item.cid]})" if item.cid in changed else " (same size and mtime: replaced in place)"
            results[item.cid] = CheckResult(
                item.cid,
                "fail",
                f"{item.path}: sha256 pinned {_short(item.entry['sha256'])}, "
                f"found {_short(digest)}{why}{_adapter_config_diff(item)}",
            )
        elif item.cid in changed:
            results[item.cid] = CheckResult(
                item.cid,
                "warn",
                f"{item.path}: {changed[item.cid]}, content as pinned "
                f"(sha256 {_short(digest)}); `molctl lock {profile.name}` re-pins it",
            )
    return results


def _grouped(items: list[_Pinned], groups: dict[str, str], results: dict[str, CheckResult], verify: Verify):
    """Each group's failing and warning rows, then one passing row for its files as pinned."""
    out: list[CheckResult] = []
    how = "sha256 read and matched" if verify.full_hash else "size and mtime unchanged; --full-hash reads them"
    for group, label in groups.items():
        members = [i for i in items if i.group == group]
        out.extend(results[i.cid] for i in members if i.cid in results)
        good = [i for i in members if i.cid not in results]
        if good:
            out.append(CheckResult(group, "pass", f"{len(good)} {label} as pinned ({how})"))
        elif not members:
            out.append(CheckResult(group, "pass", f"no {label} pinned or present"))
    return out


def _adapter_config_diff(item: _Pinned) -> str:
    """For a changed adapter_config.json: which of r, lora_alpha, target_modules and the declared
    base changed."""
    if item.meta is None:
        return ""
    from molctl import manifest as mf

    try:
        now = mf.adapter_meta(item.path.parent)
    except ManifestError:
        return ""
    diff = [
        f"{k} {json.dumps(item.meta.get(k))} -> {json.dumps(now.get(k))}" for k in now if item.meta.get(k) != now.get(k)
    ]
    return f"; {', '.join(diff)}" if diff else ""
