"""A scripted fake SGLang 0.5.13.post1 launcher (`python -m sglang.launch_server ...`), for the
lifecycle and proxy tests: a real SGLang cannot run here (no CUDA). It reuses the fake vLLM's
chat behaviour (tests/fake_engine.py: directives, /_log, /_config, /_reset) and changes what
SGLang does differently; each behaviour cites where SGLang does it (paths in sgl-project/sglang;
the facts are summarised in docs/engines/sglang.md).

Start-up, in SGLang's order:
  0. parses its argv with the fake package's ServerArgs parser, strictly (launch_server.py
     prepare_server_args -> parser.parse_args: an unknown flag is "unrecognized arguments", exit 2;
     aliases and unambiguous abbreviations such as `--tp` are taken);
  1. prints `server_args=ServerArgs(...)` (server_args.py, logged by the launcher);
  2. spawns the scheduler (one per --tp rank) and the detokenizer, which rename themselves
     `sglang::scheduler_TP<n>` / `sglang::detokenizer` with setproctitle (wiping the environment
     marker) and arm PR_SET_PDEATHSIG=SIGKILL (managers/scheduler.py run_scheduler_process,
     detokenizer_manager.py, utils kill_itself_when_parent_died);
  3. logs the load: "Load weight begin", the shard progress, "Load weight end", "KV Cache is
     allocated" (model_executor/model_runner.py); nothing listens meanwhile (http_server.py
     launch_server runs _launch_subprocesses before uvicorn);
  4. serves with status Starting: /health and /health_generate (one handler) answer 503,
     /get_model_info, /server_info, /get_server_info and /v1/models 200 (http_server.py health_generate);
  5. warm-up: polls /get_model_info, POSTs /generate, then status Up and "The server is fired up
     and ready to roll!" (http_server.py _execute_server_warmup / _wait_and_warmup); a failed
     warm-up kills the process tree.
Serving:
  - /v1/models: the base card (parent null) and one card per loaded adapter, id = lora_name,
    parent = served name (PR #12229, http_server.py available_models);
  - /v1/chat/completions: `model="<served>:<adapter>"` selects an adapter (PR #11570,
    entrypoints/openai/serving_base.py _parse_model_parameter: split at the first ':'; the
    `lora_path` field is the older form, the model form wins); an adapter that is not loaded is
    a 400; usage has `prompt_tokens_details.cached_tokens` only with --enable-cache-report
    (entrypoints/openai/usage_processor.py);
  - /server_info: the server args plus `"version": __version__`; /get_server_info answers the same
    and logs "Endpoint '/get_server_info' is deprecated ..." on every call (http_server.py).
  - /health: 503 while Starting or shutting down; otherwise, by default
    (SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION true), a 1-token generate checked after
    `asyncio.sleep(1)`, so a 200 takes at least 1 s; with that variable 0/false /health answers
    200 at once and only /health_generate generates (http_server.py health_generate).
Shutdown: SIGTERM logs "SIGTERM received. ... Draining requests and shutting down...", /health
turns 503 (`gracefully_exit`); `sigterm_watchdog` notices it within 5 s (it polls every 5 s), logs
"Gracefully exiting... Remaining number of requests N" every 5 s until none is left (no upper
bound), then `kill_process_tree(os.getpid(), include_parent=True)`: the children, then the
launcher itself with SIGKILL (managers/tokenizer_manager.py SignalHandler / sigterm_watchdog,
utils kill_process_tree). A SIGTERM while loading (no handler yet) ends the launcher at once.
Child failure: a scheduler that raises logs "Scheduler hit an exception: ..." and sends SIGQUIT to
the launcher, whose handler logs "Received sigquit from a child process. It usually means the
child failed." and kills the tree, itself included (entrypoints/engine.py
launch_phase_sigquit_handler). Once the scheduler is ready, `SubprocessWatchdog` (PR #18582, Feb
2026, utils/watchdog.py) polls the children every 1 s: one that exited with a non-zero code (a
SIGKILLed scheduler, but also one SIGTERMed by `molctl down`) makes the launcher SIGQUIT itself,
and the whole tree goes. So a dead scheduler never leaves a launcher that looks alive.

FAKE_* knobs (the profile's engine.env): FAKE_STARTUP_DELAY (s of "loading"), FAKE_WARMUP_DELAY
(s the warm-up takes, default 0.3), FAKE_WARMUP_FAIL=1, FAKE_EXIT=<code> (the launcher exits while
loading), FAKE_SCHEDULER_FAIL=1 (the scheduler raises while loading, SGLang's SIGQUIT path),
FAKE_TERM_POLL (s between the sigterm watchdog's checks, SGLang's 5 by default),
FAKE_IGNORE_TERM=1 (a wedged launcher: SIGTERM and SIGQUIT ignored), FAKE_ORPHAN=1 (children do not
arm PDEATHSIG: the orphaned-scheduler case,
as versions that disable kill_itself_when_parent_died), FAKE_NO_CHILDREN=1, FAKE_ADAPTERS (comma
list of the adapters that load), FAKE_PARENT, FAKE_SGLANG_VERSION, FAKE_NO_SERVER_INFO=1 (an older
release: /get_server_info only), FAKE_ANSWER_DELAY, FAKE_NO_EFFECT and
FAKE_SAME_AS (the efficacy canary's adapters with no effect, or answering as another: fake_engine.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fake_engine as base  # noqa: E402
from aiohttp import ClientSession, web  # noqa: E402

VERSION = "0.5.13.post1"
# /health's generate waits this long before checking (http_server.py health_generate:
# `await asyncio.sleep(1)`), so a 200 takes at least this; readiness waits size their per-request
# timeout from it (tests/procs.py SGLANG_HEALTH_REQUEST_TIMEOUT_S).
HEALTH_GENERATE_S = 1.0

CHILD = r"""
import ctypes, os, signal, sys, time
if sys.argv[2] == "1":
    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG, as kill_itself_when_parent_died
