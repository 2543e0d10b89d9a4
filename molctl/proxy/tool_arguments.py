"""Tool-call `arguments` in a client's history that no engine version would fail on.

Chat templates take a history tool call's arguments as an object, so vLLM parses the JSON text
before rendering. vLLM 0.24 `json.loads` it and answers 400 on text that is not JSON ("Unterminated
string ...", vllm/entrypoints/chat_utils.py `_postprocess_messages`), and hands a JSON non-object
("[]", "42") to the template as it is; vLLM 0.32 coerces both to `{}` with a warning
(vllm/renderers/chat_utils.py, same function: one malformed call would otherwise fail every later
turn of the conversation). The proxy sends what 0.32 makes of it to every version: such arguments
become "{}" before any hop is built, and `molctl check`'s template render goes through the same
function (`molctl.checks.template`).
"""

from __future__ import annotations

import json
from typing import Any


def repaired(arguments: Any) -> str | None:
    """ "{}" for arguments text that is not a JSON object (malformed, or valid JSON of another kind,
    `null` included); None when it needs nothing (an object, empty or absent arguments)."""
    if not isinstance(arguments, str) or not arguments:
        return None
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return "{}"
    return None if isinstance(parsed, dict) else "{}"


def repair_history(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[int]]:
    """`messages` with every assistant tool call's arguments `repaired` (new dicts for the changed
    messages and calls only; the client's own are never changed), and the indices of the messages
    changed."""
    out: list[dict[str, Any]] | None = None
    changed: list[int] = []
    for i, msg in enumerate(messages):
        calls = msg.get("tool_calls") if msg.get("role") == "assistant" else None
        if not isinstance(calls, list):
            continue
        fixed = []
        for call in calls:
            fn = call.get("function") if isinstance(call, dict) else None
            text = repaired(fn.get("arguments")) if isinstance(fn, dict) else None
            fixed.append(call if text is None else {**call, "function": {**fn, "arguments": text}})
        if any(a is not b for a, b in zip(fixed, calls, strict=True)):
            if out is None:
                out = list(messages)
            out[i] = {**msg, "tool_calls": fixed}
            changed.append(i)
    return (messages if out is None else out), changed
