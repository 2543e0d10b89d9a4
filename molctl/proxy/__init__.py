"""The MoL proxy: one public OpenAI-compatible model in front of the engine's four adapters.

A request: `server` (uvicorn, drain on SIGTERM; `run_proxy` is `molctl proxy`) -> `app` (auth,
endpoints) -> `orchestrator` (route hop or tool stickiness -> answer hop -> record -> summary).
Its modules, one line each:
- `admission`: how many hops of each kind are in flight at the engine, and who waits.
- `app`: the raw ASGI application: auth, request ids, endpoints, the Responses flow, drain.
- `conversations`: conversation state found from the history itself (keys, turn records, tool calls).
- `engine_client`: the one keep-alive HTTP/1.1 client to the engine (and its replicas).
- `errors`: the errors the proxy answers, in the OpenAI shape, and the engine's errors scrubbed.
- `fastjson`: JSON on the hot path (orjson where it gives the standard library's values).
- `http_protocol`: uvicorn's httptools protocol with the request-head bound and one-send heads.
- `metrics`: the Prometheus metrics, on their own listener.
- `orchestrator`: one chat request's hops, and the background summaries.
- `redis_store`: the shared state of proxy replicas on Redis (or Valkey).
- `request_fields`: which request fields are honoured, passed to the engine, ignored or refused.
- `response_store`: the Responses API's stored records, per tenant (the in-memory backend).
- `responses`: the Responses API on top of the chat machinery (conversion, objects, stream events).
- `samples`: sample conversations `molctl check`'s template category renders through this code.
- `server`: `molctl proxy`: the proxy under uvicorn with drain-on-SIGTERM.
- `shaping`: the one place that shapes what clients see (public model name, own ids, no engine extras).
- `sqlite_store`: the durable state on SQLite (stored responses, chat's turn records).
- `validation`: chat request validation: the raw body to a checked dict, or a 400 naming the field.
- `views`: what each hop sends: the router's messages, each adapter's view, the summary request.
"""
