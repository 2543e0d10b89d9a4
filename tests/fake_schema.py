"""What the fake engine answers for a client's own tools and output schemas: tool-call arguments
and structured output that validate against the JSON Schema the client sent, as a real engine
with guided decoding gives them (vLLM's tool parsers and structured outputs), so clients that
validate what they get (pydantic-ai, the AI SDK, LangChain) accept it."""

from __future__ import annotations

import json
import re
from typing import Any

SAMPLES = {"string": "Paris", "integer": 3, "number": 1.5, "boolean": True, "null": None}


def sample(schema: Any, defs: dict[str, Any] | None = None, depth: int = 0) -> Any:
    """A value that validates against the common subset of JSON Schema clients send (type,
    properties/required, items, enum/const, anyOf/oneOf, $ref into $defs/definitions)."""
    if not isinstance(schema, dict) or depth > 8:
        return "Paris"
    defs = defs if defs is not None else {**schema.get("definitions", {}), **schema.get("$defs", {})}
    if "$ref" in schema:
        return sample(defs.get(schema["$ref"].rsplit("/", 1)[-1], {}), defs, depth + 1)
    if "const" in schema:
        return schema["const"]
    if schema.get("enum"):
        return schema["enum"][0]
    for key in ("anyOf", "oneOf", "allOf"):
        if schema.get(key):
            options = [s for s in schema[key] if not (isinstance(s, dict) and s.get("type") == "null")] or schema[key]
            return sample(options[0], defs, depth + 1)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object" or (kind is None and "properties" in schema):
        props = schema.get("properties") or {}
        return {name: sample(sub, defs, depth + 1) for name, sub in props.items()}
    if kind == "array":
        n = max(1, schema.get("minItems", 1))
        return [sample(schema.get("items", {}), defs, depth + 1) for _ in range(n)]
    if kind == "string" and schema.get("format") == "date":
        return "2026-12-03"
    return SAMPLES.get(kind, "Paris")


def tool_named(payload: dict, marker: str | None) -> tuple[str, str] | None:
    """(name, arguments) of the call a `[tool:NAME]` marker asks for (`[tool]`: the request's
    first tool), arguments built from that tool's schema; None without a marker or tool."""
    if marker is None:
        return None
    tools = [t.get("function") or {} for t in payload.get("tools") or []]
    if marker == "":
        fn = tools[0] if tools else None
    else:
        fn = next((t for t in tools if t.get("name") == marker), None)
        if fn is None:  # a tool the request did not send: the old fixed arguments
            return marker, json.dumps({"city": "Paris", "unit": "celsius", "days": 3})
    if fn is None:
        return None
    return fn["name"], json.dumps(sample(fn.get("parameters") or {"type": "object"}))


TOOL_MARKER = re.compile(r"\[tool(?::([\w.\-]+))?\]")


def structured_answer(payload: dict) -> str | None:
    """The content a response_format (json_schema or json_object) or structured_outputs.json asks for."""
    fmt = payload.get("response_format") or {}
    if fmt.get("type") == "json_schema":
        return json.dumps(sample((fmt.get("json_schema") or {}).get("schema") or {"type": "object"}))
    if fmt.get("type") == "json_object":
        return json.dumps({"answer": "Paris"})
    so = payload.get("structured_outputs") or {}
    if isinstance(so.get("json"), dict):
        return json.dumps(sample(so["json"]))
    return None
