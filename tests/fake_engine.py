"""A scripted fake OpenAI engine (vLLM-shaped), run as a real HTTP server in a subprocess.

It logs every chat request it receives (hop header, model, messages, payload) and behaves by
configuration (POST /_config, merged) and by directives in the user's text:
  [route:L2]    the route hop answers this label (unless config route_label is set)
  [tool:NAME]   the answer hop answers with a call of tool NAME, arguments from its schema ([tool]: the
                request's first tool) (unless the last message is a tool result)
Answers never contain an adapter name: tests learn who answered from GET /_log.

Strict mode (config `strict: true`, the default of the proxy contract tests) rejects what the
real bases reject, with vLLM 0.32's status, message, `param` and order (checked against a real
vLLM 0.32 by tests/e2e/test_e2e.py test_strict_fake_engine_agrees_with_vllm):
- the request model's checks (vllm/entrypoints/openai/chat_completion/protocol.py check_tool_usage,
  check_logprobs): `tools: []`, a `tool_choice` other than "none" without tools, `top_logprobs`
  without `logprobs: true` (400, param the field, message + " (parameter=FIELD)");
- a model that is neither the base's served name nor an adapter: 404 NotFoundError, param
  `model` (vllm/entrypoints/serve/engine/serving.py _check_model);
- an output limit above the window: "max_tokens=M cannot be greater than max_model_len=N. ..."
  (param max_completion_tokens when sent, else max_tokens; vllm/renderers/params.py
  TokenizeParams.__post_init__), checked before the chat template runs;
- the Qwen3.5/3.6 chat template's rules (vLLM answers a template exception as a 400 with its
  message, vLLM issue 41114): one system message, first ("System message must be at the
  beginning."), only the roles system/user/assistant/tool ("Unexpected message role." for
  `developer`), and at least one user message ("No user query found in messages."); no message
  at all is vLLM's own "Cannot apply chat template to an empty conversation. ...";
- the window rule (config `max_model_len`), the prompt's tokens estimated as its
  whitespace-separated words plus 4 per message: a prompt over the window fails (vLLM tokenizes
  with truncation at window + 1, so it reports "at least N+1" tokens: vllm/renderers/params.py
  _token_len_check, param input_tokens); otherwise max_tokens is CLAMPED to the room left, never
  refused (vllm/entrypoints/serve/utils/api_utils.py get_max_tokens: min(window - prompt,
  max_tokens)); a prompt of exactly the window leaves 0 and fails as SamplingParams does:
  "max_tokens must be at least 1, got 0." (param max_tokens, no context-length wording).

Also serves as the fake engine of the lifecycle tests (issue 4): /health, /v1/models and /version.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import time

from aiohttp import web

try:
    from tests import fake_schema
except ImportError:  # run as a script: tests/ is sys.path[0]
    import fake_schema

DEFAULT_CONFIG = {
    "served_name": "tiny-mol-base",
    "adapters": ["L0", "L1", "L2", "L3"],
    "parent": None,  # defaults to served_name
    "health_status": 200,
    "route_label": None,
    "route_in": "content",  # or "reasoning" (vLLM 0.32's field; "reasoning_content", its old name, also lands there)
    "route_delay": 0.0,
    "answer_delay": 0.0,
    "summary_delay": 0.0,
    "summary_fail": 0,  # fail this many summary hops with 500
    "token_delay": 0.0,
    "tool_arg_chunks": 3,
    "answer_error": None,  # {"status": 400, "body": {...}, "headers": {...}} for the answer hop
    "answer_words": 0,  # extra words after "answer-N" (for long streams)
    "answer_word": "word",  # the extra word (a long one makes a big stream)
    "answer_finish": None,  # override the answer's finish reason (e.g. "abort")
    "stream_error_after": None,  # after this many content pieces, an error frame then [DONE] (vLLM's way)
    "stream_no_finish": False,
    # with a request's logprobs: true, each content piece carries its logprobs, and the stream ends
    # with vLLM's final chunk for a token the parser swallowed: an empty delta with the
    # finish_reason and that token's logprobs (vllm/entrypoints/openai/chat_completion/serving.py)
    "answer_logprobs": False,  # end the stream with [DONE] but no finish_reason (neither vLLM nor SGLang does)
    "answer_reasoning": None,  # reasoning text of every answer (as a reasoning parser returns it)
    "reasoning_field": "reasoning",  # where: vLLM 0.32's `reasoning`, or `reasoning_content` (SGLang, older vLLM)
    "strict": False,  # enforce vLLM's window rule and the Qwen3.5/3.6 template's role rules
    "max_model_len": 2048,  # the window in strict mode
    # per engine model (the base's served name or an adapter), for `molctl bench` (answer hops and direct requests):
    "model_delay": {},  # {model: seconds before the first chunk}
    "model_error": {},  # {model: {"status": 503, "body"?: {...}, "headers"?: {...}}}
    "model_text": {},  # {model: text}: that model's answers say this text instead of "answer-N"
    # for other proxies (bench/bench_proxy.py runs the upstream harness's proxy against this engine):
    # a request without a hop header whose last message is a user message with exactly this text
    # is a summary hop (the upstream labels only its route hop, with X-MOL-Internal-Hop)
    "summary_marker": None,
    # `--scheduling-policy` (argv, or config): a request whose `priority` is not 0 under "fcfs" is
    # a 400, "Got priority N but Priority scheduling is not enabled." (vLLM's v0 engine, in
    # add_request; vLLM 0.32 ignores the field instead): the stricter behaviour, so a proxy sending
    # priorities to an engine not started for them fails here. None: no check (the fake SGLang,
    # which ignores the field unless started for it)
    "scheduling_policy": "fcfs",
    "priority_refusal": None,  # that 400's message instead ("V1 does not support priority yet.": vLLM 0.8-0.9.1)
    # the adapter efficacy canary (molctl.lifecycle.canary; /v1/completions here, /generate in the fake SGLang):
    # each model answers its own greedy tokens and logprobs, except
    "no_effect": [],  # adapters served "with no effect": the base model's tokens and logprobs (vllm#55193)
    "same_as": {},  # {adapter: other adapter}: a copy under two names, the other's tokens and logprobs
    # Token ids (issue 30), off by default: an engine that ignores `return_token_ids` (vLLM before
    # it had the field), whose summaries the proxy sends as chat requests. On: as vLLM 0.32 (see
    # `render`, `tokenize`, `completions`).
    "token_ids": False,
}


def vllm_error(
    message: str,
    status: int = 400,
    err_type: str = "BadRequestError",
    param: str | None = None,
    value=None,
    suffix: bool = True,
) -> web.Response:
    """vLLM's error body (vllm/entrypoints/serve/engine/protocol.py ErrorResponse). A
    VLLMValidationError (a `param`) reads "MESSAGE (parameter=P, value=V)" (vllm/exceptions.py
    VLLMValidationError.__str__) and names P in `param`; `suffix=False`: a `param` set without
    that wording (the 404 of an unknown model)."""
    extras = ([f"parameter={param}"] if param is not None else []) + ([f"value={value}"] if value is not None else [])
    if extras and suffix:
        message = f"{message} ({', '.join(extras)})"
    return web.json_response(
        {"error": {"message": message, "type": err_type, "param": param, "code": status}}, status=status
    )


def estimate_tokens(payload: dict) -> int:
    words = 0
    messages = payload.get("messages") or []
    for msg in messages:
        words += 4 + len(text_of(msg.get("content")).split())
        for call in msg.get("tool_calls") or []:
            words += len(json.dumps(call).split())
    if payload.get("tools"):
        words += len(json.dumps(payload["tools"]).split())
    return words


def strict_violation(payload: dict) -> web.Response | None:
    """In vLLM 0.32's order: the request model's validators, the model, the output limit, the
    chat template, the prompt's length, then the sampling params."""
    if payload.get("tools") == []:
        return vllm_error(
            "`tools` must not be an empty array. Either provide at least one tool or omit the field entirely.",
            param="tools",
        )
    if payload.get("tool_choice") not in (None, "none") and payload.get("tools") is None:
        return vllm_error("When using `tool_choice`, `tools` must be set.", param="tool_choice")
    top = payload.get("top_logprobs")
    if isinstance(top, int) and (top == -1 or top > 0) and not payload.get("logprobs"):
        return vllm_error("when using `top_logprobs`, `logprobs` must be set to true.", param="top_logprobs")
    cfg = STATE.config
    model = payload.get("model")
    if model and model != cfg["served_name"] and model not in cfg["adapters"]:
        return vllm_error(
            f"The model `{model}` does not exist. Valid aliases: {cfg['served_name']}.",
            404,
            "NotFoundError",
            param="model",
            suffix=False,
        )
    window = cfg["max_model_len"]
    limit_param = "max_completion_tokens" if payload.get("max_completion_tokens") is not None else "max_tokens"
    limit = payload.get(limit_param)
    if limit is not None and limit > window:
        # a VLLMValidationError message with its own parameter=/value= suffix
        return vllm_error(
            f"{limit_param}={limit} cannot be greater than max_model_len={window}. Please request fewer output tokens.",
            param=limit_param,
            value=limit,
        )
    messages = payload.get("messages") or []
    if not messages:
        return vllm_error("Cannot apply chat template to an empty conversation. Provide at least one message.")
    for i, msg in enumerate(messages):
        role = msg.get("role")
        if role not in ("system", "user", "assistant", "tool"):
            return vllm_error("Unexpected message role.")
        if role == "system" and i > 0:
            return vllm_error("System message must be at the beginning.")
        if (
            role == "system"
            and isinstance(msg.get("content"), list)
            and any(isinstance(p, dict) and p.get("type") not in ("text", None) for p in msg["content"])
        ):
            # the Qwen3.5/3.6 templates: raise_exception('System message cannot contain images.')
            return vllm_error("System message cannot contain images.")
    if not any(m.get("role") == "user" for m in messages):
        return vllm_error("No user query found in messages.")
    prompt = estimate_tokens(payload)
    if prompt > window:
        # tokenized with truncation at window + 1 (TokenizeParams.get_encode_kwargs), hence "at least"
        return vllm_error(
            f"This model's maximum context length is {window} tokens. However, your prompt contains "
            f"at least {window + 1} input tokens, which exceeds this limit even without any output "
            f"tokens. Please reduce the length of the input prompt.",
            param="input_tokens",
            value=window + 1,
        )
    room = window - prompt if limit is None else min(window - prompt, limit)
    if room < 1:
        return vllm_error(f"max_tokens must be at least 1, got {room}.", param="max_tokens", value=room)
    return None


