"""The request's `tools` as a Response object echoes them (`echo_tools`), normalized as OpenAI's are.

OpenAI's Response carries each tool in its schema's shape (openai-openapi, components `Tool`:
FunctionTool, FileSearchTool, WebSearchTool, MCPTool, ...), not as the client sent it:
- a function tool has its four required keys (`type`, `name`, `parameters`, `strict`) and
  `description`; `strict` not sent is `true`, as OpenAI's Responses API makes function tools
  strict by default (its migration guide, "Responses vs Chat Completions"); `parameters` not
  sent is null. The engine gets `strict` only when the client sent it (vLLM and SGLang do not
  enforce it outside a guided `tool_choice`): the echo is OpenAI's, not a promise of enforcement.
- every tool keeps only the keys its schema declares (`FIELDS`); others (a client's typo, a
  newer key) are dropped from the echo, as the request-fields policy already noted or refused them.
- a hosted tool missing a key its schema requires (`file_search` without `vector_store_ids`, `mcp`
  without `server_label`, ...) is a 400 naming it (`required`), as OpenAI's "Missing required
  parameter"; its values are not checked further: hosted tools never run here.
- a lower-case tool type OpenAI has not published (yet) is echoed as sent (nothing to normalize by).
"""

from __future__ import annotations

from typing import Any

from molctl.proxy.errors import ProxyError

# tool type -> (the keys its schema declares, the keys it requires besides `type`); openai-openapi
# commit f85dbe223d40e1a31cba812ab2d755c7e98a92a3, components.schemas.Tool's alternatives
_CALLERS = ("allowed_callers",)
FIELDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "file_search": (("vector_store_ids", "max_num_results", "ranking_options", "filters"), ("vector_store_ids",)),
    "computer": ((), ()),
    "computer_use_preview": (
        ("environment", "display_width", "display_height"),
        ("environment", "display_width", "display_height"),
    ),
    "web_search": (("external_web_access", "filters", "user_location", "search_context_size"), ()),
    "web_search_2025_08_26": (("external_web_access", "filters", "user_location", "search_context_size"), ()),
    "mcp": (
        (
            "server_label",
            "server_url",
            "connector_id",
            "tunnel_id",
            "authorization",
            "server_description",
            "headers",
            "allowed_tools",
            "require_approval",
            "defer_loading",
            *_CALLERS,
        ),
        ("server_label",),
    ),
    "code_interpreter": (("container", *_CALLERS), ("container",)),
    "programmatic_tool_calling": ((), ()),
    "image_generation": (
        (
            "model",
            "quality",
            "size",
            "output_format",
            "output_compression",
            "moderation",
            "background",
            "input_fidelity",
            "input_image_mask",
            "partial_images",
            "action",
        ),
        (),
    ),
    "local_shell": ((), ()),
    "shell": (("environment", *_CALLERS), ()),
    "custom": (("name", "description", "format", "defer_loading", *_CALLERS), ("name",)),
    "tool_search": (("execution", "description", "parameters"), ()),
    "web_search_preview": (("user_location", "search_context_size", "search_content_types"), ()),
    "web_search_preview_2025_03_11": (("user_location", "search_context_size", "search_content_types"), ()),
    "apply_patch": (_CALLERS, ()),
}
FUNCTION_OPTIONAL = ("output_schema", "defer_loading", "allowed_callers")


def function_tool(tool: dict[str, Any]) -> dict[str, Any]:
    out = {
        "type": "function",
        "name": tool["name"],
        "description": tool.get("description"),
        "parameters": tool.get("parameters"),
        "strict": True if tool.get("strict") is None else tool["strict"],
    }
    out.update({k: tool[k] for k in FUNCTION_OPTIONAL if tool.get(k) is not None})
    return out


def _hosted(tool: dict[str, Any], where: str) -> dict[str, Any]:
    known = FIELDS.get(tool["type"])
    if known is None:
        return dict(tool)
    keys, required = known
    for key in required:
        if tool.get(key) is None:
            raise ProxyError(
                400,
                f"Missing required parameter: '{where}.{key}'.",
                "invalid_request_error",
                "missing_required_parameter",  # OpenAI's code for it
                f"{where}.{key}",
            )
    return {"type": tool["type"], **{k: tool[k] for k in keys if tool.get(k) is not None}}


def _namespace(tool: dict[str, Any], where: str) -> dict[str, Any]:
    inner = [
        function_tool(t) if t["type"] == "function" else _hosted(t, f"{where}.tools[{j}]")
        for j, t in enumerate(tool["tools"])
    ]
    return {"type": "namespace", "name": tool["name"], "description": tool.get("description") or "", "tools": inner}


def echo_tools(tools: Any) -> list[dict[str, Any]]:
    """The Response's `tools` for a request's (already checked by `convert._convert_tools`)."""
    out = []
    for i, tool in enumerate(tools or ()):
        if tool["type"] == "function":
            out.append(function_tool(tool))
        elif tool["type"] == "namespace":
            out.append(_namespace(tool, f"tools[{i}]"))
        else:
            out.append(_hosted(tool, f"tools[{i}]"))
    return out
