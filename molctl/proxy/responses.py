"""The Responses API (`/v1/responses`) on top of the chat machinery.

A Responses request is translated into a chat request (`to_chat`): `instructions` become a
leading system message for this request only (they do not carry over), the stored chain's chat
messages (`previous_response_id`) come next, then this request's input items as chat messages
(message items with text parts, `function_call` -> an assistant message's `tool_calls`,
`function_call_output` -> a `tool` message, `developer`/`system` kept as such: the orchestrator
handles them as in chat). The orchestrator then runs it like any chat request (route hop or tool
stickiness, one leading system message, folded views, summaries), and its chat answer is shaped
as a Response object (`response_object`), or its chat chunks as Responses stream events
(`StreamTranslator`).

Choices, where the issue leaves room:
- Tools: function tools (flat `{"type": "function", "name", "description", "parameters",
  "strict"}`) go to the engine; a `namespace` (a named group of function tools) is flattened to
  its functions, each named `NAMESPACE__NAME` for the engine, and their calls come back with
  `name` and `namespace` apart; any other tool type (hosted tools the engine cannot run:
  `web_search`, `file_search`, `code_interpreter`, `computer_use_preview`, `image_generation`,
  `mcp`, `local_shell`, `custom`, ...) is left out of the engine's list and noted in the log, never
  a 400 that stops the client (the model never sees it, so no instruction needs to say so).
  `tool_choice`: "auto"/"none"/"required", `{"type": "function", "name"[, "namespace"]}`,
  `{"type": "allowed_tools", "mode", "tools"}` (the engine gets only those tools and the mode), or
  a hosted tool's choice (noted; "auto", since that tool is not there).
- Input items: messages, `function_call`, `function_call_output` and `reasoning` are converted;
  the calls and outputs of hosted and custom tools (`web_search_call`, `computer_call_output`,
  `custom_tool_call`, ...: see IGNORED_ITEMS) are left out of the prompt with a note in the log
  (this server never ran them); an `item_reference` is replaced by the output item it names, from
  the tenant's stored responses (item ids carry their response's id: `ItemIds`), and one that names
  no stored item is a 400 naming it, as is any other type, so no instruction is dropped unseen.
- Reasoning round trip: a `reasoning` item in the input (its `content` text, else its `summary`
  text, else the `encrypted_content` this proxy returned) becomes the `reasoning` (vLLM) and
  `reasoning_content` (SGLang) of the assistant message that follows it, as the engine produced
  it; with `include: ["reasoning.encrypted_content"]` every reasoning item carries that text in
  `encrypted_content`, zlib-compressed and base64-encoded behind `mol1.`: opaque to the client,
  not secret (the same text is in the item's `content`). Foreign encrypted content (another
  server's) is noted and left out.
- `reasoning.effort` maps like chat's `reasoning_effort`; `reasoning.summary` is accepted and has
  no effect (the engine's reasoning text is returned whole as a `reasoning` item).
- `text.format` json_schema / json_object -> chat `response_format`; `text` (the default) adds
  nothing.
- `include`: `message.output_text.logprobs` (the engine's logprobs on the output text) and
  `reasoning.encrypted_content` (see above) are honoured; any other string (the outputs of hosted
  tools this server never runs) is accepted and noted: there is nothing to include.
- Unknown top-level fields (a coding agent's `client_metadata`, ...) are accepted, noted once
  and counted as in chat (request_fields.FieldPolicy); the engine's extensions pass to the answer
  hop; `conversation`, `prompt` and `background: true` are 400s (ignoring them would drop the
  conversation, the instructions or the mode the client asked for). `text.verbosity`,
  `service_tier`, `max_tool_calls`, `stream_options`, `context_management` and the prompt-cache
  options are accepted and ignored (no engine reads them; the proxy never compacts).
- `truncation` "disabled" or "auto" is accepted and echoed; the proxy never drops items itself
  (a conversation past the window is a `context_length_exceeded` 400 either way).
- `user`, `safety_identifier`, `prompt_cache_key`, `metadata` are accepted and echoed (`metadata`: OpenAI's
  limits, at most 16 pairs, keys up to 64 characters, values up to 512).
- A finish reason `length` gives `status: "incomplete"` with `incomplete_details.reason:
  "max_output_tokens"`; the engine's `abort`/`error` give `status: "failed"` (not stored).
- An unknown, deleted, expired or another tenant's `previous_response_id` is a 404
  `previous_response_not_found` (never a 403 that would confirm it exists).
"""

from __future__ import annotations

import base64
import copy
import json
import os
import re
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

from molctl.proxy.errors import ProxyError, invalid, shown
from molctl.proxy.request_fields import PERMISSIVE, FieldPolicy
from molctl.proxy.validation import EFFORTS, check_function_def, check_media_url, check_model

ECHOED = (
    "instructions",
    "max_output_tokens",
    "metadata",
    "parallel_tool_calls",
    "previous_response_id",
    "prompt_cache_key",
    "safety_identifier",
    "temperature",
    "top_logprobs",
    "top_p",
    "truncation",
    "user",
)
ACCEPTED_IGNORED = (
    "service_tier",
    "stream_options",
    "prompt_cache_retention",
    "prompt_cache_options",
    "max_tool_calls",
    "moderation",
    "context_management",
    "background_options",
)
# ignoring these would drop what the client asked for: a 400 naming them when set
UNSERVED = {
    "conversation": "the Conversations API is not served here; continue with previous_response_id",
    "prompt": "stored prompt templates are not served here; send the text as instructions",
}
KNOWN = frozenset(
    {
        "model",
        "input",
        "stream",
        "store",
        "tools",
        "tool_choice",
        "text",
        "reasoning",
        "include",
        "background",
        *ECHOED,
        *ACCEPTED_IGNORED,
        *UNSERVED,
    }
)
REASONING_UNUSED = ("generate_summary", "context", "mode")  # OpenAI's Reasoning fields this proxy does not use
INCLUDE_LOGPROBS, INCLUDE_REASONING = "message.output_text.logprobs", "reasoning.encrypted_content"
TEXT_PARTS = ("input_text", "output_text", "text")
NAMESPACE_SEP = "__"  # a namespace's function as the engine sees it: NAMESPACE__NAME
# Items of tools this server never runs (hosted and custom tools): a client's history may hold them
IGNORED_ITEMS = frozenset(
    {
        "web_search_call",
        "file_search_call",
        "computer_call",
        "computer_call_output",
        "code_interpreter_call",
        "image_generation_call",
        "local_shell_call",
        "local_shell_call_output",
        "shell_call",
        "shell_call_output",
        "apply_patch_call",
        "apply_patch_call_output",
        "mcp_list_tools",
        "mcp_approval_request",
        "mcp_approval_response",
        "mcp_call",
        "custom_tool_call",
        "custom_tool_call_output",
        "tool_search_call",
        "tool_search_output",
    }
)
ENCRYPTED_PREFIX = "mol1."


