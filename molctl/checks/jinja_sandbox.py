"""The Jinja side of the template checks: a chat template compiled as Hugging Face's
apply_chat_template compiles it (`compile_template`: ImmutableSandboxedEnvironment, trim_blocks,
lstrip_blocks, loopcontrols, `raise_exception`, `tojson` with ensure_ascii=False and indent,
`strftime_now`, a no-op `{% generation %}`), bounded so a template cannot take the host's memory
or CPU, and vLLM's content-format detection on its AST (`detect_content_format`).

molctl.checks.template imports this module where it renders (jinja2 is imported then, not when
`molctl check` starts)."""

from __future__ import annotations

import functools
import json
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.nodes as nodes
from jinja2.exceptions import SecurityError
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from molctl.checks.render_limits import BRACE_WIDTHS, MAX_OUTPUT, PERCENT_WIDTHS


@lru_cache(maxsize=16)
def compile_template(text: str):
    """Compile `text` like Hugging Face's apply_chat_template does (cached per text)."""
    env = Bounded(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    for name in ("center", "indent", "wordwrap", "truncate"):  # filters with a width: `'x' | center(10**10)`
        env.filters[name] = _sized(env.filters[name])
    do_format = env.filters["format"]

    @functools.wraps(do_format)
    def bounded_format(value, *args, **kwargs):  # '%10000000000s' | format(1)
        if isinstance(value, str):
            _check_format(value, PERCENT_WIDTHS, args, kwargs)
        return do_format(value, *args, **kwargs)

    env.filters["format"] = bounded_format
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(text)


class Generation(Extension):
    """`{% generation %}...{% endgeneration %}` (assistant-token masks in training templates): a no-op."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
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
            raise SecurityError(f"a width of {value} is above the {MAX_OUTPUT}-character limit of a rendered prompt")


def _sized(fn):
    @functools.wraps(fn)  # keeps Jinja's pass_context/pass_environment marks
    def wrapper(value, *args, **kwargs):
        _check_sizes(args, kwargs)
        return fn(value, *args, **kwargs)

    return wrapper


# ------------------------------------------------------------------------------ content format
def detect_content_format(text: str) -> str:
    """vLLM 0.32's `--chat-template-content-format auto` (renderers/hf.py, _detect_content_format and
    _iter_nodes_assign_content_item), re-implemented on the template's Jinja AST: "openai" (content
    passed as a list of parts) when a loop iterates over a message's content (`for x in
    message.content`, a variable assigned from it, a macro parameter it is passed to, or a loop over
    `content` outside macros), else "string"; "string" for a template that does not parse."""
    try:
        ast = compile_template(text).environment.parse(text)
    except Exception:
        return "string"
    items = _message_items(ast)
    bound, in_macros = _content_params(ast, items)
    for loop in ast.find_all(nodes.For):
        it = loop.iter
        if any(_access(it, m, "content") for m in items):
            return "openai"
        if isinstance(it, nodes.Name) and (
            it.name in bound.get(id(loop), ()) or (id(loop) not in in_macros and it.name == "content")
        ):
            return "openai"
    return "string"


def _var(node, name):
    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == name


def _attr(node, name, key):
    if isinstance(node, nodes.Getitem):
        return _var(node.node, name) and isinstance(node.arg, nodes.Const) and node.arg.value == key
    return isinstance(node, nodes.Getattr) and _var(node.node, name) and node.attr == key


def _access(node, name, key=None):
    if isinstance(node, nodes.Filter):
        return node.node is not None and _access(node.node, name, key)
    if isinstance(node, nodes.Test):
        return _access(node.node, name, key)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
        return _access(node.node, name, key)
    return _attr(node, name, key) if key else _var(node, name)


def _message_items(ast) -> list[str]:
    """The loop variables that iterate over the messages (or a variable assigned from them)."""
    names, queue = ["messages"], ["messages"]
    while queue:  # variables assigned from messages (or a slice or filter of it)
        current = queue.pop(0)
        for assign in ast.find_all(nodes.Assign):
            if _access(assign.node, current) and isinstance(assign.target, nodes.Name):
                names.append(assign.target.name)
                if assign.target.name != current:
                    queue.append(assign.target.name)
    return [
        loop.target.name
        for loop in ast.find_all(nodes.For)
        if isinstance(loop.target, nodes.Name) and any(_access(loop.iter, n) for n in names)
    ]


def _content_params(ast, items: list[str]) -> tuple[dict[int, set[str]], set[int]]:
    """For each loop inside a macro: the macro's parameters a message's content is passed to; and
    the ids of every loop inside a macro."""
    bound: dict[int, set[str]] = {}
    in_macros: set[int] = set()
    for macro in ast.find_all(nodes.Macro):
        params = {a.name for a in macro.args}
        content_params = set()
        for call in ast.find_all(nodes.Call):
            if isinstance(call.node, nodes.Name) and call.node.name == macro.name:
                for i, arg in enumerate(call.args):
                    if i < len(macro.args) and any(_access(arg, m, "content") for m in items):
                        content_params.add(macro.args[i].name)
                for kw in call.kwargs:
                    if kw.key in params and any(_access(kw.value, m, "content") for m in items):
                        content_params.add(kw.key)
        for loop in macro.find_all(nodes.For):
            in_macros.add(id(loop))
            if content_params:
                bound[id(loop)] = content_params
    return bound, in_macros