# counters served on /metrics, vLLM's names (vllm/v1/metrics/loggers.py; a counter gets `_total`).
# Only answer hops and direct requests count; `vllm:num_preemptions_total` stays 0; the queue-time
# histogram (`vllm:request_queue_time_seconds_sum`) is left out on purpose (a metric that is missing).
METRICS = (
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
    "vllm:request_success_total",
    "vllm:generation_tokens_total",
)


# and vLLM's scheduler gauges (same file): requests running (here: chat requests being answered), waiting
# (the fake has no scheduler queue: 0) and the KV cache's usage (no KV cache: 0)
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


SCHEDULER_HEADERS = ("x-session-id", "x-llm-d-inference-objective", "x-llm-d-inference-fairness-id")


class Engine:
    def __init__(self):
        self.base = dict(DEFAULT_CONFIG)  # DEFAULT_CONFIG + the --config given at start (kept by /_reset)
        self.config = dict(self.base)
        self.log: list[dict] = []
        self.counter = 0
        self.metrics = dict.fromkeys(METRICS, 0)
        self.running = 0  # chat requests being answered (vllm:num_requests_running)
        self.computed: list[tuple[str, tuple[int, ...], str]] = []

    def reset(self):
        self.config = dict(self.base)
        self.log = []
        self.computed = []