def encode_reasoning(text: str) -> str:
    """A reasoning item's `encrypted_content`: the text, opaque to the client (see the module docstring)."""
    return ENCRYPTED_PREFIX + base64.urlsafe_b64encode(zlib.compress(text.encode("utf-8"))).decode("ascii")


def decode_reasoning(blob: str) -> str | None:
    """The text of an `encrypted_content` this proxy made, else None."""
    if not blob.startswith(ENCRYPTED_PREFIX):
        return None
    try:
        data = zlib.decompressobj().decompress(base64.urlsafe_b64decode(blob[len(ENCRYPTED_PREFIX) :]), 1 << 24)
        return data.decode("utf-8")
    except (ValueError, zlib.error):
        return None


def new_id(prefix: str) -> str:
    return prefix + os.urandom(12).hex()


class ItemIds:
    """Output item ids of one response: `PREFIX` + the response id's hex + a counter, so an
    `item_reference` names the response that holds its item (`response_of_item`)."""

    def __init__(self, response_id: str):
        self.base = response_id.removeprefix("resp_")
        self.n = 0

    def __call__(self, prefix: str) -> str:
        self.n += 1
        return f"{prefix}{self.base}{self.n:04x}"


def response_of_item(item_id: str) -> str | None:
    """The response id an output item id of this proxy's (ItemIds) came from, else None."""
    _, sep, rest = item_id.partition("_")
    if not sep or len(rest) != 28 or not all(c in "0123456789abcdef" for c in rest):
        return None
    return "resp_" + rest[:24]


class NeedsReferences(Exception):
    """The input holds item references: the caller fetches them (`referenced_items`) and parses
    `body` again with `refs`."""

    def __init__(self, body: dict[str, Any], ids: list[str]):
        super().__init__(ids)
        self.body, self.ids = body, ids


def item_not_found(item_id: str) -> ProxyError:
    return invalid(
        f"Item with id {shown(item_id)} not found (items of responses created with store=false are not kept).", "input"
    )


def referenced_items(ids: list[str], records: dict[str, dict[str, Any] | None]) -> dict[str, dict[str, Any]]:
    """item id -> the output item it names, from the stored records by response id (the first
    id not found is a 400, as OpenAI's)."""
    out: dict[str, dict[str, Any]] = {}
    for item_id in ids:
        record = records.get(response_of_item(item_id) or "")
        item = next(
            (i for i in ((record or {}).get("response") or {}).get("output") or () if i.get("id") == item_id), None
        )
        if item is None:
            raise item_not_found(item_id)
        out[item_id] = item
    return out


def duplicate_item(item_id: str) -> ProxyError:
    return invalid(
        f"Duplicate item found with id {shown(item_id)}. Remove duplicate items from your input and try again.", "input"
    )


def public_param(param: str | None) -> str | None:
    """An error's `param` as a Responses client knows it: the chat request the proxy builds has
    `messages` where the client sent `input` (a context overflow names `messages`), and
    `response_format` where it sent `text.format`; chat's function tools and named tool_choice
    nest under `function` where the Responses request has the fields flat
    (`tools[0].function.parameters` -> `tools[0].parameters`, `tool_choice.function.name` ->
    `tool_choice.name`)."""
    if param is None:
        return None
    if param == "messages" or param.startswith("messages["):
        return "input"
    if param == "response_format" or param.startswith("response_format."):
        return "text.format"  # the Responses request's text.format became chat's response_format
    if param.startswith(("tools[", "tool_choice.")):
        return re.sub(r"^(tools\[\d+\]|tool_choice)\.function(?=\.|$)", r"\1", param)
    return param


def not_found(response_id: str, param: str | None = None) -> ProxyError:
    if param == "previous_response_id":
        # Each stored response holds its whole conversation, so a chain never needs its earlier
        # responses; only the one named here must still be stored.
        return ProxyError(
            404,
            f"Previous response with id '{shown(response_id)}' not found (deleted, created with "
            "store=false, or expired or evicted from the proxy's store).",
            "invalid_request_error",
            "previous_response_not_found",
            "previous_response_id",
        )
    return ProxyError(404, f"Response with id '{shown(response_id)}' not found.", "invalid_request_error", "not_found")


