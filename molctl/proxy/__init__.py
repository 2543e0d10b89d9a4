"""The MoL proxy: one public OpenAI-compatible model in front of the engine's four adapters.

A request: `http.server` (uvicorn, drain on SIGTERM; `run_proxy` is `molctl proxy`) -> `http.app`
(auth, request ids, body limits) -> `apis` (the wire shape to a plan) -> `pipeline.run` (prepare ->
load -> route -> answer -> record -> summary) -> back through `apis` and `http.sse` as bytes.
Its modules, one line each:
- `affinity`: conversation affinity between replicas: the engine a conversation's hops go to.
- `apis.chat`: POST /v1/chat/completions: the body to a plan, the pipeline's answer back.
- `apis.chat_validation`: chat request validation: the raw body to a checked dict, or a 400 naming the field.
- `apis.conversations.handlers`: the Conversations API's endpoints (/v1/conversations, its items).
- `apis.conversations.items`: conversation items: checked as input items, back to chat messages, paged.
- `apis.conversations.records`: conversation records on the response store; `ResponsesOnly`.
- `apis.conversations.turns`: `conversation` on POST /v1/responses: its items as history, the answer's added.
- `apis.models`: GET /v1/models and /v1/models/{id}: the one public model.
- `apis.request_fields`: which request fields are honoured, passed to the engine, ignored or refused.
- `apis.responses.compact`: POST /v1/responses/compact: the context folded from the kept summaries.
- `apis.responses.compaction_item`: the compaction item's `encrypted_content` (the fold text, compressed).
- `apis.responses.convert`: Responses input items, tools, tool choice and text format as chat's.
- `apis.responses.events`: Response objects, stored records, input_items pages, the stream translator.
- `apis.responses.handlers`: the Responses endpoints: create, get, delete, input_items, cancel, compact.
- `apis.responses.protocol`: Responses request validation and its translation to a chat request.
- `conversations`: conversation state found from the history itself (keys, turn records, tool calls).
- `engine_client`: the one keep-alive HTTP/1.1 client to the engine (and its replicas).
- `engine_wire`: one keep-alive connection to the engine, parsed by httptools, and its body's lines.
- `errors`: the errors the proxy answers, in the OpenAI shape, and the engine's errors scrubbed.
- `fastjson`: JSON on the hot path (orjson where it gives the standard library's values).
- `http.app`: the raw ASGI application: auth, request ids, drain, dispatch to the APIs, the log line.
- `http.body`: request bodies: read within their bounds, parsed on the loop or in a worker thread.
- `http.requestlog`: the request's log line, one JSON object per request.
- `http.protocol`: uvicorn's httptools protocol with the request-head bound and one-send heads.
- `http.server`: `molctl proxy`: the proxy under uvicorn with drain-on-SIGTERM.
- `http.sse`: the held-back-200 SSE writer.
- `metrics`: the plain counters and the Prometheus metrics, on their own listener.
- `pipeline.admission`: how many hops of each kind are in flight at the engine, and who waits.
- `pipeline.plan`: the request plan and the request state, as fields.
- `pipeline.priority`: the one hop-priority policy.
- `pipeline.routing`: the route hop, label parsing, its fallback and the one sticky tool-turn rule.
- `pipeline.run`: the pipeline's entry points shared by chat and Responses (prepare, load, answer, stream).
- `pipeline.speculative`: the speculative answer on the conversation's adapter, held until the route decides.
- `pipeline.summary`: the background summary hops.
- `pipeline.views`: what each hop sends: the router's messages, each adapter's view, the summary request.
- `pipeline.window`: every hop's max_tokens within the engine's window (a prompt bound, else measured).
- `tool_arguments`: history tool-call arguments that are not a JSON object, sent as {} (as vLLM 0.32).
- `scheduler_hints`: the headers llm-d's scheduler reads on each hop (session, objective, tenant).
- `samples`: sample conversations `molctl check`'s template category renders through this code.
- `shaping`: the one place that shapes what clients see (public model name, own ids, no engine extras).
- `store`: the state stores (package): the contracts and the one factory of a `proxy.store` spec.
- `store.base`: the ConversationStore / ResponseStore / RecordStore contracts, StoreScope, the store errors.
- `store.factory`: the one place a spec (sqlite, memory, sqlite:/path, redis://) becomes stores.
- `store.local`: in-process record stores behind the proxy's async interface (LocalResponses).
- `store.memory`: the in-memory backends (Responses records, chat's MemoryStore).
- `store.writebehind`: the write-behind front of the SQLite and Redis conversation stores.
- `store.sqlite`: the SQLite backend (package).
- `store.sqlite.store`: SqliteResponseStore, the profile's SQLite file.
- `store.sqlite.schema`: the file's schema, migrations, integrity check and errors.
- `store.sqlite.responses`: the Responses records on SQLite (chains, quotas, eviction).
- `store.sqlite.conversations`: chat's turn and call rows on SQLite (SqliteConversationStore).
- `store.sqlite.admin`: `molctl state` on SQLite (describe, prune).
- `store.redis`: the Redis backend, shared by proxy replicas (package).
- `store.redis.target`: the store's URL, password, blocking client and errors.
- `store.redis.connection`: RedisState, a process's connection, health and batched writes.
- `store.redis.scripts`: the Lua scripts.
- `store.redis.responses`: the Responses records on Redis.
- `store.redis.conversations`: chat's shared state on Redis (RedisConversationStore, RedisScope).
- `store.redis.replicas`: the replica registry (heartbeats, conversation affinity).
- `store.redis.admin`: `molctl state` and `molctl check` on Redis (describe, prune).
- `tracing`: OpenTelemetry traces: a server span per request, a client span per hop, traceparent to the engine.
"""
