"""The MoL proxy: one public OpenAI-compatible model in front of the engine's four adapters.

HTTP request -> auth (app) -> conversation state (state) -> router + views (views) -> engine
client (engine_client) -> response shaping (shaping). `orchestrator` ties one request together;
`app` is the raw ASGI application; `server` runs it under uvicorn with drain-on-SIGTERM.
"""
