"""Media named by URL (image_url, audio_url, video_url; the Responses API's input_image) is fetched
by the engine, from the engine's host: the proxy lets through data: URLs and http(s) URLs whose
host is in `proxy.media_url_hosts`, and refuses the rest with a 400 naming the field, before any
hop. Driven by the official `openai` SDK against the fake engine (its log shows what reached it)."""

from __future__ import annotations

import openai
import pytest

from molctl.errors import ProfileError
from molctl.profiles import load_profile, profile_dirs
from molctl.proxy.apis.chat_validation import check_media_url
from molctl.proxy.errors import ProxyError
from tests.proxy_stack import PUBLIC, own_stack

PNG = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGNgYGBgAAAABQABh6FO1AAAAABJRU5ErkJggg=="


def image(url) -> list[dict]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "[route:L2] what is this?"},
                {"type": "image_url", "image_url": {"url": url}},
            ],
        }
    ]


def refused(s, messages, stream=False) -> dict:
    with pytest.raises(openai.BadRequestError) as err:
        s.chat(messages, stream=stream)
    assert err.value.status_code == 400
    assert s.log() == []  # refused before the route hop: the engine saw nothing
    return err.value.body


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "url",
    [
        "http://169.254.169.254/latest/meta-data/iam/",
        "http://127.0.0.1:8000/v1/models",
        "https://images.example.com/cat.png",
        "http://[::1]/x",
        "HTTP://LOCALHOST/x",
    ],
)
def test_a_remote_media_url_is_refused_by_default(s, url, stream):
    body = refused(s, image(url), stream)
    assert body["code"] == "media_url_not_allowed" and body["param"] == "messages[0].content[1].image_url.url"
    assert "proxy.media_url_hosts" in body["message"] and "data: URL" in body["message"]


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": "http://10.0.0.5/x.png"},  # the URL itself, as vLLM also reads it
        {"type": "audio_url", "audio_url": {"url": "http://10.0.0.5/x.wav"}},
        {"type": "video_url", "video_url": {"url": "http://10.0.0.5/x.mp4"}},
    ],
)
def test_every_part_the_engine_fetches_by_url_is_checked(s, part):
    body = refused(s, [{"role": "user", "content": [part]}])
    assert body["code"] == "media_url_not_allowed" and body["param"].startswith(
        f"messages[0].content[0].{part['type']}"
    )


@pytest.mark.parametrize(
    "url",
    [
        "file:///etc/passwd",
        "ftp://images.example.com/x",
        "http://",
        # parsers disagree on these hosts: urllib3 (vLLM's fetcher) ends the
        # host at a backslash, urlsplit reads the part after the '@'
        "http://169.254.169.254\\@images.example.com/",
        "http://images.example.com@10.0.0.5/",
        "https://images.example.com/a b",
        "https://images.example.com/x\x00",
    ],
)
def test_urls_that_are_not_plain_http_are_refused_even_where_any_host_is_allowed(s, url):
    body = refused(s, image(url))
    assert body["code"] == "invalid_request_error" and body["param"] == "messages[0].content[1].image_url.url"
    assert "plain host" in body["message"]
    with pytest.raises(ProxyError, match="plain host"):
        check_media_url(url, "image_url", ("*", "images.example.com"))


def test_a_data_url_reaches_the_engine_unchanged(s):
    r = s.chat(image(PNG))
    assert r.choices[0].message.content
    answer = s.answers()[-1]
    assert answer["messages"][-1]["content"][1] == {"type": "image_url", "image_url": {"url": PNG}}
    assert "[image]" in s.log("route")[-1]["messages"][-1]["content"]  # the router sees a placeholder


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": None, "uuid": "img-1"},  # vLLM's cached media, named by its uuid
        {"type": "image_url", "image_url": {"url": None}, "uuid": "img-1"},
        {
            "type": "image_url",
            "image_url": {"url": PNG},
            "video_url": None,
            "audio_url": None,
        },  # every field serialised
    ],
)
def test_a_null_media_url_fetches_nothing_and_passes(s, part):
    s.chat([{"role": "user", "content": [{"type": "text", "text": "[route:L2] what is this?"}, part]}])
    assert s.answers()[-1]["messages"][-1]["content"][1] == part