@dataclass
class ResponsesRequest:
    body: dict[str, Any]
    chat: dict[str, Any]  # the chat request without its messages
    messages: list[dict[str, Any]]  # this request's input as chat messages
    input_items: list[dict[str, Any]]
    stream: bool = False
    store: bool = True
    logprobs: bool = False
    encrypted_reasoning: bool = False  # include: reasoning.encrypted_content
    # a namespace's functions as the engine knows them: NAMESPACE__NAME -> (namespace, name)
    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)
    prev: dict[str, Any] | None = None
    history: list[dict[str, Any]] = field(default_factory=list)  # the chain's chat messages

    def chat_body(self) -> dict[str, Any]:
        """The chat request (after the stored chain, if any, was loaded into `prev` / `history`)."""
        self.check_chain()
        head = []
        if self.body.get("instructions"):
            head.append({"role": "system", "content": self.body["instructions"]})
        return {**self.chat, "messages": head + self.history + self.messages}

    def check_chain(self) -> None:
        """What OpenAI refuses once the input meets the stored chain (400s, `param: "input"`):
        - an input item with the id of an item the previous response holds already (its output, or
          its own input): the client resent what `previous_response_id` brings (it would reach the
          engine twice). Only the previous response's items are known by id; echoed `reasoning`
          items are ignored anyway.
        - a function call left without its output: the previous response's calls and the input's
          own must each be answered by a `function_call_output` of this input;
        - a `function_call_output` whose `call_id` matches no call of the chain or of the input.
        Calls answered, or left unanswered, earlier in the chain are not looked at again (a chain
        stored before these checks continues)."""
        if self.prev is not None:
            known = {i.get("id") for i in self.prev.get("input_items") or [] if isinstance(i, dict)}
            known |= {i.get("id") for i in (self.prev.get("response") or {}).get("output") or [] if isinstance(i, dict)}
            known.discard(None)
            for item in self.input_items:
                if item["id"] in known:
                    raise duplicate_item(item["id"])
        seen: set[str] = set()
        for msg in self.history:
            seen.update(c.get("id") for c in msg.get("tool_calls") or [])
        last = self.history[-1] if self.history else {}
        pending = {c.get("id"): None for c in last.get("tool_calls") or []}  # the previous response's calls
        for msg in self.messages:
            for call in msg.get("tool_calls") or []:
                seen.add(call["id"])
                pending[call["id"]] = None
            if msg["role"] == "tool":
                if msg["tool_call_id"] not in seen:
                    raise invalid(
                        f"No tool call found for function call output with call_id {shown(msg['tool_call_id'])}.",
                        "input",
                    )
                pending.pop(msg["tool_call_id"], None)
        if pending:
            raise invalid(f"No tool output found for function call {shown(str(next(iter(pending))))}.", "input")


# ------------------------------------------------------------------------ request


def _parts_to_content(parts: Any, where: str, role: str, media_hosts: tuple[str, ...] = ()) -> Any:
    if isinstance(parts, str):
        return parts
    if not isinstance(parts, list):
        raise invalid(f"'{where}' must be a string or an array of content parts.", where)
    out: list[dict[str, Any]] = []
    for j, part in enumerate(parts):
        w = f"{where}[{j}]"
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise invalid(f"'{w}' must be an object with a 'type'.", w)
        kind = part["type"]
        if kind in TEXT_PARTS or kind == "refusal":
            text = part.get("refusal") if kind == "refusal" else part.get("text")
            if not isinstance(text, str):
                raise invalid(f"'{w}.text' must be a string.", f"{w}.text")
            out.append({"type": "text", "text": text})
        elif kind == "input_image" and role == "user":
            url = part.get("image_url")
            if not isinstance(url, str):
                raise invalid(
                    f"'{w}.image_url' must be a URL or a data URL (file ids are not supported).", f"{w}.image_url"
                )
            check_media_url(url, f"{w}.image_url", media_hosts)
            image: dict[str, Any] = {"url": url}
            if part.get("detail") in ("low", "high", "auto"):
                image["detail"] = part["detail"]
            out.append({"type": "image_url", "image_url": image})
        else:
            raise invalid(f"The content part type '{kind}' is not supported here.", f"{w}.type")
    if all(p["type"] == "text" for p in out):
        return "".join(p["text"] for p in out) if role == "assistant" or len(out) == 1 else out
    return out


def _reasoning_text(item: dict[str, Any], where: str, fields: FieldPolicy) -> str | None:
    """What a `reasoning` input item says: its content text, else its summary text, else the
    `encrypted_content` this proxy made (another server's is noted and gives None)."""
    for key, kinds in (("content", ("reasoning_text", "text")), ("summary", ("summary_text",))):
        parts = item.get(key)
        if parts is not None and not isinstance(parts, list):
            raise invalid(f"'{where}.{key}' must be an array.", f"{where}.{key}")
        texts = [p.get("text") for p in parts or () if isinstance(p, dict) and p.get("type") in kinds]
        if any(not isinstance(t, str) for t in texts):
            raise invalid(f"'{where}.{key}' parts need a string 'text'.", f"{where}.{key}")
        if texts:
            return "".join(texts) if key == "content" else "\n\n".join(texts)
    blob = item.get("encrypted_content")
    if blob is None:
        return None
    if not isinstance(blob, str):
        raise invalid(f"'{where}.encrypted_content' must be a string.", f"{where}.encrypted_content")
    text = decode_reasoning(blob)
    if text is None:
        fields.note_ignored("input[].encrypted_content", "responses", "reasoning another server encrypted; left out")
    return text


def item_type(item: dict[str, Any]) -> Any:
    """An input item's `type`; absent or null is "not set" (OpenAI's EasyInputMessage and
    ItemReferenceParam leave it optional, the latter nullable): a message when the item has a
    `role`, else an `item_reference` when it has an `id`."""
    kind = item.get("type")
    if kind is None:
        return "item_reference" if "role" not in item and "id" in item else "message"
    return kind


def flat_name(name: str, namespace: Any) -> str:
    return f"{namespace}{NAMESPACE_SEP}{name}" if isinstance(namespace, str) and namespace else name


