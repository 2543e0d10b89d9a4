"""The proxy's state stores: the contracts (`base`), the one place a `proxy.store` spec becomes
stores (`factory`), and the memory, SQLite (`sqlite/`) and Redis (`redis/`) backends.
Design notes: docs/design/store.md."""
