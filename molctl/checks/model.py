"""Model and adapter checks: the upstream file checks plus real safetensors headers.

Only headers are read (a Venti shard is ~5 GB; a header is kilobytes), so checking 141 shards
is a matter of milliseconds. Adapters are checked for what makes vLLM fail at start-up (rank
above --max-lora-rank) and for what makes it *silently* serve the base model (target modules
whose names match nothing in the base: vllm#55193, #34186).
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Any

from molctl.checks.result import CheckResult, Probes, describe
from molctl.engines import get_engine
from molctl.profiles import Profile
from molctl.routes import ROUTES
from molctl.safetensors import HeaderError, SafetensorsHeader, read_header

INDEX = "model.safetensors.index.json"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def _real_file_problem(path: Path) -> str | None:
    """None when `path` is a real, non-symlink, non-empty file; otherwise what is wrong."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return f"{path} is missing"
    except OSError as exc:
        return f"{path}: {exc.strerror}"
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symlink (expected a real file)"
    if not stat.S_ISREG(st.st_mode):
        return f"{path} is not a regular file"
    if st.st_size == 0:
        return f"{path} is empty"
    return None


def _load_json(path: Path) -> tuple[Any, str | None]:
    problem = _real_file_problem(path)
    if problem:
        return None, problem
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        return None, f"{path} cannot be read: {exc.strerror or exc}"
    except UnicodeDecodeError as exc:
        return None, f"{path} is not valid JSON: {exc}"
    try:
        return json.loads(text), None
    except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep; ValueError: a 5000-digit integer
        return None, f"{path} is not valid JSON: {exc}"


def load_weight_map(profile: Profile) -> tuple[dict[str, str] | None, str | None]:
    """The index's tensor -> shard map (parsed once per file version: model and adapter checks share it)."""
    path = profile.base_dir / INDEX
    try:
        st = os.stat(path)
        stamp = (str(path), st.st_mtime_ns, st.st_size)
    except OSError:
        stamp = None
    if stamp is not None and stamp == _INDEX_CACHE.get("stamp"):
        return _INDEX_CACHE["value"]
    value = _parse_weight_map(profile)
    _INDEX_CACHE.update(stamp=stamp, value=value)
    return value


_INDEX_CACHE: dict[str, Any] = {}


def _parse_weight_map(profile: Profile) -> tuple[dict[str, str] | None, str | None]:
    index, problem = _load_json(profile.base_dir / INDEX)
    if problem:
        return None, problem
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        return None, f"{profile.base_dir / INDEX} has no 'weight_map' object (expected tensor name -> shard file)"
    for tensor, shard in weight_map.items():  # a shard is a file of base/, never a path out of it (/etc/passwd, ../x)
        if not isinstance(shard, str) or not _inside(shard):
            return None, (
                f"{profile.base_dir / INDEX} assigns {tensor!r} to {shard!r}, expected the name of a "
                f"shard file inside {profile.base_dir}"
            )
    return weight_map, None


def _inside(name: str) -> bool:
    """A relative path that stays inside its folder (as `molctl lock` wants it: no `/etc/passwd`, no `../x`, no NUL)."""
    return (
        bool(name) and "\0" not in name and not os.path.isabs(name) and os.path.normpath(name).split(os.sep)[0] != ".."
    )


def run_model(profile: Profile, probes: Probes) -> list[CheckResult]:
    root = profile.model_root
    results: list[CheckResult] = []
    if root.is_symlink():
        return [CheckResult("model.root", "fail", f"model root {root} is a symlink (expected a real directory)")]
    if not root.is_dir():
        hint = f"; {profile.model.hint}" if profile.model.hint else ""
        return [
            CheckResult(
                "model.root", "fail", f"model root {root} is not a directory (set model_root or --model-root{hint})"
            )
        ]
    if root.resolve() != root.absolute():
        return [CheckResult("model.root", "fail", f"model root {root} resolves to {root.resolve()} through a symlink")]
    results.append(CheckResult("model.root", "pass", f"{root} is a real directory"))
    results.append(_config_result(profile))
    weight_map, problem = load_weight_map(profile)
    if problem:
        results.append(CheckResult("model.index", "fail", problem))
        return results
    shards: dict[str, set[str]] = {}
    for tensor, shard in weight_map.items():
        shards.setdefault(shard, set()).add(tensor)
    want_shards = profile.model.shards
    if want_shards is not None and len(shards) != want_shards:
        results.append(
            CheckResult(
                "model.index",
                "fail",
                f"{profile.base_dir / INDEX} names {len(shards)} shard files, expected exactly {want_shards}",
            )
        )
    else:
        results.append(CheckResult("model.index", "pass", f"{len(weight_map)} tensors in {len(shards)} shards"))
    return results + _shard_results(profile, shards)