def _convert_input(
    value: Any,
    media_hosts: tuple[str, ...] = (),
    fields: FieldPolicy = PERMISSIVE,
    refs: dict[str, dict[str, Any]] | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """-> (chat messages, the input items as `/input_items` returns them). `refs`: the items
    `item_reference`s name (NeedsReferences)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}], [
            {
                "id": new_id("msg_"),
                "type": "message",
                "role": "user",
                "status": "completed",
                "content": [{"type": "input_text", "text": value}],
            }
        ]
    if not isinstance(value, list) or not value:
        raise invalid("'input' must be a string or a non-empty array of input items.", "input")
    messages: list[dict[str, Any]] = []
    items: list[dict[str, Any]] = []
    reasoning: list[str] = []  # reasoning items waiting for the assistant message they precede

    def assistant(msg: dict[str, Any]) -> dict[str, Any]:
        if reasoning:
            msg["reasoning"] = msg["reasoning_content"] = "\n\n".join(reasoning)
            reasoning.clear()
        messages.append(msg)
        return msg

    for i, item in enumerate(value):
        w = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid(f"'{w}' must be an object.", w)
        if item_type(item) == "item_reference" and refs is not None and item.get("id") in refs:
            item = refs[item["id"]]
        kind = item_type(item)
        if item.get("id") is not None and not isinstance(item["id"], str):  # echoed by input_items, used by `after`
            raise invalid(f"'{w}.id' must be a string.", f"{w}.id")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise invalid(f"'{w}.role' must be one of user, assistant, system, developer.", f"{w}.role")
            content = _parts_to_content(item.get("content"), f"{w}.content", role, media_hosts)
            if role == "assistant":
                assistant({"role": role, "content": content})
            else:
                reasoning.clear()  # reasoning belongs to the assistant turn right after it
                messages.append({"role": role, "content": content})
            parts = item.get("content")
            if isinstance(parts, str):
                parts = [{"type": "output_text" if role == "assistant" else "input_text", "text": parts}]
            items.append(
                {
                    "id": item.get("id") or new_id("msg_"),
                    "type": "message",
                    "role": role,
                    "status": item.get("status") or "completed",
                    "content": parts,
                }
            )
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise invalid(f"'{w}.{key}' must be a string.", f"{w}.{key}")
            if item.get("namespace") is not None and not isinstance(item["namespace"], str):
                raise invalid(f"'{w}.namespace' must be a string.", f"{w}.namespace")
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": flat_name(item["name"], item.get("namespace")), "arguments": item["arguments"]},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and not reasoning:  # one turn: its text, then its calls
                last.setdefault("tool_calls", []).append(call)
            else:
                assistant({"role": "assistant", "content": None, "tool_calls": [call]})
            out = {
                "id": item.get("id") or new_id("fc_"),
                "type": "function_call",
                "status": "completed",
                "call_id": item["call_id"],
                "name": item["name"],
                "arguments": item["arguments"],
            }
            if item.get("namespace"):
                out["namespace"] = item["namespace"]
            items.append(out)
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise invalid(f"'{w}.call_id' must be a string.", f"{w}.call_id")
            output = item.get("output")
            if isinstance(output, list):
                text = _parts_to_content(output, f"{w}.output", "assistant")
            elif isinstance(output, str):
                text = output
            else:
                raise invalid(f"'{w}.output' must be a string or an array of text parts.", f"{w}.output")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
            items.append(
                {
                    "id": item.get("id") or new_id("fco_"),
                    "type": "function_call_output",
                    "status": "completed",
                    "call_id": item["call_id"],
                    "output": output,
                }
            )
        elif kind == "reasoning":
            text = _reasoning_text(item, w, fields)
            if text:
                reasoning.append(text)
        elif kind in IGNORED_ITEMS:
            fields.note_ignored(
                f"input[].{kind}", "responses", "an item of a tool this server does not run; left out of the prompt"
            )
        elif kind == "item_reference":  # without refs: references() found none to fetch
            raise invalid(f"'{w}.id' must be the id of an output item of a stored response.", f"{w}.id")
        else:
            raise invalid(f"The input item type '{kind}' is not supported.", f"{w}.type")
    ids = [i["id"] for i in items]
    if len(set(ids)) != len(ids):
        seen: set[str] = set()  # the first repeated id, in one pass (`ids[:n]` per item was quadratic)
        raise duplicate_item(next(i for i in ids if i in seen or seen.add(i)))  # type: ignore[func-returns-value]
    if not messages:
        raise invalid("'input' holds no message.", "input")
    if messages[-1]["role"] not in ("user", "tool"):
        raise invalid("The last input item must be a user message or a function_call_output.", "input")
    return messages, items


def _function_tool(tool: dict[str, Any], where: str, namespace: dict[str, Any] | None = None) -> dict[str, Any]:
    check_function_def(tool, where)
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    if namespace is not None:
        fn["name"] = flat_name(tool["name"], namespace["name"])
        if namespace.get("description"):
            fn["description"] = (
                f"({namespace['name']}: {namespace['description']}) {tool.get('description') or ''}".strip()
            )
    return {"type": "function", "function": fn}


def _convert_tools(
    tools: Any, fields: FieldPolicy = PERMISSIVE
) -> tuple[list[dict[str, Any]], dict[str, tuple[str, str]]]:
    """-> (the chat tools, NAMESPACE__NAME -> (namespace, name) for the namespaces' functions)."""
    if not isinstance(tools, list):
        raise invalid("'tools' must be an array of tools.", "tools")
    out: list[dict[str, Any]] = []
    namespaced: dict[str, tuple[str, str]] = {}
    for i, tool in enumerate(tools):
        w = f"tools[{i}]"
        if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
            raise invalid(f"'{w}' must be an object with a 'type'.", w)
        kind = tool["type"]
        if kind == "function":
            out.append(_function_tool(tool, w))
        elif kind == "namespace":
            if not isinstance(tool.get("name"), str) or not tool["name"] or NAMESPACE_SEP in tool["name"]:
                raise invalid(f"'{w}.name' must be a non-empty string without '{NAMESPACE_SEP}'.", f"{w}.name")
            if not isinstance(tool.get("tools"), list):
                raise invalid(f"'{w}.tools' must be an array of tools.", f"{w}.tools")
            for j, inner in enumerate(tool["tools"]):
                if not isinstance(inner, dict) or inner.get("type") != "function":
                    fields.note_ignored(
                        f"tools[].tools[].{(inner or {}).get('type') if isinstance(inner, dict) else '?'}",
                        "responses",
                        "only a namespace's function tools reach the engine",
                    )
                    continue
                chat_tool = _function_tool(inner, f"{w}.tools[{j}]", tool)
                namespaced[chat_tool["function"]["name"]] = (tool["name"], inner["name"])
                out.append(chat_tool)
        else:
            fields.note_ignored(
                f"tools[].{kind}"[:80], "responses", "a tool the engine cannot run; left out of its tools"
            )
    names = [t["function"]["name"] for t in out]
    if len(set(names)) != len(names):
        raise invalid(f"Two tools are named {next(n for n in names if names.count(n) > 1)!r}.", "tools")
    return out, namespaced


def _convert_tool_choice(choice: Any, chat: dict[str, Any], fields: FieldPolicy = PERMISSIVE) -> None:
    """Set chat's `tool_choice` (and narrow its `tools` for `allowed_tools`) from a Responses one."""
    names = {t["function"]["name"] for t in chat.get("tools") or ()}
    if choice in ("auto", "none", "required"):
        if choice != "required" or names:
            chat["tool_choice"] = choice
        else:
            fields.note_ignored("tool_choice", "responses", "'required' with no tool the engine can run")
        return
    if not isinstance(choice, dict) or not isinstance(choice.get("type"), str):
        raise invalid("'tool_choice' must be 'auto', 'none', 'required' or an object with a 'type'.", "tool_choice")
    kind = choice["type"]
    if kind == "function":
        if not isinstance(choice.get("name"), str):
            raise invalid("'tool_choice.name' must be a string.", "tool_choice.name")
        chat["tool_choice"] = {
            "type": "function",
            "function": {"name": flat_name(choice["name"], choice.get("namespace"))},
        }
    elif kind == "allowed_tools":
        mode, allowed = choice.get("mode", "auto"), choice.get("tools")
        if mode not in ("auto", "required") or not isinstance(allowed, list):
            raise invalid(
                "'tool_choice' allowed_tools needs a 'mode' of auto or required and an array 'tools'.", "tool_choice"
            )
        keep = {
            flat_name(t.get("name"), t.get("namespace"))
            for t in allowed
            if isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("name"), str)
        }
        chat["tools"] = [t for t in chat.get("tools") or () if t["function"]["name"] in keep]
        if not chat["tools"]:
            del chat["tools"]
        elif mode == "required" or mode == "auto":
            chat["tool_choice"] = mode
    else:
        fields.note_ignored(f"tool_choice.{kind}"[:80], "responses", "a tool the engine cannot run; 'auto' instead")
        if names:
            chat["tool_choice"] = "auto"


def _convert_text(text: Any, fields: FieldPolicy = PERMISSIVE) -> dict[str, Any] | None:
    if not isinstance(text, dict):
        raise invalid("'text' must be an object.", "text")
    if text.get("verbosity") not in (None, "low", "medium", "high"):
        raise invalid("'text.verbosity' must be low, medium or high.", "text.verbosity")
    fields.check_extra(text, ("format", "verbosity"), "responses", "text.")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise invalid("'text.format' must be an object.", "text.format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict) or not isinstance(fmt.get("name"), str):
            raise invalid("'text.format' json_schema needs a string 'name' and an object 'schema'.", "text.format")
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": schema}
    raise invalid(f"The text format type '{kind}' is not supported.", "text.format.type")


def references(body: Any) -> list[str]:
    """The ids of the `item_reference` input items (what `NeedsReferences` asks the caller for)."""
    items = body.get("input") if isinstance(body, dict) else None
    if not isinstance(items, list):
        return []
    return [
        i["id"]
        for i in items
        if isinstance(i, dict) and item_type(i) == "item_reference" and isinstance(i.get("id"), str)
    ]


def parse_request(
    body: Any,
    public_model: str,
    media_hosts: tuple[str, ...] = (),
    fields: FieldPolicy = PERMISSIVE,
    refs: dict[str, dict[str, Any]] | None = None,
) -> ResponsesRequest:
    """Validate a Responses request and translate what does not depend on the stored chain.
    `media_hosts`: `proxy.media_url_hosts` (validation.check_media_url); `fields`: the engine's
    extensions and what to do with unknown fields (request_fields); `refs`: see NeedsReferences."""
    if refs is None:
        ids = references(body)
        if ids:
            raise NeedsReferences(body, ids)
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object.")
    if body.get("background") not in (None, False):  # the default: clients that send it
        raise invalid(
            "'background' is not supported: there is no background mode; send background=false.", "background"
        )
    for key, why in UNSERVED.items():
        if body.get(key) is not None:
            raise invalid(f"'{key}' is not supported: {why}.", key)
    fields.check_extra(body, KNOWN, "responses")
    check_model(body, public_model)
    if "input" not in body:
        raise invalid("'input' is required.", "input")
    messages, items = _convert_input(body["input"], media_hosts, fields, refs)
    chat: dict[str, Any] = {"model": public_model, **fields.forwarded(body)}
    for key in ("stream", "store"):
        if body.get(key) is not None and not isinstance(body[key], bool):
            raise invalid(f"'{key}' must be a boolean.", key)
    for key in ("instructions", "previous_response_id", "user", "safety_identifier", "prompt_cache_key"):
        if body.get(key) is not None and not isinstance(body[key], str):
            raise invalid(f"'{key}' must be a string.", key)
    if body.get("stream"):
        chat["stream"] = True
    for key in ("temperature", "top_p"):
        v = body.get(key)
        if v is not None:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise invalid(f"'{key}' must be a number.", key)
            chat[key] = v
    limit = body.get("max_output_tokens")
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise invalid("'max_output_tokens' must be a positive integer.", "max_output_tokens")
        chat["max_tokens"] = limit
    if body.get("parallel_tool_calls") is not None:
        if not isinstance(body["parallel_tool_calls"], bool):
            raise invalid("'parallel_tool_calls' must be a boolean.", "parallel_tool_calls")
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    namespaced: dict[str, tuple[str, str]] = {}
    if body.get("tools") is not None:
        tools, namespaced = _convert_tools(body["tools"], fields)
        if tools:
            chat["tools"] = tools
    if body.get("tool_choice") is not None:
        _convert_tool_choice(body["tool_choice"], chat, fields)
    if body.get("text") is not None:
        fmt = _convert_text(body["text"], fields)
        if fmt is not None:
            chat["response_format"] = fmt
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise invalid("'reasoning' must be an object.", "reasoning")
        # OpenAI's other Reasoning fields, explicit null: "not set", even with request_fields: reject
        fields.check_extra(
            {k: v for k, v in reasoning.items() if v is not None or k not in REASONING_UNUSED},
            ("effort", "summary"),
            "responses",
            "reasoning.",
        )
        if reasoning.get("effort") is not None:
            if reasoning["effort"] not in EFFORTS:
                raise invalid(f"'reasoning.effort' must be one of {', '.join(EFFORTS)}.", "reasoning.effort")
            chat["reasoning_effort"] = reasoning["effort"]
        if reasoning.get("summary") not in (None, "auto", "concise", "detailed"):
            raise invalid("'reasoning.summary' must be auto, concise or detailed.", "reasoning.summary")
    if body.get("truncation") not in (None, "auto", "disabled"):
        raise invalid("'truncation' must be 'auto' or 'disabled'.", "truncation")
    metadata = body.get("metadata")
    if metadata is not None and (
        not isinstance(metadata, dict)
        or len(metadata) > 16
        or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512 for k, v in metadata.items()
        )
    ):
        raise invalid(
            "'metadata' must be an object of at most 16 pairs: string keys of up to 64 characters, "
            "string values of up to 512.",
            "metadata",
        )
    include = body.get("include")
    logprobs = False
    if include is not None:
        if not isinstance(include, list):
            raise invalid("'include' must be an array.", "include")
        for i, value in enumerate(include):
            if not isinstance(value, str):
                raise invalid(f"'include[{i}]' must be a string.", f"include[{i}]")
            if value not in (INCLUDE_LOGPROBS, INCLUDE_REASONING):
                fields.note_ignored(f"include[].{value}"[:80], "responses", "nothing of it exists here")
        logprobs = INCLUDE_LOGPROBS in include
    top = body.get("top_logprobs")
    if top is not None:
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20:
            raise invalid("'top_logprobs' must be an integer from 0 to 20.", "top_logprobs")
        logprobs = True
        chat["top_logprobs"] = top
    if logprobs:
        chat["logprobs"] = True
    if body.get("user") is not None:
        chat["user"] = body["user"]
    return ResponsesRequest(
        body=body,
        chat=chat,
        messages=messages,
        input_items=items,
        stream=bool(body.get("stream")),
        store=body.get("store", True) is not False,
        logprobs=logprobs,
        encrypted_reasoning=INCLUDE_REASONING in (include or ()),
        namespaced=namespaced,
    )


# ------------------------------------------------------------------------ response


def shape_usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if not usage:
        return None
    return {
        "input_tokens": usage.get("prompt_tokens", 0),
        "input_tokens_details": {"cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)},
        "output_tokens": usage.get("completion_tokens", 0),
        "output_tokens_details": {
            "reasoning_tokens": (usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)
        },
        "total_tokens": usage.get("total_tokens", 0),
    }


def shape_logprobs(chat_logprobs: Any) -> list[dict[str, Any]]:
    content = chat_logprobs.get("content") if isinstance(chat_logprobs, dict) else None
    out = []
    for lp in content or []:
        if isinstance(lp, dict) and isinstance(lp.get("token"), str):
            out.append(
                {
                    "token": lp["token"],
                    "logprob": lp.get("logprob", 0.0),
                    "bytes": lp.get("bytes") or [],
                    "top_logprobs": [
                        {"token": t.get("token"), "logprob": t.get("logprob"), "bytes": t.get("bytes") or []}
                        for t in lp.get("top_logprobs") or []
                        if isinstance(t, dict)
                    ],
                }
            )
    return out


def status_of(finish: str | None) -> tuple[str, dict[str, Any] | None, dict[str, Any] | None]:
    """-> (status, incomplete_details, error) for a chat finish reason."""
    if finish == "length":
        return "incomplete", {"reason": "max_output_tokens"}, None
    if finish == "content_filter":
        return "incomplete", {"reason": "content_filter"}, None
    if finish in ("abort", "error"):
        return "failed", None, {"code": "server_error", "message": f"The model backend stopped the answer ({finish})."}
    return "completed", None, None


def public_call(item: dict[str, Any], req: ResponsesRequest) -> dict[str, Any]:
    """A function_call item as the client named the function: a namespace's NAMESPACE__NAME
    -> `name` and `namespace` apart (ResponsesRequest.namespaced)."""
    split = req.namespaced.get(item["name"])
    if split is not None:
        item["namespace"], item["name"] = split
    return item


def engine_call_name(item: dict[str, Any]) -> str:
    """A function_call item's name as the engine knows it (the inverse of `public_call`)."""
    return flat_name(item["name"], item.get("namespace"))


def reasoning_item(text: str, status: str, req: ResponsesRequest | None, ids: Any = new_id) -> dict[str, Any]:
    item = {
        "id": ids("rs_"),
        "type": "reasoning",
        "summary": [],
        "status": status,
        "content": [{"type": "reasoning_text", "text": text}],
    }
    if req is not None and req.encrypted_reasoning:
        item["encrypted_content"] = encode_reasoning(text)
    return item


def output_items(
    message: dict[str, Any],
    status: str,
    logprobs: list | None = None,
    req: ResponsesRequest | None = None,
    ids: Any = new_id,
) -> list[dict[str, Any]]:
    """A chat assistant message -> Responses output items (reasoning, message, function calls);
    `ids`: their ids (ItemIds of the response)."""
    items: list[dict[str, Any]] = []
    item_status = "completed" if status == "completed" else "incomplete"
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if isinstance(reasoning, str) and reasoning:
        items.append(reasoning_item(reasoning, item_status, req, ids))
    text = message.get("content") if isinstance(message.get("content"), str) else ""
    if text or not message.get("tool_calls"):  # an empty answer is still one (empty) message item
        items.append(
            {
                "id": ids("msg_"),
                "type": "message",
                "role": "assistant",
                "status": item_status,
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}],
            }
        )
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        item = {
            "id": ids("fc_"),
            "type": "function_call",
            "status": item_status,
            "call_id": call.get("id"),
            "name": fn.get("name"),
            "arguments": fn.get("arguments") or "",
        }
        items.append(public_call(item, req) if req is not None else item)
    return items


