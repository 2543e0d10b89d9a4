"""Request validation for POST /v1/chat/completions: the raw body to a checked dict, or a 400
`invalid_request_error` that names the offending field (`param`).

`parse_body` reads the bytes (orjson, or the standard library for what only it reads);
`check_request` checks the body against the field table (docs/contract.md "Request fields"):
refused fields are 400s naming the field; accepted-and-ignored ones pass; the engine module's
extensions are checked for their JSON kind and passed to the answer hop; any other unknown field
is noted and counted (`request_fields.FieldPolicy`) or a 400 with `proxy.request_fields: reject`.
The shapes the engine's chat template iterates over (roles, content, tool calls, tools,
`tool_choice`, `top_logprobs`) are checked here, so a malformed message is a 400 naming e.g.
`messages[3].tool_calls[0].function`, never a 500; so are JSON nested past the parser's
recursion limit and strings holding a lone UTF-16 surrogate. docs/design/proxy.md, "Chat
request validation", has each choice.
"""

from __future__ import annotations

import math
import re
from json.scanner import make_scanner
from typing import Any

from molctl.profiles import MEDIA_HOST_PATTERN
from molctl.proxy import fastjson
from molctl.proxy.apis.request_fields import PERMISSIVE, FieldPolicy
from molctl.proxy.errors import ProxyError, invalid

PASSTHROUGH = (
    "temperature",
    "top_p",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "logprobs",
    "top_logprobs",
    "response_format",
    "tool_choice",
    "parallel_tool_calls",
    "logit_bias",
    "user",
)
SAMPLING_NUMBERS = ("temperature", "top_p", "presence_penalty", "frequency_penalty")
ACCEPTED_IGNORED = (
    "store",
    "metadata",
    "service_tier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "prompt_cache_options",
    "safety_identifier",
    "prediction",
    "verbosity",
    "moderation",
    "web_search_options",
)
REJECTED = {
    "functions": "use 'tools' instead of the legacy 'functions'",
    "function_call": "use 'tool_choice' instead of the legacy 'function_call'",
    "audio": "audio output is not supported",
    "modalities": "only text output is supported",
}
KNOWN = frozenset(
    {
        "model",
        "messages",
        "stream",
        "stream_options",
        "n",
        "max_tokens",
        "max_completion_tokens",
        "reasoning_effort",
        "chat_template_kwargs",
        "tools",
        *PASSTHROUGH,
        *ACCEPTED_IGNORED,
        *REJECTED,
    }
)
ROLES = ("system", "developer", "user", "assistant", "tool")
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


_WS = re.compile(r"[ \t\n\r]*")
_SCAN = make_scanner(fastjson.STDLIB_DECODER)  # non-finite floats kept as fastjson.NonFinite


def _loads_in_steps(text: str) -> Any:
    """json.loads for a large top-level object, one array element per C call: a worker thread
    running it lets the event loop take the GIL between elements (one json.loads of 8 MiB holds
    it for about 100 ms). Any surprise raises ValueError; the caller then uses json.loads."""
    ws, scan = _WS.match, _SCAN
    i = ws(text, 0).end()
    if text[i : i + 1] != "{":
        raise ValueError("not an object")
    out: dict[str, Any] = {}
    i = ws(text, i + 1).end()
    if text[i : i + 1] == "}":
        if ws(text, i + 1).end() != len(text):
            raise ValueError("extra data")
        return out
    while True:
        if text[i : i + 1] != '"':
            raise ValueError("expected a key")
        key, i = scan(text, i)
        i = ws(text, i).end()
        if text[i : i + 1] != ":":
            raise ValueError("expected ':'")
        i = ws(text, i + 1).end()
        if text[i : i + 1] == "[":
            items: list[Any] = []
            i = ws(text, i + 1).end()
            if text[i : i + 1] == "]":
                i += 1
            else:
                while True:
                    item, i = scan(text, i)
                    items.append(item)
                    i = ws(text, i).end()
                    c = text[i : i + 1]
                    i = ws(text, i + 1).end()
                    if c == "]":
                        break
                    if c != ",":
                        raise ValueError("expected ',' or ']'")
            value: Any = items
        else:
            value, i = scan(text, i)
        out[key] = value
        i = ws(text, i).end()
        c = text[i : i + 1]
        i = ws(text, i + 1).end()
        if c == "}":
            break
        if c != ",":
            raise ValueError("expected ',' or '}'")
    if i != len(text):
        raise ValueError("extra data")
    return out


