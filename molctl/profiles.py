"""Profiles: YAML files describing one MoL stack (engine, model layout, adapters, proxy prompts).

Loading is strict: an unknown key, a wrong type, a bad name or invalid YAML is a `ProfileError`
naming the file, the line (where YAML tells it) and the dotted field. `--set dotted.key=value`
and `--model-root` overrides are applied to the raw data *before* validation, so an override
is checked exactly like a value written in the file.

Built-in profiles live in the package (`molctl/profiles_builtin`, a link to the repository's
`profiles/` in a checkout, copies in a wheel); user folders given with
`--profiles-dir` or `MOLCTL_PROFILES_DIR` (os.pathsep-separated) are searched after it, and a
later folder's `NAME.yaml` replaces an earlier one of the same name.
"""

from __future__ import annotations

import math
import os
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from molctl import profilechecks
from molctl.errors import ProfileError
from molctl.profilespec import (
    PH_DESCRIPTIONS,
    PH_LABELS,
    REQUIRED,
    SCHEMA,
    AdapterSpec,
    EngineSpec,
    LogSpec,
    ModelSpec,
    Profile,
    Prompts,
    ProxySpec,
    declared,
)
from molctl.profileyaml import _short, _Validator, apply_overrides, load_yaml_with_lines
from molctl.routes import ROUTES

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]*$")


def builtin_profiles_dir() -> Path:
    """The shipped profiles: `profiles_builtin` beside this module, resolved (in a checkout or an
    editable install that is the repository's `profiles/`; in a wheel, the package's own copies)."""
    return (Path(__file__).parent / "profiles_builtin").resolve()


# a DNS name or an IPv4 address, or an IPv6 one in brackets: a proxy.media_url_hosts entry, and
# the host part of a media URL the proxy lets through (molctl.proxy.apis.chat_validation)
MEDIA_HOST_PATTERN = (
    r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*"
    r"|\[[0-9A-Fa-f:.]+\]"
)
MEDIA_HOST = re.compile(f"(?:{MEDIA_HOST_PATTERN})")
NON_EMPTY = ("served_model_name", "base_model", "model_root", "engine.served_name", "engine.host", "proxy.host")


# --------------------------------------------------------------------------------------------
# Validation.


