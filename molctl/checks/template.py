"""Template checks: the model's own chat template renders every message list the proxy sends.

A template that refuses the proxy's messages (Qwen3.5/3.6: "System message must be at the
beginning.", vllm#41114; an unknown role) makes the engine answer 400 to every affected request,
which no other check sees before real traffic does. So:

- `template.found`: the template the engine will use, found in the engine's order (the profile's
  `engine.args.chat-template`, else `chat_template.jinja`, else `tokenizer_config.json`); none is
  a warning naming what the engine does instead.
- `template.render`: the template, compiled once in a sandboxed Jinja environment like Hugging
  Face's (`compile_template`), renders each request of `molctl.proxy.samples` with messages and
  variables prepared as vLLM 0.32 does (`engine_messages`, `template_kwargs`); a failure names
  the error, the hop and the shape.
- `template.prefix`: each hop's rendered prompt starts with the same hop's prompt of the previous
  turn on the same adapter, so the engine's prefix cache serves the history; a break is a warning.

Entry points: `run(profile, probes)` (the category), `Template`, `render`, `engine_messages`,
`template_kwargs`, `detect_content_format`. The render results are cached in STATE/cache, keyed by
the template, the profile and the proxy's source files. The details (lookup order, the Jinja
environment, the preparation rules, the cache): docs/design/template-checks.md.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, NamedTuple

from molctl.checks.result import CheckResult, Probes
from molctl.engines import get_engine
from molctl.profiles import Profile

JINJA_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


@dataclass
class Template:
    source: str  # where it came from, for details
    texts: dict[str, str]  # name -> template text ("default" for a single template)
    tokens: dict[str, str]

    def pick(self, has_tools: bool) -> tuple[str, str]:
        if len(self.texts) == 1:
            return next(iter(self.texts.items()))
        if has_tools and "tool_use" in self.texts:
            return "tool_use", self.texts["tool_use"]
        if "default" in self.texts:
            return "default", self.texts["default"]
        raise KeyError(f"no 'default' template among {', '.join(self.texts)}")


class NotFound(Exception):
    pass


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):  # AddedToken form
        return value["content"]
    return None


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: JSON nested too deep
        raise ValueError(f"{path}: {exc}") from None
    return data if isinstance(data, dict) else None


def tokenizer_dir(profile: Profile) -> Path:
    tok = profile.engine.args.get("tokenizer")
    if isinstance(tok, str) and tok.strip():
        path = Path(tok).expanduser()
        if path.is_absolute() or path.exists():
            return path
    return profile.base_dir


def find_template(profile: Profile) -> Template:
    """The chat template the engine will use; raises NotFound (with the reason) or ValueError."""
    directory = tokenizer_dir(profile)
    config = _read_json(directory / TOKENIZER_CONFIG) or {}
    tokens = {k: t for k in SPECIAL_TOKENS if (t := _token_text(config.get(k))) is not None}
    if len(tokens) < len(SPECIAL_TOKENS):
        special = _read_json(directory / "special_tokens_map.json") or {}
        for k in SPECIAL_TOKENS:
            if k not in tokens and (t := _token_text(special.get(k))) is not None:
                tokens[k] = t

    flag = profile.engine.args.get("chat-template")
    if isinstance(flag, str) and flag:
        path = Path(flag).expanduser()
        try:
            if path.is_file():
                return Template(
                    f"{path} (engine flag chat-template)", {"default": path.read_text(encoding="utf-8")}, tokens
                )
        except OSError:
            pass
        if any(c in flag for c in "{}\n"):
            return Template("the engine flag chat-template (inline)", {"default": flag}, tokens)
        raise NotFound(
            f"engine flag chat-template {flag!r} names no file here (a built-in template name of the "
            f"engine is not rendered by this check)"
        )

    jinja = directory / JINJA_FILE
    if jinja.is_file():
        try:
            return Template(str(jinja), {"default": jinja.read_text(encoding="utf-8")}, tokens)
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{jinja}: {exc}") from None

    value = config.get("chat_template")
    if isinstance(value, str) and value:
        return Template(f"{directory / TOKENIZER_CONFIG} chat_template", {"default": value}, tokens)
    if isinstance(value, list) and value:
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if not named or not all(isinstance(k, str) and isinstance(v, str) for k, v in named.items()):
            raise ValueError(
                f"{directory / TOKENIZER_CONFIG}: chat_template list entries need a string 'name' and 'template'"
            )
        return Template(f"{directory / TOKENIZER_CONFIG} chat_template (named: {', '.join(named)})", named, tokens)
    raise NotFound(
        f"no chat template: no {JINJA_FILE} or 'chat_template' in {directory / TOKENIZER_CONFIG}, "
        "and no engine flag chat-template"
    )


def _fallback(profile: Profile) -> str:
    return get_engine(profile.engine.kind).no_template_fallback


# ---------------------------------------------------------------------------------- rendering
@lru_cache(maxsize=16)
def compile_template(text: str):
    """Compile `text` like Hugging Face's apply_chat_template does (cached per text)."""
    import jinja2
    from jinja2.exceptions import SecurityError
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}` (assistant-token masks in training templates): a no-op."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    class Bounded(ImmutableSandboxedEnvironment):
        """`*` and `**` are intercepted (and so never folded at compile time): `'x' * 10**10` or
        `10 ** 10**8` would take the memory or the CPU of the host; a width above MAX_OUTPUT given
        to a string method (`'x'.ljust(10**10)`) or a width filter is refused for the same reason."""

        intercepted_binops = frozenset({"*", "**", "%"})

        def call_binop(self, context, operator, left, right):
            if operator == "%" and isinstance(left, str):  # '%10000000000s' % 1
                _check_format(left, PERCENT_WIDTHS, right if isinstance(right, tuple) else (right,), {})
            if operator == "*" and (
                isinstance(left, int)
                and isinstance(right, (str, list, tuple))
                or isinstance(right, int)
                and isinstance(left, (str, list, tuple))
            ):
                count, seq = (left, right) if isinstance(left, int) else (right, left)
                if count * len(seq) > MAX_OUTPUT:
                    raise SecurityError(
                        f"a sequence of {len(seq)} repeated {count} times is above the "
                        f"{MAX_OUTPUT}-character limit of a rendered prompt"
                    )
            if (
                operator == "**"
                and isinstance(left, int)
                and isinstance(right, int)
                and abs(left) > 1
                and right * max(abs(left).bit_length(), 1) > 1_000_000
            ):
                raise SecurityError(f"{left} ** {right} is too large to compute")
            return super().call_binop(context, operator, left, right)

        def call(self, __context, __obj, *args, **kwargs):
            if isinstance(getattr(__obj, "__self__", None), str):  # 'x'.ljust(N), .center, .zfill, .expandtabs
                _check_sizes(args, kwargs)
            return super().call(__context, __obj, *args, **kwargs)

        def wrap_str_format(self, value):  # Jinja's sandboxed str.format / format_map, bounded
            wrapped = super().wrap_str_format(value)
            if wrapped is None:
                return None

            @functools.wraps(wrapped)
            def bounded(*args, **kwargs):  # '{:>10000000000}'.format(1), '{:{w}}'.format(1, w=10**10)
                _check_format(value.__self__, BRACE_WIDTHS, args, kwargs)
                return wrapped(*args, **kwargs)

            return bounded

    def _check_format(fmt, pattern, args, kwargs):
        """A format string's widths and precisions; its arguments too where they can be widths
        (`%*s`, `{:{w}}`): a large number that is only formatted ('%d' % 1700000000) is fine."""
        if "*" in fmt or ":{" in fmt:
            _check_sizes(args, kwargs)
        for numbers in pattern.findall(fmt):
            _check_sizes(tuple(int(n) for n in numbers if n), {})

    def _check_sizes(args, kwargs):
        for value in (*args, *kwargs.values()):
            if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_OUTPUT:
                raise SecurityError(
                    f"a width of {value} is above the {MAX_OUTPUT}-character limit of a rendered prompt"
                )

    def sized(fn):
        @functools.wraps(fn)  # keeps Jinja's pass_context/pass_environment marks
        def wrapper(value, *args, **kwargs):
            _check_sizes(args, kwargs)
            return fn(value, *args, **kwargs)

        return wrapper

    env = Bounded(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    for name in ("center", "indent", "wordwrap", "truncate"):  # filters with a width: `'x' | center(10**10)`
        env.filters[name] = sized(env.filters[name])
    do_format = env.filters["format"]

    @functools.wraps(do_format)
    def bounded_format(value, *args, **kwargs):  # '%10000000000s' | format(1)
        if isinstance(value, str):
            _check_format(value, PERCENT_WIDTHS, args, kwargs)
        return do_format(value, *args, **kwargs)

    env.filters["format"] = bounded_format
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(text)


# ------------------------------------------------------------------------------ content format
CONTENT_FLAG = "chat-template-content-format"


def detect_content_format(text: str) -> str:
    """vLLM 0.32's `--chat-template-content-format auto` (renderers/hf.py, _detect_content_format and
    _iter_nodes_assign_content_item), re-implemented on the template's Jinja AST: "openai" (content
    passed as a list of parts) when a loop iterates over a message's content (`for x in
    message.content`, a variable assigned from it, a macro parameter it is passed to, or a loop over
    `content` outside macros), else "string"; "string" for a template that does not parse."""
    import jinja2.nodes as nodes

    try:
        ast = compile_template(text).environment.parse(text)
    except Exception:
        return "string"

    def var(node, name):
        return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == name

    def attr(node, name, key):
        if isinstance(node, nodes.Getitem):
            return var(node.node, name) and isinstance(node.arg, nodes.Const) and node.arg.value == key
        return isinstance(node, nodes.Getattr) and var(node.node, name) and node.attr == key

    def access(node, name, key=None):
        if isinstance(node, nodes.Filter):
            return node.node is not None and access(node.node, name, key)
        if isinstance(node, nodes.Test):
            return access(node.node, name, key)
        if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
            return access(node.node, name, key)
        return attr(node, name, key) if key else var(node, name)

    names, queue = ["messages"], ["messages"]
    while queue:  # variables assigned from messages (or a slice or filter of it)
        current = queue.pop(0)
        for assign in ast.find_all(nodes.Assign):
            if access(assign.node, current) and isinstance(assign.target, nodes.Name):
                names.append(assign.target.name)
                if assign.target.name != current:
                    queue.append(assign.target.name)
    items = [
        loop.target.name
        for loop in ast.find_all(nodes.For)
        if isinstance(loop.target, nodes.Name) and any(access(loop.iter, n) for n in names)
    ]
    bound: dict[int, set[str]] = {}
    in_macros: set[int] = set()
    for macro in ast.find_all(nodes.Macro):
        params = {a.name for a in macro.args}
        content_params = set()
        for call in ast.find_all(nodes.Call):
            if isinstance(call.node, nodes.Name) and call.node.name == macro.name:
                for i, arg in enumerate(call.args):
                    if i < len(macro.args) and any(access(arg, m, "content") for m in items):
                        content_params.add(macro.args[i].name)
                for kw in call.kwargs:
                    if kw.key in params and any(access(kw.value, m, "content") for m in items):
                        content_params.add(kw.key)
        for loop in macro.find_all(nodes.For):
            in_macros.add(id(loop))
            if content_params:
                bound[id(loop)] = content_params
    for loop in ast.find_all(nodes.For):
        it = loop.iter
        if any(access(it, m, "content") for m in items):
            return "openai"
        if isinstance(it, nodes.Name) and (
            it.name in bound.get(id(loop), ()) or (id(loop) not in in_macros and it.name == "content")
        ):
            return "openai"
    return "string"


def content_format(profile: Profile, template: Template) -> tuple[str, str]:
    """(the content format the engine passes messages in, where that comes from): the profile's
    engine flag, else the engine's auto detection on the template (the tools one when named). SGLang
    has no such flag; its own detection follows the same rule (a loop over a message's content)."""
    flag = profile.engine.args.get(CONTENT_FLAG)
    if flag in ("string", "openai"):
        return flag, f"engine.args.{CONTENT_FLAG}"
    found = {detect_content_format(text) for text in template.texts.values()}
    fmt = "openai" if "openai" in found else "string"
    return fmt, f"{profile.engine.kind}'s auto detection on the template"


class EngineRefusal(ValueError):
    """What vLLM answers 400 before the template runs (its message)."""


def _parts(content: Any) -> list[Any]:
    """A message's content as vLLM parses it: a string is one text part, None no part."""
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return list(content) if isinstance(content, list) else [content]


def _shaped(parts: list[Any], content_format: str) -> Any:
    """vLLM 0.32 (renderers/chat_utils.py, _parse_chat_message_content_parts): "string" joins the
    text parts with newlines; "openai" passes the parts as a list of {"type": "text", ...} dicts.
    Non-text parts are kept as sent (the template decides: images in a system message raise)."""
    texts = [p.get("text", "") for p in parts if isinstance(p, dict) and p.get("type") == "text"]
    if len(texts) < len(parts):
        return parts
    if content_format == "openai":
        return [{"type": "text", "text": t} for t in texts]
    return "\n".join(texts)


def _engine_tool_calls(calls: list[Any]) -> list[dict[str, Any]]:
    """vLLM 0.32's _postprocess_messages: a non-object entry or a type other than function is a 400;
    arguments parsed to an object (empty, unparseable or a JSON non-object: {}, with a warning)."""
    fixed = []
    for call in calls:
        if not isinstance(call, dict):
            raise EngineRefusal("assistant tool_calls entries must be objects.")
        fn = call.get("function")
        if call.get("type", "function") != "function" or not isinstance(fn, dict):
            raise EngineRefusal("chat completions only support assistant tool_calls of type 'function'.")
        args = fn.get("arguments")
        if args and not isinstance(args, dict):
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except ValueError:
                    args = None
            args = args if isinstance(args, dict) else {}
        fixed.append({**call, "function": {**fn, "arguments": args or {}}})
    return fixed


def engine_messages(messages: list[dict[str, Any]], content_format: str = "string") -> list[dict[str, Any]]:
    """Messages as vLLM 0.32 hands them to the template (entrypoints/openai/chat_completion/
    protocol.py, renderers/chat_utils.py): only role, content, tool_calls, tool_call_id, name and
    the reasoning are kept; `reasoning_content` is read as `reasoning` and an assistant's reasoning
    is passed as both `reasoning` and `reasoning_content`; content in `content_format` ("string"
    or "openai", see `content_format`), a tool message's text parts always joined with newlines;
    tool calls as `_engine_tool_calls` (an empty list dropped)."""
    out = []
    for msg in messages:
        role = msg.get("role")
        reasoning = msg.get("reasoning")
        if reasoning is None:
            reasoning = msg.get("reasoning_content")
        parts = _parts(msg.get("content"))
        shaped = _shaped(parts, "string" if role == "tool" else content_format)
        one: dict[str, Any] = {"role": role, "content": shaped}
        if role == "assistant":
            calls = msg.get("tool_calls")
            if isinstance(calls, list) and calls:
                one["tool_calls"] = _engine_tool_calls(calls)
            if reasoning is not None:
                one["reasoning"] = one["reasoning_content"] = reasoning
        elif role == "tool" and "tool_call_id" in msg:
            one["tool_call_id"] = msg["tool_call_id"]
        if isinstance(msg.get("name"), str):
            one["name"] = msg["name"]
        out.append(one)
    return out


def template_kwargs(payload: dict[str, Any]) -> dict[str, Any]:
    """The variables vLLM 0.32 passes besides messages and tools (ChatCompletionRequest.
    build_chat_params): the request's chat_template_kwargs, overridden by add_generation_prompt,
    continue_final_message, documents and reasoning_effort where set, and enable_thinking =
    (reasoning_effort != "none") when an effort is given and the kwargs do not set it."""
    kwargs = dict(payload.get("chat_template_kwargs") or {})
    effort = payload.get("reasoning_effort")
    extra = {
        "add_generation_prompt": payload.get("add_generation_prompt", True),
        "continue_final_message": payload.get("continue_final_message", False),
        "documents": payload.get("documents"),
        "reasoning_effort": effort,
    }
    if effort is not None and "enable_thinking" not in kwargs:
        extra["enable_thinking"] = effort != "none"
    kwargs.update({k: v for k, v in extra.items() if v is not None and v != "auto"})  # vLLM's merge_kwargs
    return kwargs


def render(template: Template, payload: dict[str, Any], content_format: str = "string") -> str:
    """Render one engine request as vLLM prepares it; raises what the template (or vLLM) raises."""
    tools = payload.get("tools") or None
    _, text = template.pick(bool(tools))
    kwargs = template_kwargs(payload)
    kwargs.update(messages=engine_messages(payload["messages"], content_format), tools=tools)
    for key, value in template.tokens.items():
        kwargs.setdefault(key, value)
    return _bounded_render(compile_template(text), kwargs)


MAX_OUTPUT = 4 * 1024 * 1024  # characters of one rendered prompt (a real one is kilobytes)
# the widths and precisions of printf-style and str.format format strings (a huge one allocates it)
PERCENT_WIDTHS = re.compile(r"%(?:\([^)]*\))?[#0 +-]*(\d+)?(?:\.(\d+))?")
BRACE_WIDTHS = re.compile(r"\{[^{}]*:[^{}]*?(\d+)(?:\.(\d+))?[^{}]*\}")
RENDER_TIMEOUT_S = 5.0  # of one render (a real one takes milliseconds)


class RenderLimit(Exception):
    """A template that does not end in time or renders more than MAX_OUTPUT characters."""


def _bounded_render(compiled, kwargs: dict[str, Any]) -> str:
    """`compiled.render(**kwargs)`, streamed and bounded: more than MAX_OUTPUT characters, or a
    template still running after RENDER_TIMEOUT_S (nested `range(100000)` loops), raises
    RenderLimit. The time bound is a trace function on the template's own frames (Jinja compiles
    a template to Python code named `<template>`), so it works outside the main thread too."""
    deadline = time.monotonic() + RENDER_TIMEOUT_S

    def on_line(frame, event, arg):
        if time.monotonic() > deadline:
            raise RenderLimit(f"still rendering after {RENDER_TIMEOUT_S:g} s (a loop that does not end?)")
        return on_line

    def on_call(frame, event, arg):
        return on_line if frame.f_code.co_filename == "<template>" else None

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        parts, size = [], 0
        for chunk in compiled.generate(**kwargs):
            size += len(chunk)
            if size > MAX_OUTPUT:
                raise RenderLimit(f"renders more than {MAX_OUTPUT} characters for one request")
            parts.append(chunk)
        return "".join(parts)
    finally:
        sys.settrace(previous)


class Step(NamedTuple):
    """One rendered prompt of a sample conversation, in the order the proxy sent it."""

    hop: str
    adapter: str
    prompt: str
    shape: str = ""
    conversation: str = ""


# The earlier hops a hop's prompt must extend: the previous turn's same hop on the same adapter in
# the same conversation. A hop the proxy builds as the continuation of another (a summary that
# continues its answer's prompt) is checked by adding it here, e.g. "summary": ("answer",), and
# passing its steps: it is then compared with the latest of those hops before it.
CONTINUES: dict[str, tuple[str, ...]] = {"route": ("route",), "answer": ("answer",)}


class Break(NamedTuple):
    step: Step
    previous: Step
    at: int  # the first character where they differ


def prefix_breaks(
    steps: list[Step] | list[tuple[str, str, str]], continues: dict[str, tuple[str, ...]] | None = None
) -> tuple[int, list[Break]]:
    """(how many continuations were compared, the ones whose prompt does not start with the one it
    continues). `steps` in the order sent; plain (hop, adapter, prompt) tuples are one conversation."""
    continues = CONTINUES if continues is None else continues
    latest: dict[tuple[str, str, str], Step] = {}
    compared, breaks = 0, []
    for raw in steps:
        step = raw if isinstance(raw, Step) else Step(*raw)
        prev = None
        for hop in continues.get(step.hop, ()):
            cand = latest.get((step.conversation, step.adapter, hop))
            if cand is not None:
                prev = cand
        if prev is not None:
            compared += 1
            if not step.prompt.startswith(prev.prompt):
                at = next(
                    (i for i, (a, b) in enumerate(zip(prev.prompt, step.prompt, strict=False)) if a != b),
                    min(len(prev.prompt), len(step.prompt)),
                )
                breaks.append(Break(step, prev, at))
        if step.hop in {h for hops in continues.values() for h in hops}:
            latest[(step.conversation, step.adapter, step.hop)] = step
    return compared, breaks


def _around(text: str, at: int, width: int = 20) -> str:
    """`width` characters either side of `at`, escaped (newlines as \\n), with ... where cut."""
    piece = (
        json.dumps(text[max(at - width, 0) : at], ensure_ascii=False)[1:-1]
        + "|"
        + json.dumps(text[at : at + width], ensure_ascii=False)[1:-1]
    )
    return ("..." if at > width else "") + piece + ("..." if at + width < len(text) else "")


def prefix_result(steps: list[Step] | list[tuple[str, str, str]], source: str = "the template") -> CheckResult:
    compared, breaks = prefix_breaks(steps)
    hops = ", ".join(CONTINUES)
    if not breaks:
        return CheckResult(
            "template.prefix",
            "pass",
            f"{compared} continuations ({hops} hops, turn to turn on the "
            f"same adapter) extend the previous prompt with {source}",
        )
    first = breaks[0]
    step, prev, at = first
    turn = f" for shape '{step.shape}'" if step.shape else ""
    since = f" of '{prev.shape}'" if prev.shape else ""
    more = f"; {len(breaks)} of {compared} continuations break" if len(breaks) > 1 else ""
    if len(breaks) > 1:
        others = sorted({f"{b.step.hop}/{b.step.shape}" for b in breaks[1:]} - {f"{step.hop}/{step.shape}"})
        if others:
            more += f" (also {', '.join(others[:3])}{' and more' if len(others) > 3 else ''})"
    return CheckResult(
        "template.prefix",
        "warn",
        f"the {step.hop} hop on {step.adapter}{turn} does not extend its previous prompt{since} with "
        f"{source}: they part at character {at} of {len(prev.prompt)} (the engine prefills the rest "
        f"again): expected '{_around(prev.prompt, at)}', rendered '{_around(step.prompt, at)}'{more}",
    )


def missing_text(payload: dict[str, Any], prompt: str) -> tuple[str, str] | None:
    """(the role, the text) of the first tool result or instruction (system, developer, tool
    message text) that does not reach the rendered prompt as text: absent, or printed as a
    part dict (`{'type': 'text', ...}`, a template given list content it does not read)."""
    for msg in payload.get("messages", []):
        if msg.get("role") not in ("system", "developer", "tool"):
            continue
        for part in _parts(msg.get("content")):
            if not (isinstance(part, dict) and part.get("type") == "text" and part.get("text", "").strip()):
                continue
            text = part["text"].strip()
            lines = [line.strip() for line in text.splitlines() if line.strip()]
            kept = all(line in prompt or json.dumps(line, ensure_ascii=False)[1:-1] in prompt for line in lines)
            if not kept or "{'type': 'text'" in prompt:  # the part itself printed (Python's repr of a dict)
                return msg["role"], text
    return None


def _error_text(exc: BaseException) -> str:
    message = str(exc).strip() or type(exc).__name__
    first = message.splitlines()[0]
    return first if type(exc).__name__ == "TemplateError" else f"{type(exc).__name__}: {first}"


def _cache_path(profile: Profile, template: Template, probes: Probes) -> Path | None:
    if probes.state_dir is None or not probes.state_dir.is_dir():
        return None
    import molctl
    import molctl.proxy

    h = hashlib.sha256()
    h.update(json.dumps([template.source, template.texts, template.tokens], sort_keys=True).encode())
    h.update(repr(profile).encode())
    root = Path(molctl.__file__).parent
    for base, pattern in (
        (Path(molctl.proxy.__file__).parent, "*.py"),
        (root / "engines", "*.py"),
        (Path(__file__).parent, "template.py"),
        (root, "profiles.py"),
    ):
        for path in sorted(base.glob(pattern)):
            st = path.stat()
            h.update(f"{path}:{st.st_size}:{st.st_mtime_ns};".encode())
    return probes.state_dir / "cache" / f"template-{h.hexdigest()[:24]}.json"


def _cached(path: Path | None) -> list[CheckResult] | None:
    if path is None:
        return None
    try:
        data = json.loads(path.read_text())
        return [
            CheckResult(r["id"], r["status"], r["detail"] + " (remembered from an earlier check)")
            for r in data["results"]
        ]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _remember(path: Path | None, results: list[CheckResult]) -> None:
    if path is None:
        return
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        for old in path.parent.glob("template-*.json"):
            if old != path and time.time() - old.stat().st_mtime > 7 * 86400:
                old.unlink(missing_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"results": [{"id": r.id, "status": r.status, "detail": r.detail} for r in results]}))
        os.replace(tmp, path)
    except OSError:
        pass


def run(profile: Profile, probes: Probes) -> list[CheckResult]:
    if not tokenizer_dir(profile).is_dir() and not profile.engine.args.get("chat-template"):
        return [
            CheckResult("template.found", "skip", f"{tokenizer_dir(profile)} is missing (see model.root)"),
            CheckResult("template.render", "skip", "no template to render"),
            CheckResult("template.prefix", "skip", "no template to render"),
        ]
    try:
        template = find_template(profile)
    except NotFound as exc:
        return [
            CheckResult("template.found", "warn", f"{exc}; {_fallback(profile)}"),
            CheckResult("template.render", "skip", "no template to render"),
            CheckResult("template.prefix", "skip", "no template to render"),
        ]
    except ValueError as exc:
        return [
            CheckResult("template.found", "fail", str(exc)),
            CheckResult("template.render", "skip", "no template to render"),
            CheckResult("template.prefix", "skip", "no template to render"),
        ]
    out = [CheckResult("template.found", "pass", f"{template.source} ({sum(map(len, template.texts.values()))} chars)")]
    cache = _cache_path(profile, template, probes)
    if (hit := _cached(cache)) is not None:
        return [*out, *hit]
    started = time.perf_counter()
    results = _render_all(profile, template)
    _remember(cache, results)
    took = f" (in {(time.perf_counter() - started) * 1000:.0f} ms)"
    return [*out, *(CheckResult(r.id, r.status, r.detail + took) for r in results)]


def _render_all(profile: Profile, template: Template) -> list[CheckResult]:
    from molctl.proxy.samples import collect

    try:
        requests = collect(profile)
    except Exception as exc:  # the proxy itself failed on a sample: that is a finding too
        return [
            CheckResult(
                "template.render", "fail", f"the proxy failed to build its sample requests: {_error_text(exc)}"
            ),
            CheckResult("template.prefix", "skip", "no sample requests"),
        ]
    fmt, why = content_format(profile, template)
    failures: list[tuple[str, str, str]] = []
    steps: list[Step] = []
    for req in requests:
        try:
            text = render(template, req.payload, fmt)
        except Exception as exc:  # template errors, and TypeError/UndefinedError from a template that assumes shapes
            failures.append((req.hop, req.shape, _error_text(exc)))
            continue
        if (lost := missing_text(req.payload, text)) is not None:
            role, gone = lost
            shown = json.dumps(gone[:40], ensure_ascii=False)
            what = "tool result" if role == "tool" else f"{role} instruction"
            failures.append(
                (
                    req.hop,
                    req.shape,
                    f"the {what} {shown} is not in the prompt as text with content "
                    f"format '{fmt}' ({why}); expected it verbatim",
                )
            )
            continue
        steps.append(Step(req.hop, str(req.payload.get("model")), text, req.shape, req.conversation))
    return [
        _render_result(template, requests, failures),
        prefix_result(steps, template.source)
        if not failures
        else CheckResult("template.prefix", "skip", "not every request renders (see template.render)"),
    ]


def _render_result(template: Template, requests: list, failures: list[tuple[str, str, str]]) -> CheckResult:
    shapes = len({r.shape for r in requests})
    if failures:
        hop, shape, error = failures[0]
        more = ""
        if len(failures) > 1:
            more = f"; {len(failures)} of {len(requests)} requests fail"
            others = sorted({f"{h}/{s}" for h, s, _ in failures[1:]} - {f"{hop}/{shape}"})
            if others:
                more += f" (also {', '.join(others[:3])}{' and more' if len(others) > 3 else ''})"
        verb = "renders wrongly:" if error.startswith("the ") and "content format" in error else "raises"
        shown = error if verb != "raises" else repr(error)
        return CheckResult(
            "template.render", "fail", f"{template.source} {verb} {shown} on the {hop} hop for shape '{shape}'{more}"
        )
    return CheckResult(
        "template.render",
        "pass",
        f"{len(requests)} requests of {shapes} shapes (route, answer, summary hops) render with {template.source}",
    )
