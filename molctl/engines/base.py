"""What every engine adapter provides, and the shared pieces of launch-argv rendering."""

from __future__ import annotations

import abc
import hashlib
import json
import os
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from molctl.profilespec import Profile
from molctl.routes import ROUTES


@dataclass
class EngineInstall:
    """What the engine's own interpreter reports about the installed engine package."""

    found: bool
    version: str | None = None
    flags: frozenset[str] = field(default_factory=frozenset)
    error: str | None = None
    # the OpenTelemetry modules the engine's tracing imports that its environment lacks (None: not probed)
    trace_missing: tuple[str, ...] | None = None
    note: str | None = None  # how it was read, when that matters (a device pinned for the probe)


def render_args(args: Mapping[str, Any]) -> list[str]:
    """`{"max-model-len": 2048, "enable-lora": true, "off": false}` -> `--max-model-len 2048 --enable-lora`."""
    argv: list[str] = []
    for flag, value in args.items():
        if value is False or value is None:
            continue
        argv.append(f"--{flag}")
        if value is True:
            continue
        if isinstance(value, list):
            argv.extend(str(v) for v in value)
        else:
            argv.append(str(value))
    return argv


# the least the proxy's /readyz waits for the engine's /health (the engine's own health timeout
# when longer); `molctl status` gives /readyz one second more, so a proxy reporting a hung engine
# is read as its 503, not as "no answer"
READYZ_ENGINE_PROBE_MIN_S = 2.0


def run_probe_script(
    python: str, script: str, *args: str, timeout: float = 120, env: Mapping[str, str] | None = None
) -> EngineInstall:
    """Run `script` under the engine's interpreter (`env`: variables added to ours); it prints one
    JSON object on its last line."""
    try:
        proc = subprocess.run(
            [python, "-c", script, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **env} if env else None,
        )
    except FileNotFoundError:
        return EngineInstall(found=False, error=f"engine.python {python!r} does not exist")
    except PermissionError:
        return EngineInstall(found=False, error=f"engine.python {python!r} is not executable")
    except subprocess.TimeoutExpired:
        return EngineInstall(found=False, error=f"{python} did not answer within {timeout:.0f} s")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return EngineInstall(found=False, error=f"{python} failed (exit {proc.returncode}): {tail}")
    data = json.loads(lines[-1])
    return EngineInstall(
        found=data.get("found", False),
        version=data.get("version"),
        flags=frozenset(data.get("flags", ())),
        error=data.get("error"),
        trace_missing=tuple(data["trace_missing"]) if isinstance(data.get("trace_missing"), list) else None,
    )


# Appended to an engine's probe script (`TRACE_MODULES` replaced by the engine's `trace_modules`): which
# of them its environment cannot find, in `out["trace_missing"]`. find_spec imports only the parent
# packages, never the exporters themselves.
TRACE_PROBE = r"""
missing = []
for name in TRACE_MODULES:
    try:
        if importlib.util.find_spec(name) is None:
            missing.append(name)
    except (ImportError, ValueError):
        missing.append(name)
out["trace_missing"] = missing
"""


def with_trace_probe(script: str, modules: tuple[str, ...]) -> str:
    """`script` (which prints `out` as JSON on its last line) reporting `trace_missing` too."""
    head, _, tail = script.rpartition("print(json.dumps(out))")
    return head + TRACE_PROBE.replace("TRACE_MODULES", repr(modules)) + "print(json.dumps(out))" + tail


# Run as a script under engine.python, or exec'd here (`install_fingerprint`) when engine.python is
# this very interpreter: the fingerprint then costs no interpreter start (~30 ms of every `check`).
FINGERPRINT_SCRIPT = r"""
import importlib.util, json, os, sys
def fingerprint(package):
    spec = importlib.util.find_spec(package)
    out = {"exe": os.path.realpath(sys.executable)}
    if spec is not None and spec.origin:
        out["origin"] = spec.origin
        out["mtimes"] = [os.stat(spec.origin).st_mtime, os.stat(os.path.dirname(spec.origin)).st_mtime]
    return out
if __name__ == "__main__":
    print(json.dumps(fingerprint(sys.argv[1])))
"""


