"""The Conversations API's endpoints (OpenAI's /v1/conversations): create, get, update, delete,
and items list, add, get, delete. Per tenant: another tenant's conversation is a 404. Records:
`records.ConversationRecords` (on the response store); items: `items`."""

from __future__ import annotations

from typing import Any

from molctl.profiles import Profile
from molctl.proxy.apis.conversations.items import item_not_found, parse_items
from molctl.proxy.apis.conversations.records import ConversationRecords, conversation_not_found
from molctl.proxy.apis.exchange import Exchange
from molctl.proxy.apis.listing import list_page, page_params
from molctl.proxy.apis.request_fields import PERMISSIVE, FieldPolicy
from molctl.proxy.errors import invalid
from molctl.proxy.http.body import parse_on_loop

PATH = "/v1/conversations"
QUERY_LIST = ("limit", "order", "after", "include", "include[]")
QUERY_INCLUDE = ("include", "include[]")
INCLUDE_VALUES = (  # OpenAI's IncludeEnum
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
    "reasoning.encrypted_content",
    "message.output_text.logprobs",
)


def check_metadata(value: Any, param: str = "metadata") -> dict[str, Any]:
    """OpenAI's Metadata: at most 16 pairs, string keys up to 64 characters, string values up to 512."""
    if value is None:
        return {}
    if (
        not isinstance(value, dict)
        or len(value) > 16
        or not all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in value.items()
        )
    ):
        raise invalid(
            f"'{param}' must be an object of at most 16 pairs: string keys of up to 64 characters, "
            "string values of up to 512.",
            param,
        )
    return dict(value)


class ConversationsAPI:
    def __init__(self, records: ConversationRecords, profile: Profile, fields: FieldPolicy = PERMISSIVE):
        self.records = records
        self.media_hosts = profile.proxy.media_url_hosts
        self.fields = fields

    async def dispatch(self, ex: Exchange, path: str, method: str) -> bool:
        """Routes /v1/conversations[/{id}[/items[/{item_id}]]]; False: no such endpoint."""
        if path == PATH:
            if method != "POST":
                return False
            await self.create(ex)
            return True
        if not path.startswith(PATH + "/"):
            return False
        parts = path[len(PATH) + 1 :].split("/")
        if len(parts) == 1 and parts[0]:
            handler = {"GET": self.get, "POST": self.update, "DELETE": self.delete}.get(method)
            if handler is None:
                return False
            await handler(ex, parts[0])
        elif len(parts) == 2 and parts[0] and parts[1] == "items":
            handler = {"GET": self.list_items, "POST": self.add_items}.get(method)
            if handler is None:
                return False
            await handler(ex, parts[0])
        elif len(parts) == 3 and parts[0] and parts[1] == "items" and parts[2]:
            handler = {"GET": self.get_item, "DELETE": self.delete_item}.get(method)
            if handler is None:
                return False
            await handler(ex, parts[0], parts[2])
        else:
            return False
        return True

    # ------------------------------------------------------------------ helpers
    async def _body(self, ex: Exchange, allowed: tuple[str, ...], empty_ok: bool) -> dict[str, Any]:
        raw = await ex.body()
        if not raw.strip() and empty_ok:
            return {}
        body = await parse_on_loop(raw)
        if not isinstance(body, dict):
            raise invalid("The request body must be a JSON object.")
        for key in body:
            if key not in allowed:
                raise invalid(f"Unrecognized request argument supplied: {str(key)[:80]}", str(key)[:80])
        return body

    @staticmethod
    def _query(ex: Exchange, allowed: tuple[str, ...]) -> dict[str, str]:
        """The query's parameters (the last value of each); `include` values must be OpenAI's
        IncludeEnum (accepted: conversation items are text, nothing more is there to include)."""
        raw = ex.query()
        for key in raw:
            if key not in allowed:
                raise invalid(f"Unrecognized query parameter: {key[:80]}", key[:80])
        for key in QUERY_INCLUDE:
            for value in raw.get(key, ()):
                if value not in INCLUDE_VALUES:
                    raise invalid(f"'include' values must be among {', '.join(INCLUDE_VALUES)}.", "include")
        return {k: v[-1] for k, v in raw.items()}

    async def _record(self, ex: Exchange, conversation_id: str) -> dict[str, Any]:
        record = await self.records.get(ex.tenant, conversation_id)
        if record is None:
            raise conversation_not_found(conversation_id)
        return record

    # ------------------------------------------------------------------ conversations
    async def create(self, ex: Exchange) -> None:
        body = await self._body(ex, ("metadata", "items"), empty_ok=True)
        metadata = check_metadata(body.get("metadata"))
        items = parse_items(body.get("items"), "items", set(), self.media_hosts, self.fields)
        record = self.records.new(ex.tenant, metadata, items)
        await self.records.put(record)
        await ex.json(200, record["conversation"])

    async def get(self, ex: Exchange, conversation_id: str) -> None:
        self._query(ex, ())
        await ex.json(200, (await self._record(ex, conversation_id))["conversation"])

    async def update(self, ex: Exchange, conversation_id: str) -> None:
        body = await self._body(ex, ("metadata",), empty_ok=False)
        if "metadata" not in body:
            raise invalid("'metadata' is required.", "metadata")
        metadata = check_metadata(body["metadata"])
        async with self.records.lock(ex.tenant, conversation_id):
            record = await self._record(ex, conversation_id)
            record["conversation"]["metadata"] = metadata
            await self.records.put(record)
        await ex.json(200, record["conversation"])

    async def delete(self, ex: Exchange, conversation_id: str) -> None:
        async with self.records.lock(ex.tenant, conversation_id):
            if not await self.records.delete(ex.tenant, conversation_id):
                raise conversation_not_found(conversation_id)
        await ex.json(200, {"id": conversation_id, "object": "conversation.deleted", "deleted": True})

    # ------------------------------------------------------------------ items
    async def list_items(self, ex: Exchange, conversation_id: str) -> None:
        query = self._query(ex, QUERY_LIST)
        limit, order = page_params(query)
        record = await self._record(ex, conversation_id)
        await ex.json(200, list_page(record["items"], limit, order, query.get("after")))

    async def add_items(self, ex: Exchange, conversation_id: str) -> None:
        self._query(ex, QUERY_INCLUDE)
        body = await self._body(ex, ("items",), empty_ok=False)
        async with self.records.lock(ex.tenant, conversation_id):
            record = await self._record(ex, conversation_id)
            existing = {i["id"] for i in record["items"]}
            added = parse_items(body.get("items"), "items", existing, self.media_hosts, self.fields, required=True)
            record["items"].extend(added)
            await self.records.put(record)
        await ex.json(200, list_page(added, len(added), "asc", None))

    async def get_item(self, ex: Exchange, conversation_id: str, item_id: str) -> None:
        self._query(ex, QUERY_INCLUDE)
        record = await self._record(ex, conversation_id)
        item = next((i for i in record["items"] if i["id"] == item_id), None)
        if item is None:
            raise item_not_found(item_id)
        await ex.json(200, item)

    async def delete_item(self, ex: Exchange, conversation_id: str, item_id: str) -> None:
        async with self.records.lock(ex.tenant, conversation_id):
            record = await self._record(ex, conversation_id)
            kept = [i for i in record["items"] if i["id"] != item_id]
            if len(kept) == len(record["items"]):
                raise item_not_found(item_id)
            record["items"] = kept
            await self.records.put(record)
        await ex.json(200, record["conversation"])
