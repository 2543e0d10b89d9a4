"""What counts as a secret in a profile or an environment, shared by `lock` (which redacts it in
the manifest), `render` (which refuses to write it into manifests or units) and `check` (which
warns when `up` would put it on the engine's world-readable command line)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

# a variable whose name says it holds a secret (any case)
SECRET_RE = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)
# an engine flag that is a secret: a whole word of its name (`api-key`, `hf-token`; not
# `max-num-batched-tokens` nor `ssl-keyfile`)
SECRET_ARG_RE = re.compile(r"(^|[-_])(key|token|secret|password|passwd|credentials?)($|[-_])", re.IGNORECASE)
# the user-info part of a URL in any value (HF_ENDPOINT=https://user:pass@mirror/, a proxy URL)
URL_CREDENTIALS_RE = re.compile(r"(?<=://)[^/\s@]+@")
REDACTED = "<redacted>"


def redact_value(name: str, value: str) -> str:
    """A variable's value as a manifest may hold it: `<redacted>` for a secret's name, and a URL's
    `user:password@` replaced by `<redacted>@` in any other value."""
    if SECRET_RE.search(name):
        return REDACTED
    return URL_CREDENTIALS_RE.sub(REDACTED + "@", value)


def secret_engine_args(args: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(flag, why) for each engine flag that carries a secret: its name says so, or its value is a
    URL with a user name or password."""
    out = []
    for flag, value in args.items():
        if SECRET_ARG_RE.search(flag):
            out.append((flag, "its name says it is a secret"))
        elif any(URL_CREDENTIALS_RE.search(str(v)) for v in (value if isinstance(value, list) else [value])):
            out.append((flag, "its value is a URL with a user name or password (scheme://user:pass@host)"))
    return out
