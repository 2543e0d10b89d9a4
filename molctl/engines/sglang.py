"""SGLang (pinned 0.5.13.post1): `sglang.launch_server`, adapters selected with `model=<base>:<adapter>`.

`ENGINE` is this module's `molctl.engines.base.Engine`: flags and facts as attributes (launch
module, LoRA and capacity flags, priority refusals, metric names, `version_path`), the installed
flags (`probe_install`: SGLang's own argument parser, or its source where it does not import),
adapter naming (`adapter_model`), the route hop's `regex` constraint (`guided_choice`), hop
priorities, the template probe and summary continuation, the efficacy canary's request, and what
a 503 from /health means (`health_detail`).

What SGLang does (start-up, /health, adapters, version, shutdown, metrics, structured output,
flag parsing), each fact with the SGLang source it was read from, and what molctl does about it:
docs/engines/sglang.md. tests/fake_sglang.py scripts the same facts.
"""

from __future__ import annotations

from typing import Any

from molctl.engines.base import AnswerTokens, Engine, EngineInstall, Sample, _ints, run_probe_script, with_trace_probe
from molctl.profilespec import Profile

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
    # server_args.py: --enable-trace, and --otlp-traces-endpoint HOST:PORT (gRPC by default; an
    # http://.../v1/traces URL with OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf)
    trace_flags = ("--enable-trace", "--otlp-traces-endpoint")
    # srt/tracing/trace.py imports the SDK and the OTLP exporters inside a try (ImportError: tracing
    # off), and --enable-trace then fails at start; they come with the `tracing` extra
    trace_install = "pip install 'sglang[tracing]'"
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
    # /server_info: the server args, scheduler info and `version`; /get_server_info answers the
    # same with a deprecation warning logged on every call (entrypoints/http_server.py). Older
    # releases have only /get_server_info: readiness asks it when /server_info answers 404.
    version_path = "/server_info"
    version_fallback_path = "/get_server_info"
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

    def cache_env(self, cache_dir) -> dict[str, str]:
        # https://docs.sglang.io/references/torch_compile_cache.html: TORCHINDUCTOR_CACHE_DIR keeps
        # torch.compile's artifacts; TRITON_CACHE_DIR its Triton kernels (default ~/.triton/cache)
        return {"TORCHINDUCTOR_CACHE_DIR": f"{cache_dir}/inductor", "TRITON_CACHE_DIR": f"{cache_dir}/triton"}

    # SGLang 0.5 (scheduler / model_runner.py): "server_args=", "Load weight begin", tqdm's
    # "Loading safetensors checkpoint shards", "Load weight end", "KV Cache is allocated" /
    # "Memory pool end", "Capture cuda graph begin" / "Capturing batches", torch.compile under
    # --enable-torch-compile ("Compiling"), uvicorn's "Uvicorn running", then its warm-up
    # request and "The server is fired up and ready to roll" (tests/fake_sglang.py logs these)
    phases = (
        (r"server_args=|ServerArgs\(", "config", ""),
        (r"Load weight begin", "weights", ""),
        (
            r"Loading safetensors checkpoint shards:\s*(\d+)% Completed \| (\d+)/(\d+)",
            "weights",
            "{0}% ({1}/{2} shards)",
        ),
        (r"Load weight end", "weights", "100%"),
        (r"KV Cache is allocated|Memory pool end", "kv_cache", ""),
        (r"Capture cuda graph|Capturing batches", "cuda_graphs", ""),
        (r"Uvicorn running|Application startup complete", "api_server", "warming up"),
        (r"The server is fired up and ready to roll", "api_server", "serving"),
    )

    def probe_install(self, python: str) -> EngineInstall:
        return run_probe_script(python, with_trace_probe(PROBE_SCRIPT, self.trace_modules))

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

    # The summary hop as a continuation of the answer's tokens (issue 30). SGLang 0.5.13.post1
    # (entrypoints/openai/protocol.py ChatCompletionRequest, serving_chat.py,
    # managers/tokenizer_manager.py):
    # - `return_prompt_token_ids: true` puts the rendered prompt's ids in each choice's
    #   `prompt_token_ids` (refused with `stream: true`), but a chat answer carries its generated
    #   ids only as `output_token_logprobs` in `meta_info`, which the tokenizer manager fills only
    #   when the request asked for logprobs (`_handle_batch_output` -> `add_logprob_return_values`
    #   under `return_logprob`); `output_ids` are withheld from the OpenAI serving path. Asking for
    #   logprobs on every answer would compute them for every token and show them to a client
    #   that did not ask. So the answer hop asks for none of it (it used to ask for the prompt ids:
    #   up to the window's 262k ids per response, parsed for nothing, as no answer ever carried
    #   its output ids), and every SGLang summary is the chat summary
    #   (summary_chat_fallbacks_total).
    # - The native /generate takes `input_ids` and the adapter as `lora_path` (its --lora-paths
    #   name; managers/io_struct.py GenerateReqInput) and answers `text` and `meta_info` with
    #   `prompt_tokens` and `cached_tokens` (tokenizer_manager.py _compute_meta_info); the radix
    #   cache is keyed by the tokens and the adapter. `answer_tokens` reads the shapes an answer
    #   with logprobs would carry, should a later release report the ids without them.
    # - The template probe: no /tokenize that renders chat messages in 0.5.13, so a 1-token chat
    #   request with `return_prompt_token_ids` (and `continue_final_message` for the open form).
    def answer_token_fields(self, stream: bool) -> dict[str, Any]:
        return {}

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
        meta = body["meta_info"]
        chosen = meta["output_token_logprobs"]
        tops = [{str(t[1]): float(t[0]) for t in (row or [])} for row in meta.get("output_top_logprobs") or []]
        return Sample(tokens=[int(t[1]) for t in chosen], logprobs=[float(t[0]) for t in chosen], top=tops)

    def health_detail(self, status: int) -> str:
        if status == 503:
            return "/health answers 503 (SGLang: warming up, shutting down, or its health check failed)"
        return super().health_detail(status)


ENGINE = SglangEngine()
