"""`conversation` on POST /v1/responses: the conversation's items become the request's history
(`load`), and the response's input and output items are added to it (`append`).

The history is made of chat messages converted from the items, as a `previous_response_id`
chain's stored messages are: the pipeline finds the turn records of the earlier turns by their
conversation keys (the route of each turn, its summary for the fold, the replica that answered
it) exactly as for a chain, on any replica of a shared store.
"""

from __future__ import annotations

from typing import Any

from molctl.proxy.apis.conversations.items import duplicate, history_messages
from molctl.proxy.apis.conversations.records import ConversationRecords, conversation_not_found


async def load(records: ConversationRecords, req: Any, tenant: str, media_hosts: tuple[str, ...] = ()) -> None:
    """The conversation's items as the request's history (404 naming `conversation` when it is not
    this tenant's); an input item with the id of an item the conversation holds is a 400."""
    record = await records.get(tenant, req.conversation_id)
    if record is None:
        raise conversation_not_found(req.conversation_id, "conversation")
    known = {i["id"] for i in record["items"]}
    for item in req.input_items:
        if item["id"] in known:
            raise duplicate(item["id"], "input")
    req.history = history_messages(record["items"], media_hosts)


async def append(records: ConversationRecords, req: Any, tenant: str, response: dict[str, Any]) -> None:
    """After the answer: its input items then its output items, at the conversation's end (read
    again under the conversation's lock: a turn added meanwhile is kept). A conversation deleted
    meanwhile stays deleted (the response is still answered)."""
    response["conversation"] = {"id": req.conversation_id}
    async with records.lock(tenant, req.conversation_id):
        record = await records.get(tenant, req.conversation_id)
        if record is None:
            return
        record["items"].extend([*req.input_items, *(response.get("output") or ())])
        await records.put(record)
