"""Responses input items and tools as chat messages and chat tools (`protocol.parse_request` calls these).

`_convert_input` turns input items into chat messages (message items, `function_call` -> an
assistant message's `tool_calls`, `function_call_output` -> a `tool` message, `reasoning` -> the
next assistant message's reasoning; hosted tools' items are left out with a note); `_convert_tools`,
`_convert_tool_choice` and `_convert_text` do the same for tools, the tool choice and the text
format. The choices behind each are in docs/design/proxy.md, "The Responses API".
"""

from __future__ import annotations

import base64
import os
import re
import zlib
from typing import Any

from molctl.proxy.apis.chat_validation import check_finite, check_function_def, check_media_url
from molctl.proxy.apis.request_fields import PERMISSIVE, FieldPolicy
from molctl.proxy.apis.responses.compaction_item import decode_compaction
from molctl.proxy.errors import ProxyError, invalid, shown

TEXT_PARTS = ("input_text", "output_text", "text")
NAMESPACE_SEP = "__"  # a namespace's function as the engine sees it: NAMESPACE__NAME
# a namespace's name becomes part of its functions' names at the engine (NAMESPACE__NAME): the
# characters a function name may hold (OpenAI: a-z, A-Z, 0-9, underscores and dashes; dots too)
NAMESPACE_NAME = re.compile(r"(?!.*__)[A-Za-z0-9_.-]{1,64}")
HOSTED_KIND = re.compile(r"[a-z][a-z0-9_]*")  # OpenAI's hosted tool types: web_search, mcp, ...

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
# What reasoning `encrypted_content` may inflate to (a 21 KB item inflated to 16 MiB, 8 of them
# peaked the proxy at 699 MB): an item at most 4 MiB (about 1M tokens of text, past any answer's
# reasoning at proxy.max_output_tokens), a request's items together at most 8 MiB (the body limit:
# no more text than a client may send in the clear).
REASONING_ITEM_MAX = 4 << 20
REASONING_REQUEST_MAX = 8 << 20


def encode_reasoning(text: str) -> str:
    """A reasoning item's `encrypted_content`: the text, opaque to the client (see the module docstring)."""
    return ENCRYPTED_PREFIX + base64.urlsafe_b64encode(zlib.compress(text.encode("utf-8"))).decode("ascii")


def decode_reasoning(blob: str, limit: int = REASONING_ITEM_MAX) -> str | None:
    """The text of an `encrypted_content` this proxy made, else None; OverflowError when it
    inflates past `limit` bytes (it is never inflated further than that)."""
    if not blob.startswith(ENCRYPTED_PREFIX):
        return None
    try:
        inflate = zlib.decompressobj()
        data = inflate.decompress(base64.urlsafe_b64decode(blob[len(ENCRYPTED_PREFIX) :]), limit + 1)
        if len(data) > limit:
            raise OverflowError(limit)
        return data.decode("utf-8")
    except (ValueError, zlib.error):
        return None


def new_id(prefix: str) -> str:
    return prefix + os.urandom(12).hex()


def duplicate_item(item_id: str) -> ProxyError:
    return invalid(
        f"Duplicate item found with id {shown(item_id)}. Remove duplicate items from your input and try again.", "input"
    )


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
            detail = part.get("detail")
            if detail is not None and detail not in IMAGE_DETAILS:
                raise invalid(f"'{w}.detail' must be one of {', '.join(IMAGE_DETAILS)}.", f"{w}.detail")
            if detail is not None:
                image["detail"] = detail
            out.append({"type": "image_url", "image_url": image})
        else:
            raise invalid(f"The content part type '{kind}' is not supported here.", f"{w}.type")
    if all(p["type"] == "text" for p in out):
        return "".join(p["text"] for p in out) if role == "assistant" or len(out) == 1 else out
    return out


