"""What a queued summary keeps is small and bounded by the profile (issue 40): a queued summary
kept the answer's token lists and the whole chat-fallback payload (2.85 MB at 150k tokens, about
730 MB at the default queue of 256). Now: the continuation's ids as one JSON array (about 7 bytes a
token) when the summary suffix is known, else the ids at 4 bytes each and the chat request's JSON; over
`proxy.summary_job_max_bytes` the summary is dropped and counted."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from types import SimpleNamespace

from molctl.engines.base import AnswerTokens
from molctl.engines.vllm import ENGINE
from molctl.proxy import fastjson
from molctl.proxy.apis.request_fields import PERMISSIVE
from molctl.proxy.conversations import TurnRecord
from molctl.proxy.pipeline.priority import PriorityPolicy
from molctl.proxy.pipeline.summary import Summaries
from tests.proxy_stack import TINY

TOKENS = 256 * 1024  # a 256k-token conversation


class Counters:
    def __init__(self):
        self.counts: dict[str, float] = {}

    def inc(self, name, n=1, **labels):
        self.counts[name] = self.counts.get(name, 0) + n


def summaries(job_max: int | None = None) -> tuple[Summaries, Counters]:
    profile = TINY
    if job_max is not None:
        profile = dataclasses.replace(TINY, proxy=dataclasses.replace(TINY.proxy, summary_job_max_bytes=job_max))
    counters = Counters()
    priority = PriorityPolicy(profile, ENGINE, None, counters)
    return Summaries(profile, ENGINE, None, None, counters, PERMISSIVE, priority, None, 1, 5.0), counters


def plan(words: int = 10_000) -> SimpleNamespace:
    text = "word " * words
    view = [{"role": "system", "content": "sys"}, {"role": "user", "content": text}]
    return SimpleNamespace(
        body={},
        route="L1",
        view=view,
        answer={"role": "assistant", "content": text},
        tokens=AnswerTokens(list(range(TOKENS)), list(range(1000)), True),
        engine=None,
        record=TurnRecord("L1"),
        record_key=b"k",
        big=True,
        request_id="r",
    )


def test_a_queued_summary_with_a_known_suffix_keeps_its_ids_json_and_no_chat_payload():
    """Guards the 2.85 MB per queued summary: token lists (36 bytes a token) and the chat payload."""
    s, _ = summaries()
    s._suffixes[s.adapter_models["L1"]] = [7, 8, 9]
    p = plan()
    job = s._job(p)
    assert job.chat is None and job.tokens is None
    ids = [*range(TOKENS), *range(999), 7, 8, 9]  # the stop token ends the output: the suffix's first is dropped
    assert job.size() == len(json.dumps(ids, separators=(",", ":"))) < 8 * (TOKENS + 1000)
    path, body = asyncio.run(s.summary_request(job))
    assert json.loads(fastjson.dumps_bytes(body))["prompt"] == ids


def test_without_the_suffix_the_ids_and_the_chat_json_are_kept_and_the_request_is_the_same():
    """Guards the fallback: the chat request sent from the kept JSON is the one built at queue time."""
    s, _ = summaries()
    p = plan(100)
    job = s._job(p)
    assert job.tokens is not None and job.size() == len(job.chat) + 4 * (TOKENS + 1000)
    s.engine = SimpleNamespace(continuation_path=None)  # no continuation: the chat summary goes
    path, body = asyncio.run(s.summary_request(job))
    assert body == s.summary_payload(p)


def test_a_summary_over_the_profiles_bound_is_dropped_and_counted():
    """Guards the bound: a queued summary never keeps more than proxy.summary_job_max_bytes."""
    s, counters = summaries(job_max=64 * 1024)
    p = plan()

    async def go():
        s.start(p)
        return s.waiting, list(s.background)

    waiting, tasks = asyncio.run(go())
    assert (waiting, tasks) == (0, []) and counters.counts.get("summaries_dropped_total") == 1
    assert p.record.finished and p.record.summary is None
