"""The Redis backend (`proxy.store: redis://...`, shared by proxy replicas): `target` (URL, password,
errors), `connection` (RedisState), `scripts`, `responses`, `conversations`, `replicas`, `admin`."""
