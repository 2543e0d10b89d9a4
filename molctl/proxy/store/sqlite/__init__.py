"""The SQLite backend (`proxy.store: sqlite`, `sqlite:/path`): `store` (SqliteResponseStore, the
file's connection), `schema` (tables, migrations, integrity), `responses`, `conversations`, `admin`."""