def _config_result(profile: Profile) -> CheckResult:
    """`model.config`: the base's config.json is a JSON object of the profile's model_type."""
    config, problem = _load_json(profile.base_dir / "config.json")
    want = profile.model.model_type
    if problem:
        return CheckResult("model.config", "fail", problem)
    if not isinstance(config, dict):
        return CheckResult("model.config", "fail", f"{profile.base_dir / 'config.json'} is not a JSON object")
    if want is not None and config.get("model_type") != want:
        return CheckResult(
            "model.config",
            "fail",
            f"{profile.base_dir / 'config.json'}: model_type is {config.get('model_type')!r}, expected {want!r}",
        )
    return CheckResult("model.config", "pass", f"model_type {config.get('model_type')!r}")


def _shard_results(profile: Profile, shards: dict[str, set[str]]) -> list[CheckResult]:
    """`model.shards` (each shard a real, non-empty file inside the base dir) and `model.headers`
    (each header parses and holds exactly the tensors the index assigns to it)."""
    results: list[CheckResult] = []
    file_problems: list[str] = []
    header_problems: list[str] = []
    for shard in sorted(shards):
        path = profile.base_dir / shard
        problem = _real_file_problem(path)
        if problem is None and not path.resolve().is_relative_to(profile.base_dir.resolve()):
            problem = f"{path} resolves to {path.resolve()}, outside {profile.base_dir} (a symlinked folder on the way)"
        if problem:
            file_problems.append(problem)
            continue
        try:
            header = read_header(path)
        except (HeaderError, OSError) as exc:
            header_problems.append(f"{path}: {exc}")
            continue
        have = set(header.tensors)
        missing = sorted(shards[shard] - have)
        extra = sorted(have - shards[shard])
        if missing:
            header_problems.append(f"{path} lacks {describe(missing)}, which {INDEX} assigns to it")
        elif extra:
            header_problems.append(f"{path} holds {describe(extra)}, which {INDEX} does not assign to it")
    if file_problems:
        results.append(
            CheckResult("model.shards", "fail", f"{len(file_problems)} shard(s) bad: {describe(file_problems, 2)}")
        )
    else:
        results.append(CheckResult("model.shards", "pass", f"{len(shards)} shard files present, real and non-empty"))
    if header_problems:
        results.append(
            CheckResult("model.headers", "fail", f"{len(header_problems)} shard(s) bad: {describe(header_problems, 2)}")
        )
    elif not file_problems:
        results.append(
            CheckResult("model.headers", "pass", "every shard header parses, matches the index and fits the file")
        )
    return results


def _adapter_module_path(tensor: str) -> str:
    module = tensor.split(".lora_")[0]
    for prefix in ("base_model.model.",):
        if module.startswith(prefix):
            module = module[len(prefix) :]
    return module


class BaseNames:
    """Questions about the base model's tensor names, answered without building big sets."""

    def __init__(self, tensors: dict[str, str] | None):
        self.tensors = tensors or {}
        self._joined: str | None = None

    def __bool__(self) -> bool:
        return bool(self.tensors)

    @property
    def joined(self) -> str:
        if self._joined is None:
            self._joined = "\n" + "\n".join(self.tensors) + "\n"
        return self._joined

    def has_module_name(self, name: str) -> bool:
        """Some tensor path has a component `name` (e.g. q_proj)."""
        return f".{name}." in self.joined or f"\n{name}." in self.joined

    def has_module_path(self, path: str) -> bool:
        return f"{path}.weight" in self.tensors or f"\n{path}." in self.joined


def run_adapters(profile: Profile, probes: Probes) -> list[CheckResult]:
    weight_map, _ = load_weight_map(profile)
    base = BaseNames(weight_map)
    engine_max = get_engine(profile.engine.kind).max_lora_rank(profile)
    results: list[CheckResult] = []
    for route in ROUTES:
        results.extend(_check_adapter(profile, route, base, engine_max))
    results.extend(_capacity(profile, engine_max))
    return results