def _or(value: Any, default: Any) -> Any:
    """A request field echoed in the response: an explicit null is "not set", echoed as the default."""
    return default if value is None else value


def response_object(
    req: ResponsesRequest,
    response_id: str,
    created_at: int,
    status: str,
    output: list,
    usage: dict[str, Any] | None = None,
    error: dict[str, Any] | None = None,
    incomplete: dict[str, Any] | None = None,
) -> dict[str, Any]:
    b = req.body
    fmt = (b.get("text") or {}).get("format") or {"type": "text"}
    reasoning = b.get("reasoning") or {}
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "background": False,
        "error": error,
        "incomplete_details": incomplete,
        "instructions": b.get("instructions"),
        "max_output_tokens": b.get("max_output_tokens"),
        "model": b["model"],
        "output": output,
        "parallel_tool_calls": _or(b.get("parallel_tool_calls"), True),
        "previous_response_id": b.get("previous_response_id"),
        "prompt_cache_key": b.get("prompt_cache_key"),
        "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
        "safety_identifier": b.get("safety_identifier"),
        "store": req.store,
        "temperature": b.get("temperature"),
        "text": {"format": fmt},
        "tool_choice": _or(b.get("tool_choice"), "auto"),
        "tools": b.get("tools") or [],
        "top_logprobs": b.get("top_logprobs"),
        "top_p": b.get("top_p"),
        "truncation": _or(b.get("truncation"), "disabled"),
        "usage": usage,
        "user": b.get("user"),
        "metadata": b.get("metadata") or {},
    }