def _env_str(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def _expand_path(raw: str, base: Path) -> Path:
    expanded = os.path.expanduser(os.path.expandvars(raw))
    path = Path(expanded)
    return path if path.is_absolute() else (base / path)


def build_profile(
    data: dict[str, Any],
    source: Path,
    lines: dict[str, int] | None = None,
    overrides: Iterable[tuple[str, Any]] = (),
    expected_name: str | None = None,
) -> Profile:
    """Validate raw profile data (after applying overrides) into an immutable `Profile`.

    The schema walk first (unknown keys, types, required fields), then each section's own rules
    in a fixed order (name, engine, proxy, prompts, adapters, logs): the first problem is raised.
    """
    overrides = list(overrides)
    apply_overrides(data, overrides)
    v = _Validator(source, lines or {}, {k for k, _ in overrides}, REQUIRED)
    v.walk(data, SCHEMA)
    _check_declared(Profile, data, "", v)
    for key in NON_EMPTY:  # `--set served_model_name=$UNSET_VAR` gave a stack serving model ''
        head, _, tail = key.partition(".")
        value = data.get(head, {}).get(tail) if tail else data.get(head)
        if isinstance(value, str) and not value.strip():
            raise v.fail(key, "must not be empty")

    name = _checked_name(data["name"], expected_name, v)
    for key, value in (("model_root", data["model_root"]), ("proxy.host", data["proxy"].get("host"))):
        problem = _exec_problem(value) if isinstance(value, str) else None  # both reach an argv
        if problem:
            raise v.fail(key, problem)
    engine = _engine_spec(data["engine"], data["proxy"], v)
    proxy = _proxy_spec(data["proxy"], v)
    prompts = _prompts(data["prompts"], v)
    adapters = _adapter_spec(data.get("adapters", {}), v)
    base = source.parent if source else Path.cwd()
    return Profile(
        **({"description": data["description"]} if "description" in data else {}),
        name=name,
        served_model_name=data["served_model_name"],
        base_model=data["base_model"],
        model_root=_expand_path(data["model_root"], base),
        model=ModelSpec(**data.get("model", {})),  # the sections' defaults are their declarations'
        adapters=adapters,
        engine=engine,
        proxy=proxy,
        prompts=prompts,
        source=source,
        logs=_log_spec(data.get("logs", {}), v),
    )


def _check_declared(cls: type, values: dict[str, Any], prefix: str, v: _Validator) -> None:
    """The declared rules of every field of `cls` present in `values` (and of its sections):
    `choices`, `positive` (finite, > 0, at most 2**53: a timer or a size past any float) and
    `between`. The range comparisons alone reject NaN; a boolean is no number here."""
    for name, f in declared(cls):
        if name not in values or values[name] is None:
            continue
        value, dotted, meta = values[name], prefix + name, f.metadata
        if "section" in meta:
            _check_declared(meta["section"], values[name], dotted + ".", v)
        elif meta["choices"] and value not in meta["choices"]:
            raise v.fail(dotted, f"{_short(value)!r}: expected one of {', '.join(meta['choices'])}")
        elif meta["positive"] and not 0 < value <= 2**53:
            raise v.fail(dotted, _not_positive(value))
        elif meta["between"] and not (
            not isinstance(value, bool) and meta["between"][0] <= value <= meta["between"][1]
        ):
            low, high, what = meta["between"]
            raise v.fail(dotted, f"{_short(value)}: expected {what} from {low} to {high}")


def _not_positive(value: float) -> str:
    if value <= 0:
        return "must be > 0"
    if value > 2**53 and value != math.inf:  # a timer or a size past any float
        return f"{_short(value)}: too large (at most {2**53})"
    return f"{_short(value)}: must be a finite number > 0"  # NaN or infinity (YAML .nan, .inf)


def _checked_name(name: str, expected_name: str | None, v: _Validator) -> str:
    """The profile's `name`: `[a-z0-9][a-z0-9-]*`, and equal to its file name when one is given."""
    if not NAME_RE.match(name):
        raise v.fail("name", f"bad name {name!r}: expected [a-z0-9][a-z0-9-]*")
    if expected_name is not None and name != expected_name:
        raise v.fail("name", f"{name!r} differs from the file name {expected_name!r}")
    return name


def _check_ports(engine: dict[str, Any], proxy: dict[str, Any], v: _Validator) -> None:
    """Both ports are TCP ports, and they differ."""
    for port_key, section in (("engine.port", engine), ("proxy.port", proxy)):
        if not 1 <= section["port"] <= 65535:  # _short: a 4000-digit port was echoed whole
            raise v.fail(port_key, f"{_short(section['port'])} is not a TCP port (1-65535)")
    if engine["port"] == proxy["port"]:
        raise v.fail("proxy.port", f"{proxy['port']} is also engine.port; they must differ")
    metrics = proxy.get("metrics_port")
    if metrics is not None:
        if not 1 <= metrics <= 65535:
            raise v.fail("proxy.metrics_port", f"{_short(metrics)} is not a TCP port (1-65535)")
        for other in ("engine.port", "proxy.port"):
            if metrics == (engine if other == "engine.port" else proxy)["port"]:
                raise v.fail("proxy.metrics_port", f"{metrics} is also {other}; they must differ")


def _engine_spec(data: dict[str, Any], proxy: dict[str, Any], v: _Validator) -> EngineSpec:
    """The `engine` section: a known kind, a PEP 440 version pin, ports (with the proxy's), GPUs,
    a positive start timeout, flags written without dashes; env values become strings."""
    eng = dict(data)
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    try:
        SpecifierSet(eng["version"])
    except InvalidSpecifier:
        raise v.fail("engine.version", f"{eng['version']!r} is not a version specifier (e.g. ==0.24.0)") from None
    _check_ports(eng, proxy, v)
    for flag in eng.get("args", {}):
        if flag.startswith("-") or not re.match(r"^[a-z0-9][a-z0-9-]*$", flag):
            raise v.fail(f"engine.args.{flag}", "flag names are written without dashes, e.g. max-model-len")
    _check_trace_endpoint(eng, v)
    _check_exec_strings(eng, v)
    problem = profilechecks.problem("engine", eng)  # the engine module's own rules
    if problem:
        raise v.fail(*problem)
    for key in ("python", "otlp_traces_endpoint", "cache_dir"):  # null or empty: the declared default
        if not eng.get(key):
            eng.pop(key, None)
    cache = eng.get("cache_dir")
    if cache and not os.path.isabs(os.path.expanduser(cache)) and ".." in Path(cache).parts:
        raise v.fail(
            "engine.cache_dir", f"{cache!r}: a relative path stays below STATE/PROFILE (no '..'); give an absolute path"
        )
    if "python" in eng:
        eng["python"] = os.path.expanduser(eng["python"])
    if "env" in eng:
        eng["env"] = {k: _env_str(val) for k, val in eng["env"].items()}
    if "unset_env" in eng:
        eng["unset_env"] = tuple(eng["unset_env"])
    return EngineSpec(**eng)


def _check_trace_endpoint(eng: dict[str, Any], v: _Validator) -> None:
    """engine.otlp_traces_endpoint: one word (the engine module checks its flags against engine.args)."""
    endpoint = eng.get("otlp_traces_endpoint")
    if endpoint and not re.fullmatch(r"\S+", endpoint):
        raise v.fail("engine.otlp_traces_endpoint", f"{_short(endpoint)}: expected a collector address without spaces")


# One argv or environment string is at most 32 pages on Linux (MAX_ARG_STRLEN, 128 KiB with 4 KiB
# pages): a longer one (an inline chat template) made exec fail with E2BIG after the preflight passed.
MAX_ARG_BYTES = 32 * 4096 - 1  # without the terminating NUL


def _exec_problem(text: str) -> str | None:
    """Why exec would refuse this argv or environment string (subprocess raised ValueError or
    UnicodeEncodeError, a traceback after `check` passed and after `switch` stopped the old stack)."""
    if "\0" in text:
        return "contains a NUL byte: no command-line argument or environment variable can hold one"
    try:
        size = len(os.fsencode(text))
    except UnicodeError:
        return f"not encodable as {sys.getfilesystemencoding()} (a lone surrogate?): exec cannot pass it"
    if size > MAX_ARG_BYTES:
        return f"{size} bytes: one command-line argument or environment variable holds at most {MAX_ARG_BYTES}"
    return None


def _env_name_problem(name: str) -> str | None:
    if not name:
        return "an environment variable name must not be empty"
    if "=" in name:  # the environment's NAME=VALUE form (subprocess: "illegal environment variable name")
        return f"{_short(name)!r}: an environment variable name cannot contain '='"
    return _exec_problem(name)


def _check_exec_strings(eng: dict[str, Any], v: _Validator) -> None:
    """Every engine string that reaches exec (argv, environment) is one exec takes: env names
    without '=', no NUL byte, encodable, within MAX_ARG_BYTES (checked here, so that `check`
    fails and `up`/`switch` stop nothing)."""
    for key in ("python", "host", "served_name", "otlp_traces_endpoint"):
        problem = _exec_problem(eng[key]) if isinstance(eng.get(key), str) else None
        if problem:
            raise v.fail(f"engine.{key}", problem)
    for flag, value in eng.get("args", {}).items():
        for i, item in enumerate(value) if isinstance(value, list) else [(None, value)]:
            problem = _exec_problem(item) if isinstance(item, str) else None
            if problem:
                raise v.fail(f"engine.args.{flag}" + (f"[{i}]" if i is not None else ""), problem)
    for name, value in eng.get("env", {}).items():
        problem = _env_name_problem(name) or _exec_problem(f"{name}={_env_str(value)}")
        if problem:
            raise v.fail(f"engine.env.{name}", problem)
    for i, name in enumerate(eng.get("unset_env", ())):
        problem = _env_name_problem(name)
        if problem:
            raise v.fail(f"engine.unset_env[{i}]", problem)


def _proxy_spec(data: dict[str, Any], v: _Validator) -> ProxySpec:
    """The `proxy` section: a known default route and reasoning style, positive limits, and a
    route input bound of at least 200 characters."""
    proxy = dict(data)
    if proxy.get("default_route", "L2") not in ROUTES:
        raise v.fail("proxy.default_route", f"{proxy['default_route']!r}: expected one of {', '.join(ROUTES)}")
    hosts = []
    for i, host in enumerate(proxy.get("media_url_hosts", ())):
        if host != "*" and not MEDIA_HOST.fullmatch(host):
            raise v.fail(
                f"proxy.media_url_hosts[{i}]",
                f"{_short(host)}: expected a host name such as images.example.com "
                '(no scheme, port or path), an IP address, or "*" for any',
            )
        hosts.append(host.lower().strip("[]"))
    proxy["media_url_hosts"] = tuple(hosts)
    if "chat_template_kwargs" in proxy:
        proxy["chat_template_kwargs"] = tuple(proxy["chat_template_kwargs"])
    for name in ("proxy.store", "proxy.otlp_endpoint"):  # their owners' grammars
        if proxy.get(name.split(".")[1]) is not None:
            problem = profilechecks.problem(name, proxy)
            if problem:
                raise v.fail(*problem)
    prefix = proxy.get("scheduler_objectives")
    if prefix is not None and not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,236}[a-z0-9])?", prefix):
        raise v.fail("proxy.scheduler_objectives", f"{_short(prefix)}: expected an object name prefix (a-z, 0-9, '-')")
    return ProxySpec(**proxy)