# Capacity flags of seed 002 (warn level). The proxy serves the four adapters concurrently (the
# route hop on L0 while answers and summaries run on L1-L3), so the engine should keep all four
# resident in one batch; a larger --max-lora-rank than the largest real rank reserves memory for
# nothing. Flag and default per engine: `Engine.max_loras_flag` (vLLM --max-loras, default 1;
# SGLang --max-loras-per-batch, default 8).
CONCURRENT_ADAPTERS = len(ROUTES)


def _real_ranks(profile: Profile) -> dict[str, int]:
    """route -> r of the adapters whose config is readable (the adapter checks report the others)."""
    ranks = {}
    for route in ROUTES:
        config, problem = _load_json(profile.adapter_dir(route) / ADAPTER_CONFIG)
        r = config.get("r") if problem is None and isinstance(config, dict) else None
        if isinstance(r, int) and not isinstance(r, bool) and r > 0:
            ranks[route] = r
    return ranks


def _capacity(profile: Profile, engine_max: int | None) -> list[CheckResult]:
    """`adapter.max-lora-rank`: warn when --max-lora-rank is above the largest real adapter rank;
    `adapter.max-loras`: warn when fewer adapters fit one batch than the proxy serves at once."""
    out = []
    ranks = _real_ranks(profile)
    if engine_max is not None and len(ranks) == len(ROUTES):
        top = max(ranks.values())
        if top < engine_max:
            out.append(
                CheckResult(
                    "adapter.max-lora-rank",
                    "warn",
                    f"--max-lora-rank {engine_max} is above the largest adapter rank {top} "
                    f"({', '.join(f'{k} r={v}' for k, v in ranks.items())}): memory reserved for nothing; "
                    f"set engine.args.max-lora-rank to {top}",
                )
            )
        elif top == engine_max:
            out.append(
                CheckResult("adapter.max-lora-rank", "pass", f"--max-lora-rank {engine_max} = the largest adapter rank")
            )
    flag, default = get_engine(profile.engine.kind).max_loras_flag
    value = profile.engine.args.get(flag)
    value = value if isinstance(value, int) and not isinstance(value, bool) else None
    effective = default if value is None else value
    shown = f"--{flag} {value}" if value is not None else f"--{flag} unset (the engine's default {default})"
    if effective < CONCURRENT_ADAPTERS:
        out.append(
            CheckResult(
                "adapter.max-loras",
                "warn",
                f"{shown} is below the {CONCURRENT_ADAPTERS} adapters the proxy serves concurrently "
                f"(route hop on L0, answers and summaries on L1-L3): requests for the others wait for a "
                f"slot; set engine.args.{flag} to {CONCURRENT_ADAPTERS}",
            )
        )
    else:
        out.append(CheckResult("adapter.max-loras", "pass", f"{shown} >= {CONCURRENT_ADAPTERS} concurrent adapters"))
    return out


def _check_adapter(profile: Profile, route: str, base: BaseNames, engine_max: int | None) -> list[CheckResult]:
    """adapter.Lk.{dir,config,rank,base,weights,targets} for one route; a failing dir, config or
    weights check ends that adapter's list (what follows would only repeat it)."""
    d = profile.adapter_dir(route)
    cid = f"adapter.{route}"
    if d.is_symlink() or not d.is_dir():
        what = "a symlink" if d.is_symlink() else "missing"
        return [CheckResult(f"{cid}.dir", "fail", f"adapter directory {d} is {what} (expected a real directory)")]
    cfg_path = d / ADAPTER_CONFIG
    config, result = _adapter_config(cid, cfg_path)
    out = [result]
    if config is None:
        return out
    rank, result = _adapter_rank(cid, cfg_path, config, profile, engine_max)
    out.append(result)
    result = _adapter_base(cid, cfg_path, config, profile)
    if result is not None:
        out.append(result)
    weights = d / ADAPTER_WEIGHTS
    header, result = _adapter_weights(cid, weights, rank)
    out.append(result)
    if header is None:
        return out
    out.append(_adapter_targets(cid, cfg_path, weights, config, header, base))
    moe = _adapter_moe(cid, cfg_path, config, header, base)
    if moe is not None:
        out.append(moe)
    return out


EXPERT_RE = re.compile(r"(^|\.)experts(\.|$)")