def is_this_interpreter(python: str) -> bool:
    """`python` names the interpreter running molctl, in the same environment: the same file in the
    same bin folder (a virtual environment is found from the path it was started by, so two venvs
    whose pythons both resolve to one base interpreter are different)."""
    import shutil
    import sys

    path = python if os.sep in python else shutil.which(python)
    if not path or not sys.executable:
        return False
    here = os.path.abspath(sys.executable)
    there = os.path.abspath(path)
    return os.path.dirname(here) == os.path.dirname(there) and os.path.realpath(here) == os.path.realpath(there)


def install_fingerprint(python: str, package: str) -> dict[str, Any]:
    """What identifies the installed engine package under `python` (interpreter, the package's
    file and folder mtimes, which a reinstall or upgrade changes); `origin` is missing when the
    package is not found. Raises OSError/ValueError/IndexError/TimeoutExpired when the probe fails."""
    if is_this_interpreter(python):
        namespace: dict[str, Any] = {}
        exec(FINGERPRINT_SCRIPT, namespace)  # noqa: S102 - our own constant; not run as __main__
        return namespace["fingerprint"](package)
    proc = subprocess.run(
        [python, "-c", FINGERPRINT_SCRIPT, package],
        capture_output=True,
        text=True,
        timeout=30,
        stdin=subprocess.DEVNULL,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def probe_install_cached(engine: Engine, python: str, cache_dir: Path | None) -> EngineInstall:
    """`engine.probe_install(python)`, remembered per installed package: the full probe imports the
    engine (about 7 s for vLLM), the fingerprint (`install_fingerprint`) takes milliseconds."""
    if cache_dir is None:
        return engine.probe_install(python)
    try:
        fingerprint = install_fingerprint(python, engine.package)
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return engine.probe_install(python)
    if "origin" not in fingerprint:
        return engine.probe_install(python)
    key = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:24]
    path = cache_dir / f"engine-{engine.kind}-{key}.json"
    try:
        data = json.loads(path.read_text())
        return EngineInstall(
            found=True,
            version=data["version"],
            flags=frozenset(data["flags"]),
            trace_missing=tuple(data["trace_missing"]),
            note=data.get("note"),
        )
    except (OSError, ValueError, KeyError, TypeError):  # TypeError: a cache file of another shape (a traceback)
        pass
    install = engine.probe_install(python)
    if install.found and install.flags and not install.error:
        try:
            cache_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(
                json.dumps(
                    {
                        "version": install.version,
                        "flags": sorted(install.flags),
                        "trace_missing": list(install.trace_missing or ()),
                        "note": install.note,
                    }
                )
            )
            os.replace(tmp, path)
        except OSError:
            pass
    return install


def adapter_problems(profile: Profile, engine: Engine, models: object) -> list[str]:
    """What is wrong with an engine's /v1/models for this profile (empty when L0-L3 are all
    listed with the profile's engine-side base as parent). Used by `up`, `status` and /readyz."""
    listed = engine.listed_adapters(models)
    if listed is None:
        return ["/v1/models did not return a model list"]
    parent = profile.engine.served_name
    problems = []
    for route in ROUTES:
        name = route if route in listed else engine.adapter_model(profile, route)
        if name not in listed:
            problems.append(f"adapter {route} is missing from /v1/models")
        elif listed[name] != parent:
            problems.append(f"adapter {route} is attached to parent {listed[name]!r}, expected {parent!r}")
    return problems


@dataclass
class Sample:
    """One model's answer to the adapter efficacy canary's prompt (`molctl.lifecycle.canary`): per
    generated token, the token, its logprob and the top logprobs at that position ({token: logprob})."""

    tokens: list[Any] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[dict[str, float]] = field(default_factory=list)
    seconds: float = 0.0


