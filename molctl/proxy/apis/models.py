"""GET /v1/models and GET /v1/models/{id}: the one public model (404 for any other id)."""

from __future__ import annotations

import json

from molctl.proxy.apis.exchange import Exchange
from molctl.proxy.errors import ProxyError, shown


class ModelsAPI:
    def __init__(self, served_model_name: str):
        self.name = served_model_name
        self.model = {"id": served_model_name, "object": "model", "created": 0, "owned_by": "molctl"}
        self.list_body = json.dumps({"object": "list", "data": [self.model]}).encode()

    async def list(self, ex: Exchange) -> None:
        await ex.json(200, None, raw=self.list_body)

    async def get(self, ex: Exchange, model_id: str) -> None:
        if model_id != self.name:
            raise ProxyError(
                404,
                f"The model '{shown(model_id)}' does not exist.",
                "invalid_request_error",
                "model_not_found",
                "model",
            )
        await ex.json(200, self.model)
