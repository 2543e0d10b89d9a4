"""SGLang (pinned 0.5.13.post1): `sglang.launch_server`, adapters selected with `model=<base>:<adapter>`.

What SGLang does, and what molctl does about it. Read from SGLang's own source with the `search`
tool (paths are in sgl-project/sglang; "PR"/"issue" are its GitHub threads). A real SGLang
cannot run on molctl's CI host (no CUDA: its import fails on the CPU), so these facts are what
`tests/fake_sglang.py` scripts, each behaviour citing the same place.

Start-up and readiness (python/sglang/srt/entrypoints/http_server.py, engine.py):
- `launch_server` first runs `_launch_subprocesses`: the scheduler process(es) (one per TP rank,
  managers/scheduler.py `run_scheduler_process`) and the detokenizer process
  (managers/detokenizer_manager.py) load the model while the launcher waits for their "ready"
  pipe message. Nothing listens on the port during the whole load: a connect is refused.
- Then uvicorn serves, with `tokenizer_manager.server_status = ServerStatus.Starting`. `/health`
  and `/health_generate` are ONE handler (`health_generate`): it answers 503 while the status is
  Starting, and 503 once SIGTERM set `gracefully_exit`; otherwise it sends a 1-token generate
  (input_ids [0]) and answers 200 if the scheduler/detokenizer answered within
  HEALTH_CHECK_TIMEOUT (20 s; else 503 and status UnHealthy). It checks only after
  `asyncio.sleep(1)`: a healthy /health takes at least 1 s (`health_timeout_s`), and every probe
  is a generate request. With SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0 (default true) /health
  answers 200 at once (still 503 while starting or shutting down) and only /health_generate
  generates; venti-sglang sets it, as molctl status, the proxy's /readyz and `up` poll /health.
  `/get_model_info`, `/get_server_info` and `/v1/models` answer 200 as soon as uvicorn listens,
  i.e. before the warm-up.
- The warm-up thread (`_wait_and_warmup` -> `_execute_server_warmup`) polls `/get_model_info`,
  then POSTs a real `/generate` ("The capital city of France is", max_new_tokens 8); only when
  that answers 200 does it set ServerStatus.Up and log "The server is fired up and ready to
  roll!". A failed warm-up logs "Initialization failed. warmup error" and kills the process
  tree. So on SGLang `/health` 200 already means "warmed up and serving"; molctl still checks
  the adapters, the version and a 1-token completion per adapter (an adapter can load and do
  nothing), like on vLLM. A 503 while starting is shown as "warming up" (`health_detail`).
- Log phases for the progress line (`phases` below): "server_args=ServerArgs(...)" printed at
  start, "Load weight begin", "Loading safetensors checkpoint shards: ... n/N", "Load weight
  end", "KV Cache is allocated" / "Memory pool end", "Capture cuda graph" / "Capturing batches",
  "Uvicorn running on" / "Application startup complete" (warm-up under way), then "The server is
  fired up and ready to roll!".

Adapters:
- `--lora-paths` takes `<PATH>`, `<NAME>=<PATH>` or a JSON object
  `{"lora_name":str,"lora_path":str,"pinned":bool}` per adapter (docs/advanced_features/lora.md,
  server_args.py); it implies `--enable-lora`. molctl passes `L0=DIR ... L3=DIR`.
  `--max-loras-per-batch` (default 8) is the GPU adapter-pool size, `--max-loaded-loras` the CPU
  cap (>= max-loras-per-batch), `--max-lora-rank` the largest rank (inferred from the adapters
  when unset; molctl's model check reads it via `max_lora_rank`).
- `/v1/models` lists, since PR #12229 (Oct 2025, before 0.5.13), the base card (`parent` null)
  and one card per loaded adapter: `id` = lora_name (bare: "L2"), `root` = its path, `parent` =
  the served model name (http_server.py `available_models`, `lora_registry.get_all_adapters()`).
  So `adapter_problems` reads the same `{id: parent}` shape as on vLLM (`listed_adapters`).
- A request selects an adapter with `model="<served-name>:<adapter>"` (PR #11570, Oct 2025:
  entrypoints/openai/serving_base.py `_parse_model_parameter` / `_resolve_lora_path`), or with
  the older `lora_path` body field; the `model:adapter` form wins when both are given. The
  split is at the FIRST ':' and the base part is never checked, so a served name with a ':'
  (sglang issue #12745: `gpt-oss:120b`) selects an adapter "120b": engine.served_name must not
  contain ':'. An adapter that is not loaded is a 400 `{"object": "error", "type":
  "BadRequestError", "message": "The following requested LoRA adapters are not loaded: L2\n
  Loaded adapters: dict_keys([...])."}` (lora/lora_registry.py `acquire`, serving_base.py
  `create_error_response`; streaming too: serving_chat.py kick-starts the generator before the
  200), a message naming every loaded adapter: the proxy must never pass it on.
  molctl uses the `model` form everywhere (`adapter_model`),
  also for the 1-token readiness smoke (`smoke_request`: `{"model": "<base>:L<n>", "max_tokens":
  1, ...}` to /v1/chat/completions, the OpenAI endpoint the proxy uses, not the native
  /generate).

Version: `/get_server_info` returns the server args, the scheduler info and
`"version": __version__` (http_server.py `get_server_info`); molctl reads it after the adapters
and stops the engine (exit 3) when it does not match `engine.version` (`version_path`).

Shutdown (managers/tokenizer_manager.py `SignalHandler`, utils `kill_itself_when_parent_died`,
launch_server.py):
- SIGTERM on the launcher: "SIGTERM received. ... Draining requests and shutting down..." sets
  `gracefully_exit` (/health turns 503); `sigterm_watchdog` notices within 5 s (it polls every
  5 s), logs "Gracefully exiting... Remaining number of requests N" every 5 s while requests
  are in flight (no upper bound: molctl's stop timeout is the bound), then
  `kill_process_tree(os.getpid(), include_parent=True)`: the children, then the launcher kills
  itself with SIGKILL (its exit status is -9 even on a clean stop). While loading there is no
  handler yet: SIGTERM ends the launcher at once.
- Child failure: a scheduler that raises logs "Scheduler hit an exception: ..." and SIGQUITs the
  launcher: "Received sigquit from a child process. It usually means the child failed.", tree
  killed, launcher SIGKILLed (entrypoints/engine.py launch_phase_sigquit_handler), so a crash
  while loading reads "exited with code -9" and the reason is in the log. Once the schedulers are
  ready, `SubprocessWatchdog` (utils/watchdog.py, PR #18582, in 0.5.13) polls the children every
  1 s; any non-zero exit (a scheduler SIGKILLed by the OOM killer, or SIGTERMed by `molctl down`,
  which signals every member) SIGQUITs the launcher, which kills the tree: a dead scheduler
  never leaves a launcher that looks alive, and `down` finishes within about a second.
- The scheduler and detokenizer rename themselves (`setproctitle("sglang::scheduler...")`,
  "sglang::detokenizer"), which wipes the environment marker in /proc/PID/environ: molctl finds
  them by the second marker, the run-dir cwd (molctl/procid.py), as for vLLM's EngineCore.
- They arm PR_SET_PDEATHSIG=SIGKILL (`kill_itself_when_parent_died`), so a SIGKILLed launcher
  usually takes them along; but some versions disable it ("does not work for `--dp 2`"), and it
  fires per parent thread, so an orphaned scheduler holding the GPUs is possible: `up`/`down`
  stop leftover marked processes whether or not their leader lives.

Metrics, usage, parsers, structured output:
- `--enable-metrics` serves Prometheus `/metrics`; `--enable-cache-report` adds
  `usage.prompt_tokens_details.cached_tokens` (entrypoints/openai/usage_processor.py,
  serving_chat.py `enable_cache_report=...`), in the final stream chunk too when
  `stream_options.include_usage`; without it SGLang reports no cached tokens.
- GLM-5 parsers: `--reasoning-parser glm45` (reasoning in `reasoning_content`), `--tool-call-parser
  glm45` / `glm47` (function_call/ detectors), as venti-sglang passes.
- Structured output on the OpenAI endpoint: the request fields `regex`, `ebnf` or `json_schema`
  (response_format) of ChatCompletionRequest (entrypoints/openai/protocol.py), one at a time
  ("Only one constraint parameter (`json_schema`, `regex`, or `ebnf`) can be specified",
  docs structured_outputs); there is no vLLM-style `choice`. The route hop sends
  `regex: "(L0|L1|L2|L3)"` (`guided_choice`) with thinking off
  (`chat_template_kwargs.enable_thinking: false`). With `--reasoning-parser`, SGLang wraps the
  grammar in `ReasonerGrammarObject` (constrained/reasoner_grammar_backend.py), which lifts it
  until the think-end token only when the request reasons: `maybe_init_reasoning(reasoning)`
  starts it constrained (tokens_after_think_end = 0) when `require_reasoning` is false, and
  serving_chat.py `_get_reasoning_from_request` makes glm45 reason by default unless
  `enable_thinking` is false. So the route hop is constrained from its first token (not run on
  a real GLM-5 here). The proxy still reads the label leniently (content or reasoning_content)
  and falls back to `default_route`.

Flags (`probe_install`): the launch parses with `prepare_server_args(sys.argv[1:])`
(server_args.py: `ServerArgs.add_cli_args(parser)`, `parser.parse_args`): an unknown flag ends it
(exit 2), an alias is as good as the name ("--tensor-parallel-size", "--tp-size" in one
add_argument call; "--model-path", "--model"), and argparse's abbreviations are taken: the
documented `--tp 2`, which venti-sglang passes, is a prefix of --tp-size alone (no `--tp` is
declared). The probe builds that parser where SGLang imports (the GPU host) and lists every
option string plus every prefix that names one long option alone; where it does not import (no
CUDA: its utils import torch/torchvision at import time) it reads the source: the option strings
of each add_argument call, and the dataclass fields of PR #28814/#28919 (June 2026, after 0.5.13:
`tp_size: A[int, Arg(aliases=[...])]` -> --tp-size, in server_args.py and srt/arg_groups/)."""

