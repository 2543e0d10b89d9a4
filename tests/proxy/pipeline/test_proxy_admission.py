"""Admission control through the real proxy process and the openai SDK, against the fake engine
with a slow answer hop: per-key fairness, 429 + Retry-After on overflow and on the wait deadline
(chat and responses, stream and non-stream), nothing lost or duplicated at the engine."""

from __future__ import annotations

import asyncio
import signal
import statistics
import threading
import time
import uuid

import httpx
import openai
import pytest

from molctl.profiles import load_profile, profile_dirs
from tests.helpers import free_port, wait_for
from tests.procs import fake_engine_argv, proxy_argv, running

KEYS = ["sk-adm-heavy", "sk-adm-light-1", "sk-adm-light-2"]
PUBLIC = load_profile("tiny", profile_dirs()).served_model_name


@pytest.fixture(scope="module")
def keyfile(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys"
    path.write_text("\n".join(KEYS) + "\n")
    path.chmod(0o600)
    return path


class Stack:
    def __init__(self, engine_url: str, proxy_url: str):
        self.engine_url, self.proxy_url = engine_url, proxy_url

    def client(self, key: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.proxy_url + "/v1", api_key=key, max_retries=0, timeout=60)

    def config(self, **cfg):
        httpx.post(self.engine_url + "/_config", json=cfg).raise_for_status()

    def answers(self) -> list[str]:
        """The user text of every answer hop the engine received."""
        log = httpx.get(self.engine_url + "/_log").json()
        return [e["messages"][-1]["content"] for e in log if e["hop"] == "answer" and e.get("messages")]

    def reset(self):
        httpx.post(self.engine_url + "/_reset").raise_for_status()


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with running(fake_engine_argv(port), url + "/health", log=tmp_path_factory.mktemp("logs") / "engine.log"):
        yield url


def proxy(engine_url: str, keyfile, tmp_path, *sets: str):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = proxy_argv(
        "tiny",
        engine_url,
        port,
        "--api-key-file",
        str(keyfile),
        "--store",
        "memory",
        *(a for s in sets for a in ("--set", s)),
    )
    return running(argv, url + "/health", log=tmp_path / "proxy.log"), Stack(engine_url, url)


async def answering(s: Stack, text: str, timeout: float = 10.0) -> None:
    """Wait until the engine has received the answer hop of `text`: its request holds an answer
    slot (taken before the route hop) for the engine's whole answer_delay from then on. A fixed
    sleep assumed that within 0.3-0.5 s on a loaded runner."""
    deadline = time.monotonic() + timeout
    while text not in await asyncio.to_thread(s.answers):
        assert time.monotonic() < deadline, f"{text!r} not answered within {timeout} s"
        await asyncio.sleep(0.05)


async def ask(client: openai.AsyncOpenAI, text: str, api: str = "chat", stream: bool = False):
    """One request; returns (seconds, status, retry-after or None)."""
    start = time.monotonic()
    try:
        if api == "chat":
            out = await client.chat.completions.create(
                model=PUBLIC, messages=[{"role": "user", "content": text}], stream=stream
            )
        else:
            out = await client.responses.create(model=PUBLIC, input=text, stream=stream)
        if stream:
            async for _ in out:
                pass
        return time.monotonic() - start, 200, None
    except openai.RateLimitError as exc:
        return time.monotonic() - start, 429, (exc.response.headers.get("retry-after"), exc.body)


def test_a_heavy_key_does_not_starve_the_others(engine, keyfile, tmp_path):
    """2 answer slots, a slow answer hop. The heavy key keeps 30 requests queued; two light keys
    send one request at a time (10x fewer). With round-robin between keys a light request waits
    about one round of slots; first-come-first-served would put it behind the heavy burst."""
    ctx, s = proxy(engine, keyfile, tmp_path, "proxy.max_inflight=2", "proxy.max_queue=64", "proxy.queue_timeout_s=120")
    s.reset()
    s.config(answer_delay=0.25)
    with ctx:

        async def main():
            heavy, light1, light2 = clients = [s.client(k) for k in KEYS]
            solo = [await ask(light1, f"solo-{i}-{uuid.uuid4().hex}") for i in range(3)]
            service_s = statistics.median(t for t, _, _ in solo)  # one request alone: the service time
            heavy_tasks = [asyncio.ensure_future(ask(heavy, f"heavy-{i}-{uuid.uuid4().hex}")) for i in range(30)]
            await asyncio.sleep(service_s)  # the heavy burst is queued first

            async def light(client, name):
                return [await ask(client, f"{name}-{i}-{uuid.uuid4().hex}") for i in range(3)]

            lights = await asyncio.gather(light(light1, "l1"), light(light2, "l2"))
            heavies = await asyncio.gather(*heavy_tasks)
            for client in clients:  # closed on this loop, not garbage-collected on another
                await client.close()
            return service_s, [r for rs in lights for r in rs], heavies

        service_s, lights, heavies = asyncio.run(main())
    assert all(status == 200 for _, status, _ in lights + heavies), [r for r in lights + heavies if r[1] != 200]
    light_p50 = statistics.median(t for t, _, _ in lights)
    heavy_p50 = statistics.median(t for t, _, _ in heavies)
    # FIFO would make a light request wait behind ~30 heavy ones (15 service times on 2 slots)
    assert light_p50 <= 5 * service_s, (light_p50, service_s, heavy_p50)
    assert heavy_p50 > light_p50
    answered = s.answers()
    assert len(answered) == 3 + 30 + 6 and len(set(answered)) == len(answered)  # nothing lost or duplicated


@pytest.mark.parametrize("api,stream", [("chat", False), ("chat", True), ("responses", False), ("responses", True)])
def test_overflow_is_429_with_retry_after(engine, keyfile, tmp_path, api, stream):
    """1 slot, 3 waiting at most: of 10 concurrent requests 4 are served, 6 refused with 429 +
    Retry-After in the OpenAI error shape (a stream's before its first byte); the engine sees
    each served request once and none of the refused."""
    ctx, s = proxy(engine, keyfile, tmp_path, "proxy.max_inflight=1", "proxy.max_queue=3", "proxy.queue_timeout_s=60")
    s.reset()
    # the split is exact only if all 10 requests reach the proxy before the first answer frees its
    # slot (a queued one moving up frees a queue place for an 11th); 0.4 s was tight for 10
    # connections on a loaded runner, where 5 were served
    s.config(answer_delay=1.5)
    texts = [f"over-{i}-{uuid.uuid4().hex}" for i in range(10)]
    with ctx:

        async def main():
            async with s.client(KEYS[0]) as client:
                return await asyncio.gather(*(ask(client, t, api, stream) for t in texts))

        results = asyncio.run(main())
    served = [t for t, r in zip(texts, results, strict=True) if r[1] == 200]
    refused = [r for r in results if r[1] == 429]
    assert len(served) == 4 and len(refused) == 6, results
    for _, _, (retry_after, body) in refused:
        assert retry_after is not None and retry_after.isdigit() and int(retry_after) >= 1
        assert body["code"] == "rate_limit_exceeded" and body["type"] == "rate_limit_error"
    assert sorted(s.answers()) == sorted(served)


def test_wait_deadline_is_429_and_draining_stays_503(engine, keyfile, tmp_path):
    ctx, s = proxy(engine, keyfile, tmp_path, "proxy.max_inflight=1", "proxy.max_queue=10", "proxy.queue_timeout_s=0.3")
    s.reset()
    s.config(answer_delay=1.5)
    with ctx as proc:

        async def main():
            async with s.client(KEYS[1]) as client:
                first = asyncio.ensure_future(ask(client, "first"))
                await asyncio.sleep(0.5)
                late = await ask(client, "late", "chat", True)
                return await first, late

        first, late = asyncio.run(main())
        assert first[1] == 200
        assert late[1] == 429 and late[2][0].isdigit()
        assert s.answers() == ["first"]

        # a draining proxy (one request still in flight) answers 503, not 429
        async def hold():
            async with s.client(KEYS[2]) as client:
                await ask(client, "in flight during the drain")

        s.config(answer_delay=3.0)  # in flight for 3 s from its answer hop on: the drain waits for it
        holder = threading.Thread(target=lambda: asyncio.run(hold()))
        holder.start()
        try:
            # in flight (a fixed 0.5 s sleep could signal an idle proxy, which exits at once: the POST
            # below then failed to connect instead of getting 503)
            assert wait_for(lambda: "in flight during the drain" in s.answers(), 10)
            proc.send_signal(signal.SIGTERM)
            assert wait_for(lambda: httpx.get(s.proxy_url + "/health").json()["status"] == "draining", 5)
            r = httpx.post(
                s.proxy_url + "/v1/chat/completions",
                headers={"Authorization": f"Bearer {KEYS[1]}"},
                json={"model": PUBLIC, "messages": [{"role": "user", "content": "x"}]},
            )
            assert r.status_code == 503 and "retry-after" in r.headers
        finally:
            holder.join(30)


def test_the_log_line_of_a_refused_or_abandoned_request_shows_its_queue_wait(engine, keyfile, tmp_path):
    """A request refused at its wait deadline, and one whose client left while it waited, log
    the time they spent queued (it was 0.0: only a granted slot recorded its wait)."""
    import json

    ctx, s = proxy(engine, keyfile, tmp_path, "proxy.max_inflight=1", "proxy.max_queue=10", "proxy.queue_timeout_s=0.4")
    s.reset()
    s.config(answer_delay=2.0)
    with ctx:

        async def main():
            async with s.client(KEYS[0]) as client:
                holder = asyncio.ensure_future(ask(client, "holds the slot"))
                await answering(s, "holds the slot")
                refused = None
                try:
                    await client.chat.completions.create(
                        model=PUBLIC,
                        messages=[{"role": "user", "content": "refused"}],
                        extra_headers={"X-Request-Id": "rid-refused"},
                    )
                except openai.RateLimitError:
                    refused = 429
                async with s.client(KEYS[1]) as impatient:
                    with pytest.raises(openai.APITimeoutError):
                        await impatient.with_options(timeout=0.3).chat.completions.create(
                            model=PUBLIC,
                            messages=[{"role": "user", "content": "left"}],
                            extra_headers={"X-Request-Id": "rid-left"},
                        )
                await holder
                return refused

        assert asyncio.run(main()) == 429
        time.sleep(0.3)
    text = (tmp_path / "proxy.log").read_text().splitlines()
    lines = {line["request_id"]: line for line in (json.loads(raw) for raw in text if raw.startswith("{"))}
    assert lines["rid-refused"]["status"] == 429 and lines["rid-refused"]["queue_s"] >= 0.35
    assert lines["rid-left"]["client_disconnect"] is True and lines["rid-left"]["queue_s"] >= 0.25


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_a_stream_queued_longer_than_the_keepalive_is_still_a_real_429(engine, keyfile, tmp_path, api):
    """SSE keep-alives (and so the 200) are held while a stream waits for an answer slot: a stream
    refused at the wait deadline after several keep-alive periods is a real 429 with Retry-After,
    not an error frame inside a 200 stream (the SDK raises RateLimitError, and can back off)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = proxy_argv(
        "tiny",
        engine,
        port,
        "--api-key-file",
        str(keyfile),
        "--store",
        "memory",
        "--sse-keepalive",
        "0.2",
        "--set",
        "proxy.max_inflight=1",
        "--set",
        "proxy.queue_timeout_s=1.5",
    )
    s = Stack(engine, url)
    s.reset()
    s.config(answer_delay=3.0)
    with running(argv, url + "/health", log=tmp_path / "proxy.log"):

        async def main():
            async with s.client(KEYS[0]) as holder_client, s.client(KEYS[1]) as client:
                holder = asyncio.ensure_future(ask(holder_client, "holds the slot"))
                await answering(s, "holds the slot")
                refused = await ask(client, "queued stream", api, stream=True)
                await holder
                return refused

        _, status, detail = asyncio.run(main())
    assert status == 429, detail
    retry_after, body = detail
    assert retry_after.isdigit() and int(retry_after) >= 1 and body["code"] == "rate_limit_exceeded"


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_a_route_hop_waits_for_an_answer_slot_not_inside_the_engine(engine, keyfile, tmp_path, api):
    """Found by a review of the GPU profiles: route hops had a budget of their own, so with every
    answer slot taken (max_inflight = the engine's max-num-seqs) a new request's route hop went
    to the engine at once and waited there behind answers that can run for minutes, past
    route_timeout_s: the request fell back to the previous or default adapter. The answer slot is
    now taken before the route hop: while A's answer holds the only slot, B's route hop is not
    sent; it goes once A's answer is done, and B is routed by its label."""
    ctx, s = proxy(engine, keyfile, tmp_path, "proxy.max_inflight=1", "proxy.max_queue=4", "proxy.queue_timeout_s=60")
    s.reset()
    s.config(answer_delay=2.0)

    def hops(rid: str) -> list[dict]:
        return [e for e in httpx.get(s.engine_url + "/_log").json() if (e.get("request_id") or "").startswith(rid)]

    async def one(client, rid: str, text: str):
        headers = {"X-Request-Id": rid}
        if api == "chat":
            return await client.chat.completions.create(
                model=PUBLIC, messages=[{"role": "user", "content": text}], extra_headers=headers
            )
        return await client.responses.create(model=PUBLIC, input=text, extra_headers=headers)

    with ctx:

        async def main() -> float:
            async with s.client(KEYS[0]) as client:
                a = asyncio.ensure_future(one(client, "req-slot-a", "[route:L1] first"))
                while not any(e["hop"] == "answer" for e in hops("req-slot-a")):  # A's answer is running
                    await asyncio.sleep(0.02)
                b_sent = time.time()
                b = asyncio.ensure_future(one(client, "req-slot-b", "[route:L3] second"))
                await asyncio.gather(a, b)
                return b_sent

        b_sent = asyncio.run(main())
    # Timestamps, not a snapshot after a fixed sleep (which a loaded host outran): the fake engine
    # and this test read the host's clock. B was sent while A's 2 s answer ran, and B's route hop
    # reached the engine only after that answer (it went at once, into the full engine, before)
    a_answer = next(e for e in hops("req-slot-a") if e["hop"] == "answer")
    b_route = next(e for e in hops("req-slot-b") if e["hop"] == "route")
    b_answer = next(e for e in hops("req-slot-b") if e["hop"] == "answer")
    assert b_sent < a_answer["t"] + 1.5, "B was sent after A's answer: the test proves nothing"
    assert b_route["t"] >= a_answer["t"] + 1.9  # after A's 2 s answer
    assert (a_answer["model"], b_answer["model"]) == ("L1", "L3")  # routed by their labels, no fallback


def test_a_request_waiting_for_another_adapters_summary_gives_its_slot_back(engine, keyfile, tmp_path):
    """Found by the regression review of the route-under-slot change: X's second turn switches
    adapter and waits (summary_wait_s) for its first turn's summary; it held the only answer slot
    meanwhile, so an unrelated request Y of another key queued 3 s while the engine ran no
    answer. Now the slot goes back during that wait: Y is answered at once, X still is after."""
    ctx, s = proxy(
        engine, keyfile, tmp_path, "proxy.max_inflight=1", "proxy.summary_wait_s=3", "proxy.queue_timeout_s=60"
    )
    s.reset()
    s.config(answer_delay=0.1, summary_delay=5.0)
    with ctx:

        async def main():
            async with s.client(KEYS[0]) as x_client, s.client(KEYS[1]) as y_client:
                u1 = {"role": "user", "content": "[route:L1] plan my trip"}
                r1 = await x_client.chat.completions.create(model=PUBLIC, messages=[u1])
                a1 = {"role": "assistant", "content": r1.choices[0].message.content}
                x2 = asyncio.ensure_future(
                    x_client.chat.completions.create(
                        model=PUBLIC, messages=[u1, a1, {"role": "user", "content": "[route:L2] now write code"}]
                    )
                )
                await asyncio.sleep(0.3)  # X's second turn waits for turn 1's summary (5 s; it waits 3)
                start = time.monotonic()
                y = await y_client.chat.completions.create(
                    model=PUBLIC, messages=[{"role": "user", "content": "[route:L0] hi"}]
                )
                y_s = time.monotonic() - start
                x = await x2
                return y_s, y, x

        y_s, y, x = asyncio.run(main())
    assert y.choices[0].message.content and x.choices[0].message.content
    # was ~3 s: queued behind X's idle slot until its 3 s summary wait ended; 2.5 s leaves a loaded
    # runner room for Y's own route and answer hops and still tells the two apart
    assert y_s < 2.5, y_s


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_a_stream_that_gave_its_slot_back_for_a_summary_is_still_refused_with_a_real_429(
    engine, keyfile, tmp_path, api
):
    """Found by the review of the slot changes: X's streamed second turn switches adapter, gives
    its slot back while it waits for turn 1's summary, and queues again; the keep-alives sent
    during that wait had already answered 200, so a refusal at the second queue deadline was an
    error frame inside a 200 stream. It now counts as queued until it has a slot again: a real
    429 with Retry-After, as for any queued stream."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = proxy_argv(
        "tiny",
        engine,
        port,
        "--api-key-file",
        str(keyfile),
        "--store",
        "memory",
        "--sse-keepalive",
        "0.2",
        "--set",
        "proxy.max_inflight=1",
        "--set",
        "proxy.queue_timeout_s=0.8",
        "--set",
        "proxy.summary_wait_s=1.5",
    )
    s = Stack(engine, url)
    s.reset()
    s.config(answer_delay=0.1, summary_delay=5.0, model_delay={"L3": 5.0})
    with running(argv, url + "/health", log=tmp_path / "proxy.log"):

        async def main():
            async with s.client(KEYS[0]) as x_client, s.client(KEYS[1]) as other:
                u1 = {"role": "user", "content": "[route:L1] plan my trip"}
                r1 = await x_client.chat.completions.create(model=PUBLIC, messages=[u1])
                turn2 = [
                    u1,
                    {"role": "assistant", "content": r1.choices[0].message.content},
                    {"role": "user", "content": "[route:L2] now write code"},
                ]

                async def x2():
                    try:
                        if api == "chat":
                            out = await x_client.chat.completions.create(model=PUBLIC, messages=turn2, stream=True)
                        else:
                            out = await x_client.responses.create(model=PUBLIC, input=turn2, stream=True)
                        async for _ in out:
                            pass
                        return 200, None
                    except openai.RateLimitError as exc:
                        return 429, exc.response.headers.get("retry-after")
                    except openai.APIError as exc:  # an error frame inside a 200 stream
                        return 200, repr(exc)

                x = asyncio.ensure_future(x2())
                await asyncio.sleep(0.4)  # X2 routed, waits for turn 1's summary with its slot given back
                slow = asyncio.ensure_future(
                    other.chat.completions.create(
                        model=PUBLIC, messages=[{"role": "user", "content": "[route:L3] takes the slot for 5 s"}]
                    )
                )
                result = await x
                await slow
                return result

        status, detail = asyncio.run(main())
    assert status == 429, detail  # was a 200 stream ending in a rate_limit_exceeded error frame
    assert detail is not None and detail.isdigit()
