"""What counts as a secret in a profile or an environment, shared by `lock` (which redacts it in
the manifest), `render` (which refuses to write it into manifests or units) and `check` (which
warns when `up` would put it on the engine's world-readable command line)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

# a variable whose name says it holds a secret (any case)...
SECRET_RE = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)
# ...unless it names where a secret is (GOOGLE_APPLICATION_CREDENTIALS, AWS_SHARED_CREDENTIALS_FILE,
# *_KEY_PATH) or is a tokenizer setting (TOKENIZERS_PARALLELISM)
NOT_SECRET_RE = re.compile(r"(_FILE|_PATH|_DIR)$|^GOOGLE_APPLICATION_CREDENTIALS$|^TOKENIZERS_", re.IGNORECASE)
# an engine flag that is a secret: its name ends in the secret word (`api-key`, `hf-token`,
# `admin-api-key`; not `ssl-keyfile`, `max-num-batched-tokens`, `long-prefill-token-threshold`,
# `bucket-time-to-first-token`) and its value is text (`allow-credentials: true`, vLLM's bare
# `--hf-token` (use the cached login) and lists of numbers are no secrets)
SECRET_ARG_RE = re.compile(r"(^|[-_])(key|token|secret|password|passwd|credentials?)$", re.IGNORECASE)
# the user-info part of a URL in any value (HF_ENDPOINT=https://user:pass@mirror/, a proxy URL)
URL_CREDENTIALS_RE = re.compile(r"(?<=://)[^/\s@]+@")
REDACTED = "<redacted>"


def is_secret_name(name: str) -> bool:
    """An environment variable whose name says it holds a secret (see SECRET_RE, NOT_SECRET_RE)."""
    return bool(SECRET_RE.search(name)) and not NOT_SECRET_RE.search(name)


def redact_value(name: str, value: str) -> str:
    """A variable's value as a manifest may hold it: `<redacted>` for a secret's name, and a URL's
    `user:password@` replaced by `<redacted>@` in any other value."""
    if is_secret_name(name):
        return REDACTED
    return URL_CREDENTIALS_RE.sub(REDACTED + "@", value)


def secret_engine_args(args: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(flag, why) for each engine flag that carries a secret: its name says so, or its value is a
    URL with a user name or password."""
    out = []
    for flag, value in args.items():
        if SECRET_ARG_RE.search(flag) and isinstance(value, str) and value:
            out.append((flag, "its name says it is a secret"))
        elif any(URL_CREDENTIALS_RE.search(str(v)) for v in (value if isinstance(value, list) else [value])):
            out.append((flag, "its value is a URL with a user name or password (scheme://user:pass@host)"))
    return out