from __future__ import annotations

from typing import Any

from molctl.engines.base import AnswerTokens, Engine, EngineInstall, _ints, run_probe_script
from molctl.profiles import Profile

PROBE_SCRIPT = r"""
import argparse, importlib.metadata, importlib.util, json, os, re
spec = importlib.util.find_spec("sglang")
out = {"found": spec is not None}


def source_groups(root):
    # The option strings of each add_argument call (every one: "--model-path", "--model"), and
    # the fields add_cli_args_from_dataclass turns into flags since PR #28814/#28919 (June 2026:
    # `tp_size: A[int, Arg(..., aliases=["--tensor-parallel-size"])]` -> --tp-size and its
    # aliases; `no_cli=True` fields have none), in server_args.py and srt/arg_groups/.
    files = [os.path.join(root, "srt", "server_args.py")]
    for base, _, names in os.walk(os.path.join(root, "srt", "arg_groups")):
        files += sorted(os.path.join(base, n) for n in names if n.endswith(".py"))
    opt = r"[\"'](--[A-Za-z0-9][A-Za-z0-9_-]*)[\"']"
    groups = [["-h", "--help"]]  # argparse's own
    for path in files:
        try:
            text = open(path, encoding="utf-8").read()
        except OSError:
            if path == files[0]:
                raise
            continue
        for call in re.findall(r"add_argument\(((?:\s*[\"'][^\"']*[\"']\s*,)+)", text):
            groups.append(re.findall(opt, call))
        for m in re.finditer(r"(?m)^ {4}(\w+): A\[", text):
            end = re.compile(r"(?m)^ {4}\S").search(text, m.end())
            body = text[m.end():end.start() if end else len(text)]
            if "no_cli=True" in body:
                continue
            aliases = re.search(r"aliases=\[([^\]]*)\]", body)
            groups.append(["--" + m.group(1).replace("_", "-")] + (re.findall(opt, aliases.group(1)) if aliases else []))
    return [g for g in groups if g]


if spec is not None:
    try:
        out["version"] = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        out["version"] = None
    root = list(spec.submodule_search_locations or [])[0]
    try:  # the parser launch_server parses with (server_args.py prepare_server_args): exact
        from sglang.srt.server_args import ServerArgs
        parser = argparse.ArgumentParser()
        ServerArgs.add_cli_args(parser)
        groups = [list(a.option_strings) for a in parser._actions if a.option_strings]
    except Exception:  # it does not import on a host without CUDA: read the source instead
        try:
            groups = source_groups(root)
        except OSError as exc:
            groups = []
            out["error"] = "cannot read %s: %s" % (exc.filename, exc.strerror)
    longs = sorted({o for g in groups for o in g if o.startswith("--")})
    flags = {o[2:] for o in longs}
    # argparse (allow_abbrev, the default) also takes a prefix of exactly one long option:
    # SGLang's documented `--tp 2` is `--tp-size`, which is declared under that name only
    for o in longs:
        for n in range(3, len(o)):
            if sum(1 for x in longs if x.startswith(o[:n])) == 1:  # so is every longer prefix
                flags.update(o[2:m] for m in range(n, len(o)))
                break
    out["flags"] = sorted(flags)
print(json.dumps(out))
"""