def assistant_message(message: dict[str, Any]) -> dict[str, Any]:
    """The chat message kept in the chain (reasoning left out, as clients resend it in chat)."""
    out: dict[str, Any] = {"role": "assistant", "content": message.get("content") if message.get("content") else None}
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {
                "id": c.get("id"),
                "type": "function",
                "function": {
                    "name": (c.get("function") or {}).get("name"),
                    "arguments": (c.get("function") or {}).get("arguments") or "",
                },
            }
            for c in message["tool_calls"]
        ]
    elif out["content"] is None:
        out["content"] = ""
    return out


def make_record(
    req: ResponsesRequest, tenant: str, response: dict[str, Any], answer: dict[str, Any], route: str
) -> dict[str, Any]:
    return {
        "id": response["id"],
        "tenant": tenant,
        "created_at": response["created_at"],
        "previous_response_id": req.body.get("previous_response_id"),
        "messages": [*req.history, *req.messages, assistant_message(answer)],
        "input_items": req.input_items,
        "response": response,
        "route": route,
    }


def complete_response(req: ResponsesRequest, response_id: str, created_at: int, chat: dict[str, Any]) -> dict[str, Any]:
    choice = chat["choices"][0]
    status, incomplete, error = status_of(choice.get("finish_reason"))
    logprobs = shape_logprobs(choice.get("logprobs")) if req.logprobs else None
    return response_object(
        req,
        response_id,
        created_at,
        status,
        output_items(choice["message"], status, logprobs, req, ItemIds(response_id)),
        shape_usage(chat.get("usage")),
        error,
        incomplete,
    )


