"""The profile file as data: strict YAML with the line of every key (`load_yaml_with_lines`: no
duplicate keys, no alias bombs, no values YAML cannot read), `--set` overrides
(`parse_set_option`, `apply_overrides`), and the check of that data against a type schema
(`_Validator`, the type specs `_ListOf` / `_MapOf`), whose errors name the file, the line and the
field. molctl.profiles holds the schema itself and builds the typed profile."""

from __future__ import annotations

import math
import os
import stat
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from molctl.errors import ProfileError, UsageError


class _ListOf:
    def __init__(self, item: Any):
        self.item = item


class _MapOf:
    def __init__(self, item: Any):
        self.item = item


_SCALARS = yaml.constructor.SafeConstructor()


MAX_VALUES = 100_000  # a profile holds ~100; YAML aliases of aliases expand exponentially ("billion laughs")


class Unreadable:
    """A scalar PyYAML's constructor raised on (an integer past Python's int-string limit, an
    impossible date, a tag that does not fit): kept in the data so that the validator reports it
    like any bad value, naming its field and line (it was a traceback, exit 1)."""

    def __init__(self, text: str, problem: str, too_long: bool = False):
        self.text = text
        self.problem = problem
        self.too_long = too_long  # a number past the int-string limit (not a tag or a date)

    def __str__(self) -> str:
        return f"{_short(self.text)!r}{self._digits()}: {self.problem}"

    def _digits(self) -> str:
        digits = self.text.lstrip("+-").replace("_", "")
        return f" ({len(digits)} digits)" if len(digits) > 20 and digits.isdigit() else ""


def _int_limit() -> int:
    return sys.get_int_max_str_digits() or 4300  # 0: no limit set (then 4300, the default, as a bound to name)


def _construct_problem(node: yaml.Node, exc: Exception) -> str:
    if isinstance(exc, yaml.YAMLError):  # e.g. a tag no constructor reads
        return getattr(exc, "problem", None) or str(exc).splitlines()[0]
    kind = node.tag.rpartition(":")[2]
    what = {"int": "integer", "float": "number", "bool": "true/false"}.get(kind, kind)
    if "Exceeds the limit" in str(exc):  # int() refuses more digits than sys.get_int_max_str_digits()
        return f"not a valid {what}: more than {_int_limit()} digits"
    if kind == "timestamp" and isinstance(exc, ValueError) and str(exc):  # datetime's own words: day out of range
        return f"not a valid {what}: {str(exc).splitlines()[0]}"
    return f"not a valid {what}"


def _too_long_int(value: Any) -> bool:
    """An int no message could print: str() raises past the int-string limit (a hexadecimal or
    sexagesimal YAML integer is read without that limit)."""
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            str(value)
        except ValueError:
            return True
    return False


# what PyYAML's constructor raises on a node it cannot make a value of
_CONSTRUCT_ERRORS = (yaml.YAMLError, ValueError, TypeError, AttributeError, OverflowError)


def _scalar(node: yaml.Node) -> Any:
    """A scalar node's value, or `Unreadable` where the constructor raises or makes an unprintable int."""
    try:
        value = _SCALARS.construct_object(node, deep=True)
    except _CONSTRUCT_ERRORS as exc:
        _SCALARS.recursive_objects.pop(node, None)  # else an alias of the same node reads as "recursive"
        return Unreadable(str(node.value), _construct_problem(node, exc), too_long="Exceeds the limit" in str(exc))
    if _too_long_int(value):
        return Unreadable(str(node.value), f"not a valid integer: more than {_int_limit()} digits", too_long=True)
    return value


def _construct(node: yaml.Node, path: str, lines: dict[str, int]) -> Any:
    lines[path] = node.start_mark.line + 1
    if len(lines) > MAX_VALUES:  # one entry per value constructed (an alias's copies have their own paths)
        raise ProfileError(f"more than {MAX_VALUES} values (aliases expanding?); a profile holds a few hundred", None)
    if isinstance(node, yaml.MappingNode):
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            key = str(key_node.value) if isinstance(key_node, yaml.ScalarNode) else _key(key_node)
            child = f"{path}.{key}" if path else key
            if key in out:
                raise ProfileError(
                    f"line {key_node.start_mark.line + 1}: duplicate key '{child}'", None
                )  # file: by caller
            out[key] = _construct(value_node, child, lines)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_construct(item, f"{path}[{i}]", lines) for i, item in enumerate(node.value)]
    # scalars: the composer already resolved the tag (int, bool, null, float, str)
    return _scalar(node)


