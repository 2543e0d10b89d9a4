"""The background summary hops: one per final answer, once the client has the whole response.

`Summaries.start(plan)` queues the turn's summary (at most `proxy.summary_inflight` run at once,
at most `proxy.summary_queue_max` wait; more are dropped: `summaries_dropped_total`; one that
waited past `proxy.summary_wait_s`, or whose turn a later turn folded without it, is stale:
`summaries_stale_total`). `summary_request` builds the hop: the continuation of the answer's own
tokens (`summary_suffix`, from the engine's template probe) where the engine reported them, else
the chat summary (`summary_payload`). docs/design/proxy.md ("Summaries") has the reasoning.
"""

from __future__ import annotations

import asyncio
import logging
import time
from array import array
from dataclasses import dataclass
from typing import Any

import orjson

from molctl.engines.base import AnswerTokens, Engine, RawIds, continuation_ids
from molctl.profiles import Profile
from molctl.proxy import fastjson
from molctl.proxy.affinity import EngineChoice
from molctl.proxy.apis.request_fields import FieldPolicy
from molctl.proxy.conversations import TurnRecord, text_of
from molctl.proxy.engine_client import CHAT_PATH, EngineClient, checked_completion
from molctl.proxy.errors import EngineHTTPError, EngineUnavailable
from molctl.proxy.pipeline.plan import Plan
from molctl.proxy.pipeline.priority import PRIORITY_RETRY_S, PriorityPolicy
from molctl.proxy.pipeline.routing import described
from molctl.proxy.pipeline.views import PROBE_ANSWER, PROBE_USER, suffix_after, summary_messages
from molctl.proxy.pipeline.window import WindowFit
from molctl.proxy.store.base import ConversationStore
from molctl.routes import ROUTES

log = logging.getLogger("molctl.proxy")


@dataclass
class SummaryJob:
    """What a queued summary hop keeps until it has a slot, and no more (issue 40: the token
    lists and the chat fallback's messages, 2.85 MB a summary at 150k tokens): the continuation's
    whole prompt as JSON when the summary suffix is known (about 7 bytes a token, sent as it is:
    no int objects are made again), else the answer's token ids as 4-byte arrays and the chat
    request (the fallback) as its JSON bytes; `size()` of it is bounded by
    `proxy.summary_job_max_bytes`."""

    chat: bytes | None  # the chat summary's JSON (`summary_payload`); None when `ids` is set
    model: str
    route: str
    tokens: AnswerTokens | None  # the answer's ids as arrays, while the suffix is not known yet
    extra: dict[str, Any]  # answer-hop fields the continuation must repeat to hit its cache (vLLM cache_salt)
    engine: EngineChoice | None = None  # the request's engine (conversation affinity): the summary goes there too
    ids: bytes | None = None  # the continuation's prompt (`continuation_ids`) as a JSON array, built at queue time
    count: int = 0  # how many ids that is

    def size(self) -> int:
        """The bytes it keeps: the JSON and the token arrays (the rest is a few hundred)."""
        arrays = [a for a in (self.tokens.prompt, self.tokens.output) if a is not None] if self.tokens else []
        return len(self.chat or b"") + len(self.ids or b"") + sum(len(a) * a.itemsize for a in arrays)  # type: ignore[attr-defined]


def continuation_json(tokens: AnswerTokens, suffix: list[int]) -> tuple[bytes, int]:
    """`continuation_ids` as a JSON array and its length; a prompt the engine client kept as its
    text (`RawIds`) is joined as it is, never parsed (256k ids: 1 ms, not 25)."""
    prompt = tokens.prompt
    if not isinstance(prompt, RawIds):
        ids = continuation_ids(tokens, suffix)
        return fastjson.dumps_bytes(ids), len(ids)
    rest = continuation_ids(AnswerTokens([], tokens.output, tokens.stop_token), suffix)
    if not rest:
        return prompt.text, prompt.count
    tail = fastjson.dumps_bytes(rest)
    return prompt.text.rstrip()[:-1] + b"," + tail[1:], prompt.count + len(rest)


def compact_ids(ids: list[int]) -> array:
    """Token ids as 4 bytes each (every vocabulary fits), 8 for a value that does not."""
    try:
        return array("i", ids)
    except OverflowError:
        return array("q", ids)


