"""vLLM: OpenAI API server, adapters selected with `model=<adapter name>`, guided choice via
`structured_outputs`.

`ENGINE` is this module's `molctl.engines.base.Engine`: flags and facts as attributes, the
installed flags and version (`probe_install`: the API server's own `--help`), the base class's
readiness hooks, the template probe, summary continuation and the efficacy canary's request.
What vLLM does that these rely on, and why `version_path` stays None: docs/engines/vllm.md."""

from __future__ import annotations

from typing import Any

from molctl.engines.base import AnswerTokens, Engine, EngineInstall, Sample, _ints, run_probe_script, with_trace_probe
from molctl.profilespec import Profile

API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"

# Runs under engine.python. Version from the package itself; flags from the API server's own
# argument parser (its --help), which is what the launch command will parse.
PROBE_SCRIPT = r"""
import contextlib, importlib.util, io, json, re, runpy, sys, warnings
out = {"found": importlib.util.find_spec("vllm") is not None}
if out["found"]:
    try:
        warnings.simplefilter("ignore")
        import vllm
        out["version"] = str(getattr(vllm, "__version__", "") or "")
        buf = io.StringIO()
        sys.argv = ["api_server", "--help"]
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
            try:
                runpy.run_module("API_SERVER_MODULE", run_name="__main__")
            except SystemExit:
                pass
        out["flags"] = sorted(set(re.findall(r"(?<![\w-])--([a-z0-9][a-z0-9-]*)", buf.getvalue())))
        if not out["flags"]:
            out["error"] = "the API server's --help listed no flags"
    except Exception as exc:
        out["error"] = "%s: %s" % (type(exc).__name__, exc)
print(json.dumps(out))
""".replace("API_SERVER_MODULE", API_SERVER_MODULE)


# The environment that pins vLLM's platform to the CPU (see VllmEngine.probe_install).
CPU_PIN = {"VLLM_TARGET_DEVICE": "cpu"}