def _prompts(data: dict[str, Any], v: _Validator) -> Prompts:
    """The `prompts` section: exactly one description per route, no empty text, `{summary}` in
    `fold`, and the route prompt's description and label placeholders."""
    prompts = dict(data)
    if sorted(prompts["adapters"]) != list(ROUTES):
        got = ", ".join(sorted(prompts["adapters"])) or "none"
        raise v.fail("prompts.adapters", f"expected exactly the routes {', '.join(ROUTES)}, got {got}")
    for key in ("identity", "route", "summary"):
        if not prompts[key].strip():
            raise v.fail(f"prompts.{key}", "must not be empty")
    for route, text in prompts["adapters"].items():
        if not text.strip():
            raise v.fail(f"prompts.adapters.{route}", "must not be empty")
    if "fold" in prompts and "{summary}" not in prompts["fold"]:
        raise v.fail("prompts.fold", "must contain the placeholder {summary}")
    for ph in (PH_DESCRIPTIONS, PH_LABELS):
        if ph not in prompts["route"]:
            raise v.fail("prompts.route", f"must contain the placeholder {ph}")
    return Prompts(**prompts)


def _adapter_spec(data: dict[str, Any], v: _Validator) -> AdapterSpec:
    """The `adapters` section: at most one of the two rank rules."""
    adapters = dict(data)
    if adapters.get("rank_equals") is not None and adapters.get("rank_max") is not None:
        raise v.fail("adapters.rank_max", "set either rank_equals or rank_max, not both")
    for i, name in enumerate(adapters.get("base_names", ())):
        if not name.strip() or name != name.strip():  # "" is in every declared base: every adapter would pass
            raise v.fail(
                f"adapters.base_names[{i}]",
                f"{_short(name)}: expected a base model name such as GLM-5.2, not blank and without surrounding spaces",
            )
    if "base_names" in adapters:
        adapters["base_names"] = tuple(adapters["base_names"])
    return AdapterSpec(**adapters)