def _reasoning_text(item: dict[str, Any], where: str, fields: FieldPolicy, room: int) -> tuple[str | None, int]:
    """(What a `reasoning` input item says, the bytes inflated for it): its content text, else
    its summary text, else the `encrypted_content` this proxy made (another server's is noted and
    gives None), which may inflate to at most REASONING_ITEM_MAX bytes and `room` (what the
    request's earlier items left of REASONING_REQUEST_MAX): past either it is a 400 naming it."""
    for key, kinds in (("content", ("reasoning_text", "text")), ("summary", ("summary_text",))):
        parts = item.get(key)
        if parts is not None and not isinstance(parts, list):
            raise invalid(f"'{where}.{key}' must be an array.", f"{where}.{key}")
        texts = [p.get("text") for p in parts or () if isinstance(p, dict) and p.get("type") in kinds]
        if any(not isinstance(t, str) for t in texts):
            raise invalid(f"'{where}.{key}' parts need a string 'text'.", f"{where}.{key}")
        if texts:
            return "".join(texts) if key == "content" else "\n\n".join(texts), 0
    blob = item.get("encrypted_content")
    if blob is None:
        return None, 0
    field = f"{where}.encrypted_content"
    if not isinstance(blob, str):
        raise invalid(f"'{field}' must be a string.", field)
    try:
        text = decode_reasoning(blob, min(REASONING_ITEM_MAX, room))
    except OverflowError:
        raise invalid(
            f"'{field}' inflates past {min(REASONING_ITEM_MAX, room)} bytes (at most {REASONING_ITEM_MAX} "
            f"per item, {REASONING_REQUEST_MAX} for a request's reasoning items together).",
            field,
        ) from None
    if text is None:
        fields.note_ignored("input[].encrypted_content", "responses", "reasoning another server encrypted; left out")
        return None, 0
    return text, len(text.encode("utf-8"))


IMAGE_DETAILS = ("low", "high", "auto")  # an input_image's `detail`, as OpenAI takes it
SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


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
    conv = _Input(media_hosts, fields)
    for i, item in enumerate(value):
        w = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid(f"'{w}' must be an object.", w)
        if (
            item_type(item) == "item_reference"
            and refs is not None
            and isinstance(item.get("id"), str)
            and item["id"] in refs
        ):
            item = refs[item["id"]]
        conv.add(item, w)
    messages, items = conv.messages, conv.items
    ids = [i["id"] for i in items]
    if len(set(ids)) != len(ids):
        seen: set[str] = set()  # the first repeated id, in one pass (`ids[:n]` per item was quadratic)
        raise duplicate_item(next(i for i in ids if i in seen or seen.add(i)))  # type: ignore[func-returns-value]
    if not messages:
        raise invalid("'input' holds no message.", "input")
    if messages[-1]["role"] not in ("user", "tool"):
        raise invalid("The last input item must be a user message or a function_call_output.", "input")
    return messages, items