class Summaries:
    def __init__(
        self,
        profile: Profile,
        engine: Engine,
        client: EngineClient,
        store: ConversationStore,
        counters: Any,
        fields: FieldPolicy,
        priority: PriorityPolicy,
        window: int | None,
        concurrency: int,
        timeout_s: float,
    ):
        self.profile = profile
        self.engine = engine
        self.client = client
        self.store = store
        self.counters = counters
        self.fields = fields
        self.priority = priority
        self.window = window
        self.window_fit = WindowFit(engine, client, window, counters)
        self.summary_instruction = profile.substitute(profile.prompts.summary).strip()
        self.adapter_models = {r: engine.adapter_model(profile, r) for r in ROUTES}
        self._slots = asyncio.Semaphore(concurrency)
        self.concurrency = concurrency
        self.waiting = 0  # tasks created that do not hold a slot yet
        self.running = 0
        self.timeout_s = timeout_s
        self.background: set[asyncio.Task] = set()
        self._suffixes: dict[str, list[int]] = {}  # adapter model -> the summary suffix (`summary_suffix`)
        self._suffix_failed: dict[str, float] = {}  # adapter model -> when its template probe last failed
        self._suffix_lock = asyncio.Lock()
        self._fallback_said: set[str] = set()

    def summary_payload(self, plan: Plan) -> dict[str, Any]:
        """The chat summary: the fallback of the token continuation (`summary_request`)."""
        answer = {"role": "assistant", "content": text_of(plan.answer.get("content"))}
        payload: dict[str, Any] = {
            "model": self.adapter_models[plan.route],
            "messages": summary_messages(plan.view, answer, self.summary_instruction),
            "max_tokens": self.profile.proxy.summary_max_tokens,
            "temperature": 0,
            "stream": False,
        }
        if self.profile.proxy.reasoning != "none":
            payload["chat_template_kwargs"] = {"enable_thinking": False}
        self.priority.mark(payload, "summary", plan.engine)
        return payload

    def start(self, plan: Plan) -> None:
        """Called once the client has the complete response (body sent, or after [DONE])."""
        record, key = plan.record, plan.record_key
        if record is None or key is None:
            return
        free = self.concurrency - self.running
        if self.waiting >= self.profile.proxy.summary_queue_max + free:
            self.counters.inc("summaries_dropped_total")
            record.set_summary(None)
            return
        job = self._job(plan)
        if job.size() > self.profile.proxy.summary_job_max_bytes:
            self.counters.inc("summaries_dropped_total")
            record.set_summary(None)
            if "size" not in self._fallback_said:
                self._fallback_said.add("size")
                log.warning(
                    "a summary would keep %d bytes while queued, over proxy.summary_job_max_bytes (%d): "
                    "dropped (counted in summaries_dropped_total; said once)",
                    job.size(),
                    self.profile.proxy.summary_job_max_bytes,
                )
            return
        self.waiting += 1
        task = asyncio.get_running_loop().create_task(
            self._summarise(job, record, key, time.monotonic(), plan.big, plan.request_id)
        )
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    def _job(self, plan: Plan) -> SummaryJob:
        """The queued summary: the summary request only, not the client's request (`SummaryJob`)."""
        salt = plan.body.get("cache_salt")
        extra = {"cache_salt": salt} if isinstance(salt, str) and "cache_salt" in self.fields.extensions else {}
        model, tokens = self.adapter_models[plan.route], plan.tokens
        complete = tokens is not None and tokens.complete() and self.engine.continuation_path is not None
        suffix = self._suffixes.get(model) if complete else None
        if suffix is not None:
            text, count = continuation_json(tokens, suffix)  # type: ignore[arg-type]
            return SummaryJob(None, model, plan.route, None, extra, plan.engine, text, count)
        if complete:
            tokens = AnswerTokens(compact_ids(tokens.prompt), compact_ids(tokens.output), tokens.stop_token)  # type: ignore[arg-type, union-attr]
        chat = fastjson.dumps_bytes(self.summary_payload(plan))
        return SummaryJob(chat, model, plan.route, tokens if complete else None, extra, plan.engine)

    def _stale(self, record: TurnRecord, queued: float) -> bool:
        return record.stale or time.monotonic() - queued > self.profile.proxy.summary_wait_s

    async def summary_suffix(self, model: str, engine: EngineChoice | None = None) -> list[int] | None:
        """The tokens that follow an answer's own tokens in the summary hop (end of the assistant
        turn, a user turn with the summary instruction, the generation prompt with thinking off),
        derived from the engine's template probe (`Engine.probe_path`) rendering a probe
        conversation twice (`views.suffix_after`); docs/design/proxy.md, "The summary suffix".
        One probe pair per adapter model per proxy; a failed probe is tried again after
        PRIORITY_RETRY_S, the summaries meanwhile fall back to the chat summary. `engine`: the
        request's engine (the probe goes where the summary goes)."""
        if model in self._suffixes:
            return self._suffixes[model]
        failed = self._suffix_failed.get(model)
        if failed is not None and time.monotonic() - failed < PRIORITY_RETRY_S:
            return None
        async with self._suffix_lock:
            if model in self._suffixes:
                return self._suffixes[model]
            path = self.engine.probe_path
            if path is None:
                return None
            suffix, why = await self._probe(model, path, engine)
            if suffix is None:
                self._suffix_failed[model] = time.monotonic()
                log.warning(
                    "the template probe for summaries on %s failed (%s): summaries are sent as chat requests, "
                    "not as continuations of the answer's tokens",
                    model,
                    why,
                )
            else:
                self._suffixes[model] = suffix
                self._suffix_failed.pop(model, None)
            return suffix

    async def _probe(self, model: str, path: str, engine: EngineChoice | None) -> tuple[list[int] | None, str]:
        """The template probe pair: the summary suffix, or None and why not."""
        kwargs = {"enable_thinking": False} if self.profile.proxy.reasoning != "none" else None
        convo = [{"role": "user", "content": PROBE_USER}, {"role": "assistant", "content": PROBE_ANSWER}]
        suffix = None
        try:
            left_open = self.engine.probe_ids(
                await self.client.chat(
                    self.engine.probe_request(model, convo, False, kwargs),
                    "summary",
                    timeout=30,
                    path=path,
                    engine=engine,
                )
            )
            closed = self.engine.probe_ids(
                await self.client.chat(
                    self.engine.probe_request(
                        model, [*convo, {"role": "user", "content": self.summary_instruction}], True, kwargs
                    ),
                    "summary",
                    timeout=30,
                    path=path,
                    engine=engine,
                )
            )
            if left_open and closed:
                suffix = suffix_after(left_open, closed)
            why = "its tokens did not show where the answer ends"
        except (EngineHTTPError, EngineUnavailable) as exc:
            why = described(exc)
        return suffix, why

    async def summary_request(self, job: SummaryJob) -> tuple[str, dict[str, Any]] | None:
        """(path, body) of the summary hop, or None: it would not fit the engine's window.

        The continuation (issue 30): the answer hop's prompt token ids + its generated ids + the
        suffix (`summary_suffix`, `engines.base.continuation_ids`), as a completion with a token
        prompt on the same adapter (`Engine.continuation_request`): every token before the
        suffix is one the engine computed for the answer, so the engine's prefix cache serves
        all of it but the last, partial KV block. Its prompt plus `proxy.summary_max_tokens`
        must fit the window (`context_window`), else the summary is skipped
        (`summary_window_skips_total`): the chat summary would not fit either. Without the
        answer's token ids (an engine that reports none, a stream that hid them, SGLang streams)
        or a suffix, today's chat summary (`summary_payload`), counted in
        `summary_chat_fallbacks_total` and logged once per cause."""
        if job.ids is not None:
            return self._continuation(job, orjson.Fragment(job.ids), job.count)
        tokens = job.tokens
        suffix = None
        if tokens is not None and tokens.complete() and self.engine.continuation_path is not None:
            suffix = await self.summary_suffix(job.model, job.engine)
            cause = "probe"
        elif (tokens is None or not tokens.complete()) and not self.engine.answer_token_fields(False):
            cause = "engine"  # never asked (SGLang: its chat answers carry no generated ids)
        else:
            cause = "tokens"
        if suffix is None or tokens is None:
            self.counters.inc("summary_chat_fallbacks_total")
            if cause not in self._fallback_said:
                self._fallback_said.add(cause)
                if cause == "tokens":
                    log.warning(
                        "an answer hop came back without its token ids: its summary is sent as a chat request "
                        "(counted in summary_chat_fallbacks_total; said once)"
                    )
            chat: bytes = job.chat  # type: ignore[assignment]
            # a MiB of JSON takes orjson 5-20 ms to read: off the event loop, as a big body's parse
            payload = fastjson.loads(chat) if len(chat) < 1 << 20 else await asyncio.to_thread(fastjson.loads, chat)
            await self.window_fit.fit(payload, "summary", job.engine)
            return CHAT_PATH, payload
        ids = continuation_ids(tokens, suffix)
        return self._continuation(job, ids, len(ids))

    def _continuation(self, job: SummaryJob, ids: Any, count: int) -> tuple[str, dict[str, Any]] | None:
        """The continuation hop of `ids` (`count` of them; a list, or its JSON as an orjson
        Fragment), or None: with the summary's tokens it passes the window."""
        limit = self.profile.proxy.summary_max_tokens
        if self.window is not None and count + limit > self.window:
            self.counters.inc("summary_window_skips_total")
            return None
        payload = self.engine.continuation_request(job.model, job.route, ids, limit)
        payload.update(job.extra)
        self.priority.mark(payload, "summary", job.engine)
        return self.engine.continuation_path, payload

    def _summary_text(self, path: str, body: dict[str, Any], adapter: str) -> str:
        if path != CHAT_PATH:
            text, usage = self.engine.continuation_result(body)
            self.counters.inc("summary_continuations_total")
            if usage is not None:
                self._count_usage(usage, adapter)
            return text.strip()
        body = checked_completion(body)
        if isinstance(body.get("usage"), dict):
            self._count_usage(body["usage"], adapter)
        msg = ((body.get("choices") or [{}])[0]).get("message") or {}
        reasoning = msg.get("reasoning_content") or msg.get("reasoning") or ""
        return (msg.get("content") or "").strip() or reasoning.strip()[:160]

    def _count_usage(self, usage: dict[str, Any], adapter: str) -> None:
        """The summary hops' prompt and cached tokens as the engine reports them (the cache share
        of issue 30: summary_cached_tokens_total / summary_prompt_tokens_total), and by adapter
        (`Counters.usage`)."""
        self.counters.usage("summary", adapter, usage)
        prompt = usage.get("prompt_tokens")
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if isinstance(prompt, int) and isinstance(cached, int):
            self.counters.inc("summary_prompt_tokens_total", prompt)
            self.counters.inc("summary_cached_tokens_total", cached)

    async def _summarise(
        self, job: SummaryJob, record: TurnRecord, key: bytes, queued: float, big: bool, request_id: str | None = None
    ) -> None:
        waiting = True
        try:
            async with self._slots:
                self.waiting -= 1
                self.running += 1
                waiting = False
                if self._stale(record, queued):
                    self.counters.inc("summaries_stale_total")
                    record.set_summary(None)
                    return
                hop = await self.summary_request(job)
                if hop is None:
                    record.set_summary(None)
                    return
                for attempt in range(2):
                    try:
                        await self._hop(job, record, key, hop, big, request_id)
                        return
                    except (EngineHTTPError, EngineUnavailable) as exc:
                        log.warning("summary hop failed (attempt %d): %s", attempt + 1, described(exc))
                        if attempt == 0:
                            self.counters.inc("summary_retries_total")
                self.counters.inc("summary_failures_total")
                record.set_summary(None)
        finally:
            if waiting:
                self.waiting -= 1
            else:
                self.running -= 1

    async def _hop(
        self,
        job: SummaryJob,
        record: TurnRecord,
        key: bytes,
        hop: tuple[str, dict[str, Any]],
        big: bool,
        request_id: str | None,
    ) -> None:
        """One attempt of the summary hop; the summary (or None: stale) lands on the record."""
        path, payload = hop
        start = time.monotonic()
        body = await self.client.chat(
            payload,
            "summary",
            timeout=self.timeout_s,
            big=big,
            request_id=request_id,
            engine=job.engine,
            **({"path": path} if path != CHAT_PATH else {}),
        )
        self.counters.observe("hop_seconds", time.monotonic() - start, hop="summary", adapter=record.route)
        try:
            text = self._summary_text(path, body, record.route)
        except (ValueError, TypeError, AttributeError) as exc:
            raise EngineHTTPError(502, f"the engine's summary answer is unusable: {exc}") from None
        if record.stale:  # a later turn folded this one without it: keep it that way
            self.counters.inc("summaries_stale_total")
            record.set_summary(None)
            return
        self.counters.inc("summaries_total")
        record.set_summary(text)
        self.store.put_turn(key, record)  # recount its size with the summary