def finite_number(v: Any) -> bool:
    """A JSON number that is neither NaN nor an infinity (a bool is no number here)."""
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)


def parse_body(raw: bytes, in_steps: bool = False, fast_only: bool = False) -> Any:
    """JSON text -> Python, every failure a 400. `in_steps`: see `_loads_in_steps`. `fast_only`
    (the event loop): orjson's parse only, `fastjson.FALLBACK` where the standard library has to
    read the text (NaN, 19-digit numbers, anything orjson refuses: invalid JSON included); the
    caller then calls again without it from a worker thread."""
    if fast_only:
        body = fastjson.loads(raw, utf8_only=True, fast_only=True)
        if body is fastjson.FALLBACK:
            return body
    elif in_steps:
        try:
            body = _loads_in_steps(raw.decode("utf-8"))
        except (ValueError, StopIteration, RecursionError):
            in_steps = False
    if not in_steps and not fast_only:
        body = _loads(raw)
    # A lone surrogate can only arrive as a \\uD800-\\uDFFF escape; look only when one is there.
    if b"\\ud" in raw or b"\\uD" in raw:
        where = _lone_surrogate(body, "")
        if where is not None:
            raise invalid(
                f"{where or 'The body'} contains a lone UTF-16 surrogate, which is not valid text.", where or None
            )
    return body


def _loads(raw: bytes) -> Any:
    try:
        return fastjson.loads(raw, utf8_only=True)  # UTF-16 or encoded surrogates: invalid_json, as any non-UTF-8
    except RecursionError:
        raise invalid("The body is nested too deeply to be a chat request.") from None
    except ValueError as exc:  # includes UnicodeDecodeError (bytes that are not UTF-8)
        raise ProxyError(400, f"The body is not valid JSON: {exc}", "invalid_request_error", "invalid_json") from None


def _lone_surrogate(value: Any, path: str) -> str | None:
    stack = [(value, path)]
    while stack:
        v, p = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return p
        elif isinstance(v, dict):
            for k, item in v.items():
                try:
                    k.encode("utf-8")
                except UnicodeEncodeError:
                    return p or "body"
                stack.append((item, f"{p}.{k}" if p else k))
        elif isinstance(v, list):
            stack.extend((item, f"{p}[{i}]") for i, item in enumerate(v))
    return None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_content(content: Any, where: str, required: bool, media_hosts: tuple[str, ...] = ()) -> None:
    if content is None:
        if required:
            raise invalid(f"'{where}' is required.", where)
        return
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise invalid(f"'{where}' must be a string or an array of content parts.", where)
    for j, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise invalid(f"'{where}[{j}]' must be an object with a 'type'.", f"{where}[{j}]")
        if part["type"] == "text":
            if not isinstance(part.get("text"), str):
                raise invalid(f"'{where}[{j}].text' must be a string.", f"{where}[{j}].text")
            continue
        if part["type"] not in CONTENT_PART_TYPES:
            raise invalid(
                f"The content part type {part['type'][:40]!r} is not supported; expected one of "
                f"{', '.join(CONTENT_PART_TYPES)}.",
                f"{where}[{j}].type",
            )
        for key in MEDIA_URL_KEYS:
            if part.get(key) is not None:  # null: nothing to fetch (vLLM's cached-media-by-uuid parts)
                check_media_url(part[key], f"{where}[{j}].{key}", media_hosts)