class _Input:
    """The input items converted so far: chat messages, the items as `/input_items` returns them,
    and the reasoning waiting for the assistant message it precedes."""

    def __init__(self, media_hosts: tuple[str, ...], fields: FieldPolicy):
        self.media_hosts, self.fields = media_hosts, fields
        self.messages: list[dict[str, Any]] = []
        self.items: list[dict[str, Any]] = []
        self.reasoning: list[str] = []  # reasoning items waiting for the assistant message they precede
        self.inflated = 0  # bytes of encrypted reasoning inflated so far (REASONING_REQUEST_MAX)

    def assistant(self, msg: dict[str, Any]) -> dict[str, Any]:
        if self.reasoning:
            msg["reasoning"] = msg["reasoning_content"] = "\n\n".join(self.reasoning)
            self.reasoning.clear()
        self.messages.append(msg)
        return msg

    def add(self, item: dict[str, Any], w: str) -> None:
        kind = item_type(item)
        if not isinstance(kind, str):  # a list or an object is no type name (nor a set or dict key)
            raise invalid(f"'{w}.type' must be a string.", f"{w}.type")
        if item.get("id") is not None and not isinstance(item["id"], str):  # echoed by input_items, used by `after`
            raise invalid(f"'{w}.id' must be a string.", f"{w}.id")
        if kind == "message":
            self.message(item, w)
        elif kind == "function_call":
            self.function_call(item, w)
        elif kind == "function_call_output":
            self.function_call_output(item, w)
        elif kind == "reasoning":
            text, inflated = _reasoning_text(item, w, self.fields, REASONING_REQUEST_MAX - self.inflated)
            self.inflated += inflated
            if text:
                self.reasoning.append(text)
        elif kind == "compaction":  # of POST /v1/responses/compact: the folded turn's assistant message
            self.compaction(item, w)
        elif kind in IGNORED_ITEMS:
            self.fields.note_ignored(
                f"input[].{kind}", "responses", "an item of a tool this server does not run; left out of the prompt"
            )
        elif kind == "item_reference":  # without refs: references() found none to fetch
            raise invalid(f"'{w}.id' must be the id of an output item of a stored response.", f"{w}.id")
        else:
            raise invalid(f"The input item type '{kind}' is not supported.", f"{w}.type")

    def message(self, item: dict[str, Any], w: str) -> None:
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise invalid(f"'{w}.role' must be one of user, assistant, system, developer.", f"{w}.role")
        content = _parts_to_content(item.get("content"), f"{w}.content", role, self.media_hosts)
        if role == "assistant":
            self.assistant({"role": role, "content": content})
        else:
            self.reasoning.clear()  # reasoning belongs to the assistant turn right after it
            self.messages.append({"role": role, "content": content})
        parts = item.get("content")
        if isinstance(parts, str):
            parts = [{"type": "output_text" if role == "assistant" else "input_text", "text": parts}]
        self.items.append(
            {
                "id": item.get("id") or new_id("msg_"),
                "type": "message",
                "role": role,
                "status": item.get("status") or "completed",
                "content": parts,
            }
        )

    def function_call(self, item: dict[str, Any], w: str) -> None:
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
        last = self.messages[-1] if self.messages else None
        if (
            last is not None and last["role"] == "assistant" and not self.reasoning
        ):  # one turn: its text, then its calls
            last.setdefault("tool_calls", []).append(call)
        else:
            self.assistant({"role": "assistant", "content": None, "tool_calls": [call]})
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
        self.items.append(out)

    def compaction(self, item: dict[str, Any], w: str) -> None:
        text = decode_compaction(item.get("encrypted_content"))
        if text is None:
            raise invalid(
                f"'{w}.encrypted_content' must be a compaction item made by this server.", f"{w}.encrypted_content"
            )
        self.assistant({"role": "assistant", "content": text})
        self.items.append(
            {
                "id": item.get("id") or new_id("cmp_"),
                "type": "compaction",
                "encrypted_content": item["encrypted_content"],
            }
        )

    def function_call_output(self, item: dict[str, Any], w: str) -> None:
        if not isinstance(item.get("call_id"), str):
            raise invalid(f"'{w}.call_id' must be a string.", f"{w}.call_id")
        output = item.get("output")
        if isinstance(output, list):
            text = _parts_to_content(output, f"{w}.output", "assistant")
        elif isinstance(output, str):
            text = output
        else:
            raise invalid(f"'{w}.output' must be a string or an array of text parts.", f"{w}.output")
        self.messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
        self.items.append(
            {
                "id": item.get("id") or new_id("fco_"),
                "type": "function_call_output",
                "status": "completed",
                "call_id": item["call_id"],
                "output": output,
            }
        )


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


def _hosted_kind(kind: str, where: str, kinds: tuple[str, ...]) -> None:
    """A tool type the engine cannot run is a hosted tool's (lower-case snake case, as all of
    OpenAI's are) and none of `kinds` in another spelling: `"Function"` is a 400, as in chat."""
    if kind.lower() in kinds or not HOSTED_KIND.fullmatch(kind):
        raise invalid(f"The tool type {shown(kind)} is not supported; expected one of {', '.join(kinds)}.", where)