class SglangEngine(Engine):
    kind = "sglang"
    package = "sglang"
    launch_module = "sglang.launch_server"
    model_flag = "--model-path"
    lora_flag = "--lora-paths"
    memory_flag = "mem-fraction-static"
    running_flag = "max-running-requests"
    max_loras_flag = ("max-loras-per-batch", 8)
    # input + max_new_tokens >= context-length is refused (TokenizerManager._validate_one_request)
    window_flag = ("context-length", 1)
    # --abort-on-priority-when-disabled: a 503 "... using priority is disabled ..."
    priority_refusals = ("using priority is disabled",)
    bench_metrics = {
        "cached_tokens": "sglang:cached_tokens_total",
        "prompt_tokens": "sglang:prompt_tokens_total",
        "generation_tokens": "sglang:generation_tokens_total",
        "requests_finished": "sglang:num_requests_total",
        "queue_time_s_sum": "sglang:queue_time_seconds_sum",
    }
    no_template_fallback = (
        "SGLang falls back to a built-in conversation template guessed from the model path, if "
        "one matches, else its chat endpoint cannot format messages"
    )
    priority_flag = "--enable-priority-scheduling"
    # SGLang takes a request's id from the body's `rid` (ChatCompletionRequest.rid, passed on by
    # serving_chat.py; the X-Request-Id header is not read) and keys its tokenizer, scheduler and
    # detokenizer state by it: a second request in flight with the same rid is refused since PR
    # #19035 (Feb 2026) and crashed or hung the server before; so the hop id plus a random suffix
    request_id_field = "rid"
    request_id_unique = True
    version_path = "/get_server_info"
    health_timeout_s = 3.0

    # SGLang's ChatCompletionRequest, "Extra parameters for SRT backend only"
    # (python/sglang/srt/entrypoints/openai/protocol.py)
    request_extensions = {
        "top_k": "int",
        "min_p": "number",
        "repetition_penalty": "number",
        "min_tokens": "int",
        "stop_token_ids": "ints",
        "stop_regex": "str_or_strs",
        "no_stop_trim": "bool",
        "ignore_eos": "bool",
        "skip_special_tokens": "bool",
        "regex": "str",
        "ebnf": "str",
        "separate_reasoning": "bool",
        "stream_reasoning": "bool",
    }
    refused_extensions = {
        "lora_path": "the proxy chooses the adapter of every hop",
        "input_ids": "pre-computed prompt tokens bypass the conversation the proxy builds",
        "session_params": "engine sessions are not kept across the proxy's hops",
        "custom_logit_processor": "custom logit processors are the operator's, not a client's",
        "return_hidden_states": "hidden states are not part of the proxy's answer",
    }

    def served_name_problem(self, name: str) -> str | None:
        # serving_base.py _parse_model_parameter splits `model` at the first ':' (issue #12745)
        if ":" in name:
            return f"{name!r} contains ':', which SGLang reads as base:adapter (serving_base.py)"
        return None  # the default /health generates a token and answers after >= 1 s

    phases = (
        (r"server_args=|ServerArgs\(", "engine config"),
        (r"Load weight begin", "loading model"),
        (r"Loading safetensors checkpoint shards:.*?(\d+)/(\d+)", "shards loaded {0}/{1}"),
        (r"Load weight end", "weights loaded"),
        (r"KV Cache is allocated|Memory pool end", "KV cache"),
        (r"Capture cuda graph|Capturing batches", "graph capture"),
        (r"Uvicorn running|Application startup complete", "warming up"),
        (r"The server is fired up and ready to roll", "serving"),
    )

    def probe_install(self, python: str) -> EngineInstall:
        return run_probe_script(python, PROBE_SCRIPT)

    def adapter_model(self, profile: Profile, route: str) -> str:
        return f"{profile.engine.served_name}:{route}"

    def hop_priorities(self, profile: Profile) -> dict[str, int]:
        # `--enable-priority-scheduling`: a higher value runs first, unless
        # `--schedule-low-priority-values-first` (server_args.py). A request without a priority
        # then gets the LOWEST value (scheduler.py _set_or_validate_priority: -sys.maxsize - 1),
        # and a waiting request preempts running ones more than
        # --priority-scheduling-preemption-threshold (10) below it: so every hop names its
        # priority, answers and summaries 0, route hops 1 above them (ordered first in the queue,
        # never a reason to preempt an answer). Without the flag SGLang ignores the field, unless
        # --abort-on-priority-when-disabled (a 503): none is sent.
        args = profile.engine.args
        if args.get("enable-priority-scheduling") is not True:
            return {}
        urgent = -1 if args.get("schedule-low-priority-values-first") is True else 1
        return {"route": urgent, "answer": 0, "summary": 0}

    def guided_choice(self, labels: list[str]) -> dict:
        return {"regex": "(" + "|".join(labels) + ")"}

    # The summary hop as a continuation of the answer's tokens (issue 30). SGLang 0.5.13
    # (entrypoints/openai/protocol.py ChatCompletionRequest, serving_chat.py):
    # - `return_prompt_token_ids: true` puts the rendered prompt's ids in each choice's
    #   `prompt_token_ids`; `return_meta_info: true` the scheduler's meta_info in the choice's
    #   `meta_info` (finish_reason {"type": "stop", "matched": <token id or string>}, and the
    #   generated ids as `output_token_logprobs` [[logprob, id, text], ...] only when the request
    #   asked for logprobs; `output_ids` only where the server returns token ids). Both are
    #   refused with `stream: true` ("return_prompt_token_ids is not supported with
    #   streaming"), so a streamed answer asks for neither and its summary is the chat one.
    #   An answer without generated ids is the chat summary too (summary_chat_fallbacks_total):
    #   not run against a real SGLang here (no CUDA), so which releases report them is open.
    # - The native /generate takes `input_ids` and the adapter as `lora_path` (its --lora-paths
    #   name; managers/io_struct.py GenerateReqInput) and answers `text` and `meta_info` with
    #   `prompt_tokens` and `cached_tokens` (tokenizer_manager.py _compute_meta_info); the radix
    #   cache is keyed by the tokens and the adapter.
    # - The template probe: no /tokenize that renders chat messages in 0.5.13, so a 1-token chat
    #   request with `return_prompt_token_ids` (and `continue_final_message` for the open form).
    def answer_token_fields(self, stream: bool) -> dict[str, Any]:
        return {} if stream else {"return_prompt_token_ids": True, "return_meta_info": True}

    def answer_tokens(self, body: dict[str, Any]) -> AnswerTokens:
        choice = (body.get("choices") or [{}])[0]
        if not isinstance(choice, dict):
            return AnswerTokens()
        meta = choice.get("meta_info") if isinstance(choice.get("meta_info"), dict) else {}
        output = _ints(meta.get("output_ids")) or _ints(choice.get("output_ids")) or _ints(choice.get("token_ids"))
        if output is None and isinstance(meta.get("output_token_logprobs"), list):
            rows = meta["output_token_logprobs"]
            if all(isinstance(r, list) and len(r) >= 2 for r in rows):
                output = _ints([r[1] for r in rows])
        finish = meta.get("finish_reason") if isinstance(meta.get("finish_reason"), dict) else {}
        stopped = finish.get("type") == "stop" and isinstance(finish.get("matched"), int)
        return AnswerTokens(_ints(choice.get("prompt_token_ids")), output, stopped)

    probe_path = "/v1/chat/completions"

    def probe_request(
        self, model: str, messages: list[dict[str, Any]], generation_prompt: bool, kwargs: dict[str, Any] | None
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model,
            "messages": messages,
            "max_tokens": 1,
            "temperature": 0,
            "return_prompt_token_ids": True,
            "continue_final_message": not generation_prompt,
        }
        if kwargs:
            body["chat_template_kwargs"] = kwargs
        return body

    def probe_ids(self, body: Any) -> list[int] | None:
        choice = ((body.get("choices") or [{}])[0]) if isinstance(body, dict) else {}
        return _ints(choice.get("prompt_token_ids")) if isinstance(choice, dict) else None

    continuation_path = "/generate"

    def continuation_request(self, model: str, route: str, ids: list[int], max_tokens: int) -> dict[str, Any]:
        return {
            "input_ids": ids,
            "lora_path": route,
            "stream": False,
            "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0},
        }

    def continuation_result(self, body: Any) -> tuple[str, dict[str, Any] | None]:
        text = body.get("text") if isinstance(body, dict) else None
        if not isinstance(text, str):
            raise ValueError("the generate answer has no text")
        meta = body.get("meta_info") if isinstance(body.get("meta_info"), dict) else {}
        prompt, cached = meta.get("prompt_tokens"), meta.get("cached_tokens")
        if not isinstance(prompt, int):
            return text, None
        return text, {"prompt_tokens": prompt, "prompt_tokens_details": {"cached_tokens": cached}}

    # The efficacy canary: the native /generate (no chat template), `return_logprob` with
    # `top_logprobs_num`, the adapter as `lora_path` (its --lora-paths name; none: the base). The
    # answer's meta_info holds `output_token_logprobs` [[logprob, token_id, text], ...] and
    # `output_top_logprobs` (one such list per token) (managers/io_struct.py GenerateReqInput,
    # tokenizer_manager.py add_logprob_return_values). Greedy needs no seed: temperature 0 is argmax.
    canary_path = "/generate"

    def canary_request(
        self, profile: Profile, route: str | None, prompt: str, max_tokens: int, top: int, seed: int
    ) -> dict:
        body = {
            "text": prompt,
            "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0},
            "return_logprob": True,
            "top_logprobs_num": top,
        }
        if route is not None:
            body["lora_path"] = route
        return body

    def canary_sample(self, body):
        from molctl.canary import Sample

        meta = body["meta_info"]
        chosen = meta["output_token_logprobs"]
        tops = [{str(t[1]): float(t[0]) for t in (row or [])} for row in meta.get("output_top_logprobs") or []]
        return Sample(tokens=[int(t[1]) for t in chosen], logprobs=[float(t[0]) for t in chosen], top=tops)

    def health_detail(self, status: int) -> str:
        if status == 503:
            return "/health answers 503 (SGLang: warming up, shutting down, or its health check failed)"
        return super().health_detail(status)


ENGINE = SglangEngine()
