"""Malformed requests to the proxy are answered, never a 500: bodies that are not UTF-8 JSON (lone
surrogates, UTF-16, a BOM, trailing data), tool-call arguments that decode to a lone surrogate,
websocket upgrades, and linear-time checks of large inputs (a real proxy in front of the strict
fake engine)."""

from __future__ import annotations

import json

import httpx
import pytest

from molctl.proxy.http.body import BIG_BODY
from tests.proxy_in_process import own_records
from tests.proxy_stack import KEY, PUBLIC

AUTH = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses"}


def body_with(api: str, text: str, pad: int = 0) -> str:
    """A valid request whose user text is `text` (JSON-escaped by the caller), padded past BIG_BODY on demand."""
    extra = f' "{"x " * pad}"' if pad else ""
    if api == "chat":
        return (
            f'{{"model": "{PUBLIC}", "messages": [{{"role": "user", "content": "{text}"}}'
            + (f', {{"role": "assistant", "content":{extra}}}, {{"role": "user", "content": "y"}}' if pad else "")
            + "]}"
        )
    return (
        f'{{"model": "{PUBLIC}", "input": [{{"role": "user", "content": "{text}"}}'
        + (f', {{"role": "assistant", "content":{extra}}}, {{"role": "user", "content": "y"}}' if pad else "")
        + "]}"
    )


def assert_error(r: httpx.Response, status: int, code: str) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code, err
    return err