def _namespace_tools(tool: dict[str, Any], w: str, fields: FieldPolicy) -> list[tuple[dict[str, Any], str]]:
    """A namespace's function tools as (chat tool, its own name); a nested namespace or a misspelt type is a 400
    naming it, a hosted or custom tool inside one is noted and left out."""
    if not isinstance(tool.get("name"), str) or not NAMESPACE_NAME.fullmatch(tool["name"]):
        raise invalid(
            f"'{w}.name' must be a non-empty name of letters, digits, '_', '-' or '.' without '{NAMESPACE_SEP}'.",
            f"{w}.name",
        )
    if not isinstance(tool.get("tools"), list):
        raise invalid(f"'{w}.tools' must be an array of tools.", f"{w}.tools")
    out = []
    for j, inner in enumerate(tool["tools"]):
        where = f"{w}.tools[{j}]"
        if not isinstance(inner, dict) or not isinstance(inner.get("type"), str):
            raise invalid(f"'{where}' must be an object with a 'type'.", where)
        if inner["type"] == "function":
            out.append((_function_tool(inner, where, tool), inner["name"]))
            continue
        _hosted_kind(inner["type"], f"{where}.type", ("function", "namespace"))
        fields.note_ignored(f"tools[].tools[].{inner['type']}"[:80], "responses", "only a namespace's functions run")
    return out


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
            for chat_tool, name in _namespace_tools(tool, w, fields):
                namespaced[chat_tool["function"]["name"]] = (tool["name"], name)
                out.append(chat_tool)
        else:
            _hosted_kind(kind, f"{w}.type", ("function", "namespace"))
            fields.note_ignored(
                f"tools[].{kind}"[:80], "responses", "a tool the engine cannot run; left out of its tools"
            )
    names = [t["function"]["name"] for t in out]
    if len(set(names)) != len(names):
        raise invalid(f"Two tools are named {next(n for n in names if names.count(n) > 1)!r}.", "tools")
    return out, namespaced


def _convert_tool_choice(choice: Any, chat: dict[str, Any], fields: FieldPolicy = PERMISSIVE) -> None:
    """Set chat's `tool_choice` (and narrow its `tools` for `allowed_tools`) from a Responses
    one. A choice the engine cannot follow (`required` with no function tool to call) is a 400
    naming it, never dropped."""
    names = {t["function"]["name"] for t in chat.get("tools") or ()}
    if choice in ("auto", "none", "required"):
        if choice == "required" and not names:
            raise invalid(
                "'tool_choice' is 'required' but no function tool is declared (hosted tools do not run here).",
                "tool_choice",
            )
        chat["tool_choice"] = choice
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
        _allowed_tools(choice, chat)
    else:
        fields.note_ignored(f"tool_choice.{kind}"[:80], "responses", "a tool the engine cannot run; 'auto' instead")
        if names:
            chat["tool_choice"] = "auto"


def _allowed_tools(choice: dict[str, Any], chat: dict[str, Any]) -> None:
    """`allowed_tools`: the engine gets only the named function tools, and the mode; `required`
    naming no declared function tool is a 400 (nothing could be called)."""
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
    if chat["tools"]:
        chat["tool_choice"] = mode
        return
    del chat["tools"]
    if mode == "required":
        raise invalid(
            "'tool_choice.tools' names no declared function tool, and mode 'required' needs one to call.",
            "tool_choice.tools",
        )


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
        if not SCHEMA_NAME.fullmatch(fmt["name"]):  # OpenAI: a-z, A-Z, 0-9, underscores and dashes, up to 64
            raise invalid(
                "'text.format.name' must be 1 to 64 letters, digits, underscores or dashes.", "text.format.name"
            )
        check_finite(fmt["schema"], "text.format.schema")
        if fmt.get("strict") is not None and not isinstance(fmt["strict"], bool):
            raise invalid("'text.format.strict' must be a boolean.", "text.format.strict")
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": schema}
    raise invalid(f"The text format type '{kind}' is not supported.", "text.format.type")
