"""Template checks: the model's own chat template renders every message list the proxy sends.

A template that refuses the proxy's messages (Qwen3.5/3.6: "System message must be at the
beginning.", vllm#41114; an unknown role) makes the engine answer 400 to every affected request,
which no other check sees before real traffic does. So:

- `template.found`: the template the engine will use, found in the engine's order (the profile's
  `engine.args.chat-template`, else `chat_template.jinja`, else `tokenizer_config.json`); none is
  a warning naming what the engine does instead.
- `template.render`: the template, compiled once in a sandboxed Jinja environment like Hugging
  Face's (molctl.checks.jinja_sandbox), renders each request of `molctl.proxy.samples` with messages and
  variables prepared as vLLM 0.32 does (`engine_messages`, `template_kwargs`); a failure names
  the error, the hop and the shape.
- `template.prefix`: each hop's rendered prompt starts with the same hop's prompt of the previous
  turn on the same adapter, so the engine's prefix cache serves the history; a break is a warning.

Entry points: `run(profile, probes)` (the category), `Template`, `render`, `engine_messages`,
`template_kwargs`, `content_format`. The render results are cached in STATE/cache, keyed by
the template, the profile and the proxy's source files. The details (lookup order, the Jinja
environment, the preparation rules, the cache): docs/design/template-checks.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from molctl.checks.render_limits import MAX_OUTPUT, RENDER_TIMEOUT_S
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


CONTENT_FLAG = "chat-template-content-format"


def content_format(profile: Profile, template: Template) -> tuple[str, str]:
    """(the content format the engine passes messages in, where that comes from): the profile's
    engine flag, else the engine's auto detection on the template (the tools one when named). SGLang
    has no such flag; its own detection follows the same rule (a loop over a message's content)."""
    flag = profile.engine.args.get(CONTENT_FLAG)
    if flag in ("string", "openai"):
        return flag, f"engine.args.{CONTENT_FLAG}"
    from molctl.checks.jinja_sandbox import detect_content_format

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
    arguments parsed to an object (empty: {}). Unparseable or JSON non-object text is first replaced
    by "{}" as the proxy replaces it in every hop (`molctl.proxy.tool_arguments.repaired`), which
    is what vLLM 0.32 makes of it and what keeps vLLM 0.24 from refusing it."""
    from molctl.proxy.tool_arguments import repaired

    fixed = []
    for call in calls:
        if not isinstance(call, dict):
            raise EngineRefusal("assistant tool_calls entries must be objects.")
        fn = call.get("function")
        if call.get("type", "function") != "function" or not isinstance(fn, dict):
            raise EngineRefusal("chat completions only support assistant tool_calls of type 'function'.")
        args = repaired(fn.get("arguments")) or fn.get("arguments")
        if args and not isinstance(args, dict):
            args = json.loads(args) if isinstance(args, str) else None
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
    from molctl.checks.jinja_sandbox import compile_template

    return _bounded_render(compile_template(text), kwargs)


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