def _key(node: yaml.Node) -> str:
    """A complex mapping key (`? [a, b]`) as text; one that does not construct is one line."""
    try:
        value = _SCALARS.construct_object(node, deep=True)
        return str(value)
    except _CONSTRUCT_ERRORS:
        _SCALARS.recursive_objects.pop(node, None)
        raise ProfileError(f"line {node.start_mark.line + 1}: a mapping key that cannot be read", None) from None


def _not_a_file(path: Path) -> str | None:
    """Why `path` is no profile file to read: a directory, a dangling symbolic link, or something
    else that is not a regular file (a FIFO would block the read forever)."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return f"is a dangling symbolic link (to {os.readlink(path)})" if path.is_symlink() else None
    except OSError:
        return None  # the read says why (a symlink loop, permissions)
    if stat.S_ISDIR(mode):
        return "is a directory"
    return None if stat.S_ISREG(mode) else "is not a regular file"


def load_yaml_with_lines(path: Path) -> tuple[dict[str, Any], dict[str, int]]:
    problem = _not_a_file(path)
    if problem:
        raise ProfileError(f"{path}: cannot read profile: {problem}")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ProfileError(f"{path}: cannot read profile: {exc.strerror}") from None
    except UnicodeDecodeError as exc:  # was a traceback from `profiles`, `check` and `up`
        raise ProfileError(f"{path}: cannot read profile: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    try:
        node = yaml.compose(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ProfileError(f"{path}{where}: invalid YAML: {problem}") from None
    if node is None:
        raise ProfileError(f"{path}: profile is empty")
    if not isinstance(node, yaml.MappingNode):
        raise ProfileError(f"{path}:{node.start_mark.line + 1}: a profile must be a mapping of keys")
    lines: dict[str, int] = {}
    try:
        data = _construct(node, "", lines)
    except ProfileError as exc:
        raise ProfileError(f"{path}: {exc}") from None
    return data, lines


def parse_set_option(item: str) -> tuple[str, Any]:
    """`engine.port=9000` -> ("engine.port", 9000). The value is read as YAML, as a profile file
    is, except that what YAML cannot make of it is the text itself (`engine.env.PASS=!secret`: a
    tag; `{a: 1, a: 2}`: a duplicate key), as it always was. A number too long to be one
    (`engine.port=99...9`, 5000 digits) is `Unreadable`, reported by the validator as
    "FILE (--set KEY): field 'KEY': ..." (it was a traceback)."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise UsageError(f"--set {item!r}: expected dotted.key=value, e.g. engine.port=9000")
    if not raw.strip():
        return key, ""
    try:
        node = yaml.compose(raw, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except yaml.YAMLError:
        return key, raw
    if node is None:
        return key, None
    try:
        value = _construct(node, "", {})
    except ProfileError:  # a duplicate key, an alias bomb: the text, never expanded
        return key, raw
    bad = _unreadable_in(value)
    if bad is None:
        return key, value
    if not bad.too_long:
        return key, raw
    return key, value if bad is value else Unreadable(raw, bad.problem, too_long=True)


def _unreadable_in(value: Any) -> Unreadable | None:
    """The first `Unreadable` in a value, or None."""
    if isinstance(value, Unreadable):
        return value
    if isinstance(value, (list, dict)):
        for v in value.values() if isinstance(value, dict) else value:
            bad = _unreadable_in(v)
            if bad is not None:
                return bad
    return None


def apply_overrides(data: dict[str, Any], overrides: Iterable[tuple[str, Any]]) -> None:
    for key, value in overrides:
        target = data
        parts = key.split(".")
        for part in parts[:-1]:
            nxt = target.get(part)
            if nxt is None:
                nxt = target[part] = {}
            if not isinstance(nxt, dict):
                raise ProfileError(f"--set {key}: '{part}' is not a mapping in this profile")
            target = nxt
        target[parts[-1]] = value


def _type_name(spec: Any) -> str:
    if isinstance(spec, tuple):
        return " or ".join(_type_name(s) for s in spec)
    if isinstance(spec, _ListOf):
        return f"a list of {_type_name(spec.item)}"
    if isinstance(spec, _MapOf):
        return f"a mapping of {_type_name(spec.item)}"
    if isinstance(spec, dict):
        return "a mapping"
    if spec is type(None):
        return "null"
    return {str: "a string", int: "an integer", float: "a number", bool: "true/false"}.get(spec, str(spec))


def _matches(value: Any, spec: Any) -> bool:
    if isinstance(spec, tuple):
        return any(_matches(value, s) for s in spec)
    if isinstance(spec, _ListOf):
        return isinstance(value, list) and all(_matches(v, spec.item) for v in value)
    if isinstance(spec, _MapOf):
        return isinstance(value, dict) and all(_matches(v, spec.item) for v in value.values())
    if isinstance(spec, dict):
        return isinstance(value, dict)
    if spec is bool:
        return isinstance(value, bool)
    if spec is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if spec is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, spec)