def _adapter_moe(
    cid: str, cfg_path: Path, config: dict[str, Any], header: SafetensorsHeader, base: BaseNames
) -> CheckResult | None:
    """`adapter.Lk.moe` (only as a warning): the adapter targets MoE expert weights: LoRA tensors
    under `.experts.`, a target module named like `experts`, or a target module name (w1/w2/w3,
    gate_up_proj, down_proj...) that the base has inside `.experts.`. vLLM does not validate MoE
    LoRA layouts (2D per-expert vs 3D fused, `is_3d_lora_weight`) and can serve wrong output
    without an error (seed 002): such an adapter needs a known-answer test, not just a load."""
    targets = config.get("target_modules")
    names = (
        [targets]
        if isinstance(targets, str)
        else [t for t in targets if isinstance(t, str)]
        if isinstance(targets, list)
        else []
    )
    expert_tensors = [n for n in header.tensors if ".lora_" in n and ".experts." in n]
    found = []
    if expert_tensors:
        dims = sorted({len(header.tensors[n]["shape"]) for n in expert_tensors})
        found.append(f"{len(expert_tensors)} LoRA tensors under .experts. ({'/'.join(f'{d}D' for d in dims)})")
    named = [t for t in names if EXPERT_RE.search(t)]
    if named:
        found.append(f"target_modules {describe(named)}")
    if base:
        inside = [
            t
            for t in names
            if t not in named and re.search(rf"\.experts\.(\d+\.)?{re.escape(t.rsplit('.', 1)[-1])}\.", base.joined)
        ]
        if inside:
            found.append(f"target_modules {describe(inside)}, which the base has inside .experts.")
    if not found:
        return None
    return CheckResult(
        f"{cid}.moe",
        "warn",
        f"{cfg_path}: targets MoE expert weights ({'; '.join(found)}); vLLM does not validate MoE LoRA "
        f"layouts (2D per-expert vs 3D fused, is_3d_lora_weight) and can serve wrong output without an "
        f"error: test it with known inputs before trusting it",
    )


def _adapter_config(cid: str, cfg_path: Path) -> tuple[dict[str, Any] | None, CheckResult]:
    """`adapter_config.json` parses to an object whose peft_type is LoRA; (None, fail) otherwise."""
    config, problem = _load_json(cfg_path)
    if problem is None and not isinstance(config, dict):
        problem = f"{cfg_path} is not a JSON object"
    if problem is None and str(config.get("peft_type", "")).upper() != "LORA":
        problem = f"{cfg_path}: peft_type is {config.get('peft_type')!r}, expected 'LORA'"
    if problem:
        return None, CheckResult(f"{cid}.config", "fail", problem)
    return config, CheckResult(f"{cid}.config", "pass", f"{cfg_path} is a LoRA config")


def _adapter_rank(
    cid: str, cfg_path: Path, config: dict[str, Any], profile: Profile, engine_max: int | None
) -> tuple[int | None, CheckResult]:
    """`r` is a positive integer within the profile's rank rule and the engine's --max-lora-rank.
    Returns the rank to check the weights' shapes against (None when `r` is not a usable number)."""
    rank = config.get("r")
    spec = profile.adapters
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        return None, CheckResult(f"{cid}.rank", "fail", f"{cfg_path}: r is {rank!r}, expected a positive integer")
    if spec.rank_equals is not None and rank != spec.rank_equals:
        return rank, CheckResult(
            f"{cid}.rank", "fail", f"{cfg_path}: r is {rank}, profile {profile.name} requires r == {spec.rank_equals}"
        )
    if spec.rank_max is not None and rank > spec.rank_max:
        return rank, CheckResult(
            f"{cid}.rank", "fail", f"{cfg_path}: r is {rank}, profile {profile.name} requires r <= {spec.rank_max}"
        )
    if engine_max is not None and rank > engine_max:
        return rank, CheckResult(
            f"{cid}.rank", "fail", f"{cfg_path}: r is {rank}, above the engine's --max-lora-rank {engine_max}"
        )
    return rank, CheckResult(f"{cid}.rank", "pass", f"r = {rank}")


def _adapter_base(cid: str, cfg_path: Path, config: dict[str, Any], profile: Profile) -> CheckResult | None:
    """The declared base (`base_model_name_or_path`) names one of `adapters.base_names` or is the
    profile's base directory; None when the profile names no base."""
    spec = profile.adapters
    if not spec.base_names:
        return None
    declared = str(config.get("base_model_name_or_path") or "")
    try:
        same_dir = declared and Path(declared).expanduser().resolve() == profile.base_dir.resolve()
    except (OSError, ValueError, RuntimeError):  # a NUL byte, a symlink loop: not the base directory
        same_dir = False
    if same_dir or any(names_base(declared, b) for b in spec.base_names):
        return CheckResult(f"{cid}.base", "pass", f"declared base {declared!r}")
    expected = " or ".join(repr(b) for b in spec.base_names)
    return CheckResult(
        f"{cid}.base",
        "fail",
        f"{cfg_path}: base_model_name_or_path is {declared!r}, expected a name containing {expected} "
        f"(not followed by more version digits) or {profile.base_dir}",
    )


