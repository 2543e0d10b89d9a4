"""An engine's error message reaches the client only scrubbed of what it says about the server: every
configured path (the model root, the base and adapter folders; also as `file://` URLs, relative,
or with spaces), the engine's address, and the served, base and adapter names in any case and
common decoration (`lora-L2`, `adapter_L2`, `L2-v1`, `l2`, the base model's name). A message that
still names LoRA or adapter internals after that is replaced by a generic one. Found in 96 of 387
client-visible engine answers (400/422 passthrough and mid-stream error frames)."""

from __future__ import annotations

import re

import pytest

from molctl.engines import get_engine
from molctl.profiles import load_profile, profile_dirs
from molctl.proxy.errors import EngineHTTPError, from_engine
from molctl.proxy.http.app import ProxyApp

VENTI = load_profile("venti", profile_dirs())
UPSTREAM = "http://10.0.0.11:8100"
APP = ProxyApp(VENTI, get_engine("vllm"), UPSTREAM, None)
NAMES, PUBLIC = APP.orch.engine_names, VENTI.served_model_name
ROOT = str(VENTI.model_root)
L2 = str(VENTI.adapter_dir("L2"))


def _client_message(text: str, status: int = 400, in_stream: bool = False) -> str:
    return from_engine(
        EngineHTTPError(status, {"error": {"message": text}}, in_stream=in_stream), NAMES, PUBLIC
    ).message


@pytest.mark.parametrize(
    ("text", "leaks"),
    [
        (f"Cannot read file://{L2}/adapter_model.safetensors", ["file://", ROOT, "safetensors"]),
        (f"no such file: {L2.lstrip('/')}/adapter_config.json", [L2.lstrip("/"), "adapter_config"]),
        ("loading ./loras/L2/adapter_config.json failed", ["./loras", "loras/L2"]),
        ("/srv/my models/venti/loras/L2 is missing", ["my models", "/srv", "loras"]),
        (f"{VENTI.base_dir} has no config.json", [ROOT]),
        ("cannot connect to 10.0.0.11:8100", ["10.0.0.11", "8100"]),
        ("upstream http://127.0.0.1:8000/v1/chat/completions refused", ["127.0.0.1", "8000"]),
        ("The model `lora-L2` does not exist.", ["lora-L2"]),
        ("The model `adapter_L2` does not exist.", ["adapter_L2"]),
        ("The model `L2-v1` does not exist.", ["L2-v1"]),
        ("The model `l2` does not exist.", ["`l2`"]),
        ("GLM-5.2 does not support tool_choice=required here", ["GLM-5.2"]),
        ("glm52 rejected the request", ["glm52"]),
        (f"The model `{VENTI.engine.served_name.upper()}` does not exist.", [VENTI.engine.served_name.upper()]),
    ],
    ids=[
        "file-url",
        "relative-config",
        "dot-relative",
        "spaces",
        "base-dir",
        "address",
        "url",
        "lora-prefix",
        "adapter-prefix",
        "version-suffix",
        "lower-case",
        "base-name",
        "base-alias",
        "served-upper",
    ],
)
def test_an_engine_message_reaches_the_client_without_server_details(text, leaks):
    for status, in_stream in ((400, False), (422, False), (500, True)):
        message = _client_message(text, status, in_stream)
        for leak in leaks:
            assert leak.lower() not in message.lower(), (text, message)


def test_a_message_still_naming_lora_internals_is_replaced_by_a_generic_one():
    message = _client_message("LoRA adapter rank 64 exceeds max_lora_rank 16")
    assert re.search(r"(?i)lora|adapter|rank", message) is None, message
    assert message == "The request was rejected by the model backend."


@pytest.mark.parametrize(
    "text",
    [
        "This model's maximum context length is 2048 tokens. However, you requested 3000 tokens.",
        "temperature must be in [0, 2], got 3.0.",
        "response_format json_schema is not valid JSON Schema: 'type' is a required property",
    ],
)
def test_an_ordinary_validation_message_is_kept_as_it_is(text):
    assert _client_message(text) == text
