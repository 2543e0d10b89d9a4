"""The Responses shapes' schemas for the tests: openai-openapi's components (tests/data/
openai_responses_schemas.json names the commit), validated with `jsonschema`, and Open Responses'
OpenAPI 2026-04-24 as the pydantic models of `openresponses-types`. `check(component, value)`
validates a value against both (tests/proxy/apis/test_responses_shapes_match_openai_schema.py)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import openresponses_types.types as open_types
import pydantic

SPEC = json.loads((Path(__file__).parent / "data" / "openai_responses_schemas.json").read_text())
# The one place openai-openapi's schema and Open Responses' disagree: the Response's `user` and
# `usage` are typed non-null there, while OpenAI's own examples of `response.created` carry
# `"user": null, "usage": null` and Open Responses requires both, nullable. The proxy sends null.
for _key in ("user", "usage"):
    _props = SPEC["components"]["schemas"]["ModelResponseProperties" if _key == "user" else "Response"]
    _props = _props["properties"] if "properties" in _props else _props["allOf"][-1]["properties"]
    _props[_key] = {"anyOf": [_props[_key], {"type": "null"}]}
# OpenAI's names for the reasoning text's events; Open Responses names them response.reasoning.delta
# and .done (the proxy sends OpenAI's, which the SDKs parse)
OPENAI_ONLY_EVENTS = ("response.reasoning_text.delta", "response.reasoning_text.done")
# Open Responses' models (its OpenAPI 2026-04-24, as pydantic models: openresponses-types), by event type
OPEN_EVENTS = {
    next(iter(cls.model_fields["type"].annotation)).value: cls
    for name, cls in vars(open_types).items()
    if name.endswith("StreamingEvent") and isinstance(cls, type) and issubclass(cls, pydantic.BaseModel)
}


def event_schema(event_type: str) -> str:
    """The ResponseStreamEvent alternative for an event type (its own errors name the field)."""
    schemas = SPEC["components"]["schemas"]
    for alt in schemas["ResponseStreamEvent"]["anyOf"]:
        name = alt["$ref"].rsplit("/", 1)[-1]
        if event_type in schemas[name]["properties"]["type"].get("enum", ()):
            return name
    raise AssertionError(f"OpenAI's schema has no event {event_type!r}")


def check(component: str, value: dict, open_responses: bool = True) -> None:
    """`value` against OpenAI's schema `component` and, for a Response or an event, Open Responses'
    model (`open_responses`: False for a Response echoing hosted tools, which Open Responses has not)."""
    if component == "Response" and open_responses:
        open_types.ResponseResource.model_validate(value)
    if component == "ResponseStreamEvent":
        if value["type"] not in OPENAI_ONLY_EVENTS:
            OPEN_EVENTS[value["type"]].model_validate(value)
        check(event_schema(value["type"]), value)
    schema = {"$ref": f"#/components/schemas/{component}", "components": SPEC["components"]}
    found = jsonschema.Draft202012Validator(schema).iter_errors(value)
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message[:300]}" for e in found]
    assert not errors, (value.get("type"), errors)
