"""The MoL proxy: one public OpenAI-compatible model in front of the engine's four adapters.

HTTP request -> auth (app) -> validation (validation) -> conversation state (conversations) ->
route-hop input and per-hop message views (views) -> engine client (engine_client) -> response
shaping (shaping); errors in the OpenAI shape (errors). `orchestrator` ties one request together;
`app` is the raw ASGI application; `server` runs it under uvicorn with drain-on-SIGTERM
(`run_proxy`: the `molctl proxy` command); `samples` are the requests `check`'s template
category renders.
"""