def list_input_items(record: dict[str, Any], limit: int, order: str, after: str | None) -> dict[str, Any]:
    items = list(record.get("input_items") or [])
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [i.get("id") for i in items]
        items = items[ids.index(after) + 1 :] if after in ids else []
    page = items[:limit]
    # OpenAI's ResponseItemList requires both ids as strings (not nullable): "" for an empty page
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else "",
        "last_id": page[-1]["id"] if page else "",
        "has_more": len(items) > limit,
    }


# ------------------------------------------------------------------------ stream


def sse(event: dict[str, Any]) -> bytes:
    return f"event: {event['type']}\ndata: ".encode() + json.dumps(event, ensure_ascii=False).encode() + b"\n\n"


class StreamTranslator:
    """Chat chunks (from `Orchestrator.stream`) -> Responses stream events, each numbered."""

    def __init__(self, req: ResponsesRequest, response_id: str, created_at: int | None = None):
        self.req = req
        self.id = response_id
        self.ids = ItemIds(response_id)
        self.created_at = created_at if created_at is not None else int(time.time())
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the open reasoning or message item
        self.calls: dict[int, dict[str, Any]] = {}  # chat tool-call index -> open function_call item
        self.finish: str | None = None
        self.usage: dict[str, Any] | None = None
        self.message: dict[str, Any] = {"role": "assistant", "content": "", "reasoning_content": ""}

    def ev(self, type_: str, **fields: Any) -> dict[str, Any]:
        event = {"type": type_, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def snapshot(self, status: str, **kw: Any) -> dict[str, Any]:
        return response_object(self.req, self.id, self.created_at, status, kw.pop("output", []), **kw)

    def start(self) -> list[dict[str, Any]]:
        return [
            self.ev("response.created", response=self.snapshot("in_progress")),
            self.ev("response.in_progress", response=self.snapshot("in_progress")),
        ]

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.output.append(item)
        # a copy of the item as it is now (empty): the translator goes on filling it, and the event is
        # serialised later, after the rest of its chunk was fed; clients build the item on this one
        return [self.ev("response.output_item.added", output_index=len(self.output) - 1, item=copy.deepcopy(item))]

    def _close_open(self, status: str = "completed") -> list[dict[str, Any]]:
        item, self.open = self.open, None
        if item is None:
            return []
        idx = self.output.index(item)
        item["status"] = status
        part = item["content"][0]
        if item["type"] == "reasoning":
            if self.req.encrypted_reasoning:
                item["encrypted_content"] = encode_reasoning(part["text"])
            events = [
                self.ev(
                    "response.reasoning_text.done",
                    item_id=item["id"],
                    output_index=idx,
                    content_index=0,
                    text=part["text"],
                ),
                self.ev("response.content_part.done", item_id=item["id"], output_index=idx, content_index=0, part=part),
            ]
        else:
            events = [
                self.ev(
                    "response.output_text.done",
                    item_id=item["id"],
                    output_index=idx,
                    content_index=0,
                    text=part["text"],
                    logprobs=part["logprobs"],
                ),
                self.ev("response.content_part.done", item_id=item["id"], output_index=idx, content_index=0, part=part),
            ]
        return events + [self.ev("response.output_item.done", output_index=idx, item=item)]

    def _close_calls(self, status: str = "completed") -> list[dict[str, Any]]:
        events = []
        for _, item in sorted(self.calls.items()):
            idx = self.output.index(item)
            item["status"] = status
            if "namespace" not in item:
                public_call(item, self.req)
            events.append(
                self.ev(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=idx,
                    arguments=item["arguments"],
                )
            )
            events.append(self.ev("response.output_item.done", output_index=idx, item=item))
        self.calls = {}
        return events

    def _open(self, kind: str) -> list[dict[str, Any]]:
        """Close the open item, open a reasoning or message item with its one (empty) part."""
        events = self._close_open()
        if kind == "reasoning":
            item = {"id": self.ids("rs_"), "type": "reasoning", "summary": [], "status": "in_progress", "content": []}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {
                "id": self.ids("msg_"),
                "type": "message",
                "role": "assistant",
                "status": "in_progress",
                "content": [],
            }
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        events += self._add(item)
        events.append(
            self.ev(
                "response.content_part.added",
                item_id=item["id"],
                output_index=len(self.output) - 1,
                content_index=0,
                part=copy.deepcopy(part),
            )
        )
        item["content"].append(part)
        self.open = item
        return events

    def _text(self, kind: str, delta: str, logprobs: list) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self.open is None or self.open["type"] != kind:
            events += self._open(kind)
        item = self.open
        idx = self.output.index(item)
        part = item["content"][0]
        part["text"] += delta
        if kind == "reasoning":
            events.append(
                self.ev(
                    "response.reasoning_text.delta", item_id=item["id"], output_index=idx, content_index=0, delta=delta
                )
            )
        else:
            part["logprobs"].extend(logprobs)
            events.append(
                self.ev(
                    "response.output_text.delta",
                    item_id=item["id"],
                    output_index=idx,
                    content_index=0,
                    delta=delta,
                    logprobs=logprobs,
                )
            )
        return events

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """One chat chunk -> the events it makes."""
        if chunk.get("usage"):
            self.usage = shape_usage(chunk["usage"])
        events: list[dict[str, Any]] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if isinstance(reasoning, str) and reasoning:
                self.message["reasoning_content"] += reasoning
                events += self._text("reasoning", reasoning, [])
            if isinstance(delta.get("content"), str) and delta["content"]:
                self.message["content"] += delta["content"]
                lp = shape_logprobs(choice.get("logprobs")) if self.req.logprobs else []
                events += self._text("message", delta["content"], lp)
            for call in delta.get("tool_calls") or []:
                index = call.get("index", 0)
                fn = call.get("function") or {}
                item = self.calls.get(index)
                if item is None:
                    events += self._close_open()
                    item = {
                        "id": self.ids("fc_"),
                        "type": "function_call",
                        "status": "in_progress",
                        "call_id": call.get("id"),
                        "name": fn.get("name") or "",
                        "arguments": "",
                    }
                    if item["name"] in self.req.namespaced:  # engines send the whole name in the first delta
                        public_call(item, self.req)
                    self.calls[index] = item
                    events += self._add(item)
                else:
                    item["call_id"] = item["call_id"] or call.get("id")
                    item["name"] += fn.get("name") or ""
                if fn.get("arguments"):
                    item["arguments"] += fn["arguments"]
                    events.append(
                        self.ev(
                            "response.function_call_arguments.delta",
                            item_id=item["id"],
                            output_index=self.output.index(item),
                            delta=fn["arguments"],
                        )
                    )
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
        return events

    def answer(self) -> dict[str, Any]:
        """The chat message the stream made (for the chain)."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.message["content"]}
        calls = [i for i in self.output if i["type"] == "function_call"]
        if calls:
            msg["tool_calls"] = [
                {
                    "id": c["call_id"],
                    "type": "function",
                    "function": {"name": engine_call_name(c), "arguments": c["arguments"]},
                }
                for c in calls
            ]
        return msg

    def finish_events(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """-> (the closing events, the final response object)."""
        status, incomplete, error = status_of(self.finish)
        item_status = "completed" if status == "completed" else "incomplete"
        events: list[dict[str, Any]] = []
        if not any(i["type"] in ("message", "function_call") for i in self.output):
            events += self._open("message")  # no text, no call: one empty message item, as `output_items` makes
        events += self._close_open(item_status) + self._close_calls(item_status)
        final = self.snapshot(status, output=self.output, usage=self.usage, error=error, incomplete=incomplete)
        kind = {"completed": "response.completed", "incomplete": "response.incomplete", "failed": "response.failed"}[
            status
        ]
        return events + [self.ev(kind, response=final)], final

    def failed(self, exc: ProxyError) -> list[dict[str, Any]]:
        """The engine failed after the stream started: close what is open and say so."""
        events = self._close_open("incomplete") + self._close_calls("incomplete")
        error = {"code": "server_error", "message": exc.message}
        return events + [
            self.ev(
                "response.failed", response=self.snapshot("failed", output=self.output, error=error, usage=self.usage)
            )
        ]