class RawIds:
    """Token ids kept as the JSON array text the engine sent (`molctl.proxy.fastjson.loads_lifting`): 256k ids
    are 1.8 MB of bytes, not 256k int objects (9 MB, 19 ms to make), and go on to the summary
    hop as they came (`proxy.pipeline.summary`)."""

    __slots__ = ("text", "count")

    def __init__(self, text: bytes, count: int):
        self.text, self.count = text, count

    def __len__(self) -> int:
        return self.count

    def __iter__(self):
        return iter(orjson.loads(self.text))


def _ints(value: Any) -> list[int] | None:
    """A JSON list of token ids (or the engine client's RawIds of one), else None."""
    if isinstance(value, RawIds):
        return value  # type: ignore[return-value]
    if isinstance(value, list) and set(map(type, value)) <= {int}:  # 4x a per-item isinstance (256k ids: 6 ms)
        return value
    return None


@dataclass
class AnswerTokens:
    """What the answer hop's engine reported of its tokens (issue 30): the prompt it rendered and
    the tokens it generated, and whether generation ended on a stop token (EOS or one of
    `stop_token_ids`), which the engine includes in `output` but which the chat template may
    spell otherwise. `prompt`/`output` None: not reported (an engine that cannot, a stream that
    hid them)."""

    prompt: list[int] | None = None
    output: list[int] | None = None
    stop_token: bool = False

    def complete(self) -> bool:
        return self.prompt is not None and self.output is not None


def continuation_ids(answer: AnswerTokens, suffix: list[int]) -> list[int]:
    """The summary hop's token prompt: the answer hop's prompt ids, its generated ids, then the
    `suffix` (end of the assistant turn, a user turn with the instruction, the generation
    prompt; `Summaries.summary_suffix`). When generation ended on a stop token: the suffix
    starts with that very token (Qwen's `<|im_end|>`, GLM's `<|user|>`): it is not repeated;
    otherwise (an EOS the template never prints, e.g. `<|endoftext|>`) it is dropped, and the
    suffix closes the turn as the template does. Everything before the suffix is the exact token
    sequence the engine computed for the answer, so its KV blocks are in the prefix cache."""
    assert answer.prompt is not None and answer.output is not None
    output = answer.output
    if answer.stop_token and output:
        if suffix and suffix[0] == output[-1]:
            suffix = suffix[1:]
        else:
            output = output[:-1]
    return [*answer.prompt, *output, *suffix]