import setproctitle
setproctitle.setproctitle(sys.argv[1])
if sys.argv[3] != "-":  # managers/scheduler.py run_scheduler_process: except -> log, SIGQUIT the parent
    time.sleep(float(sys.argv[3]))
    print("[TP0] Scheduler hit an exception: Traceback (most recent call last):\n"
          "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB (simulated)", flush=True)
    os.kill(os.getppid(), signal.SIGQUIT)
    sys.exit(1)
print(f"[{sys.argv[1]}] ready", flush=True)
time.sleep(3600)
"""


class Sgl:
    def __init__(self):
        self.status = "starting"  # ServerStatus.Starting -> Up
        self.gracefully_exit = False
        self.served = "default"
        self.lora_paths: dict[str, str] = {}
        self.cache_report = False
        self.version = VERSION
        self.server_args: dict = {}
        self.children: list[subprocess.Popen] = []
        self.names: list[str] = []
        self.inflight = 0
        self.rids: set = set()  # the rids of the requests in flight
        self.running_phase = False  # the tokenizer manager's handlers replace the launch-phase ones
        self.metrics = False
        # metrics/collector.py counter names (cached tokens labelled by cache_source in 0.5.x)
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0, "cached_tokens": 0, "num_requests": 0}
        # the counters observed at least once: prometheus_client exposes no sample of a labelled
        # counter before its first .labels(...).inc() (see metrics())
        self.observed: set[str] = set()

    def finished(self, prompt: int, generation: int, cached: int) -> None:
        """metrics/collector.py TokenizerMetricsCollector.observe_one_finished_request: prompt and
        generation tokens and num_requests on every finished request, cached tokens only `if
        cached_tokens > 0`."""
        for key, n in (
            ("prompt_tokens", prompt),
            ("generation_tokens", generation),
            ("num_requests", 1),
            ("cached_tokens", cached),
        ):
            if n > 0 or key != "cached_tokens":
                self.counters[key] += n
                self.observed.add(key)


SGL = Sgl()


def error(message: str, status: int = 400) -> web.Response:
    """SGLang's OpenAI error body: serving_base.py create_error_response (ErrorResponse, err_type
    "BadRequestError", HTTP 400), as a client sees it (sglang issue #12745)."""
    return web.json_response(
        {"object": "error", "message": message, "type": "BadRequestError", "param": None, "code": status}, status=status
    )


def loaded_adapters() -> list[str]:
    return [a for a in base.STATE.config["adapters"] if a in SGL.lora_paths or not SGL.lora_paths]


def health_generation() -> bool:
    """envs.SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION (default true; get_bool_env_var: "1"/"true")."""
    return os.environ.get("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "true").lower() in ("1", "true")


async def health(request):
    """http_server.py health_generate (/health and /health_generate)."""
    if SGL.gracefully_exit or SGL.status != "up":
        return web.Response(status=503)
    if request.path == "/health" and not health_generation():
        return web.Response(status=200)
    await asyncio.sleep(HEALTH_GENERATE_S)  # the 1-token generate; last_receive_tstamp is checked after it
    return web.Response(status=base.STATE.config["health_status"])


async def models(request):
    parent = base.STATE.config["parent"] or SGL.served
    data = [
        {
            "id": SGL.served,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "sglang",
            "root": SGL.served,
            "parent": None,
            "max_model_len": SGL.server_args.get("context_length"),
        }
    ]
    data += [
        {
            "id": a,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "sglang",
            "root": SGL.lora_paths.get(a, a),
            "parent": parent,
            "max_model_len": None,
        }
        for a in loaded_adapters()
    ]
    return web.json_response({"object": "list", "data": data})


async def model_info(request):
    return web.json_response(
        {
            "model_path": SGL.server_args.get("model_path"),
            "tokenizer_path": SGL.server_args.get("model_path"),
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
        }
    )


async def server_info(request):
    """/server_info: the server args, the scheduler's info, `internal_states` and `version`
    (entrypoints/http_server.py server_info)."""
    return web.json_response({**SGL.server_args, "internal_states": [{}], "version": SGL.version})


async def get_server_info(request):
    """/get_server_info: the same answer, with a deprecation warning logged on every call
    (http_server.py get_server_info)."""
    print(
        "Endpoint '/get_server_info' is deprecated and will be removed in a future version. "
        "Please use '/server_info' instead.",
        flush=True,
    )
    return await server_info(request)


async def metrics(request):
    """Prometheus text, only with --enable-metrics (http_server.py mounts /metrics then); one
    sample per counter, the queue-time histogram's _sum and _count. The counters carry labels
    (model_name), and prometheus_client exposes no sample of a labelled metric before its first
    `.labels(...)`: `sglang:num_requests_total` and the token counters appear with the first
    finished request (the warm-up's /generate), `sglang:cached_tokens_total` only with the first
    request that hit the cache (collector.py observe_one_finished_request: `if cached_tokens > 0`)."""
    if not SGL.metrics:
        return web.Response(status=404)
    c, labels = SGL.counters, f'model_name="{SGL.served}"'
    lines = [
        f"sglang:{key}_total{{{labels}}} {c[key]}"
        for key in ("prompt_tokens", "generation_tokens", "num_requests")
        if key in SGL.observed
    ]
    if "cached_tokens" in SGL.observed:
        lines.append(f'sglang:cached_tokens_total{{{labels},cache_source="device"}} {c["cached_tokens"]}')
    if "num_requests" in SGL.observed:  # the scheduler's histogram, observed when a request leaves the queue
        lines += [
            f"sglang:queue_time_seconds_sum{{{labels}}} {0.001 * c['num_requests']}",
            f"sglang:queue_time_seconds_count{{{labels}}} {c['num_requests']}",
        ]
    return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")


async def generate(request):
    """The native /generate: the warm-up's (a finished request for the metrics, the first one, so
    nothing is cached yet), and the adapter efficacy canary's, with `return_logprob`: the adapter
    named by `lora_path` (an adapter that is not loaded is a 400, as LoRARegistry.acquire), the
    answer's meta_info `output_token_logprobs` [[logprob, token_id, None], ...] and
    `output_top_logprobs` (one such list per token; text None without return_text_in_logprobs)
    (tokenizer_manager.py add_logprob_return_values), from the fake vLLM's canary_output."""
    payload = await request.json()
    SGL.finished(7, 8, 0)
    if not payload.get("return_logprob"):
        return web.json_response(
            {"text": " Paris.", "meta_info": {"id": "warmup", "finish_reason": {"type": "length"}}}
        )
    adapter = payload.get("lora_path")
    base.STATE.log.append(
        {
            "hop": request.headers.get("X-MoL-Hop"),
            "model": adapter,
            "endpoint": "generate",
            "payload": payload,
            "t": time.time(),
        }
    )
    if adapter is not None and adapter not in loaded_adapters():
        return error(
            f"The following requested LoRA adapters are not loaded: {adapter}\n"
            f"Loaded adapters: dict_keys({loaded_adapters()!r})."
        )
    params = payload.get("sampling_params") or {}
    out = base.canary_output(
        adapter or SGL.served, int(params.get("max_new_tokens") or 16), int(payload.get("top_logprobs_num") or 0) or 1
    )
    meta = {
        "id": "canary",
        "finish_reason": {"type": "length", "length": len(out)},
        "prompt_tokens": 12,
        "completion_tokens": len(out),
        "output_token_logprobs": [[lp, t, None] for t, lp, _ in out],
        "output_top_logprobs": [[[v, k, None] for k, v in top.items()] for _, _, top in out],
    }
    return web.json_response({"text": "".join(f" w{t}" for t, _, _ in out), "meta_info": meta})


def _strip_cached(usage: dict) -> dict:
    if SGL.cache_report:
        return usage
    return {k: v for k, v in usage.items() if k != "prompt_tokens_details"}


_completion, _stream_body = base.completion, base.stream_body


def completion(model, message, finish, usage):
    return _completion(model, message, finish, _strip_cached(usage))


HTTP_STATUS_NAMES = {400: "BAD_REQUEST", 500: "INTERNAL_SERVER_ERROR", 503: "SERVICE_UNAVAILABLE"}


async def stream_body(resp, emit, message, finish, tool, cfg, payload, model, usage, created):
    """The answer stream. Config `stream_abort` {"status": 400|500|503, "message", "after": N}: a
    scheduler abort with a status code after N content pieces (0: before any, e.g. "The request
    queue is full.", 503, once --max-queued-requests is exceeded). SGLang (serving_chat.py
    _generate_chat_stream, PR #19357, Feb 2026) sends it under the 200 it has already committed
    (the kick-start before the 200 only catches ValueError; PR #28175 is open), as
    create_streaming_error_response's frame, WRAPPED: `{"error": {"object": "error", "message",
    "type": HTTPStatus name, "param": null, "code": status}}` (serving_base.py), with no role chunk
    and no finish_reason for that choice, then the usage chunk (stream_options.include_usage)
    and `[DONE]`. `stream_error_after` (vLLM's frame in tests/fake_engine.py) is SGLang's 500
    abort here."""
    usage = _strip_cached(usage)
    abort = cfg.get("stream_abort")
    if abort is None and cfg["stream_error_after"] is not None:
        abort = {
            "status": 500,
            "message": "Internal error in the scheduler (simulated).",
            "after": cfg["stream_error_after"],
        }
    if abort is None:
        await _stream_body(resp, emit, message, finish, tool, cfg, payload, model, usage, created)
        return
    pieces = re.findall(r"\S+\s*", message.get("content") or "")[: abort.get("after", 0)]
    if pieces:
        await emit({"role": "assistant", "content": ""})
    for piece in pieces:
        await emit({"content": piece})
    status = abort["status"]
    err = {
        "object": "error",
        "message": abort["message"],
        "type": HTTP_STATUS_NAMES[status],
        "param": None,
        "code": status,
    }
    await resp.write(b"data: " + json.dumps({"error": err}).encode() + b"\n\n")
    if (payload.get("stream_options") or {}).get("include_usage"):
        await resp.write(
            b"data: "
            + json.dumps(
                {
                    "id": "x",
                    "object": "chat.completion.chunk",
                    "created": 0,
                    "model": model,
                    "choices": [],
                    "usage": usage,
                }
            ).encode()
            + b"\n\n"
        )
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()


base.completion, base.stream_body = completion, stream_body


def strict_violation(payload: dict) -> web.Response | None:
    """Strict mode (config `strict`), SGLang's rules and body (not vLLM's, tests/fake_engine.py):
    the chat template's exceptions are a 400 with their message (serving_chat.py: a
    jinja2.TemplateError is raised again as ValueError -> create_error_response); the window is
    --context-length (else config `max_model_len`) and TokenizerManager._validate_one_request
    refuses, with `>=` where vLLM has `>` (a prompt that fills the window exactly is refused):
    input >= window: "The input (N tokens) is longer than the model's context length (W
    tokens)."; input + max_new_tokens >= window: "Requested token count exceeds the model's
    maximum context length of W tokens. ..." (sglang test/srt/test_request_length_validation.py).
    Without max_tokens the scheduler gives the request the room left (max_req_len - input - 1)."""
    messages = payload.get("messages") or []
    for i, msg in enumerate(messages):
        if msg.get("role") not in ("system", "user", "assistant", "tool"):
            return error("Unexpected message role.")
        if msg.get("role") == "system" and i > 0:
            return error("System message must be at the beginning.")
    if not any(m.get("role") == "user" for m in messages):
        return error("No user query found in messages.")
    window = SGL.server_args.get("context_length") or base.STATE.config["max_model_len"]
    prompt = base.estimate_tokens(payload)
    max_new = payload.get("max_tokens") or payload.get("max_completion_tokens")  # serving_chat.py
    if prompt >= window:
        return error(f"The input ({prompt} tokens) is longer than the model's context length ({window} tokens).")
    if max_new is not None and max_new + prompt >= window:
        return error(
            f"Requested token count exceeds the model's maximum context length of {window} tokens. "
            f"You requested a total of {max_new + prompt} tokens: {prompt} tokens from the input messages "
            f"and {max_new} tokens for the completion. Please reduce the number of tokens in the input "
            f"messages or the completion to fit within the limit."
        )
    return None


base.strict_violation = lambda payload: None  # chat() below applies SGLang's rules instead


async def chat(request):
    payload = await request.json()  # aiohttp keeps the body: base.chat reads it again
    model = payload.get("model")
    if not isinstance(model, str):
        return error("model is required")
    # serving_base.py _parse_model_parameter: split at the first ':', strip, "" -> None; the base
    # part is never checked; _resolve_lora_path: the model's adapter wins over `lora_path`
    adapter = (model.split(":", 1)[1].strip() or None) if ":" in model else payload.get("lora_path")
    if adapter is not None and adapter not in loaded_adapters():
        # lora/lora_registry.py LoRARegistry.acquire: the message lists every loaded adapter
        message = (
            f"The following requested LoRA adapters are not loaded: {adapter}\n"
            f"Loaded adapters: dict_keys({loaded_adapters()!r})."
        )
        base.STATE.log.append(
            {
                "hop": request.headers.get("X-MoL-Hop"),
                "model": model,
                "messages": payload.get("messages"),
                "payload": payload,
                "t": time.time(),
                "rejected": message,
            }
        )
        return error(message)
    if base.STATE.config["strict"]:
        rejected = strict_violation(payload)
        if rejected is not None:
            base.STATE.log.append(
                {
                    "hop": request.headers.get("X-MoL-Hop"),
                    "model": model,
                    "messages": payload.get("messages"),
                    "payload": payload,
                    "t": time.time(),
                    "rejected": json.loads(rejected.text)["message"],
                }
            )
            return rejected
    if (
        request.headers.get("X-MoL-Hop") == "route"
        and not any(payload.get(k) for k in ("regex", "ebnf", "json_schema"))
        and (payload.get("response_format") or {}).get("type") != "json_schema"
    ):
        # no constraint: SGLang samples freely (there is no vLLM-style `choice`; a vLLM
        # `structured_outputs` field is not a ChatCompletionRequest field and constrains nothing)
        base.STATE.log.append(
            {
                "hop": "route",
                "model": model,
                "messages": payload.get("messages"),
                "payload": payload,
                "t": time.time(),
                "unconstrained": True,
            }
        )
        return web.json_response(
            base.completion(
                model,
                {"content": "Sure! This request is about code, so the best specialist is probably the coding one."},
                "stop",
                {"prompt_tokens": 10, "completion_tokens": 16, "total_tokens": 26},
            )
        )
    if base.STATE.config.get("abort_on_priority") and payload.get("priority") is not None:
        # --abort-on-priority-when-disabled without --enable-priority-scheduling: any priority, 0
        # included, is aborted with a 503 (scheduler.py _set_or_validate_priority), once the
        # request reached the scheduler (config `abort_delay`: seconds before the 503)
        await asyncio.sleep(base.STATE.config.get("abort_delay") or 0)
        base.STATE.log.append(
            {
                "hop": request.headers.get("X-MoL-Hop"),
                "model": model,
                "messages": payload.get("messages"),
                "payload": payload,
                "t": time.time(),
                "rejected": "priority",
            }
        )
        return error("Using priority is disabled for this server. Please send a new request without a priority.", 503)
    rid = payload.get("rid")
    if rid is not None and rid in SGL.rids:
        # TokenizerManager refuses a request whose rid is in flight (PR #19035; before it the
        # server crashed or hung: its state is keyed by rid); the message is paraphrased
        return error(f"Duplicate request ID detected: rid={rid!r} is already in flight.")
    SGL.inflight += 1
    if rid is not None:
        SGL.rids.add(rid)
    SGL.finished(10, 3, 4)  # the usage base.chat reports
    try:
        return await base.chat(request)
    finally:
        SGL.inflight -= 1
        SGL.rids.discard(rid)


def make_app() -> web.Application:
    app = web.Application(client_max_size=64 * 2**20)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/get_model_info", model_info)
    if os.environ.get("FAKE_NO_SERVER_INFO") != "1":  # a release from before /server_info
        app.router.add_get("/server_info", server_info)
    app.router.add_get("/get_server_info", get_server_info)
    app.router.add_post("/generate", generate)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/_log", base.get_log)
    app.router.add_post("/_config", base.set_config)
    app.router.add_post("/_reset", base.reset)
    return app


def kill_children() -> None:
    """kill_process_tree(os.getpid(), include_parent=False) (sglang/srt/utils)."""
    for child in SGL.children:
        if child.poll() is None:
            child.kill()
    for child in SGL.children:
        try:
            child.wait(5)
        except subprocess.TimeoutExpired:
            pass


def kill_tree_and_self() -> None:
    """kill_process_tree(os.getpid(), include_parent=True): the children, then itself (SIGKILL)."""
    kill_children()
    os.kill(os.getpid(), signal.SIGKILL)


def on_sigquit(signum, frame) -> None:
    if SGL.running_phase:  # managers/tokenizer_manager.py running_phase_sigquit_handler
        print(f"SIGQUIT received. signum={signum!r}, frame={frame!r}. It usually means one child failed.", flush=True)
    else:  # entrypoints/engine.py launch_phase_sigquit_handler
        print("Received sigquit from a child process. It usually means the child failed.", flush=True)
    kill_tree_and_self()


def subprocess_watchdog() -> None:
    """utils/watchdog.py SubprocessWatchdog: every 1 s; a child gone with a non-zero exit code ->
    SIGQUIT to the launcher itself."""
    while True:
        time.sleep(1.0)
        for child, name in zip(SGL.children, SGL.names, strict=True):
            code = child.poll()
            if code not in (None, 0):
                print(
                    f"Subprocess {name} (pid={child.pid}) crashed with exit code {code}. "
                    f"Triggering SIGQUIT for cleanup...",
                    flush=True,
                )
                os.kill(os.getpid(), signal.SIGQUIT)
                return


async def warmup(url: str) -> None:
    await asyncio.sleep(float(os.environ.get("FAKE_WARMUP_DELAY", "0.3")))
    async with ClientSession() as session:
        async with session.get(url + "/get_model_info") as r:
            assert r.status == 200
        if os.environ.get("FAKE_WARMUP_FAIL") == "1":
            print("Initialization failed. warmup error: AssertionError: <Response [500]> (simulated)", flush=True)
            kill_children()
            os.kill(os.getpid(), signal.SIGKILL)
        async with session.post(
            url + "/generate",
            json={"text": "The capital city of France is", "sampling_params": {"temperature": 0, "max_new_tokens": 8}},
        ) as r:
            assert r.status == 200
    SGL.status = "up"
    print("The server is fired up and ready to roll!", flush=True)


async def serve(host: str, port: int) -> None:
    runner = web.AppRunner(make_app(), handle_signals=False, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    print(f"Uvicorn running on http://{host}:{port} (Press CTRL+C to quit)", flush=True)
    print("Application startup complete.", flush=True)
    done = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_term():
        print(
            f"SIGTERM received. signum={signal.SIGTERM!r} frame=None. Draining requests and shutting down...",
            flush=True,
        )
        SGL.gracefully_exit = True

    async def sigterm_watchdog():  # managers/tokenizer_manager.py sigterm_watchdog
        poll = float(os.environ.get("FAKE_TERM_POLL", "5"))
        while not SGL.gracefully_exit:
            await asyncio.sleep(poll)
        while True:
            print(f"Gracefully exiting... Remaining number of requests {SGL.inflight}.", flush=True)
            if not SGL.inflight:
                break
            await asyncio.sleep(poll)
        done.set()

    if os.environ.get("FAKE_IGNORE_TERM") == "1":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        loop.add_signal_handler(signal.SIGTERM, on_term)
    SGL.running_phase = True
    tasks = [
        asyncio.ensure_future(sigterm_watchdog()),
        asyncio.ensure_future(warmup(f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}")),
    ]
    await done.wait()
    del tasks
    kill_tree_and_self()


def main() -> None:
    env = os.environ
    # launch_server.py: prepare_server_args(sys.argv[1:]) -> parser.parse_args (server_args.py):
    # an unknown flag ends the launch with argparse's "unrecognized arguments" (exit 2)
    sys.path.insert(0, str(Path(__file__).resolve().parent / "fake_sglang_pkg"))
    from sglang.srt.server_args import prepare_server_args

    parser = argparse.ArgumentParser(prog="launch_server.py")
    parser.add_argument("--config", default="{}", help="initial fake config JSON (tests only)")
    args = prepare_server_args(sys.argv[1:], parser)
    args.lora_paths = args.lora_paths or []
    args.tp = args.tensor_parallel_size
    for item in args.lora_paths:  # <PATH> | <NAME>=<PATH> | JSON (server_args.py LoRA parsing)
        if item.startswith("{"):
            obj = json.loads(item)
            SGL.lora_paths[obj["lora_name"]] = obj["lora_path"]
        elif "=" in item:
            name, path = item.split("=", 1)
            SGL.lora_paths[name] = path
        else:
            SGL.lora_paths[item] = item
    if args.max_loaded_loras is not None:  # server_args.py check_lora_server_args
        assert args.max_loaded_loras >= args.max_loras_per_batch, (
            "max_loaded_loras should be greater than or equal to max_loras_per_batch. "
            f"max_loaded_loras={args.max_loaded_loras}, max_loras_per_batch={args.max_loras_per_batch}"
        )
        assert len(SGL.lora_paths) <= args.max_loaded_loras, (
            "The number of LoRA paths should not exceed max_loaded_loras. "
            f"max_loaded_loras={args.max_loaded_loras}, lora_paths={len(SGL.lora_paths)}"
        )
    SGL.served = args.served_model_name or args.model_path  # server_args.py: defaults to model_path
    SGL.cache_report = args.enable_cache_report
    SGL.metrics = args.enable_metrics
    SGL.version = env.get("FAKE_SGLANG_VERSION", VERSION)
    SGL.server_args = {
        "model_path": args.model_path,
        "served_model_name": SGL.served,
        "host": args.host,
        "port": args.port,
        "tp_size": args.tp,
        "context_length": args.context_length,
        "enable_lora": bool(SGL.lora_paths),
        "lora_paths": SGL.lora_paths,
        "max_loras_per_batch": args.max_loras_per_batch,
        "max_lora_rank": args.max_lora_rank,
        "enable_cache_report": args.enable_cache_report,
    }
    for target in (base.STATE.base, base.STATE.config):
        target.update(json.loads(args.config))
        target["served_name"] = SGL.served
        # SGLang ignores a request's priority unless --enable-priority-scheduling (its
        # abort_on_priority_when_disabled is off by default): no vLLM-style 400 here
        target["scheduling_policy"] = None
        if SGL.lora_paths:
            target["adapters"] = list(SGL.lora_paths)
    if env.get("FAKE_ADAPTERS") is not None:
        base.STATE.config["adapters"] = base.STATE.base["adapters"] = [a for a in env["FAKE_ADAPTERS"].split(",") if a]
    if env.get("FAKE_PARENT"):
        base.STATE.config["parent"] = base.STATE.base["parent"] = env["FAKE_PARENT"]
    if env.get("FAKE_ANSWER_DELAY"):
        base.STATE.config["answer_delay"] = base.STATE.base["answer_delay"] = float(env["FAKE_ANSWER_DELAY"])
    base.apply_canary_env(base.STATE.config, base.STATE.base)

    print(
        f"fake sglang pid {os.getpid()} server_args=ServerArgs(model_path={args.model_path!r}, "
        f"served_model_name={SGL.served!r}, port={args.port}, tp_size={args.tp}, lora_paths={SGL.lora_paths!r})",
        flush=True,
    )
    if env.get("FAKE_IGNORE_TERM") == "1":  # a wedged launcher: SIGTERM and the watchdog's SIGQUIT do nothing
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # else: no SIGTERM handler while loading (the tokenizer manager installs one with its event loop):
    # the launcher dies of it; its children go by PDEATHSIG, or by the SIGTERM molctl sends them too
    signal.signal(signal.SIGQUIT, signal.SIG_IGN if env.get("FAKE_IGNORE_TERM") == "1" else on_sigquit)
    if env.get("FAKE_NO_CHILDREN") != "1":
        arm = "0" if env.get("FAKE_ORPHAN") == "1" else "1"
        titles = [f"sglang::scheduler{f'_TP{r}' if args.tp > 1 else ''}" for r in range(args.tp)] + [
            "sglang::detokenizer"
        ]
        for rank, title in enumerate(titles):
            fail = env.get("FAKE_STARTUP_DELAY", "0") if env.get("FAKE_SCHEDULER_FAIL") == "1" and rank == 0 else "-"
            SGL.children.append(subprocess.Popen([sys.executable, "-c", CHILD, title, arm, fail]))
            SGL.names.append(f"scheduler_{rank}" if title.startswith("sglang::scheduler") else "detokenizer")
    print("Load weight begin. avail mem=139.50 GB", flush=True)
    for i in range(2):
        print(f"Loading safetensors checkpoint shards: {50 * (i + 1)}% Completed | {i + 1}/2", flush=True)
    time.sleep(float(env.get("FAKE_STARTUP_DELAY", "0")))
    if env.get("FAKE_EXIT"):
        print("Scheduler hit an exception: RuntimeError: CUDA out of memory (simulated)", flush=True)
        kill_children()
        sys.exit(int(env["FAKE_EXIT"]))
    if env.get("FAKE_SCHEDULER_FAIL") == "1":
        time.sleep(5)  # the scheduler's SIGQUIT arrives meanwhile (the launcher waits on its pipe)
    print("Load weight end. type=GlmMoeDsaForCausalLM, dtype=torch.bfloat16, avail mem=60.10 GB", flush=True)
    print("KV Cache is allocated. #tokens: 1000000, K size: 10.00 GB, V size: 10.00 GB", flush=True)
    # entrypoints/engine.py: the SubprocessWatchdog starts once the schedulers reported ready
    threading.Thread(target=subprocess_watchdog, daemon=True, name="subprocess-watchdog").start()
    asyncio.run(serve(args.host, args.port))


if __name__ == "__main__":
    main()
