"""Issue 42: the new endpoints' spans are named by their route templates (`http.route`), never by
a path holding a conversation or item id (which would make span names unbounded)."""

from __future__ import annotations

import pytest

from molctl.proxy.tracing import http_route


@pytest.mark.parametrize(
    ("path", "route"),
    [
        ("/v1/responses/compact", "/v1/responses/compact"),
        ("/v1/responses/resp_1", "/v1/responses/{id}"),
        ("/v1/conversations", "/v1/conversations"),
        ("/v1/conversations/conv_1", "/v1/conversations/{id}"),
        ("/v1/conversations/conv_1/items", "/v1/conversations/{id}/items"),
        ("/v1/conversations/conv_1/items/msg_1", "/v1/conversations/{id}/items/{item_id}"),
        ("/v1/conversations/conv_1/other/msg_1", None),
        ("/v1/conversations/conv_1/items/", None),
    ],
)
def test_route_templates(path, route):
    assert http_route(path) == route
