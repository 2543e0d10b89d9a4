"""Reading safetensors headers without touching tensor data.

Format: 8 bytes little-endian header length N, N bytes of JSON mapping tensor name ->
{"dtype", "shape", "data_offsets": [begin, end]} (offsets relative to the end of the header),
plus an optional "__metadata__" entry. A file is consistent when every tensor's byte span
matches dtype x shape and the largest end offset fits in the file.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "F4": 1,
    "F6_E2M3": 1,
    "F6_E3M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
    "C64": 8,
}
MAX_HEADER = 100 * 1024 * 1024  # the format's own limit


class HeaderError(Exception):
    """The file is not a consistent safetensors file; the message says why."""


@dataclass(frozen=True)
class SafetensorsHeader:
    """`tensors` maps each name to its raw header entry: {"dtype", "shape", "data_offsets"}."""

    tensors: dict[str, dict[str, Any]]
    metadata: dict[str, Any]
    header_size: int  # 8 + N
    file_size: int
    data_end: int  # header_size + the largest end offset

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name]["shape"])


def read_header(path: Path) -> SafetensorsHeader:
    """Parse and validate the header of `path`; reads only the header bytes.

    The loop is kept tight on purpose: a Venti shard header holds about a thousand tensors and
    `check` reads 141 of them."""
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        head = fh.read(8)
        if len(head) < 8:
            raise HeaderError(f"file is {size} bytes, too short for a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER or 8 + n > size:
            raise HeaderError(f"header length {n} does not fit in the file ({size} bytes)")
        raw = fh.read(n)
    try:
        # decoded as UTF-8 here: json.loads(bytes) would also take UTF-16/32, which the format forbids;
        # RecursionError (a deeply nested header) and ValueError (an integer of 5000 digits) are malformed headers too
        obj = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        raise HeaderError(f"header is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise HeaderError("header is not a JSON object")
    metadata = obj.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    elif not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise HeaderError(f"__metadata__ is {_clip(metadata)}, expected an object of strings")
    widths, prod = DTYPE_BYTES, math.prod
    max_end = 0
    spans = []
    for name, info in obj.items():
        try:
            width = widths[info["dtype"]]
            begin, end = info["data_offsets"]
            shape = info["shape"]
            if type(shape) is not list or not all(type(d) is int and d >= 0 for d in shape):
                raise ValueError(shape)
            expected = prod(shape) * width
        except (KeyError, TypeError, ValueError):
            raise HeaderError(f"tensor {name!r}: malformed entry {_clip(info)}") from None
        if info["dtype"] == "F4":
            expected = (prod(shape) + 1) // 2
        if type(begin) is not int or type(end) is not int or begin < 0 or end - begin != expected:
            raise HeaderError(
                f"tensor {name!r}: data_offsets [{begin}, {end}] do not match {info['dtype']} {info['shape']}"
            )
        if end > max_end:
            max_end = end
        spans.append((begin, end, name))
    data_end = 8 + n + max_end
    if data_end > size:
        raise HeaderError(f"truncated: tensor data ends at byte {data_end} but the file has {size} bytes")
    if data_end < size:  # the loader wants the file to end with the data (MetadataIncompleteBuffer)
        raise HeaderError(f"{size - data_end} bytes after the tensor data (it ends at byte {data_end} of {size})")
    at = 0
    for begin, end, name in sorted(spans):  # the loader (safetensors' validate) wants the spans back to back from 0
        if begin != at:
            what = (
                "overlaps the tensor before it"
                if begin < at
                else f"leaves a gap (bytes {at}..{begin} belong to no tensor)"
            )
            raise HeaderError(f"tensor {name!r}: data_offsets [{begin}, {end}] {what}")
        at = end
    return SafetensorsHeader(obj, metadata, 8 + n, size, data_end)


def _clip(value: Any, limit: int = 200) -> str:
    """repr of a header value for a one-line message (a hostile entry can be megabytes)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def write_file(
    path: Path,
    tensors: dict[str, tuple[str, tuple[int, ...]]],
    data: dict[str, bytes] | None = None,
    metadata: dict[str, str] | None = None,
    sparse: bool = False,
) -> None:
    """Write a safetensors file. Without `data`, tensor bytes are zeros (or a hole when `sparse`).

    Used by `molctl demo init` and by tests to build layouts with real headers."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    order = sorted(tensors)
    for name in order:
        dtype, shape = tensors[name]
        nbytes = math.prod(shape) * DTYPE_BYTES[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header to 8 bytes
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)))
        fh.write(raw)
        if sparse:
            fh.truncate(8 + len(raw) + offset)
            return
        for name in order:
            if data and name in data:
                fh.write(data[name])
            else:
                dtype, shape = tensors[name]
                fh.write(b"\0" * (math.prod(shape) * DTYPE_BYTES[dtype]))
