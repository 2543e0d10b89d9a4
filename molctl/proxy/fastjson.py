"""JSON on the proxy's hot path: orjson where it gives the same JSON values as the standard
library, the standard library everywhere else.

- `loads`: orjson, which accepts exactly RFC 8259 JSON; anything it refuses (NaN/Infinity
  tokens, lone surrogate escapes, invalid text), and any text with a run of 19 digits (orjson
  reads an integer beyond 64 bits as a float: the standard library keeps it exact) goes to
  `json.loads`, so
  what is accepted and every error message stay the standard library's. Non-finite floats that
  the standard library produces are `NonFinite` (a float) so that `dumps_bytes` writes them back
  as it would (`NaN`, `Infinity`), not as orjson's `null`.
- `dumps_bytes`: orjson (compact, UTF-8: the same values as `json.dumps`, fewer bytes); what it
  cannot encode (integers beyond 64 bits, lone surrogates, other types) goes to `json.dumps`.

About 8x faster than the standard library for the hop payloads (a route payload of a few KiB:
~4 us against ~30 us), which pays on a path that encodes three payloads and decodes three answers
per turn (BENCHMARKS.md, "Proxy overhead")."""

from __future__ import annotations

import json
import math
import re
from typing import Any

import orjson

from molctl.engines.base import RawIds


class NonFinite(float):
    """A NaN or an infinity decoded by the standard library (orjson refuses them)."""

    __slots__ = ()


def _parse_float(text: str) -> float:
    value = float(text)
    return value if math.isfinite(value) else NonFinite(value)


def _parse_constant(name: str) -> float:
    return NonFinite(name.replace("Infinity", "inf"))


STDLIB_DECODER = json.JSONDecoder(parse_float=_parse_float, parse_constant=_parse_constant)


# a run of 19 digits, found by mapping every digit to "0" and anything else to " " (bytes.translate)
# and looking for nineteen zeros: ~7x faster than the regex [0-9]{19}, which took longer than
# orjson's whole parse (6.7 us against 0.7 us for a 700-byte answer; 160 us for a 14 KiB body)
_DIGITS_AS_ZERO = bytes(0x30 if 0x30 <= b <= 0x39 else 0x20 for b in range(256))
_LONG_DIGITS = b"0" * 19


FALLBACK = object()  # `loads(..., fast_only=True)`: orjson cannot give the standard library's value


def loads(raw: bytes | str, utf8_only: bool = False, fast_only: bool = False) -> Any:
    """`utf8_only` (a client's body): bytes the standard library would read as UTF-16/32, or as
    UTF-8 holding encoded surrogates (its `surrogatepass`), are a UnicodeDecodeError instead (a
    ValueError): a lone surrogate must never get past the request's checks as text.
    `fast_only`: return FALLBACK where the standard library would have to read the text (it
    refused orjson, or holds a 19-digit run), so the caller can do that off the event loop: the
    standard library reads a MiB of floats in ~100 ms."""
    as_bytes = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    if _LONG_DIGITS not in as_bytes.translate(_DIGITS_AS_ZERO):
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
    if fast_only:
        return FALLBACK
    if isinstance(raw, (bytes, bytearray)):
        raw = raw.decode("utf-8-sig") if utf8_only else raw.decode(json.detect_encoding(raw), "surrogatepass")
    return STDLIB_DECODER.decode(raw)


def _fragment(value: Any) -> Any:
    if isinstance(value, NonFinite):
        return orjson.Fragment(json.dumps(float(value)))
    raise TypeError


def dumps_bytes(value: Any) -> bytes:
    try:
        return orjson.dumps(value, default=_fragment)
    except (orjson.JSONEncodeError, TypeError):
        return json.dumps(value).encode()


LIFT_MIN = 64 << 10  # a top-level integer array of at least this many bytes (~9k token ids) is lifted
_LIFTABLE = re.compile(rb'"(\w+)"\s*:\s*\[(?=[0-9])')  # a key whose array starts with a digit
_NOT_INT_LIST = bytes(range(256)).translate(None, b"0123456789, \n\r\t")


def loads_lifting(raw: bytes) -> Any:
    """`loads` of an engine answer, its long top-level arrays of non-negative integers (a
    prompt's token ids: 7 bytes a token) kept as their text, `RawIds`, not parsed
    into int objects. An array found elsewhere than at the top level (or a surprise) is parsed
    whole as by `loads`."""
    if len(raw) < LIFT_MIN:
        return loads(raw)
    parts, lifted, pos = [], {}, 0
    for m in _LIFTABLE.finditer(raw):
        start = m.end() - 1
        end = raw.find(b"]", start)
        if start < pos or end < 0 or end - start < LIFT_MIN:
            continue
        text = raw[start : end + 1]
        if text[1:-1].translate(None, _NOT_INT_LIST) != text[1:-1] or text.endswith(b",]"):
            continue  # not only digits and commas
        key = m.group(1).decode()
        parts += [raw[pos:start], b"0"]
        lifted[key], pos = RawIds(text, text.count(b",") + 1), end + 1
    if not lifted:
        return loads(raw)
    body = loads(b"".join([*parts, raw[pos:]]))
    if not isinstance(body, dict) or any(body.get(k) != 0 for k in lifted):  # not all at the top level
        return loads(raw)
    body.update(lifted)
    return body
