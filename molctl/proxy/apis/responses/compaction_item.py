"""The `compaction` item of this proxy (POST /v1/responses/compact): its `encrypted_content` is
the fold text of the turn it stands for, compressed (not encrypted: it is the client's own
conversation); `convert._Input` turns it back into that assistant message."""

from __future__ import annotations

import base64
import zlib

COMPACTION_PREFIX = "mol1c."
FOLD_MAX = 4 << 20  # what one item may inflate to (a fold is a summary: far less)


def encode_compaction(text: str) -> str:
    return COMPACTION_PREFIX + base64.urlsafe_b64encode(zlib.compress(text.encode("utf-8"))).decode("ascii")


def decode_compaction(blob: object, limit: int = FOLD_MAX) -> str | None:
    """The fold text of a compaction item this proxy made, else None (never inflated past `limit`)."""
    if not isinstance(blob, str) or not blob.startswith(COMPACTION_PREFIX):
        return None
    try:
        data = zlib.decompressobj().decompress(base64.urlsafe_b64decode(blob[len(COMPACTION_PREFIX) :]), limit + 1)
        return data.decode("utf-8") if len(data) <= limit else None
    except (ValueError, zlib.error):
        return None