# Retention counts: the proxy's rotation renames part by part over `backups` names (a huge count
# was a thread spinning at 100% CPU and a log never rotated), and `up` keeps `keep` files per
# component; 1000 parts or files is more history than any operator reads, and cheap to walk.


def _log_spec(logs: dict[str, Any], v: _Validator) -> LogSpec:
    """The `logs` section (its ranges are declared: `_check_declared`)."""
    return LogSpec(**logs)


# --------------------------------------------------------------------------------------------
# Discovery.


def profile_dirs(extra: Iterable[str | Path] = ()) -> list[Path]:
    """Built-in folder first, then MOLCTL_PROFILES_DIR entries, then --profiles-dir entries."""
    dirs = [builtin_profiles_dir()]
    env = os.environ.get("MOLCTL_PROFILES_DIR", "")
    dirs += [Path(p).expanduser() for p in env.split(os.pathsep) if p]
    dirs += [Path(p).expanduser() for p in extra]
    return dirs


def profile_files(dirs: Iterable[Path]) -> dict[str, Path]:
    """Name -> file, later folders replacing earlier ones. A NAME.yaml that is not a readable
    file (a directory, a dangling symlink) is listed too, so that loading it says so: it was
    skipped, and `up NAME` said "no profile named". Such an entry whose stem is no profile name
    (an editor's `.#NAME.yaml` lock link) is still skipped."""
    found: dict[str, Path] = {}
    for d in dirs:
        if not d.is_dir():
            continue
        for f in sorted(d.iterdir()):
            if f.suffix in (".yaml", ".yml") and (f.is_file() or NAME_RE.match(f.stem)):
                found[f.stem] = f
    return found