MEDIA_URL_KEYS = ("image_url", "audio_url", "video_url")  # the parts vLLM and SGLang fetch by URL
# The content part types vLLM's chat parser knows (vllm/entrypoints/chat_utils.py MM_PARSER_MAP,
# and `refusal`); another is a 400 here, naming it, instead of the engine's "Unknown part type".
CONTENT_PART_TYPES = (
    "text",
    "input_text",
    "output_text",
    "thinking",
    "refusal",
    "image_url",
    "input_image",
    "image_embeds",
    "image_pil",
    "audio_url",
    "input_audio",
    "audio_embeds",
    "video_url",
    "video_embeds",
    "prompt_embeds",
    "file",
)
# An http(s) URL as every URL parser reads it alike: no user info (a@b), no backslash (urllib3,
# which vLLM fetches through, ends the host at one; urlsplit does not), no space or control
# character; the host as a proxy.media_url_hosts entry is written (a trailing dot allowed).
# Group 1: the host.
_MEDIA_URL = re.compile(
    rf"https?://({MEDIA_HOST_PATTERN})\.?(?::[0-9]{{1,5}})?(?:[/?#][^\x00-\x20\x7f\\]*)?", re.IGNORECASE | re.ASCII
)


def check_media_url(value: Any, where: str, hosts: tuple[str, ...]) -> None:
    """A media part's URL (`{"url": ...}` or the URL itself, as vLLM reads both): a data: URL, or
    an http(s) URL whose host is in `proxy.media_url_hosts` ("*": any). The engine would fetch
    any other from its own network: cloud metadata endpoints, services on its loopback, internal
    hosts (vLLM's media connector follows redirects and has no address rules; SGLang neither)."""
    url = value.get("url") if isinstance(value, dict) else value
    if isinstance(value, dict):
        where += ".url"
        if url is None:  # as the key itself null: nothing is fetched
            return
    if not isinstance(url, str):
        raise invalid(f"'{where}' must be a string (a data: URL or an http(s) URL).", where)
    if url[:5].lower() == "data:":
        return
    match = _MEDIA_URL.fullmatch(url)
    if match is None:
        raise invalid(
            f"'{where}' must be a data: URL or an http(s) URL with a plain host (no user name, backslash, "
            f"space or control character), not {url[:40]!r}.",
            where,
        )
    host = match.group(1).lower().strip("[]")
    if "*" in hosts or host in hosts:
        return
    raise ProxyError(
        400,
        f"'{where}': this server does not fetch media from {host[:80]!r} (the engine would fetch it from "
        "inside its network); send it inline as a data: URL, or ask the operator to add the host to "
        "proxy.media_url_hosts.",
        "invalid_request_error",
        "media_url_not_allowed",
        where,
    )


def check_tool_calls(calls: Any, where: str) -> None:
    if not isinstance(calls, list):
        raise invalid(f"'{where}' must be an array.", where)
    for j, call in enumerate(calls):
        w = f"{where}[{j}]"
        if not isinstance(call, dict):
            raise invalid(f"'{w}' must be an object.", w)
        if call.get("id") is not None and not isinstance(call["id"], str):
            raise invalid(f"'{w}.id' must be a string.", f"{w}.id")
        fn = call.get("function")
        if not isinstance(fn, dict):
            raise invalid(f"'{w}.function' must be an object with 'name' and 'arguments'.", f"{w}.function")
        if not isinstance(fn.get("name"), str):
            raise invalid(f"'{w}.function.name' must be a string.", f"{w}.function.name")
        if fn.get("arguments") is not None and not isinstance(fn["arguments"], str):
            raise invalid(f"'{w}.function.arguments' must be a string (JSON text).", f"{w}.function.arguments")