def names_base(declared: str, base_name: str) -> bool:
    """`base_name` occurs in `declared` (case-insensitive) where the text does not go on with more
    version digits: "GLM-5.2" is in "zai-org/GLM-5.2-FP8" and "/root/glm52_local", not in
    "GLM-5.20"; "GLM-5" is not in "GLM-5.1". Sibling releases share tensor names and shapes, so
    vLLM loads an adapter trained on the wrong one without a word (peers-and-engines: base
    compatibility)."""
    return re.search(re.escape(base_name) + r"(?![0-9]|\.[0-9])", declared, re.IGNORECASE) is not None


def _adapter_weights(cid: str, weights: Path, rank: int | None) -> tuple[SafetensorsHeader | None, CheckResult]:
    """The weights file is real, its header parses, it holds lora_A/lora_B tensors whose shapes
    fit the rank. Returns (header, pass) or (None, fail)."""
    problem = _real_file_problem(weights)
    header = None
    if problem is None:
        try:
            header = read_header(weights)
        except (HeaderError, OSError) as exc:
            problem = f"{weights}: {exc}"
    if problem is None:
        lora = {n: t for n, t in header.tensors.items() if ".lora_A" in n or ".lora_B" in n}
        if not lora:
            problem = f"{weights} holds no lora_A/lora_B tensors"
        elif rank is not None:
            bad = [f"{n} {t['shape']}" for n, t in sorted(lora.items()) if not _shape_fits(n, tuple(t["shape"]), rank)]
            if bad:
                problem = f"{weights}: shapes inconsistent with r={rank}: {describe(bad, 2)}"
    if problem:
        return None, CheckResult(f"{cid}.weights", "fail", problem)
    return header, CheckResult(f"{cid}.weights", "pass", f"{len(header.tensors)} tensors, shapes consistent with r")


def _adapter_targets(
    cid: str, cfg_path: Path, weights: Path, config: dict[str, Any], header: SafetensorsHeader, base: BaseNames
) -> CheckResult:
    """Every targeted module name (declared in `target_modules`, and found in the weights) exists
    in the base's tensor names (fail: the engine would silently ignore it); a module path that
    differs from the base's only by prefix is a warning."""
    if not base:
        return CheckResult(f"{cid}.targets", "skip", "base index unreadable; see model.index")
    targets = config.get("target_modules")
    if (
        targets is not None
        and not isinstance(targets, str)
        and not (isinstance(targets, list) and all(isinstance(t, str) for t in targets))
    ):
        return CheckResult(
            f"{cid}.targets",
            "fail",
            f"{cfg_path}: target_modules is {_clip(targets)}, expected a list of "
            f"module names or a regular expression string",
        )
    declared_missing = []
    if isinstance(targets, list):
        declared_missing = [t for t in targets if isinstance(t, str) and not base.has_module_name(t.rsplit(".", 1)[-1])]
    paths = sorted({_adapter_module_path(n) for n in header.tensors if ".lora_A" in n})
    unknown_names = sorted(n for n in {p.rsplit(".", 1)[-1] for p in paths} if not base.has_module_name(n))
    if declared_missing or unknown_names:
        names = sorted(set(declared_missing) | set(unknown_names))
        return CheckResult(
            f"{cid}.targets",
            "fail",
            f"{cfg_path}: targets module(s) {describe(names)} that no tensor of the base model has (the engine would "
            "silently ignore them)",
        )
    unmatched = [p for p in paths if not base.has_module_path(p)]
    if unmatched:
        return CheckResult(
            f"{cid}.targets",
            "warn",
            f"{weights}: module path(s) {describe(unmatched, 2)} do not match the base's tensor names exactly (prefix "
            "differs; check the engine maps them)",
        )
    return CheckResult(f"{cid}.targets", "pass", f"{len(paths)} targeted modules exist in the base")


def _clip(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _shape_fits(name: str, shape: tuple[int, ...], rank: int) -> bool:
    if len(shape) == 2:
        return shape[0] == rank if ".lora_A" in name else shape[1] == rank
    return rank in shape  # 3-D expert LoRA layouts differ by engine; the rank must appear