class _Validator:
    def __init__(self, source: Path, lines: dict[str, int], overridden: set[str], required: set[str]):
        self.source = source
        self.lines = lines
        self.overridden = overridden
        self.required = required

    def where(self, path: str) -> str:
        if path in self.overridden or any(path.startswith((o + ".", o + "[")) for o in self.overridden):
            return f"{self.source} (--set {path})"
        probe = path
        while probe:
            if probe in self.lines:
                return f"{self.source}:{self.lines[probe]}"
            probe = probe.rpartition(".")[0]
        return str(self.source)

    def fail(self, path: str, message: str) -> ProfileError:
        shown = path if path.isprintable() else path.encode("unicode_escape").decode("ascii")  # a NUL in a key
        return ProfileError(f"{self.where(path)}: field '{shown}': {message}")

    def walk(self, data: dict[str, Any], schema: dict[str, Any], prefix: str = "") -> None:
        for key, value in data.items():
            path = f"{prefix}{key}"
            if key not in schema:
                known = ", ".join(sorted(schema))
                raise self.fail(path, f"unknown key (expected one of: {known})")
            self.check(path, value, schema[key])
        for req in self.required:
            head, _, tail = req.partition(".")
            if prefix == "" and not tail and head not in data:
                raise self.fail(req, "missing (required)")
            if prefix == head + "." and tail not in data:
                raise self.fail(req, "missing (required)")
        if prefix == "":
            for section, spec in schema.items():
                if isinstance(spec, dict) and section not in data:
                    missing = [r for r in self.required if r.startswith(section + ".")]
                    if missing:
                        raise self.fail(sorted(missing)[0], "missing (required)")

    def check(self, path: str, value: Any, spec: Any) -> None:
        """One value against its type spec. A mapping's or a list's entries are checked one by one,
        so that a bad entry is named (`engine.env.HF_HUB_OFFLINE`, `engine.args.x[1]`) with its own
        line and only its own value: the whole mapping was printed, HF_TOKEN's value included."""
        if isinstance(value, Unreadable):
            raise self.fail(path, str(value))
        if _too_long_int(value):  # from code (an override): no message could print it
            raise self.fail(path, f"{_short(value)}: not a valid integer: more than {_int_limit()} digits")
        if isinstance(spec, dict):
            if not isinstance(value, dict):
                raise self.fail(path, f"expected a mapping, got {type(value).__name__}")
            self.walk(value, spec, path + ".")
        elif isinstance(spec, _MapOf) and isinstance(value, dict):
            for key, item in value.items():
                self.check(f"{path}.{key}", item, spec.item)
        elif isinstance(spec, _ListOf) and isinstance(value, list):
            for i, item in enumerate(value):
                self.check(f"{path}[{i}]", item, spec.item)
        elif not _matches(value, spec):
            for option in spec if isinstance(spec, tuple) else ():  # a list value of a "scalar or list" field
                if (
                    isinstance(option, _ListOf)
                    and isinstance(value, list)
                    or isinstance(option, _MapOf)
                    and isinstance(value, dict)
                ):
                    self.check(path, value, option)  # raises, naming the entry
            raise self.fail(path, f"expected {_type_name(spec)}, got {_shown(value)}")


def _short(value: Any) -> str:
    try:
        text = str(value)
    except ValueError:  # an int past the int-string limit
        return f"(an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits)"
    return text if len(text) <= 20 else text[:20] + "..."


def _shown(value: Any) -> str:
    """A bad value as a message shows it: shortened, and never a mapping's contents (the other
    entries of engine.env may be secrets)."""
    if isinstance(value, dict):
        return "a mapping"
    return repr(_short(value)) if isinstance(value, str) else _short(value)