def check_messages(messages: Any, media_hosts: tuple[str, ...] = ()) -> None:
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' must be a non-empty array.", "messages")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or msg.get("role") not in ROLES:
            raise invalid(f"messages[{i}] must be an object with a role in {', '.join(ROLES)}.", f"messages[{i}]")
        role = msg["role"]
        where = f"messages[{i}]"
        check_content(
            msg.get("content"), f"{where}.content", role in ("user", "tool", "system", "developer"), media_hosts
        )
        if role == "assistant" and msg.get("tool_calls") is not None:
            check_tool_calls(msg["tool_calls"], f"{where}.tool_calls")
        if role == "tool" and not isinstance(msg.get("tool_call_id"), str):
            raise invalid(f"'{where}.tool_call_id' must be a string.", f"{where}.tool_call_id")
        if msg.get("name") is not None and not isinstance(msg["name"], str):
            raise invalid(f"'{where}.name' must be a string.", f"{where}.name")
    if messages[-1]["role"] not in ("user", "tool"):
        raise invalid(f"The last message must be from the user or a tool, not '{messages[-1]['role']}'.", "messages")


def check_tools(tools: Any) -> None:
    if not isinstance(tools, list):
        raise invalid("'tools' must be an array of function tools.", "tools")
    for i, tool in enumerate(tools):
        w = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise invalid(f"'{w}' must be an object with type 'function'.", w)
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise invalid(f"'{w}.function' must be an object with a 'name'.", f"{w}.function")
        check_function_def(fn, f"{w}.function")


def non_finite_at(value: Any, where: str) -> str | None:
    """The path of the first NaN or infinity in a JSON value (Python's reader takes them; a
    schema holding one reaches the engine's guided decoding), or None."""
    stack = [(value, where)]
    while stack:
        v, w = stack.pop()
        if isinstance(v, float) and not math.isfinite(v):
            return w
        if isinstance(v, dict):
            stack.extend((item, f"{w}.{k}") for k, item in reversed(v.items()))
        elif isinstance(v, list):
            stack.extend((item, f"{w}[{i}]") for i, item in reversed(list(enumerate(v))))
    return None


def check_finite(value: Any, where: str) -> None:
    """A 400 naming the first NaN or infinity in `value` (`non_finite_at`)."""
    if value is not None:
        at = non_finite_at(value, where)
        if at is not None:
            raise invalid(f"'{at}' must be a finite number (NaN and infinities are not JSON).", at)


def check_values(body: dict[str, Any]) -> None:
    """`seed` (an integer, as vLLM's 64-bit field) and the schema of `response_format`: values the
    engine would take silently or misread, each a 400 naming it."""
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not -(2**63) <= seed < 2**63):
        raise invalid("'seed' must be an integer (64-bit).", "seed")
    fmt = body.get("response_format")
    check_finite(fmt, "response_format")
    schema = fmt.get("json_schema") if isinstance(fmt, dict) else None
    if isinstance(schema, dict) and schema.get("strict") is not None and not isinstance(schema["strict"], bool):
        raise invalid("'response_format.json_schema.strict' must be a boolean.", "response_format.json_schema.strict")


def check_tool_choice(choice: Any, tools: Any) -> None:
    """`none`, `auto`, `required` or `{"type": "function", "function": {"name"}}` naming one of `tools`."""
    if choice is None or choice in ("none", "auto"):
        return
    names = {t["function"]["name"] for t in tools or ()}
    if choice == "required":
        if not names:
            raise invalid("'tool_choice' 'required' needs at least one tool in 'tools'.", "tool_choice")
        return
    if (
        not isinstance(choice, dict)
        or choice.get("type", "function") != "function"
        or not isinstance(choice.get("function"), dict)
        or not isinstance(choice["function"].get("name"), str)
    ):
        raise invalid(
            "'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}.",
            "tool_choice",
        )
    if choice["function"]["name"] not in names:
        raise invalid(
            f"'tool_choice' names the function '{choice['function']['name'][:80]}', which is not in 'tools'.",
            "tool_choice",
        )


def check_function_def(fn: dict[str, Any], where: str) -> None:
    """A function tool's definition (chat's `tools[i].function`, or a flat Responses tool)."""
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise invalid(f"'{where}.name' must be a non-empty string.", f"{where}.name")
    if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
        raise invalid(f"'{where}.parameters' must be an object (a JSON Schema).", f"{where}.parameters")
    check_finite(fn.get("parameters"), f"{where}.parameters")
    if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
        raise invalid(f"'{where}.strict' must be a boolean.", f"{where}.strict")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise invalid(f"'{where}.description' must be a string.", f"{where}.description")