STATE = Engine()


def text_of(content) -> str:
    if isinstance(content, list):
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


# The fake tokenizer and chat template of `token_ids` mode: a word is one token (100 + its CRC),
# a message is <|im_start|> ROLE words <|im_end|>, the generation prompt <|im_start|> assistant,
# the EOS <|im_end|> (the tiny profile's Qwen-like shape, in ids).
IM_START, IM_END, ROLE_IDS = 1, 2, {"system": 3, "user": 4, "assistant": 5, "tool": 6}


def words(text: str) -> list[int]:
    import zlib

    return [100 + zlib.crc32(w.encode()) % 50000 for w in text.split()]


def render(messages: list, generation_prompt: bool = True, continue_final: bool = False) -> list[int]:
    ids: list[int] = []
    for msg in messages:
        ids += [IM_START, ROLE_IDS.get(msg.get("role"), 7), *words(text_of(msg.get("content")))]
        for call in msg.get("tool_calls") or []:
            ids += words(json.dumps(call))
        ids.append(IM_END)
    if continue_final and ids:
        ids.pop()
    elif generation_prompt:
        ids += [IM_START, ROLE_IDS["assistant"]]
    return ids


def remember(model: str, ids: list[int], text: str) -> None:
    """What the engine computed for an answer (its prompt and output), for the fake prefix cache."""
    STATE.computed.append((model, tuple(ids), text))


def cache_hit(model: str, prompt: list[int]) -> tuple[int, str]:
    """The longest prefix of `prompt` the fake prefix cache holds for `model` (whole sequences
    computed before, minus their last token, as vLLM never computes the last sampled token's KV),
    and the answer text of that sequence."""
    best, text = 0, ""
    for m, ids, answer in STATE.computed:
        if m != model:
            continue
        n = 0
        for a, b in zip(ids[:-1], prompt, strict=False):
            if a != b:
                break
            n += 1
        if n > best:
            best, text = n, answer
    return min(best, len(prompt) - 1), text


def completion(model: str, message: dict, finish: str, usage: dict) -> dict:
    """vLLM 0.32's ChatCompletionResponse as it serialises (every field, nulls included; the
    message's `reasoning`, never `reasoning_content`: vllm/entrypoints/openai/chat_completion/protocol.py)."""
    message = {
        "role": "assistant",
        "content": None,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "reasoning": None,
        **message,
    }
    return {
        "id": "chatcmpl-engine-" + model,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": None,
                "token_ids": None,
                "routed_experts": None,
            }
        ],
        "service_tier": None,
        "system_fingerprint": "fp-engine",
        "usage": usage,
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "prompt_text": None,
        "kv_transfer_params": {"engine": model},
        "ec_transfer_params": None,
        "metrics": None,
    }


async def chat(request: web.Request) -> web.StreamResponse:
    STATE.running += 1
    try:
        return await answer_chat(request)
    finally:
        STATE.running -= 1


