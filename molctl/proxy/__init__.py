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
- `request_fields`: which request fields are honoured, passed to the engine, ignored or refused.
- `responses`: the Responses API on top of the chat machinery (conversion, objects, stream events).
- `samples`: sample conversations `molctl check`'s template category renders through this code.
- `server`: `molctl proxy`: the proxy under uvicorn with drain-on-SIGTERM.
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
- `validation`: chat request validation: the raw body to a checked dict, or a 400 naming the field.
- `views`: what each hop sends: the router's messages, each adapter's view, the summary request.
"""
