"""Fuzzing review of the proxy's request handling: what a throwaway fuzzer (mutated chat and
Responses bodies, raw HTTP, the `openai` SDK, against a real proxy in front of the strict fake
engine) found, each kept as a regression test."""

from __future__ import annotations

import httpx
import pytest

from tests.test_proxy import KEY, PUBLIC, keyfile, s, stack  # noqa: F401 - fixtures

AUTH = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses"}


def body_with(api: str, text: str, pad: int = 0) -> str:
    """A valid request whose user text is `text` (JSON-escaped by the caller), padded past BIG_BODY on demand."""
    extra = f' "{"x " * pad}"' if pad else ""
    if api == "chat":
        return (f'{{"model": "{PUBLIC}", "messages": [{{"role": "user", "content": "{text}"}}'
                + (f', {{"role": "assistant", "content":{extra}}}, {{"role": "user", "content": "y"}}' if pad else "") + "]}")
    return (f'{{"model": "{PUBLIC}", "input": [{{"role": "user", "content": "{text}"}}'
            + (f', {{"role": "assistant", "content":{extra}}}, {{"role": "user", "content": "y"}}' if pad else "") + "]}")


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
    raw = body_with(api, "a\udcedb", pad=70_000 if big else 0).encode("utf-8", "surrogatepass")
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
