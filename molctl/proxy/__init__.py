"""The MoL proxy: one public OpenAI-compatible model in front of the engine's four adapters.

HTTP request -> auth (app) -> validation (validation) -> conversation state (conversations) ->
router + views (views) -> engine client (engine_client) -> response shaping (shaping); errors in
the OpenAI shape (errors). `orchestrator` ties one request together; `app` is the raw ASGI
application; `server` runs it under uvicorn with drain-on-SIGTERM.
"""