def test_the_responses_api_checks_input_image_urls_too(s):
    with pytest.raises(openai.BadRequestError) as err:
        s.client.responses.create(
            model=PUBLIC,
            input=[
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "[route:L2] what is this?"},
                        {"type": "input_image", "image_url": "http://169.254.169.254/latest/"},
                    ],
                }
            ],
        )
    assert (
        err.value.body["code"] == "media_url_not_allowed" and err.value.body["param"] == "input[0].content[1].image_url"
    )
    assert s.log() == []
    r = s.client.responses.create(
        model=PUBLIC,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "[route:L2] what is this?"},
                    {"type": "input_image", "image_url": PNG},
                ],
            }
        ],
    )
    assert r.output_text and s.answers()[-1]["messages"][-1]["content"][1]["image_url"]["url"] == PNG


@pytest.fixture(scope="module")
def media_stack(keyfile, tmp_path_factory):
    """A proxy whose profile lets the engine fetch from one host (given in mixed case)."""
    with own_stack(
        keyfile, tmp_path_factory.mktemp("media-logs"), "--set", "proxy.media_url_hosts=[Images.Example.com]"
    ) as st:
        yield st


def test_listed_hosts_are_let_through_and_others_still_refused(media_stack):
    media_stack.reset()
    for url in ("https://images.example.com/cat.png", "http://IMAGES.example.com.:8080/cat.png?size=2#x"):
        assert media_stack.chat(image(url)).choices[0].message.content
        assert media_stack.answers()[-1]["messages"][-1]["content"][1]["image_url"]["url"] == url
    media_stack.reset()
    body = refused(media_stack, image("https://images.example.com.evil.net/cat.png"))
    assert body["code"] == "media_url_not_allowed"


@pytest.mark.parametrize(
    "value, expected",
    [
        (["https://images.example.com"], "proxy.media_url_hosts[0]"),
        (["images.example.com/x"], "expected a host name"),
        (["ok.example.com", "a b"], "proxy.media_url_hosts[1]"),
        ("images.example.com", "a list of a string"),
        ([""], "expected a host name"),
        (["user@host"], "expected a host name"),
    ],
)
def test_the_media_host_list_is_validated(value, expected):
    with pytest.raises(ProfileError) as err:
        load_profile("tiny", profile_dirs(), [("proxy.media_url_hosts", value)])
    assert expected in str(err.value) and "\n" not in str(err.value)
    ok = load_profile(
        "tiny", profile_dirs(), [("proxy.media_url_hosts", ["Images.Example.COM", "*", "10.0.0.5", "[::1]"])]
    )
    assert ok.proxy.media_url_hosts == ("images.example.com", "*", "10.0.0.5", "::1")
    assert load_profile("tiny", profile_dirs()).proxy.media_url_hosts == ()


@pytest.mark.parametrize("role", ["system", "developer"])
def test_an_image_in_the_instructions_reaches_the_engine_as_an_image_in_a_user_message(s, role):
    """An image part of a system or developer message was stringified (its whole base64 data URL)
    into the one system message, on every hop; sent directly, Qwen3.6's template refuses an image
    in a system message ("System message cannot contain images.")."""
    instructions = {
        "role": role,
        "content": [
            {"type": "text", "text": "Describe what you see."},
            {"type": "image_url", "image_url": {"url": PNG}},
        ],
    }
    r = s.chat([instructions, {"role": "user", "content": "[route:L2] what is this?"}])
    assert r.choices[0].message.content
    answer = s.answers()[-1]["messages"]
    assert (
        answer[0]["role"] == "system" and PNG not in str(answer[0]) and "Describe what you see." in answer[0]["content"]
    )
    assert answer[1] == {
        "role": "user",
        "content": [
            {"type": "text", "text": "[system note] attached to the instructions:"},
            {"type": "image_url", "image_url": {"url": PNG}},
        ],
    }
    assert PNG not in str(s.log("route")[-1]["messages"])  # the router sees the request only


def test_an_image_in_a_later_system_message_stays_an_image_in_its_note(s):
    first = [{"role": "user", "content": "[route:L2] hi"}]
    reply = s.chat(first).choices[0].message.content
    note = {
        "role": "system",
        "content": [{"type": "text", "text": "Now look at this."}, {"type": "image_url", "image_url": {"url": PNG}}],
    }
    s.chat([*first, {"role": "assistant", "content": reply}, note, {"role": "user", "content": "[route:L2] and?"}])
    answer = s.answers()[-1]["messages"]
    assert {
        "role": "user",
        "content": [
            {"type": "text", "text": "[system note] Now look at this."},
            {"type": "image_url", "image_url": {"url": PNG}},
        ],
    } in answer
    assert all(PNG not in str(m["content"]) for m in answer if isinstance(m["content"], str))