async def answer_chat(request: web.Request) -> web.StreamResponse:
    payload = await request.json()
    cfg = STATE.config
    hop = request.headers.get("X-MoL-Hop") or request.headers.get("X-MOL-Internal-Hop")
    messages = payload.get("messages") or []
    last = messages[-1] if messages else {}
    if (
        hop is None
        and cfg["summary_marker"] is not None
        and last.get("role") == "user"
        and last.get("content") == cfg["summary_marker"]
    ):
        hop = "summary"
    model = payload.get("model")
    STATE.log.append(
        {
            "hop": hop,
            "model": model,
            "messages": payload.get("messages"),
            "payload": payload,
            "t": time.time(),
            "request_id": request.headers.get("X-Request-Id"),
            # W3C trace context, as vLLM reads it (vllm/tracing/otel.py extract_trace_context)
            "traceparent": request.headers.get("traceparent"),
            # what llm-d's Endpoint Picker reads (molctl.proxy.scheduler_hints); None when absent
            "scheduler": {h: request.headers.get(h) for h in SCHEDULER_HEADERS},
        }
    )
    rejected = strict_violation(payload) if cfg["strict"] else None
    priority = payload.get("priority", 0)
    if rejected is None and priority != 0 and cfg["scheduling_policy"] == "fcfs":
        rejected = vllm_error(
            cfg["priority_refusal"] or f"Got priority {priority} but Priority scheduling is not enabled."
        )
    if rejected is not None:
        STATE.log[-1]["rejected"] = json.loads(rejected.text)["error"]["message"]
        return rejected
    usage = {
        "prompt_tokens": 10,
        "total_tokens": 13,
        "completion_tokens": 3,
        "prompt_tokens_details": {"cached_tokens": 4, "created_cache_tokens": 0, "multimodal_tokens": None},
        "completion_tokens_details": None,
    }
    if hop == "route":
        await asyncio.sleep(cfg["route_delay"])
        label = cfg["route_label"]
        if label is None:
            # the last user message (the upstream's route hop ends with an assistant prefill)
            user = next((m for m in reversed(messages) if m.get("role") == "user"), last)
            m = re.search(r"\[route:(L\d)\]", text_of(user.get("content")))
            label = m.group(1) if m else "L0"
        msg = (
            {"content": None, "reasoning": label}
            if cfg["route_in"] in ("reasoning", "reasoning_content")
            else {"content": label}
        )
        return web.json_response(completion(model, msg, "stop", usage))
    if hop == "summary":
        await asyncio.sleep(cfg["summary_delay"])
        if cfg["summary_fail"] > 0:
            cfg["summary_fail"] -= 1
            return web.json_response({"error": {"message": "summary exploded", "code": 500}}, status=500)
        answered = text_of(messages[-2].get("content")) if len(messages) >= 2 else ""
        return web.json_response(completion(model, {"content": f"summary of {answered}"}, "stop", usage))
    # answer hop (also a "speculative" one: the same request under another hop name). A client
    # that goes away meanwhile cancels the handler (run_app's handler_cancellation), as vLLM's
    # with_cancellation does for a non-streamed request (vllm/entrypoints/serve/utils/api_utils.py): logged
    try:
        await asyncio.sleep(cfg["answer_delay"] + cfg["model_delay"].get(model, 0.0))
    except asyncio.CancelledError:
        STATE.log.append({"hop": hop, "model": model, "event": "client_gone", "t": time.time()})
        raise
    STATE.metrics["vllm:prefix_cache_queries_total"] += 10
    STATE.metrics["vllm:prefix_cache_hits_total"] += 4
    if model in cfg["model_error"]:
        err = cfg["model_error"][model]
        body = err.get("body") or {
            "error": {"message": "injected", "type": "ServiceUnavailableError", "code": err["status"]}
        }
        return web.json_response(body, status=err["status"], headers=err.get("headers"))
    STATE.metrics["vllm:request_success_total"] += 1
    STATE.metrics["vllm:generation_tokens_total"] += 3
    if cfg["answer_error"]:
        err = cfg["answer_error"]
        return web.json_response(err["body"], status=err["status"], headers=err.get("headers"))
    STATE.counter += 1
    n = STATE.counter
    tool = None
    if last.get("role") != "tool":
        # [tool:NAME] (or [tool]: the request's first tool): a call with arguments from its schema
        m = fake_schema.TOOL_MARKER.search(text_of(last.get("content")))
        tool = fake_schema.tool_named(payload, (m.group(1) or "") if m else None)
    structured = fake_schema.structured_answer(payload)
    if tool:
        call = {"id": f"call-{n}", "type": "function", "function": {"name": tool[0], "arguments": tool[1]}}
        message, finish = {"content": None, "tool_calls": [call]}, "tool_calls"
    elif structured is not None:
        message, finish = {"content": structured}, "stop"
    elif last.get("role") == "tool":
        message, finish = {"content": f"answer-{n} using {text_of(last.get('content'))}"}, "stop"
    else:
        text = cfg["model_text"].get(model) or f"answer-{n}"
        message, finish = {"content": text + (" " + cfg["answer_word"]) * cfg["answer_words"]}, "stop"
    if cfg["answer_reasoning"] is not None:  # a reasoning parser's output, in the field the engine names
        message[cfg["reasoning_field"]] = cfg["answer_reasoning"]
    finish = cfg["answer_finish"] or finish
    # return_token_ids (vllm/entrypoints/openai/chat_completion/serving.py): the prompt's ids on
    # the response, the generated ids on the choice, the EOS (<|im_end|>) included when the
    # answer stopped on it (check_stop appends the token first: vllm/v1/core/sched/utils.py)
    token_mode = cfg["token_ids"] and payload.get("return_token_ids")
    out_ids = words(message.get("content") or "") + ([IM_END] if finish == "stop" else [])
    prompt_ids = render(messages) if token_mode else None
    if token_mode and not message.get("tool_calls"):
        remember(model, prompt_ids + out_ids, message.get("content") or "")
    if not payload.get("stream"):
        body = completion(model, message, finish, usage)
        if token_mode:
            body["prompt_token_ids"] = prompt_ids
            body["choices"][0]["token_ids"] = out_ids
        if cfg["answer_logprobs"] and payload.get("logprobs"):
            body["choices"][0]["logprobs"] = {
                "content": [logprob(p) for p in re.findall(r"\S+\s*", message["content"] or "")]
            }
        return web.json_response(body)

    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)

    created = int(time.time())

    async def emit(delta: dict, finish_reason=None, extra=None, logprobs=None):
        # vLLM 0.32's chunks (vllm/entrypoints/openai/chat_completion/serving.py
        # chat_completion_stream_generator): the role chunk has no token_ids and carries
        # prompt_token_ids/prompt_text; a content chunk has token_ids; stop_reason only on the
        # finishing choice, system_fingerprint on the last chunk
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        if finish_reason is not None:
            choice["stop_reason"] = None
        chunk = {
            "id": "chatcmpl-engine-" + model,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [choice],
        }
        if "role" in delta:
            chunk.update(prompt_token_ids=prompt_ids, prompt_text=None)
        elif token_mode:  # the delta's tokens; the finishing chunk the EOS
            choice["token_ids"] = words(delta.get("content") or "") + ([IM_END] if finish_reason == "stop" else [])
        else:
            choice["token_ids"] = None
        chunk.update(extra or {})
        await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")

    try:
        await stream_body(resp, emit, message, finish, tool, cfg, payload, model, usage, created)
    except (ConnectionResetError, asyncio.CancelledError):
        STATE.log.append({"hop": hop, "model": model, "event": "client_gone", "t": time.time()})
        raise
    return resp


