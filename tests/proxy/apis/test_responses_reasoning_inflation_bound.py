"""Reasoning `encrypted_content` inflates within bounds (issue 40): a 21 KB item inflated to
16 MiB and eight of them peaked the proxy at 699 MB; an item past REASONING_ITEM_MAX, or a
request's items past REASONING_REQUEST_MAX together, is a 400 naming the field."""

from __future__ import annotations

import base64
import zlib

import pytest

from molctl.proxy.apis.responses import convert
from molctl.proxy.apis.responses.convert import (
    REASONING_ITEM_MAX,
    REASONING_REQUEST_MAX,
    _convert_input,
    encode_reasoning,
)
from molctl.proxy.errors import ProxyError


def bomb(size: int) -> str:
    """An `encrypted_content` in this proxy's format whose text inflates to `size` bytes."""
    return convert.ENCRYPTED_PREFIX + base64.urlsafe_b64encode(zlib.compress(b"a" * size, 9)).decode()


def turns(*blobs: str) -> list[dict]:
    items: list[dict] = []
    for blob in blobs:
        items += [
            {"type": "message", "role": "user", "content": "q"},
            {"type": "reasoning", "summary": [], "encrypted_content": blob},
            {"type": "message", "role": "assistant", "content": "a"},
        ]
    return items + [{"type": "message", "role": "user", "content": "next"}]


def test_an_item_inflating_past_the_item_bound_is_a_400_naming_it():
    """Guards the per-item bound: a 16 MiB inflation was accepted (and cut at 16 MiB silently)."""
    blob = bomb(16 << 20)
    assert len(blob) < 64 << 10
    with pytest.raises(ProxyError) as err:
        _convert_input(turns(blob))
    assert err.value.status == 400 and err.value.param == "input[1].encrypted_content"
    assert str(REASONING_ITEM_MAX) in err.value.message


def test_items_past_the_request_bound_together_are_a_400_naming_the_one_that_passes_it():
    """Guards the per-request bound: items each under the item bound add up past the request's."""
    each = REASONING_ITEM_MAX - 1
    count = REASONING_REQUEST_MAX // each + 1
    with pytest.raises(ProxyError) as err:
        _convert_input(turns(*[bomb(each)] * count))
    assert err.value.status == 400 and err.value.param == f"input[{3 * (count - 1) + 1}].encrypted_content"
    assert str(REASONING_REQUEST_MAX) in err.value.message


def test_reasoning_within_the_bounds_round_trips():
    """Guards the bound's edge: the proxy's own reasoning, up to the item bound, is read back whole."""
    text = "x" * REASONING_ITEM_MAX
    messages, _ = _convert_input(turns(encode_reasoning(text), encode_reasoning("short é")))
    assistants = [m for m in messages if m["role"] == "assistant"]
    assert assistants[0]["reasoning"] == text and assistants[1]["reasoning"] == "short é"