@pytest.mark.parametrize("api", ["chat", "responses"])
@pytest.mark.parametrize("big", [False, True])
def test_a_body_with_utf8_encoded_surrogates_is_invalid_json_not_a_500(s, api, big):
    """Found by the fuzzer's raw-byte mutations: a body holding a surrogate as UTF-8 bytes
    (b"\\xed\\xa0\\x80", which no valid UTF-8 text contains) was refused by orjson and then read by
    the standard library with `surrogatepass`, so a lone surrogate got past the check that only
    looks for `\\ud800`-style escapes; encoding the conversation key failed: a 500 with a
    traceback, for chat and the Responses API, small bodies and big ones (the worker-thread parse)."""
    raw = body_with(api, "a\udcedb", pad=BIG_BODY // 2 + 1000 if big else 0).encode("utf-8", "surrogatepass")
    raw = raw.replace("\udced".encode("utf-8", "surrogatepass"), b"\xed\xa0\x80")
    assert (len(raw) > 128 * 1024) == big
    r = httpx.post(s.proxy_url + PATHS[api], headers=AUTH, content=raw, timeout=30)
    err = assert_error(r, 400, "invalid_json")
    assert "utf-8" in err["message"]
    assert not s.log("answer")


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_a_utf16_body_is_invalid_json(s, api):
    """Found with the same mutations: a UTF-16 body (which the standard library's reader detects and
    accepts) was answered 200, though the contract makes a body that is not UTF-8 a 400
    `invalid_json`; its lone-surrogate escapes (`\\x00\\\\\\x00u\\x00d...` in UTF-16) also slipped
    past the check that looks for them in the raw bytes, and reached the engine."""
    raw = body_with(api, "a\\ud800b").encode("utf-16")
    r = httpx.post(s.proxy_url + PATHS[api], headers=AUTH, content=raw, timeout=30)
    assert_error(r, 400, "invalid_json")
    assert not s.log("answer")


def test_a_utf8_body_with_a_bom_is_still_read(s):
    """What stays accepted: UTF-8 with a byte order mark (a Windows client's file) is UTF-8."""
    raw = b"\xef\xbb\xbf" + body_with("chat", "hi").encode()
    r = httpx.post(s.proxy_url + PATHS["chat"], headers=AUTH, content=raw, timeout=30)
    assert r.status_code == 200, r.text


SURROGATE_ARGS = '{"city": "\\ud800"}'  # valid JSON text (ASCII); what it decodes to holds a lone surrogate


@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_arguments_that_decode_to_a_lone_surrogate_are_answered_not_a_500(s, stream):
    """Found by the fuzzer's tool-call mutations: arguments whose JSON text escapes a lone surrogate
    (the body itself is valid, so the body's surrogate check rightly lets it through) were
    re-serialised into the conversation key's canonical form with the surrogate decoded, and
    encoding that form failed: a 500 with a traceback, before any hop. The arguments are the
    client's text, kept as sent (as arguments that are not JSON are)."""
    messages = [
        {"role": "user", "content": "[route:L2] weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_s1", "type": "function", "function": {"name": "get_weather", "arguments": SURROGATE_ARGS}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_s1", "content": "sunny"},
    ]
    r = httpx.post(
        s.proxy_url + PATHS["chat"],
        headers=AUTH,
        timeout=30,
        json={"model": PUBLIC, "messages": messages, "stream": stream},
    )
    assert r.status_code == 200, r.text
    if stream:
        assert r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text
    sent = s.log("answer")[0]["messages"]
    assert sent[2]["tool_calls"][0]["function"]["arguments"] == SURROGATE_ARGS  # passed on as the client sent it


def test_responses_function_call_arguments_that_decode_to_a_lone_surrogate_are_answered(s):
    """The same through the Responses API (a `function_call` input item becomes a chat tool call)."""
    r = httpx.post(
        s.proxy_url + PATHS["responses"],
        headers=AUTH,
        timeout=30,
        json={
            "model": PUBLIC,
            "input": [
                {"role": "user", "content": "[route:L2] weather?"},
                {"type": "function_call", "call_id": "call_s2", "name": "get_weather", "arguments": SURROGATE_ARGS},
                {"type": "function_call_output", "call_id": "call_s2", "output": "sunny"},
            ],
        },
    )
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "completed"


def test_canonical_arguments_keep_their_form_and_never_hold_a_lone_surrogate():
    """Keys are stored: the canonical form of ordinary arguments must not change; arguments that
    would decode to a lone surrogate keep their text, so the key and the call binding can be
    encoded (and written to a durable store)."""
    from molctl.proxy.conversations import ConversationKeys, canonical_arguments

    assert canonical_arguments('{"b": 1, "a": "\\u00e9\\ud83d\\ude00"}') == '{"a":"é😀","b":1}'
    assert canonical_arguments(" not json ") == "not json"
    assert canonical_arguments(SURROGATE_ARGS) == SURROGATE_ARGS
    assert canonical_arguments(' {"a": "\\uDC00x"} ') == '{"a": "\\uDC00x"}'
    canonical_arguments(SURROGATE_ARGS).encode("utf-8")
    msg = {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": SURROGATE_ARGS}}]}
    keys = ConversationKeys(
        "t", [{"role": "user", "content": "x"}, msg, {"role": "tool", "tool_call_id": "c", "content": "r"}]
    )
    assert len(keys.extend({"role": "assistant", "content": "ok"})) == 32


def ws_upgrade(proxy_url: str, path: str, key: str | None) -> tuple[int, dict[str, str], bytes]:
    """A raw WebSocket upgrade request: (status, headers, body) of the answer."""
    import socket
    from urllib.parse import urlsplit

    u = urlsplit(proxy_url)
    head = (
        f"GET {path} HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
        + (f"Authorization: Bearer {key}\r\n" if key else "")
        + "\r\n"
    )
    with socket.create_connection((u.hostname, u.port), timeout=10) as sock:
        sock.sendall(head.encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    raw_head, _, body = data.partition(b"\r\n\r\n")
    lines = raw_head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body


@pytest.mark.parametrize(
    "path, key, status, code",
    [
        ("/v1/chat/completions", KEY, 404, "not_found"),
        ("/v1/chat/completions", None, 401, "invalid_api_key"),
        ("/v1/responses", KEY, 400, "websocket_mode_not_supported"),  # OpenAI's WebSocket mode, named
        ("/v1/responses", None, 401, "invalid_api_key"),
    ],
)
def test_a_websocket_upgrade_is_a_json_error_not_a_plain_500(s, path, key, status, code):
    """Found with raw HTTP requests: a WebSocket upgrade (to any path, without any key) made the app
    return without answering its `websocket` scope, and uvicorn answered a plain-text 500 and
    logged "ASGI callable returned without sending handshake." at ERROR for each one. It is
    answered as a request to an unknown endpoint: the OpenAI error shape, 401 or 404."""
    got, headers, body = ws_upgrade(s.proxy_url, path, key)
    assert got == status, body
    assert headers["content-type"].startswith("application/json") and headers.get("x-request-id")
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code, err
    assert httpx.get(s.proxy_url + "/v1/models", headers=AUTH, timeout=10).status_code == 200


def test_a_websocket_upgrade_is_counted_and_logged_like_a_request(caplog):
    """In-process: no ERROR, one request log line with its status; without the denial-response
    extension the upgrade is closed before the handshake."""
    import asyncio
    import logging

    from molctl.engines import get_engine
    from molctl.proxy.http.app import ProxyApp
    from tests.proxy_stack import TINY

    app = ProxyApp(TINY, get_engine("vllm"), "http://127.0.0.1:9", [KEY])

    async def run(extensions):
        sent: list[dict] = []

        async def receive():
            return {"type": "websocket.connect"}

        async def send(message):
            sent.append(message)

        scope = {
            "type": "websocket",
            "path": "/v1/responses",
            "query_string": b"",
            "extensions": extensions,
            "headers": [(b"authorization", f"Bearer {KEY}".encode())],
        }
        await asyncio.wait_for(app(scope, receive, send), 5)
        return sent

    with caplog.at_level(logging.INFO, logger="molctl.proxy"):
        sent = asyncio.run(run({"websocket.http.response": {}}))
        closed = asyncio.run(run({}))
    assert [m["type"] for m in sent] == ["websocket.http.response.start", "websocket.http.response.body"]
    code = "websocket_mode_not_supported"  # OpenAI's WebSocket mode on /v1/responses, named (issue 42)
    assert sent[0]["status"] == 400 and json.loads(sent[1]["body"])["error"]["code"] == code
    assert "WebSocket mode" in json.loads(sent[1]["body"])["error"]["message"]
    assert closed == [{"type": "websocket.close", "code": 1008}]
    records = own_records(caplog.records)  # not the module stack's proxy (in-process, on its own thread)
    assert not [r for r in records if r.levelno >= logging.WARNING]
    lines = [json.loads(r.getMessage()) for r in records if r.name == "molctl.proxy.requests"]
    assert [(line["api"], line["status"], line["error"]) for line in lines] == [("responses", 400, code)] * 2


@pytest.mark.parametrize("raw", [b"{}" + b" " * (BIG_BODY + 10_000) + b"garbage", b"{ }" + b"x" * (BIG_BODY + 10_000)])
def test_a_big_empty_object_with_trailing_data_is_invalid_json(s, raw):
    """Found reading the big-body reader while fuzzing it (then confirmed with such a body): it
    (bodies over BIG_BODY, read one array element at a time) returned `{}` for an empty object
    followed by anything, so `{} garbage...` was a 400 about a missing `model` instead of what the
    same text is under BIG_BODY, and what the contract says: invalid_json."""
    r = httpx.post(s.proxy_url + PATHS["chat"], headers=AUTH, content=raw, timeout=30)
    err = assert_error(r, 400, "invalid_json")
    assert "Extra data" in err["message"]


def test_a_duplicate_input_item_id_is_found_in_linear_time():
    """Found by timing big Responses inputs: the first repeated item id was looked for with
    `i in ids[:n]` for every item, quadratic when the duplicate is last: 20 000 items took 2.6 s
    of CPU and an 8 MiB body (about 180 000 items) minutes, one worker thread per request (the
    event loop itself for bodies under BIG_BODY) for an authenticated client's 400."""
    import gc
    import time

    from molctl.proxy.apis.responses.protocol import parse_request
    from molctl.proxy.errors import ProxyError

    def refused(n: int) -> tuple[float, ProxyError]:
        """The CPU time of one refusal of `n` items whose last repeats the one before it: this
        process's CPU time (other processes' load does not count), the collector off (its passes
        over every live object grow with n and made one run's ratio 11 where 4 was due)."""
        items = [{"id": f"m{i}", "role": "user", "content": "u"} for i in range(n)]
        items.append({"id": f"m{n - 1}", "role": "user", "content": "u"})
        gc.collect()
        gc.disable()
        try:
            start = time.process_time()
            with pytest.raises(ProxyError) as caught:
                parse_request({"model": PUBLIC, "input": items}, PUBLIC)
            return time.process_time() - start, caught.value
        finally:
            gc.enable()

    small = min(refused(5_000)[0] for _ in range(5))
    # a ratio measured in one run, not a deadline: 16x the items take ~16x the time when linear,
    # 256x when quadratic; the best of up to three tries of the large one (a try that already
    # shows a linear ratio ends it)
    for _ in range(3):
        large, error = refused(80_000)
        if large / small < 64:
            break
    assert large / small < 64, (small, large)
    assert error.param == "input" and "id m79999." in error.message
    # the first id seen twice is the one named, as before
    with pytest.raises(ProxyError) as caught:
        parse_request({"model": PUBLIC, "input": [{"id": x, "role": "user", "content": "u"} for x in "abab"]}, PUBLIC)
    assert "with id a." in caught.value.message