class VllmEngine(Engine):
    kind = "vllm"
    llmd_model_server = "vllm"
    package = "vllm"
    launch_module = API_SERVER_MODULE
    model_flag = "--model"
    lora_flag = "--lora-modules"
    # ObservabilityConfig.otlp_traces_endpoint (vllm/engine/arg_utils.py): a collector URL; the
    # protocol is OTEL_EXPORTER_OTLP_TRACES_PROTOCOL's (grpc by default); vLLM continues the
    # traceparent of each request (vllm/tracing/otel.py extract_trace_context)
    trace_flags = ("--otlp-traces-endpoint",)
    # vllm/tracing/otel.py imports the SDK and both OTLP trace exporters (grpc, http) and, with
    # --otlp-traces-endpoint set, refuses to start without them (is_otel_available; 0.24 and 0.32)
    trace_install = "pip install opentelemetry-sdk opentelemetry-exporter-otlp"
    memory_flag = "gpu-memory-utilization"
    running_flag = "max-num-seqs"
    max_loras_flag = ("max-loras", 1)
    # vLLM 0.32 cuts a max_tokens over the room left (`shortens_max_tokens`); 0.24 refuses
    # prompt + max_tokens > max-model-len; both take prompt + max_tokens == max-model-len.
    window_flag = ("max-model-len", 0)
    # the v0 engine: "Got priority N but Priority scheduling is not enabled."; the 0.8-0.9.1 V1
    # processor: "V1 does not support priority yet." (400s)
    priority_refusals = ("priority scheduling is not enabled", "does not support priority")
    bench_metrics = {
        "prefix_cache_hits": "vllm:prefix_cache_hits_total",
        "prefix_cache_queries": "vllm:prefix_cache_queries_total",
        "preemptions": "vllm:num_preemptions_total",
        "queue_time_s_sum": "vllm:request_queue_time_seconds_sum",
        "requests_finished": "vllm:request_success_total",
        "generation_tokens": "vllm:generation_tokens_total",
    }
    no_template_fallback = (
        "vLLM has no default (transformers >= 4.44), so /v1/chat/completions fails: 'default chat "
        "template is no longer allowed'; give the model a template or set engine.args.chat-template"
    )
    priority_flag = "--scheduling-policy priority"
    # vLLM names the engine request after the X-Request-Id header, but logs the JSON body
    # (request_logger.log_request_body) under the body's `request_id` (a random uuid unless set,
    # vllm/entrypoints/openai/chat_completion/protocol.py): the proxy sets both to the hop's id.
    request_id_field = "request_id"

    load_strategy_flag = "safetensors-load-strategy"  # vllm/config/load.py, in the 0.24 and 0.32 parsers

    cache_root_env = "VLLM_CACHE_ROOT"

    def cache_env(self, cache_dir) -> dict[str, str]:
        # vllm/envs.py VLLM_CACHE_ROOT (default ~/.cache/vllm): the torch.compile cache below it
        return {"VLLM_CACHE_ROOT": str(cache_dir)}

    # vllm 0.32 and 0.24 (CPU and GPU builds): api_utils.py "non-default args", core.py
    # "Initializing a V1 LLM engine"; the model runner's "Starting to load model"; tqdm's
    # "Loading safetensors checkpoint shards: 50% Completed | 1/2"; default_loader.py "Loading
    # weights took"; compilation/backends.py "Dynamo bytecode transform time", "Compiling a graph
    # for compile range", "Directly load the compiled graph(s)"; core.py "init engine (profile,
    # create kv cache, ...)", kv_cache_utils.py "GPU/CPU KV cache size", gpu_worker.py "Available
    # KV cache memory"; gpu_model_runner.py "Capturing CUDA graphs", "Graph capturing finished";
    # entry.py/api_server.py "Starting vLLM (API) server", launcher.py "Available routes are",
    # uvicorn's "Application startup complete" (checked against the CPU log in BENCHMARKS.md)
    phases = (
        (r"non-default args|Initializing a V1 LLM engine|vLLM API server version", "config", ""),
        (r"Starting to load model|Loading model from", "weights", ""),
        (
            r"Loading safetensors checkpoint shards:\s*(\d+)% Completed \| (\d+)/(\d+)",
            "weights",
            "{0}% ({1}/{2} shards)",
        ),
        (r"Loading weights took|Model loading took", "weights", "100%"),
        (
            r"Dynamo bytecode transform|Compiling a graph for|Directly load the compiled graph|torch.compile takes",
            "compile",
            "",
        ),
        (r"init engine \(profile, create kv cache|(?:GPU|CPU) KV cache size|Available KV cache memory", "kv_cache", ""),
        (r"Capturing CUDA graphs|Graph capturing finished", "cuda_graphs", ""),
        (r"Starting vLLM (?:API )?server|Started server process|Available routes are", "api_server", ""),
        (r"Application startup complete", "api_server", "serving"),
    )

    # vLLM 0.32's ChatCompletionRequest beyond OpenAI's fields
    # (vllm/entrypoints/openai/chat_completion/protocol.py, "Ordered by official OpenAI API
    # documentation" then the extra sampling and generation parameters). Its guided_* fields are
    # removed there: vLLM ignores them with a warning and leaves the output unconstrained
    # (_REMOVED_GUIDED_FIELDS in vllm/entrypoints/serve/engine/protocol.py), so they are refused.
    request_extensions = {
        "top_k": "int",
        "min_p": "number",
        "repetition_penalty": "number",
        "length_penalty": "number",
        "ignore_eos": "bool",
        "min_tokens": "int",
        "stop_token_ids": "ints",
        "include_stop_str_in_output": "bool",
        "skip_special_tokens": "bool",
        "spaces_between_special_tokens": "bool",
        "bad_words": "strs",
        "allowed_token_ids": "ints",
        "prompt_logprobs": "int",
        "structured_outputs": "object",
        "include_reasoning": "bool",
        "cache_salt": "str",
    }
    refused_extensions = {
        **{
            f"guided_{k}": "vLLM no longer reads guided_* fields (the output would not be constrained); use "
            "response_format or structured_outputs"
            for k in ("json", "regex", "choice", "grammar", "whitespace_pattern", "decoding_backend")
        },
        "use_beam_search": "beam search returns several candidates, and the proxy keeps one conversation",
        "truncate_prompt_tokens": "the proxy builds the prompt; truncating it would cut the conversation it folded",
        "kv_transfer_params": "disaggregated-prefill transfer parameters are the operator's, not a client's",
        "vllm_xargs": "custom logits-processor arguments are the operator's, not a client's",
    }

    def probe_install(self, python: str) -> EngineInstall:
        """The API server's flags from its --help. vLLM builds that parser only after picking a
        platform: `DeviceConfig.__post_init__` (vllm/config/device.py) raises "Failed to infer
        device type" when `vllm.platforms` resolved none, which is what a CUDA build sees on a host
        without a GPU (NVML finds no driver or device, the version has no `+cpu`). Then the probe
        runs again with the device pinned to the CPU, `VLLM_TARGET_DEVICE=cpu`, which selects the
        CPU platform (vllm/platforms/__init__.py: `cpu_platform_plugin`, and "an explicit CPU
        target is authoritative" in `resolve_current_platform_cls_qualname`): the version and the
        flags need no device, and the result says how they were read."""
        install = run_probe_script(python, with_trace_probe(PROBE_SCRIPT, self.trace_modules))
        if not install.flags and install.error and "Failed to infer device type" in install.error:
            pinned = run_probe_script(python, with_trace_probe(PROBE_SCRIPT, self.trace_modules), env=CPU_PIN)
            if pinned.flags:
                pinned.note = (
                    "read with the device pinned to the CPU (VLLM_TARGET_DEVICE=cpu): vLLM found no GPU on this host"
                )
                return pinned
        return install

    def adapter_model(self, profile: Profile, route: str) -> str:
        return route

    def hop_priorities(self, profile: Profile) -> dict[str, int]:
        # `--scheduling-policy priority`: the waiting queue ordered by (priority, arrival), lower
        # first, and KV-pressure preemption takes the highest (vllm/v1/core/sched/scheduler.py,
        # request_queue.py); a running request is never preempted for a waiting one. A request's
        # priority defaults to 0 (ChatCompletionRequest.priority), so answers and summaries need
        # none. Without the flag no priority is sent: vLLM 0.32 ignores one, but older versions
        # refuse it with a 400 ("Got priority N but Priority scheduling is not enabled." from the
        # v0 engine, "V1 does not support priority yet." from the 0.8-0.9.1 V1 processor).
        return {"route": -1} if profile.engine.args.get("scheduling-policy") == "priority" else {}

    def guided_choice(self, labels: list[str]) -> dict:
        return {"structured_outputs": {"choice": labels}}

    # The summary hop as a continuation of the answer's tokens (issue 30). vLLM 0.32:
    # - `return_token_ids: true` on a chat request (ChatCompletionRequest.return_token_ids,
    #   vllm/entrypoints/openai/chat_completion/protocol.py) puts the rendered prompt's ids in
    #   the response's `prompt_token_ids` and the generated ids in each choice's `token_ids`
    #   (serving.py chat_completion_full_generator). Streamed: `prompt_token_ids` on the first
    #   (role) chunk only, each chunk's choice the `token_ids` of its delta, chunks whose delta the
    #   parsers swallowed included (chat_completion_stream_generator: "If return_token_ids ...
    #   we still need to send a chunk"). Both are withheld when the request sets
    #   `include_reasoning: false` with a reasoning parser (`hide_stream_metadata`,
    #   `suppress_metadata`): then nothing is reported and the proxy falls back.
    # - The ids include the token generation stopped on: the scheduler appends the sampled token,
    #   then `check_stop` (vllm/v1/core/sched/utils.py) ends the request on the EOS
    #   (`stop_reason` None) or a `stop_token_ids` entry (`stop_reason` that id); a stop string
    #   (`stop_reason` the string) truncates the text, not the ids.
    # - `/tokenize` renders chat messages with the served template and tokenizer
    #   (TokenizeChatRequest: messages, add_generation_prompt, continue_final_message,
    #   chat_template_kwargs; vllm/entrypoints/serve/tokenize/protocol.py) and answers `tokens`.
    # - `/v1/completions` takes a prompt of token ids (CompletionRequest.prompt: list[int]) and
    #   an adapter as `model`, like chat; prefix-cache blocks are keyed by the tokens and the
    #   LoRA (vllm/v1/core/kv_cache_utils.py, extra keys), so the answer's blocks are hit.
    def answer_token_fields(self, stream: bool) -> dict[str, Any]:
        return {"return_token_ids": True}

    def answer_tokens(self, body: dict[str, Any]) -> AnswerTokens:
        choice = (body.get("choices") or [{}])[0]
        if not isinstance(choice, dict):
            return AnswerTokens()
        return AnswerTokens(_ints(body.get("prompt_token_ids")), _ints(choice.get("token_ids")), self._stopped(choice))

    def stream_tokens(self, event: dict[str, Any], into: AnswerTokens) -> None:
        prompt = _ints(event.get("prompt_token_ids"))
        if prompt is not None:
            into.prompt = prompt
        for choice in event.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            ids = _ints(choice.get("token_ids"))
            if ids is not None:  # in place: a new list per event was quadratic in the answer's length
                if into.output is None:
                    into.output = list(ids)
                else:
                    into.output.extend(ids)
            if choice.get("finish_reason"):
                into.stop_token = self._stopped(choice)

    @staticmethod
    def _stopped(choice: dict[str, Any]) -> bool:
        reason = choice.get("stop_reason")
        return choice.get("finish_reason") == "stop" and (reason is None or isinstance(reason, int))

    probe_path = "/tokenize"

    def probe_request(
        self, model: str, messages: list[dict[str, Any]], generation_prompt: bool, kwargs: dict[str, Any] | None
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model,
            "messages": messages,
            "add_generation_prompt": generation_prompt,
            "continue_final_message": not generation_prompt,
        }
        if kwargs:
            body["chat_template_kwargs"] = kwargs
        return body

    def probe_ids(self, body: Any) -> list[int] | None:
        return _ints(body.get("tokens")) if isinstance(body, dict) else None

    # A chat hop's prompt measured by `/tokenize` (TokenizeChatRequest: messages, tools,
    # chat_template_kwargs, add_generation_prompt; the same fields in 0.24 and 0.32,
    # vllm/entrypoints/serve/tokenize/protocol.py), rendered with the chat request's template and
    # tokenizer. The chat request passes `reasoning_effort` (and `enable_thinking` from it unless
    # set) to the template as kwargs (ChatCompletionRequest.build_chat_params, both versions): the
    # measurement does too. Tools are always rendered (a `tool_choice: none` request may render
    # none): the count is then an upper bound, never less.
    def length_request(self, payload: dict[str, Any]) -> dict[str, Any] | None:
        kwargs = dict(payload.get("chat_template_kwargs") or {})
        effort = payload.get("reasoning_effort")
        if effort is not None:
            kwargs.setdefault("reasoning_effort", effort)
            kwargs.setdefault("enable_thinking", effort != "none")
        body: dict[str, Any] = {
            "model": payload["model"],
            "messages": payload["messages"],
            "add_generation_prompt": True,
        }
        if payload.get("tools"):
            body["tools"] = payload["tools"]
        if kwargs:
            body["chat_template_kwargs"] = kwargs
        return body

    def length_of(self, body: Any) -> int | None:
        count = body.get("count") if isinstance(body, dict) else None
        return count if isinstance(count, int) and not isinstance(count, bool) else None

    # Output limits over the window: vLLM 0.24.0 refuses prompt + max_tokens > max-model-len with a
    # 400 (TokenizeParams.max_input_tokens is max-model-len less the request's max_tokens,
    # vllm/renderers/params.py, _token_len_check); 0.32.0 holds no output room back there and cuts
    # max_tokens to the room left (vllm/entrypoints/serve/utils/api_utils.py, get_max_tokens). The
    # versions between were not read: treated as refusing, the side that needs the proxy's fit.
    SHORTENS_FROM = "0.32.0"
    overflow_note = (
        " (this version refuses prompt + max_tokens over max-model-len and json.loads history tool-call "
        "arguments: the proxy cuts max_tokens to the room left and sends unparseable arguments as {})"
    )

    def shortens_max_tokens(self, version: str | None) -> bool:
        from packaging.version import InvalidVersion, Version

        try:
            return version is not None and Version(Version(version).public) >= Version(self.SHORTENS_FROM)
        except InvalidVersion:
            return False

    continuation_path = "/v1/completions"

    def continuation_request(self, model: str, route: str, ids: list[int], max_tokens: int) -> dict[str, Any]:
        return {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": False}

    def continuation_result(self, body: Any) -> tuple[str, dict[str, Any] | None]:
        choice = (body.get("choices") or [{}])[0] if isinstance(body, dict) else {}
        text = choice.get("text") if isinstance(choice, dict) else None
        if not isinstance(text, str):
            raise ValueError("the completion has no text")
        usage = body.get("usage")
        return text, usage if isinstance(usage, dict) else None

    # The efficacy canary: /v1/completions (no chat template between the prompt and the model),
    # `logprobs: N` for the top N per token, the tokens as "token_id:ID" so that two tokens
    # spelled alike never compare equal (vllm/entrypoints/openai/completion/protocol.py
    # CompletionRequest.return_tokens_as_token_ids, CompletionLogProbs). N must stay within the
    # engine's --max-logprobs (default 20).
    canary_path = "/v1/completions"

    def canary_request(
        self, profile: Profile, route: str | None, prompt: str, max_tokens: int, top: int, seed: int
    ) -> dict:
        model = profile.engine.served_name if route is None else self.adapter_model(profile, route)
        return {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "seed": seed,
            "logprobs": top,
            "return_tokens_as_token_ids": True,
        }

    def canary_sample(self, body):
        lp = body["choices"][0]["logprobs"]
        tops = [{str(k): float(v) for k, v in (t or {}).items()} for t in lp["top_logprobs"]]
        return Sample(tokens=list(lp["tokens"]), logprobs=[float(x) for x in lp["token_logprobs"]], top=tops)


ENGINE = VllmEngine()