def load_profile_file(path: Path, overrides: Iterable[tuple[str, Any]] = ()) -> Profile:
    data, lines = load_yaml_with_lines(path)
    return build_profile(data, path, lines, overrides, expected_name=path.stem)


def check_profile_name(name: str) -> str:
    """A PROFILE argument of any command: a profile name, the rule of a profile's own `name`
    (`[a-z0-9][a-z0-9-]*`), so that it is never a path joined onto the state dir or a profiles
    folder (`..`, `tiny/../tiny`). Exit 3 naming the value; a valid name no profile has is the
    caller's "no profile named" answer."""
    if not NAME_RE.fullmatch(name):
        shown = repr(name) if len(name) <= 80 else repr(name[:80]) + "..."
        raise ProfileError(
            f"bad profile name {shown}: expected [a-z0-9][a-z0-9-]* (a profile's name, see `molctl profiles`)"
        )
    return name


def load_profile(name: str, dirs: Iterable[Path], overrides: Iterable[tuple[str, Any]] = ()) -> Profile:
    check_profile_name(name)
    dirs = list(dirs)
    files = profile_files(dirs)
    if name not in files:
        known = ", ".join(sorted(files)) or "none"
        searched = ", ".join(str(d) for d in dirs)
        raise ProfileError(f"no profile named {name!r} (known: {known}; searched: {searched})")
    return load_profile_file(files[name], overrides)


def list_profiles(dirs: list[Path]) -> tuple[list[dict[str, Any]], list[str]]:
    """`molctl profiles`: a row per profile found, and a one-line problem per file that does not load.
    No profile file at all is a ProfileError naming the folders searched (an install without its
    built-in profiles listed an empty table and exited 0)."""
    rows, problems = [], []
    files = profile_files(dirs)
    if not files:
        searched = ", ".join(str(d) for d in dirs)
        raise ProfileError(
            f"no profile found (searched: {searched}); give a folder of NAME.yaml files with --profiles-dir"
        )
    for _name, path in sorted(files.items()):
        try:
            p = load_profile_file(path)
        except ProfileError as exc:
            problems.append(str(exc))
            continue
        rows.append(
            {
                "name": p.name,
                "engine": p.engine.kind,
                "engine_version": p.engine.version,
                "served_model_name": p.served_model_name,
                "gpus": p.engine.gpus,
                "engine_port": p.engine.port,
                "proxy_port": p.proxy.port,
                "source": str(path),
                "description": p.description,
            }
        )
    return rows, problems


def route_instruction(profile: Profile) -> str:
    """The router's instruction, built once per profile from the adapter descriptions."""
    descriptions = "\n".join(
        f"{route} = {' '.join(profile.substitute(profile.prompts.adapters[route]).split())}" for route in ROUTES
    )
    text = profile.substitute(profile.prompts.route)
    return text.replace(PH_DESCRIPTIONS, descriptions).replace(PH_LABELS, " ".join(ROUTES)).strip()