def check_model(body: dict[str, Any], public_model: str) -> None:
    """`model` is required and must be the one public model (404 model_not_found otherwise)."""
    model = body.get("model")
    if model is None:
        raise invalid("'model' is required.", "model")
    if not isinstance(model, str):  # a malformed request, not an unknown model
        raise invalid("'model' must be a string.", "model")
    if model != public_model:
        raise ProxyError(
            404,
            f"The requested model does not exist; this endpoint serves '{public_model}'.",
            "invalid_request_error",
            "model_not_found",
            "model",
        )


def check_request(
    body: Any, public_model: str, media_hosts: tuple[str, ...] = (), fields: FieldPolicy = PERMISSIVE
) -> None:
    """Everything about a chat request that does not need the conversation store. `media_hosts`:
    `proxy.media_url_hosts` (see `check_media_url`); `fields`: the engine's extensions and what
    to do with unknown fields (request_fields)."""
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object.")
    check_model(body, public_model)
    for key in body:
        if key in REJECTED and body[key] is not None and not (key == "modalities" and body[key] == ["text"]):
            raise invalid(f"'{key}' is not supported: {REJECTED[key]}.", key)
    fields.check_extra(body, KNOWN, "chat")
    check_messages(body.get("messages"), media_hosts)
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):  # true == 1 in Python, not in JSON
        raise invalid("Only n=1 is supported.", "n")
    stream = body.get("stream")
    if stream is None:  # null is the default, as in OpenAI's schema (boolean or null)
        stream = False
    if not isinstance(stream, bool):
        raise invalid("'stream' must be a boolean.", "stream")
    opts = body.get("stream_options")
    if opts is not None and (not isinstance(opts, dict) or not stream):
        raise invalid("'stream_options' must be an object and requires stream=true.", "stream_options")
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        if v is not None and (not _is_int(v) or v < 1):
            raise invalid(f"'{key}' must be a positive integer.", key)
    effort = body.get("reasoning_effort")
    if effort is not None and effort not in EFFORTS:
        raise invalid(f"'reasoning_effort' must be one of {', '.join(EFFORTS)}.", "reasoning_effort")
    fields.check_template_kwargs(body.get("chat_template_kwargs"), "chat_template_kwargs")
    check_values(body)
    if body.get("tools") is not None:
        check_tools(body["tools"])
    check_tool_choice(body.get("tool_choice"), body.get("tools"))
    top = body.get("top_logprobs")
    if top is not None:
        if not _is_int(top) or not 0 <= top <= 20:
            raise invalid("'top_logprobs' must be an integer from 0 to 20.", "top_logprobs")
        if top > 0 and body.get("logprobs") is not True:
            raise invalid("'top_logprobs' requires 'logprobs' to be true.", "top_logprobs")
    for key in SAMPLING_NUMBERS:  # the range is the engine's to check (its 400 names the field)
        v = body.get(key)
        if v is not None and not finite_number(v):
            # NaN/Infinity (accepted by the JSON reader, as Python's): vLLM's pydantic takes them and
            # its range checks (temperature < 0) are false for NaN, so they would reach the sampler
            raise invalid(f"'{key}' must be a finite number.", key)
    bias = body.get("logit_bias")
    if bias is not None and (not isinstance(bias, dict) or not all(map(finite_number, bias.values()))):
        # as the sampling numbers: vLLM clamps each bias with min(100, max(-100, bias))
        # (sampling_params.py), which makes a NaN -100: the token silently banned
        raise invalid("'logit_bias' must map token ids to finite numbers.", "logit_bias")
    for key in ("prompt_cache_key", "safety_identifier", "user"):
        if body.get(key) is not None and not isinstance(body[key], str):
            raise invalid(f"'{key}' must be a string.", key)