def logprob(token: str) -> dict:
    return {"token": token, "logprob": -0.5, "bytes": list(token.encode()), "top_logprobs": []}


async def stream_body(resp, emit, message, finish, tool, cfg, payload, model, usage, created):
    logprobs = cfg["answer_logprobs"] and payload.get("logprobs")
    await emit({"role": "assistant", "content": ""})
    field = cfg["reasoning_field"]
    if message.get(field):
        for piece in re.findall(r"\S+\s*", message[field]):
            await emit({field: piece})
    if tool:
        call = message["tool_calls"][0]
        await emit(
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": call["id"],
                        "type": "function",
                        "function": {"name": call["function"]["name"], "arguments": ""},
                    }
                ]
            }
        )
        args = call["function"]["arguments"]
        k = cfg["tool_arg_chunks"]
        size = -(-len(args) // k)
        for i in range(0, len(args), size):
            await asyncio.sleep(cfg["token_delay"])
            await emit({"tool_calls": [{"index": 0, "function": {"arguments": args[i : i + size]}}]})
    else:
        for i, piece in enumerate(re.findall(r"\S+\s*", message["content"])):
            if cfg["stream_error_after"] is not None and i >= cfg["stream_error_after"]:
                # vLLM: create_streaming_error_response(e), then [DONE]
                # (vllm/entrypoints/openai/chat_completion/serving.py)
                err = {
                    "error": {
                        "message": "EngineCore encountered an issue.",
                        "type": "InternalServerError",
                        "param": None,
                        "code": 500,
                    }
                }
                await resp.write(b"data: " + json.dumps(err).encode() + b"\n\n")
                await resp.write(b"data: [DONE]\n\n")
                await resp.write_eof()
                return
            await asyncio.sleep(cfg["token_delay"])
            await emit({"content": piece}, logprobs={"content": [logprob(piece)]} if logprobs else None)
    include_usage = (payload.get("stream_options") or {}).get("include_usage")
    fingerprint = None if include_usage else {"system_fingerprint": "fp-engine"}
    # the end of generation on the EOS token (finish "stop"): an empty delta with the finish reason
    # (and that token's logprobs), as vLLM streams it
    if logprobs and not cfg["stream_no_finish"]:
        await emit({}, finish, extra=fingerprint, logprobs={"content": [logprob("<|im_end|>")]})
    elif not cfg["stream_no_finish"]:
        await emit({}, finish, extra=fingerprint)
    if include_usage:
        # the usage chunk: the stream's id and created, no choices, usage without multimodal_tokens
        # and completion_tokens_details (exclude_none), then the fingerprint
        details = {k: v for k, v in usage["prompt_tokens_details"].items() if v is not None}
        last = {
            "id": "chatcmpl-engine-" + model,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [],
            "usage": {
                "prompt_tokens": usage["prompt_tokens"],
                "total_tokens": usage["total_tokens"],
                "completion_tokens": usage["completion_tokens"],
                "prompt_tokens_details": details,
            },
            "system_fingerprint": "fp-engine",
        }
        await resp.write(b"data: " + json.dumps(last).encode() + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()


def canary_output(model: str, max_tokens: int, top: int) -> list[tuple[int, float, dict[int, float]]]:
    """The greedy answer of `model` (the base's served name or an adapter) to any prompt: per
    token (id, logprob, {id: logprob} of the top `top`), derived from the name of the model whose
    weights answer (the base for an adapter in `no_effect`, the other for one in `same_as`)."""
    import hashlib

    cfg = STATE.config
    if model in cfg["no_effect"]:
        model = cfg["served_name"]
    model = cfg["same_as"].get(model, model)
    out = []
    for i in range(max_tokens):
        h = hashlib.sha256(f"{model}:{i}".encode()).digest()
        ids = [100 + h[k] for k in range(top)]
        ids = list(dict.fromkeys(ids)) or [100]
        lps = [-0.1 - 0.7 * k - h[10 + k] / 255 for k in range(len(ids))]
        out.append((ids[0], lps[0], dict(zip(ids, lps, strict=True))))
    return out


async def completions(request: web.Request) -> web.Response:
    """vLLM's /v1/completions as the canary asks it (logprobs N, return_tokens_as_token_ids):
    CompletionLogProbs with "token_id:ID" tokens (vllm/entrypoints/openai/completion/protocol.py)."""
    payload = await request.json()
    cfg = STATE.config
    model = payload.get("model")
    STATE.log.append(
        {
            "hop": request.headers.get("X-MoL-Hop"),
            "model": model,
            "endpoint": "completions",
            "payload": payload,
            "t": time.time(),
            "traceparent": request.headers.get("traceparent"),
            "scheduler": {h: request.headers.get(h) for h in SCHEDULER_HEADERS},
        }
    )
    if model != cfg["served_name"] and model not in cfg["adapters"]:
        return vllm_error(f"The model `{model}` does not exist.", 404, "NotFoundError", param="model", suffix=False)
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        # a token prompt (CompletionRequest.prompt: list[int]), the summary's continuation: the
        # window rule as for chat, then the usage with the fake prefix cache's cached tokens
        window, max_tokens = cfg["max_model_len"], int(payload.get("max_tokens") or 16)
        if cfg["strict"] and len(prompt) >= window:
            return vllm_error(
                f"This model's maximum context length is {window} tokens. However, your prompt "
                f"contains at least {len(prompt)} input tokens.",
                param="input_tokens",
                value=len(prompt),
            )
        if cfg["summary_fail"] > 0:
            cfg["summary_fail"] -= 1
            return web.json_response({"error": {"message": "summary exploded", "code": 500}}, status=500)
        await asyncio.sleep(cfg["summary_delay"])
        cached, answered = cache_hit(model, prompt)
        text = f"summary of {answered}"
        return web.json_response(
            {
                "id": "cmpl-engine",
                "object": "text_completion",
                "created": int(time.time()),
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "text": text,
                        "logprobs": None,
                        "finish_reason": "stop",
                        "stop_reason": None,
                        "token_ids": None,
                        "prompt_logprobs": None,
                        "prompt_token_ids": None,
                    }
                ],
                "usage": {
                    "prompt_tokens": len(prompt),
                    "completion_tokens": min(3, max_tokens),
                    "total_tokens": len(prompt) + 3,
                    "prompt_tokens_details": {"cached_tokens": cached},
                },
            }
        )
    out = canary_output(model, int(payload.get("max_tokens") or 16), int(payload.get("logprobs") or 0) or 1)
    logprobs = {
        "text_offset": list(range(len(out))),
        "token_logprobs": [lp for _, lp, _ in out],
        "tokens": [f"token_id:{t}" for t, _, _ in out],
        "top_logprobs": [{f"token_id:{k}": v for k, v in top.items()} for _, _, top in out],
    }
    return web.json_response(
        {
            "id": "cmpl-engine",
            "object": "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "text": "".join(f" w{t}" for t, _, _ in out),
                    "logprobs": logprobs,
                    "finish_reason": "length",
                    "stop_reason": None,
                }
            ],
            "usage": {"prompt_tokens": 12, "completion_tokens": len(out), "total_tokens": 12 + len(out)},
        }
    )


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's /tokenize for chat messages (TokenizeChatRequest: add_generation_prompt,
    continue_final_message; vllm/entrypoints/serve/tokenize/protocol.py), rendered with `render`."""
    payload = await request.json()
    STATE.log.append(
        {
            "hop": request.headers.get("X-MoL-Hop"),
            "model": payload.get("model"),
            "endpoint": "tokenize",
            "payload": payload,
            "t": time.time(),
            "traceparent": request.headers.get("traceparent"),
            "scheduler": {h: request.headers.get(h) for h in SCHEDULER_HEADERS},
        }
    )
    if not STATE.config["token_ids"]:
        return web.json_response({"detail": "Not Found"}, status=404)
    if payload.get("add_generation_prompt") and payload.get("continue_final_message"):
        return vllm_error("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
    tokens = render(
        payload.get("messages") or [],
        bool(payload.get("add_generation_prompt", True)),
        bool(payload.get("continue_final_message")),
    )
    return web.json_response(
        {"count": len(tokens), "max_model_len": STATE.config["max_model_len"], "tokens": tokens, "token_strs": None}
    )


async def health(request):
    return web.Response(status=STATE.config["health_status"])


async def models(request):
    cfg = STATE.config
    parent = cfg["parent"] or cfg["served_name"]
    # vLLM 0.32's ModelCard (vllm/entrypoints/openai/models/protocol.py): the base card holds the
    # window, an adapter's max_model_len is null
    created = int(time.time())

    def card(name, root, parent_name, window):
        return {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": root,
            "parent": parent_name,
            "max_model_len": window,
            "permission": [
                {
                    "id": f"modelperm-{name}",
                    "object": "model_permission",
                    "created": created,
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ],
        }

    data = [card(cfg["served_name"], "/models/base", None, cfg["max_model_len"])]
    data += [card(a, f"/models/loras/{a}", parent, None) for a in cfg["adapters"]]
    return web.json_response({"object": "list", "data": data})


async def metrics(request):
    lines = []
    for name, value in STATE.metrics.items():
        if name.endswith("_total"):
            lines.append(f"# TYPE {name.removesuffix('_total')} counter")
        lines.append(f'{name}{{engine="0",model_name="{STATE.config["served_name"]}"}} {float(value)}')
    gauges = dict(zip(GAUGES, (STATE.running, 0, 0.0), strict=True))
    for name, value in gauges.items():
        lines.append(f"# TYPE {name} gauge")
        lines.append(f'{name}{{engine="0",model_name="{STATE.config["served_name"]}"}} {float(value)}')
    return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")


async def version(request):
    return web.json_response({"version": "0.0.0-fake"})


async def get_log(request):
    return web.json_response(STATE.log)


async def set_config(request):
    STATE.config.update(await request.json())
    return web.json_response(STATE.config)


async def release_routing_keys(request):
    """The upstream harness's proxy releases its per-request routing keys at a gateway
    (DELETE /_internal/routing-keys); answered as its gateway does, so that it does not fall
    back to one DELETE per key."""
    return web.Response(status=204)


async def reset(request):
    STATE.reset()
    return web.json_response({})


def make_app() -> web.Application:
    app = web.Application(client_max_size=64 * 2**20)  # vLLM takes bodies of any size
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/version", version)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/_log", get_log)
    app.router.add_post("/_config", set_config)
    app.router.add_post("/_reset", reset)
    app.router.add_delete("/_internal/routing-keys", release_routing_keys)
    return app


def apply_canary_env(*configs: dict) -> None:
    """FAKE_NO_EFFECT (comma list of adapters served with no effect) and FAKE_SAME_AS
    (`L3=L2,...`: an adapter answering as another) into the canary's config keys."""
    import os

    env = os.environ
    for cfg in configs:
        if env.get("FAKE_NO_EFFECT"):
            cfg["no_effect"] = [a for a in env["FAKE_NO_EFFECT"].split(",") if a]
        if env.get("FAKE_SAME_AS"):
            cfg["same_as"] = dict(pair.split("=", 1) for pair in env["FAKE_SAME_AS"].split(",") if "=" in pair)


