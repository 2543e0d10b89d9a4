"""The Responses API's endpoints: create (POST /v1/responses), get, delete, input_items, cancel.

`ResponsesAPI.create` parses the request (`protocol`), loads the stored chain it continues (a
shared store that is down fails it here, before any engine work), and runs it through the
pipeline's entry points (`Orchestrator.answer` / `chunks`, with `persist=False`: the turn and the
stored response are written together), shaping the answer (`events`). Stored responses are per
tenant; another tenant's id is a 404, never a 403.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from molctl.profiles import Profile
from molctl.proxy.apis.conversations import turns
from molctl.proxy.apis.conversations.records import ConversationRecords
from molctl.proxy.apis.exchange import Exchange
from molctl.proxy.apis.listing import page_params
from molctl.proxy.apis.responses import background, compact, events
from molctl.proxy.apis.responses.convert import new_id
from molctl.proxy.apis.responses.protocol import (
    NeedsReferences,
    ResponsesRequest,
    not_found,
    parse_request,
    public_param,
    referenced_items,
    response_of_item,
)
from molctl.proxy.errors import ProxyError, invalid
from molctl.proxy.http.body import BIG_ITEMS, many_items
from molctl.proxy.pipeline.plan import Plan
from molctl.proxy.pipeline.run import Orchestrator
from molctl.proxy.store.background_backends import background_store_for
from molctl.proxy.store.base import ResponseStore, StoreScope


class ResponsesAPI:
    def __init__(
        self,
        orch: Orchestrator,
        profile: Profile,
        store: ResponseStore,
        conversations: ConversationRecords | None = None,
    ):
        self.orch = orch
        self.profile = profile
        self.responses = store
        self.conversations = conversations or ConversationRecords(store)  # `conversation` (apis.conversations)
        self.background = background.Background(
            background_store_for(store), profile.proxy.background_max_per_tenant
        )  # background: true (started and stopped with the app)

    # ------------------------------------------------------------------ create
    async def create(self, ex: Exchange) -> None:
        try:
            await self._create(ex)
        except ProxyError as exc:
            exc.param = public_param(exc.param)
            raise

    async def _create(self, ex: Exchange) -> None:
        tenant = ex.tenant
        req, big = await self._request(ex, tenant)
        if req.body.get("background"):
            await background.create(self, ex, req, big)
            return
        store_scope = self.orch.store.open_scope()  # the chain's state read with it, used by load
        await self._previous(req, tenant, store_scope)
        big = big or len(req.history) > BIG_ITEMS  # a long stored chain: prepared off the loop too
        plan = await asyncio.to_thread(self._plan, req, tenant, big) if big else self._plan(req, tenant, big)
        plan.scope = store_scope
        await self.orch.load(plan)
        ex.track(plan)
        if not plan.stream:
            await ex.run(plan, self._complete(plan, req, ex))
            return
        translator = events.StreamTranslator(req, new_id("resp_"))
        plan.responses.conversation_id = plan.responses.conversation_id or translator.id

        def error_event(exc: ProxyError) -> bytes:
            return events.sse(events.error_event(translator, exc, public_param(exc.param)))

        await ex.run(plan, self._stream(plan, req, translator, ex, error_event))

    async def _stream(
        self, plan: Plan, req: ResponsesRequest, tr: events.StreamTranslator, ex: Exchange, error_event
    ) -> None:
        chunks = self._events(plan, req, tr, ex)
        done = await ex.stream(
            plan, chunks, frame=events.sse, error_frame=error_event, end=None, abandon=lambda: self.orch.abandon(plan)
        )
        if done:
            self.orch.start_summary(plan)

    def _parse(self, body: Any) -> ResponsesRequest:
        """The request checked at this edge (`protocol.parse_request`)."""
        return parse_request(body, self.profile.served_model_name, self.profile.proxy.media_url_hosts, self.orch.fields)

    async def _request(self, ex: Exchange, tenant: str) -> tuple[ResponsesRequest, bool]:
        """The parsed request, and whether it is big (prepared in a worker thread)."""
        try:
            return await ex.json_body("input", self._parse)
        except NeedsReferences as need:  # item_reference inputs: their items from the store
            return await self._with_references(need, tenant), many_items(need.body, "input")

    async def _previous(self, req: ResponsesRequest, tenant: str, scope: StoreScope) -> None:
        """The stored chain a request continues; a shared store that is down fails a request that
        needs state (a chain, or store=true) here, before any engine work (503 + Retry-After)."""
        previous = req.body.get("previous_response_id")
        if previous is not None or req.store or req.conversation_id is not None:
            await self.responses.available()
        if req.conversation_id is not None:  # its items are the history (excludes previous_response_id)
            await turns.load(self.conversations, req, tenant, self.profile.proxy.media_url_hosts)
        if previous is not None:
            # a shared store reads the chain's conversation state in the same round trip
            record = await self.responses.get_previous(tenant, previous, scope)
            if record is None:
                raise not_found(previous, "previous_response_id")
            req.prev, req.history = record, list(record["messages"])

    async def _with_references(self, need: NeedsReferences, tenant: str) -> ResponsesRequest:
        """Parse again with the output items the request's `item_reference`s name (each a stored
        response of this tenant, found by the item's id: protocol.ItemIds)."""
        await self.responses.available()
        records: dict[str, Any] = {}
        for response_id in dict.fromkeys(filter(None, map(response_of_item, need.ids))):
            records[response_id] = await self.responses.get_response(tenant, response_id)
        refs = referenced_items(need.ids, records)
        return parse_request(
            need.body, self.profile.served_model_name, self.profile.proxy.media_url_hosts, self.orch.fields, refs
        )

    def _plan(self, req: ResponsesRequest, tenant: str, big: bool) -> Plan:
        plan = self.orch.prepare(req.chat_body(), tenant)
        plan.big = plan.big or big
        plan.include_usage = True  # the Response's usage
        plan.responses.previous, plan.responses.new_messages = (
            req.prev,
            req.messages,
        )  # the sticky tool-turn rule reads them
        plan.responses.conversation_id = req.conversation_id or events.conversation_of(req.prev)
        return plan

    async def _keep(self, req: ResponsesRequest, plan: Plan, tenant: str, response: dict[str, Any]) -> None:
        """Store a complete (or incomplete) answer (a large one from a worker thread: LocalResponses),
        and add its items to its conversation."""
        if req.conversation_id is not None and response["status"] != "failed":
            await turns.append(self.conversations, req, tenant, response)
        if req.store and response["status"] != "failed" and plan.answer is not None and plan.route is not None:
            await self.responses.put_response(
                events.make_record(req, tenant, response, plan.answer, plan.route), big=plan.big, scope=plan.scope
            )

    async def _complete(self, plan: Plan, req: ResponsesRequest, ex: Exchange) -> None:
        chat = await self.orch.answer(plan, persist=False)  # a shared store writes the turn and the record together
        response = events.complete_response(req, new_id("resp_"), int(time.time()), chat)
        plan.responses.conversation_id = plan.responses.conversation_id or response["id"]
        await self._keep(req, plan, ex.tenant, response)
        await self.orch.persisted(plan)
        await ex.json(200, response)
        self.orch.start_summary(plan)

    async def _events(
        self, plan: Plan, req: ResponsesRequest, tr: events.StreamTranslator, ex: Exchange
    ) -> AsyncIterator[dict[str, Any]]:
        """Nothing is yielded before the engine's first token, so an early failure keeps its
        status (see `http.sse`); a failure after that is a `response.failed` event."""
        answer = self.orch.chunks(plan, persist=False)  # recorded below: the turn and the response in one write
        started = False
        try:
            async for chunk in answer:
                if not started:
                    started = True
                    for event in tr.start():
                        yield event
                for event in tr.feed(chunk):
                    yield event
        except ProxyError as exc:
            if not started:
                raise
            ex.state.error = exc.code or exc.type  # a 200 that ended in response.failed
            for event in tr.failed(exc):
                yield event
            return
        finally:
            await answer.aclose()
        closing, final = tr.finish_events()
        if plan.answer is not None:
            self.orch.record(plan, plan.answer)
        await self._keep(req, plan, ex.tenant, final)  # before the last event: the next request may follow at once
        await self.orch.persisted(plan)
        for event in closing:
            yield event

    async def compact(self, ex: Exchange) -> None:
        """POST /v1/responses/compact (apis.responses.compact)."""
        try:
            await compact.compact(self, ex)
        except ProxyError as exc:
            exc.param = public_param(exc.param)
            raise

    # ------------------------------------------------------------------ stored responses
    async def get(self, ex: Exchange, response_id: str) -> None:
        """A stored response, or a background one's job (its events with `stream=true`: background.follow)."""
        query = ex.query()
        stream = query.get("stream", ["false"])[-1]
        if stream.strip().lower() not in ("false", "0", ""):  # the SDK may send False, 0
            after = background.starting_after(query)
            if await self.background.get(ex.tenant, response_id) is None:
                if await self.responses.get_response(ex.tenant, response_id) is None:
                    raise not_found(response_id)
                raise invalid(
                    "Only a background response (background=true) can be streamed again (stream=true).", "stream"
                )
            follow = self.background.follow(ex.tenant, response_id, after)
            await background.write_followed(ex.send, ex.state.request_id, follow, events.sse)
            return
        record = await self.responses.get_response(ex.tenant, response_id)
        if record is None:
            job = await self.background.get(ex.tenant, response_id)
            if job is None:
                raise not_found(response_id)
            await ex.json(200, job)
            return
        await ex.json(200, record["response"])

    async def delete(self, ex: Exchange, response_id: str) -> None:
        deleted = await self.responses.delete_response(ex.tenant, response_id)
        if await self.background.get(ex.tenant, response_id) is not None:
            await self.background.cancel_quietly(ex.tenant, response_id)
            deleted = await self.background.jobs.delete(ex.tenant, response_id) or deleted
        if not deleted:
            raise not_found(response_id)
        await ex.json(200, {"id": response_id, "object": "response.deleted", "deleted": True})

    async def cancel(self, ex: Exchange, response_id: str) -> None:
        """A background response's cancel (background.Background.cancel); any other is a 400, as OpenAI's."""
        cancelled = await self.background.cancel(ex.tenant, response_id)
        if cancelled is not None:
            await ex.json(200, cancelled)
            return
        if await self.responses.get_response(ex.tenant, response_id) is None:
            raise not_found(response_id)
        raise invalid("Only responses created with background=true can be cancelled.", "response_id")

    async def input_items(self, ex: Exchange, response_id: str) -> None:
        query = {k: v[-1] for k, v in ex.query().items()}
        for key in query:
            if key not in ("limit", "order", "after", "include", "include[]"):  # the SDK sends include[]=…
                raise invalid(f"Unrecognized query parameter: {key}", key)
        limit, order = page_params(query)
        record = await self.responses.get_response(ex.tenant, response_id)
        if record is None:
            raise not_found(response_id)
        await ex.json(200, events.list_input_items(record, limit, order, query.get("after")))