class Engine(abc.ABC):
    """Base class; subclasses fill in the engine-specific parts."""

    kind: str = ""
    package: str = ""  # the import name of the engine package
    memory_flag: str = ""  # the flag that sets the fraction of GPU memory the engine takes
    running_flag: str = ""  # the flag that bounds the sequences the engine runs at once
    default_running = 256  # the proxy's answer-hop bound when the profile sets neither
    # the body field in which the engine takes a request's id (None: the X-Request-Id header only)
    request_id_field: str | None = None
    # the engine refuses (or worse) a second request in flight under one id: the body's id gets a
    # random suffix, since a client's own X-Request-Id (which the hop id extends) may repeat
    request_id_unique = False
    # (regex, phase, detail) read from the engine's log: the start-up phase (molctl.phases.PHASES)
    # and its detail, which may use the regex groups ("{0}%"); the last matching line wins
    phases: tuple[tuple[str, str, str], ...] = ()
    # the flag that picks how the engine reads safetensors (molctl.checks.loadstrategy); None: none
    load_strategy_flag: str | None = None

    # Vendor sampling and generation fields a client may send, forwarded on the answer hop as
    # sent (never on the route or summary hop): name -> the JSON kind molctl.proxy.apis.chat_validation
    # checks ("bool", "int", "number", "str", "ints", "strs", "object", "str_or_strs").
    request_extensions: Mapping[str, str] = {}
    # Vendor fields that would break the proxy's contract if passed on: name -> why (a 400).
    refused_extensions: Mapping[str, str] = {}

    launch_module: str = ""  # python -m <this>
    # The launch flag holding the context window, and how much less than it prompt + max_tokens may be.
    window_flag: tuple[str, int] = ("max-model-len", 0)
    # Lower-case fragments of the engine's refusal of a request priority it was not started for.
    priority_refusals: tuple[str, ...] = ()
    # The flag bounding the adapters one batch holds, and the engine's default for it.
    max_loras_flag: tuple[str, int] = ("max-loras", 1)
    # `molctl bench`'s engine counters: report key -> the /metrics counter name.
    bench_metrics: Mapping[str, str] = {}
    # What the engine does with a chat request when the model has no chat template (`molctl check`).
    no_template_fallback: str = ""
    model_flag: str = ""  # the flag naming the base model folder
    lora_flag: str = ""  # the flag taking NAME=PATH adapter pairs
    # llm-d-router's `modelServers.type` for this engine when `render k8s --scheduler llm-d`
    # renders it (its picker reads the engine's metrics and LoRA info by that type); None: not offered
    llmd_model_server: str | None = None
    # The flags that send the engine's own OpenTelemetry spans to `engine.otlp_traces_endpoint`
    # (the endpoint follows the last); the proxy's hop spans are their parents (W3C traceparent).
    trace_flags: tuple[str, ...] = ()
    # What the engine's tracing imports (`engine.otlp_traces_endpoint` set): `check` fails when the
    # engine's environment lacks one, instead of the engine dying at start; and how to install them.
    trace_modules: tuple[str, ...] = (
        "opentelemetry.sdk.trace",
        "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
        "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    )
    trace_install: str = ""

    def launch_argv(self, profile: Profile) -> list[str]:
        e = profile.engine
        return [
            profile.engine_python,
            "-m",
            self.launch_module,
            self.model_flag,
            str(profile.base_dir),
            "--served-model-name",
            e.served_name,
            "--host",
            e.host,
            "--port",
            str(e.port),
            *render_args(e.args),
            *self.trace_argv(profile),
            self.lora_flag,
            *self.adapter_pairs(profile),
        ]

    def trace_argv(self, profile: Profile) -> list[str]:
        """The engine's tracing flags for `engine.otlp_traces_endpoint` (none when it is unset)."""
        endpoint = profile.engine.otlp_traces_endpoint
        return [*self.trace_flags, endpoint] if endpoint and self.trace_flags else []

    @abc.abstractmethod
    def probe_install(self, python: str) -> EngineInstall:
        """See the engine modules."""

    @abc.abstractmethod
    def guided_choice(self, labels: list[str]) -> dict[str, Any]:
        """Request fields that constrain the route hop's output to one of `labels`."""

    @abc.abstractmethod
    def adapter_model(self, profile: Profile, route: str) -> str:
        """The `model` field that selects an adapter in a request to the engine."""

    # the engine flag that turns priority scheduling on (named in the proxy's warning when an
    # engine refuses a priority)
    priority_flag = ""

    def hop_priorities(self, profile: Profile) -> dict[str, int]:
        """The `priority` field of the proxy's hops, by hop ("route", "answer", "summary"; a hop
        not named sends none): empty unless the profile starts the engine with priority
        scheduling (see the engine modules). A route hop is a few tokens a request's answer waits
        on: in a full engine it goes before the waiting answers and summaries instead of behind
        them. Answers and summaries rank equal: summaries ranked last would starve under steady
        load, and an adapter switch waits on its summary (the proxy-side version of that was
        tried and reverted, 2026-12-01)."""
        return {}

    # Readiness hooks (molctl.lifecycle.readiness calls these; the engine modules say what their engine does)
    # The path that reports the running server's version, or None: not checked at runtime.
    version_path: str | None = None
    # asked when `version_path` answers 404 (an older release of the engine), or None
    version_fallback_path: str | None = None
    # Seconds a healthy engine may take to answer /health: callers that probe it (status, the
    # proxy's /readyz, `up`) should wait at least this long before calling it unreachable.
    health_timeout_s: float = 1.0

    def served_name_problem(self, name: str) -> str | None:
        """Why the engine could not serve adapters under this base name, or None."""
        return None

    def profile_problem(self, eng: Mapping[str, Any]) -> tuple[str, str] | None:
        """The profile's `engine` section against this engine's rules (registered with
        `molctl.profilechecks` by `molctl.engines`): (field, what is wrong) or None."""
        problem = self.served_name_problem(eng["served_name"])
        if problem:
            return "engine.served_name", problem
        if eng.get("otlp_traces_endpoint"):
            for flag in self.trace_flags:  # the flags the endpoint sets must not also be set by hand
                if flag[2:] in eng.get("args", {}):
                    return (
                        "engine.otlp_traces_endpoint",
                        f"the engine's {flag} is also set as engine.args.{flag[2:]}: set one",
                    )
        return None

    def listed_adapters(self, models: object) -> dict[str, object] | None:
        """`{card id: its parent}` from a /v1/models body (None: not a model list). vLLM and
        SGLang both answer OpenAI's ModelList, an adapter's card naming the base as `parent`."""
        if not isinstance(models, dict) or not isinstance(models.get("data"), list):
            return None
        return {m.get("id"): m.get("parent") for m in models["data"] if isinstance(m, dict)}

    def health_detail(self, status: int) -> str:
        """What a non-200 /health means while the engine starts (shown on the progress line)."""
        return f"/health answers {status}"

    def smoke_request(self, profile: Profile, route: str) -> dict[str, Any]:
        """The 1-token chat completion `up` sends to each adapter before it calls the stack ready."""
        return {
            "model": self.adapter_model(profile, route),
            "max_tokens": 1,
            "temperature": 0,
            "messages": [{"role": "user", "content": "ping"}],
        }

    # The adapter efficacy canary (molctl.lifecycle.canary): where it asks, what it sends for the base
    # model (route None) or one adapter, and where the answer's tokens and logprobs are.
    canary_path: str = "/v1/completions"

    @abc.abstractmethod
    def canary_request(
        self, profile: Profile, route: str | None, prompt: str, max_tokens: int, top: int, seed: int
    ) -> dict[str, Any]:
        """The body of one greedy canary request of `max_tokens` tokens with `top` top logprobs."""

    @abc.abstractmethod
    def canary_sample(self, body: Any):
        """A `Sample` from the answer's body (raises ValueError/KeyError/TypeError
        when the answer has no logprobs)."""

    # The summary hop as a continuation of the answer hop's tokens (issue 30; the proxy's
    # `Summaries.summary_payload`). An engine that offers none of it keeps these defaults:
    # no fields, nothing reported, and the proxy sends today's chat summary.
    # The answer hop's fields that make the engine report its prompt and output token ids.
    def answer_token_fields(self, stream: bool) -> dict[str, Any]:
        return {}

    def answer_tokens(self, body: dict[str, Any]) -> AnswerTokens:
        """The token ids in a non-streamed answer's body."""
        return AnswerTokens()

    def stream_tokens(self, event: dict[str, Any], into: AnswerTokens) -> None:
        """Accumulate the token ids of one stream event (choice 0) into `into`."""
        del event, into  # this engine reports none

    # The template probe (`Summaries.summary_suffix`): an endpoint that renders messages with
    # the engine's own chat template and tokenizer and answers the token ids, without generating.
    probe_path: str | None = None

    @abc.abstractmethod
    def probe_request(
        self, model: str, messages: list[dict[str, Any]], generation_prompt: bool, kwargs: dict[str, Any] | None
    ) -> dict[str, Any]:
        """The probe's body: `generation_prompt` True adds the generation prompt; False leaves the
        last (assistant) message open, as `continue_final_message` does."""

    def probe_ids(self, body: Any) -> list[int] | None:
        return None

    # Measuring a chat hop's prompt (`molctl.proxy.pipeline.window`): a request to `probe_path`
    # that renders and tokenizes the hop's messages as the chat request would, without generating.
    def length_request(self, payload: dict[str, Any]) -> dict[str, Any] | None:
        """The measurement's body for a chat payload (None: this engine cannot measure one)."""
        del payload
        return None

    def length_of(self, body: Any) -> int | None:
        """The prompt's token count in the measurement's answer."""
        return None

    # `check`'s engine.version detail for a version that does not shorten max_tokens (empty: nothing to say)
    overflow_note: str = ""

    def shortens_max_tokens(self, version: str | None) -> bool:
        """Whether this engine version cuts a max_tokens that overflows the window to the room left
        (False: it refuses the request, or the version is unknown). The proxy fits max_tokens
        itself on every version; `check` reports the version's behaviour."""
        del version
        return False

    # The token-prompt completion the summary hop sends, on an adapter
    continuation_path: str | None = None

    @abc.abstractmethod
    def continuation_request(self, model: str, route: str, ids: list[int], max_tokens: int) -> dict[str, Any]:
        """The summary hop's body: the token prompt `ids` on `route`'s adapter (`model`), at most `max_tokens`."""

    @abc.abstractmethod
    def continuation_result(self, body: Any) -> tuple[str, dict[str, Any] | None]:
        """(the generated text, the usage as OpenAI's: prompt_tokens, prompt_tokens_details.cached_tokens)."""

    def running_version(self, body: object) -> str | None:
        """The version in the body of `version_path`'s answer."""
        return body.get("version") if isinstance(body, dict) and isinstance(body.get("version"), str) else None

    def version_problem(self, profile: Profile, version: str | None) -> str | None:
        """Why the running server's version does not satisfy the profile's pin (None: it does)."""
        from packaging.specifiers import SpecifierSet
        from packaging.version import InvalidVersion, Version

        if version is None:
            return f"{self.version_path} reported no version"
        try:
            ok = Version(Version(version).public) in SpecifierSet(profile.engine.version, prereleases=True)
        except (InvalidVersion, ValueError):
            return f"the running {self.package} reports version {version!r}, which is not a version"
        return (
            None
            if ok
            else (
                f"the running {self.package} reports version {version}, "
                f"which does not match engine.version {profile.engine.version}"
            )
        )

    # Shared helpers -----------------------------------------------------------------------
    def profile_flags(self, profile: Profile) -> list[str]:
        """Every flag the launch argv passes, without dashes (for the flag-acceptance check)."""
        return [a[2:] for a in self.launch_argv(profile) if a.startswith("--")]

    def memory_fraction(self, profile: Profile) -> float | None:
        value = profile.engine.args.get(self.memory_flag)
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    def max_running(self, profile: Profile) -> int:
        """How many requests the engine runs at once (`running_flag` in engine.args), else
        `default_running`: the default of the proxy's `proxy.max_inflight`."""
        value = profile.engine.args.get(self.running_flag) if self.running_flag else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
        return self.default_running

    def max_lora_rank(self, profile: Profile) -> int | None:
        value = profile.engine.args.get("max-lora-rank")
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    # the variable in cache_env whose value is the cache dir itself (not a folder below it), if any:
    # a profile that sets it in engine.env moves the whole cache there (molctl.enginecache)
    cache_root_env: str | None = None

    def cache_env(self, cache_dir) -> dict[str, str]:
        """The variables that point the engine at its persistent cache dir (molctl.enginecache)."""
        return {}

    def phase(self, log_lines: list[str]) -> str | None:
        """The start-up phase the log's newest matching line names, as a label ("loading weights 50%")."""
        from molctl.phases import label, log_phase

        found = log_phase(self.phases, log_lines)
        return label(*found) if found else None

    def adapter_pairs(self, profile: Profile) -> list[str]:
        return [f"{route}={profile.adapter_dir(route)}" for route in ROUTES]
