"""Issue 42: conversations on the durable stores, real proxy processes: on SQLite and on Redis a
conversation (its metadata, its items, its turns' routes and summaries) survives a proxy restart
and stays its tenant's; on one Redis, two replicas share it (a turn on either replica folds the
other's turn with its summary and lands on the engine that served the conversation, and an
update or delete on one is seen by the other)."""

from __future__ import annotations

import contextlib
import time

import httpx
import openai
import pytest

from tests.helpers import free_ports
from tests.procs import fake_engine_argv, proxy_argv, running
from tests.proxy_stack import IDENTITY, KEY, KEY2, PUBLIC, STRICT, answers_of, fold
from tests.redis_helpers import PATIENT_STORE
from tests.redis_server import redis_server


def client(url: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30)


def engine_answers(engine_url: str) -> list[dict]:
    return answers_of(httpx.get(engine_url + "/_log").json())


def system() -> dict:
    return {"role": "system", "content": IDENTITY["content"]}


def summarised(url: str, response_id: str) -> None:
    """Wait (generously) until the turn of `response_id` has its summary: its compaction folds it."""
    deadline = time.monotonic() + 60
    while True:
        out = httpx.post(
            url + "/v1/responses/compact",
            json={"model": PUBLIC, "previous_response_id": response_id},
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=30,
        ).json()
        if any(i["type"] == "compaction" for i in out["output"]):
            return
        assert time.monotonic() < deadline, "the summary never came"
        time.sleep(0.1)


@contextlib.contextmanager
def proxy(engine_url: str, port: int, keyfile, logs, name: str, *store_args: str):
    head, store = (
        (list(store_args[:2]), list(store_args[2:])) if store_args[:1] == ("--state-dir",) else ([], list(store_args))
    )
    argv = proxy_argv("tiny", engine_url, port, "--api-key-file", str(keyfile), *store)
    argv[3:3] = head  # --state-dir is molctl's own option, before the command
    with running(argv, f"http://127.0.0.1:{port}/readyz", log=logs / f"proxy-{name}.log"):
        yield f"http://127.0.0.1:{port}"


@contextlib.contextmanager
def store_args(backend: str, tmp_path):
    if backend == "sqlite":
        yield ["--state-dir", str(tmp_path / "state")]
    else:
        with redis_server() as redis:
            yield ["--set", f"proxy.store={redis.url}", *PATIENT_STORE]


@pytest.mark.parametrize("backend", ["sqlite", "redis"])
def test_a_conversation_survives_a_proxy_restart(backend, keyfile, tmp_path):
    engine_port, port = free_ports(2)
    engine_url = f"http://127.0.0.1:{engine_port}"
    u1 = {"role": "user", "content": f"[route:L2] write a parser ({backend})"}
    u2 = {"role": "user", "content": "[route:L1] now plan my trip"}
    with (
        store_args(backend, tmp_path) as args,
        running(fake_engine_argv(engine_port, STRICT), engine_url + "/health", log=tmp_path / "engine.log"),
    ):
        with proxy(engine_url, port, keyfile, tmp_path, "first", *args) as url:
            c = client(url)
            conv = c.conversations.create(
                metadata={"backend": backend}, items=[{"role": "developer", "content": "Be terse."}]
            )
            r1 = c.responses.create(model=PUBLIC, input=u1["content"], conversation=conv.id)
            summarised(url, r1.id)  # before the restart: the summary hop runs after the answer
        with proxy(engine_url, port, keyfile, tmp_path, "second", *args) as url:
            c = client(url)
            assert c.conversations.retrieve(conv.id).metadata == {"backend": backend}
            r2 = c.responses.create(model=PUBLIC, input=u2["content"], conversation=conv.id)
            assert r2.status == "completed" and r2.conversation.id == conv.id
            items = c.conversations.items.list(conv.id, order="asc").data
            assert [(i.type, i.role) for i in items] == [
                ("message", "developer"),
                ("message", "user"),
                ("message", "assistant"),
                ("message", "user"),
                ("message", "assistant"),
            ]
            with pytest.raises(openai.NotFoundError):
                client(url, KEY2).conversations.items.list(conv.id)
            c.conversations.delete(conv.id)
            with pytest.raises(openai.NotFoundError):
                c.conversations.retrieve(conv.id)
        views = [e["messages"] for e in engine_answers(engine_url)]
        developer = {"role": "system", "content": IDENTITY["content"] + "\n\nBe terse."}
        assert views[-1] == [developer, u1, fold(f"summary of {r1.output_text}"), u2]


def test_two_replicas_share_a_conversation_on_one_redis(keyfile, tmp_path):
    ports = free_ports(4)
    engines = [f"http://127.0.0.1:{p}" for p in ports[:2]]
    with redis_server() as redis, contextlib.ExitStack() as stack:
        for name, (url, port) in zip("AB", zip(engines, ports[:2], strict=True), strict=True):
            stack.enter_context(
                running(fake_engine_argv(port, STRICT), url + "/health", log=tmp_path / f"engine-{name}.log")
            )
        urls = [
            stack.enter_context(
                proxy(
                    engine,
                    port,
                    keyfile,
                    tmp_path,
                    name,
                    "--set",
                    f"proxy.store={redis.url}",
                    *PATIENT_STORE,
                    "--replica-id",
                    name,
                )
            )
            for name, engine, port in zip("AB", engines, ports[2:], strict=True)
        ]
        a, b = client(urls[0]), client(urls[1])
        conv = a.conversations.create()
        u = [f"[route:{r}] step {i}" for i, r in enumerate(["L2", "L1", "L2"])]
        r = [a.responses.create(model=PUBLIC, input=u[0], conversation=conv.id)]
        r.append(b.responses.create(model=PUBLIC, input=u[1], conversation=conv.id))
        r.append(a.responses.create(model=PUBLIC, input=u[2], conversation=conv.id))
        assert engine_answers(engines[1]) == []  # B's turn went to the engine that served the conversation
        views = [e["messages"] for e in engine_answers(engines[0])]
        assert [e["model"] for e in engine_answers(engines[0])] == ["L2", "L1", "L2"]
        U = [{"role": "user", "content": x} for x in u]
        assert views[1] == [system(), U[0], fold(f"summary of {r[0].output_text}"), U[1]]
        assert views[2] == [
            system(),
            U[0],
            {"role": "assistant", "content": r[0].output_text},
            U[1],
            fold(f"summary of {r[1].output_text}"),
            U[2],
        ]
        assert len(b.conversations.items.list(conv.id).data) == 6
        b.conversations.update(conv.id, metadata={"by": "B"})
        assert a.conversations.retrieve(conv.id).metadata == {"by": "B"}
        b.conversations.delete(conv.id)
        with pytest.raises(openai.NotFoundError):
            a.responses.create(model=PUBLIC, input="again", conversation=conv.id)