def main() -> None:
    """Also runs as a profile's engine (`engine.python` = a wrapper script): it then takes the
    vLLM-style argv and FAKE_* environment variables from the profile's engine.env:
    FAKE_STARTUP_DELAY (s before listening), FAKE_STARTUP_GATE (a path: then wait until that file
    exists, so that a test decides when the start-up ends, whatever the machine's speed), FAKE_EXIT (exit with this code during start-up),
    FAKE_IGNORE_TERM (ignore SIGTERM), FAKE_CHILD (`1`: leave a child process in the group, like
    vLLM's EngineCore; `retitle`: one that also renames itself with setproctitle, as vLLM's do;
    `gpu`: one that holds FAKE_GPU_GIB GiB (default 4) of CUDA memory through torch, for the checks
    on a real GPU host in tests/gpu_host_check.py), FAKE_ADAPTERS (comma list), FAKE_PARENT, FAKE_ANSWER_DELAY, FAKE_NO_EFFECT and
    FAKE_SAME_AS (the canary's `no_effect` and `same_as`: see apply_canary_env)."""
    import os
    import signal
    import subprocess
    import sys

    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--config", default="{}", help="initial config JSON")
    parser.add_argument("--scheduling-policy", default=None)
    args, _ = parser.parse_known_args()
    STATE.base.update(json.loads(args.config))
    STATE.config.update(json.loads(args.config))
    if args.scheduling_policy:
        STATE.config["scheduling_policy"] = STATE.base["scheduling_policy"] = args.scheduling_policy
    if args.served_model_name:
        STATE.config["served_name"] = STATE.base["served_name"] = args.served_model_name
    env = os.environ
    print(f"fake engine pid {os.getpid()} starting on {args.host}:{args.port}", flush=True)
    if env.get("FAKE_IGNORE_TERM") == "1":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if env.get("FAKE_CHILD") == "1":
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print("spawned EngineCore-like child", flush=True)
    elif env.get("FAKE_CHILD") == "retitle":
        # As vLLM's EngineCore and workers do (vllm.utils set_process_title -> setproctitle), which
        # overwrites the memory /proc/PID/environ is read from: the environment marker is gone.
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import setproctitle, time; setproctitle.setproctitle('VLLM::EngineCore'); time.sleep(600)",
            ]
        )
        print("spawned EngineCore-like child", flush=True)
    elif env.get("FAKE_CHILD") == "retitle-partial":
        # What /proc/PID/environ of vLLM 0.32's EngineCore shows here after setproctitle: not
        # nothing but a few leftover entries of the overwritten area, the marker not among them
        # (seen in test_e2e's SIGKILL test: 14 entries). Started with such an environment.
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], env={"LEFTOVER": "tail"})
        print("spawned EngineCore-like child", flush=True)
    elif env.get("FAKE_CHILD") == "gpu":
        gib = float(env.get("FAKE_GPU_GIB", "4"))
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import time, torch; "
                f"x = torch.empty({int(gib * 2**30)}, dtype=torch.uint8, device='cuda'); "
                "torch.cuda.synchronize(); time.sleep(600)",
            ]
        )
        print(f"spawned EngineCore-like child holding {gib} GiB of GPU memory", flush=True)
    if env.get("FAKE_ADAPTERS") is not None:
        STATE.config["adapters"] = [a for a in env["FAKE_ADAPTERS"].split(",") if a]
    if env.get("FAKE_PARENT"):
        STATE.config["parent"] = env["FAKE_PARENT"]
    if env.get("FAKE_ANSWER_DELAY"):
        STATE.config["answer_delay"] = float(env["FAKE_ANSWER_DELAY"])
    apply_canary_env(STATE.config, STATE.base)
    # the start-up lines vLLM 0.32 logs (molctl.engines.vllm phases), each phase's own
    print("INFO [api_utils.py:286] non-default args: {'model': 'fake'}", flush=True)
    print("INFO [cpu_model_runner.py:68] Starting to load model fake...", flush=True)
    for i in range(2):
        print(f"Loading safetensors checkpoint shards: {50 * (i + 1)}% Completed | {i + 1}/2", flush=True)
    print("INFO [default_loader.py:501] Loading weights took 0.01 seconds", flush=True)
    cache = env.get("VLLM_CACHE_ROOT")
    if cache:  # vLLM's torch.compile cache (vllm/compilation/backends.py): loaded when there, else written
        compiled = os.path.join(cache, "torch_compile_cache", "fake-graph")
        if os.path.exists(compiled):
            print(
                "INFO [backends.py:296] Directly load the compiled graph(s) for compile range (1, 8) from the cache",
                flush=True,
            )
        else:
            print("INFO [backends.py:399] Compiling a graph for compile range (1, 8) takes 0.00 s", flush=True)
            os.makedirs(os.path.dirname(compiled), exist_ok=True)
            with open(compiled, "w") as f:
                f.write("fake compiled graph\n")
    time.sleep(float(env.get("FAKE_STARTUP_DELAY", "0")))
    gate = env.get("FAKE_STARTUP_GATE")
    while gate and not os.path.exists(gate):
        time.sleep(0.05)
    print("INFO [core.py:402] init engine (profile, create kv cache, warmup model) took 0.01 s", flush=True)
    if env.get("FAKE_EXIT"):
        print("RuntimeError: CUDA out of memory (simulated)", flush=True)
        sys.exit(int(env["FAKE_EXIT"]))
    print("INFO [entry.py:140] Starting vLLM server on http://fake", flush=True)
    print("Application startup complete.", flush=True)
    web.run_app(
        make_app(),
        host=args.host,
        port=args.port,
        print=None,
        access_log=None,
        handle_signals=env.get("FAKE_IGNORE_TERM") != "1",
        handler_cancellation=True,  # a client gone cancels its request, as in vLLM (with_cancellation)
    )


if __name__ == "__main__":
    main()
