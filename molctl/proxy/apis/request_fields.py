"""Which request fields the proxy honours, passes to the engine, ignores or refuses, for both APIs.

A field is one of:
- known to the proxy (validation.KNOWN, responses.KNOWN): honoured or passed on as the contract says;
- an engine extension (`Engine.request_extensions`: vLLM's `ignore_eos`, `min_tokens`, ...; SGLang's
  own names): type-checked here and sent on the answer hop as the client sent it, never on the
  route or summary hop;
- refused: a 400 naming it and why, because passing it on would break the proxy's contract
  (`REFUSED`, `Engine.refused_extensions`) or ignoring it would change what the request means;
- unknown: accepted and ignored, as vLLM itself does (its OpenAIBaseModel has `extra="allow"`
  and logs the names), each name logged once per process (at most `LOGGED_NAMES` names) and
  counted in `ignored_request_fields_total{api}`; with `proxy.request_fields: reject` a 400.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Mapping
from typing import Any

from molctl.proxy.errors import invalid

log = logging.getLogger("molctl.proxy")

LOGGED_NAMES = 256  # distinct ignored names logged per process (a client sending random names is logged no further)

# Fields of either API that would break the proxy's contract if passed on (engine-independent).
REFUSED = {
    "echo": "the proxy builds each hop's prompt; an echo would return the proxy's own prompt",
    "add_generation_prompt": "every hop ends with the assistant's turn to answer",
    "continue_final_message": "the last message must be from the user or a tool; the proxy does not continue one",
    "chat_template": "the engine's chat template renders every hop, so that the hops share their prompt prefix",
    "lora_request": "the proxy chooses the adapter of every hop",
    "adapter": "the proxy chooses the adapter of every hop",
    "documents": "template documents are not part of the conversation the proxy keeps and folds",
    "priority": "the proxy sets each hop's engine priority (route hops first)",
}
# A refused field at one of these values asks for what the proxy does anyway: accepted.
REFUSED_DEFAULTS = {"add_generation_prompt": True, "priority": 0}

# The JSON kind of each engine extension (Engine.request_extensions), as a predicate and its wording.


def _default(key: str, value: Any) -> bool:
    """`value` of the refused field `key` means what not sending it means."""
    if value is None:
        return True
    if key in REFUSED_DEFAULTS:
        return value == REFUSED_DEFAULTS[key] and type(value) is type(REFUSED_DEFAULTS[key])
    return value is False


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v: Any) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)


KINDS = {
    "bool": (lambda v: isinstance(v, bool), "a boolean"),
    "int": (_int, "an integer"),
    "number": (_number, "a finite number"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "ints": (lambda v: isinstance(v, list) and all(map(_int, v)), "an array of integers"),
    "strs": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "an array of strings"),
    "str_or_strs": (
        lambda v: isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v)),
        "a string or an array of strings",
    ),
    "object": (lambda v: isinstance(v, dict), "an object"),
}


class FieldPolicy:
    """One proxy's rules for fields beyond the API's known set (see the module docstring)."""

    def __init__(
        self,
        extensions: Mapping[str, str] | None = None,
        refused: Mapping[str, str] | None = None,
        reject_unknown: bool = False,
        template_kwargs: tuple[str, ...] | None = None,
        counters: Any = None,
    ):
        self.extensions = dict(extensions or {})
        self.refused = {**REFUSED, **(refused or {})}
        self.reject_unknown = reject_unknown
        self.template_kwargs = template_kwargs  # None: any key (no profile given)
        self.counters = counters
        self._logged: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    @classmethod
    def of(cls, profile: Any, engine: Any, counters: Any = None) -> FieldPolicy:
        return cls(
            engine.request_extensions,
            engine.refused_extensions,
            profile.proxy.request_fields == "reject",
            tuple(profile.proxy.chat_template_kwargs),
            counters,
        )

    def check_extra(self, body: Mapping[str, Any], known: Any, api: str, where: str = "") -> None:
        """Every key of `body` not in `known`: an extension checked, a refused one a 400, the rest
        ignored (noted) or, in strict mode, a 400. `where`: the prefix of a nested object's keys."""
        for key in body:
            if key in known:
                continue
            value = body[key]
            name = f"{where}{key}"
            top = not where  # refused fields and extensions are top-level names; nested keys are unknown ones
            if top and key in self.refused and not _default(key, value):
                raise invalid(f"'{name}' is not supported: {self.refused[key]}.", name)
            if top and key in self.extensions:
                if value is not None:
                    test, wording = KINDS[self.extensions[key]]
                    if not test(value):
                        raise invalid(f"'{name}' must be {wording}.", name)
                continue
            if top and key in self.refused:  # null or false: what not sending it means
                continue
            if value is None:  # null is "not given", also for a field this server does not know
                continue
            if self.reject_unknown:
                raise invalid(
                    f"Unrecognized request argument supplied: {name} (this server's proxy.request_fields is 'reject').",
                    name,
                )
            self.note_ignored(name, api)

    def note_ignored(self, name: str, api: str, why: str = "not a field this server knows") -> None:
        """An accepted field or item the proxy does not use: logged once per name, counted."""
        if self.counters is not None:
            self.counters.inc("ignored_request_fields_total", api=api)
        with self._lock:
            if (name, api) in self._logged or len(self._logged) >= LOGGED_NAMES:
                return
            self._logged.add((name, api))
        log.info("%s request field %r ignored: %s (logged once)", api, name[:80], why)

    def forwarded(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """The engine extensions a request sets, as the answer hop sends them."""
        return {k: body[k] for k in self.extensions if body.get(k) is not None}

    def check_template_kwargs(self, kwargs: Any, where: str) -> None:
        if kwargs is None:
            return
        if not isinstance(kwargs, dict):
            raise invalid(f"'{where}' must be an object.", where)
        if self.template_kwargs is None:
            return
        for key in kwargs:
            if key not in self.template_kwargs:
                allowed = ", ".join(self.template_kwargs) or "none"
                raise invalid(
                    f"'{where}.{key}' is not a template variable this server lets clients set "
                    f"(proxy.chat_template_kwargs: {allowed}).",
                    f"{where}.{key}",
                )


PERMISSIVE = FieldPolicy()  # no engine extensions, unknown fields ignored: for callers without a profile
