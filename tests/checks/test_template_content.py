"""The content format (vLLM's --chat-template-content-format, vllm#39614/#39611): `molctl check`
renders every hop in the format the engine will use, the profile's flag or vLLM 0.32's `auto`
detection re-implemented, and fails when a tool result or an instruction does not reach the
rendered prompt as text. The GLM profile pins `string`."""

from __future__ import annotations

import pytest

from molctl.checks import template as tc
from molctl.checks.jinja_sandbox import detect_content_format
from molctl.checks.result import Probes
from molctl.demo import template_text
from molctl.profiles import load_profile, profile_dirs
from tests.layouts import make_layout

# reads user content as parts, so detected "openai", and prints the other roles' content raw
PARTS_FOR_USERS = (
    "{% for m in messages %}<|{{ m.role }}|>{% if m.role == 'user' and m.content is not string %}"
    "{% for p in m.content %}{{ p.text }}{% endfor %}{% else %}{{ m.content }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
DROPS_TOOLS = (
    "{% for m in messages %}{% if m.role != 'tool' %}<|{{ m.role }}|>{{ m.content }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SYNTHETIC = {
    "plain": "{% for m in messages %}{{ m.content }}{% endfor %}",
    "loop": "{% for m in messages %}{% for p in m['content'] %}{{ p.text }}{% endfor %}{% endfor %}",
    "assigned": "{% for m in messages %}{% set content = m.content %}{% for p in content %}{{ p }}{% endfor %}{% endfor %}",
    "macro": "{% macro t(c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}{% for m in messages %}{{ t(m.content) }}{% endfor %}",
    "sliced": "{% for m in messages[1:] %}{% for p in m.content %}{{ p }}{% endfor %}{% endfor %}",
    "broken": "{% for m in messages %}",
}


def check(tmp_path, text, profile="tiny", *sets):
    lay = make_layout(tmp_path / "m", model_type="llama", shards=2, rank=8, base_name="tiny-mol-llama")
    (lay.base / "chat_template.jinja").write_text(text)
    prof = load_profile(profile, profile_dirs(), [("model_root", str(lay.root)), *sets])
    return {r.id: r for r in tc.run(prof, Probes(state_dir=None))}


@pytest.mark.parametrize("name", [*SYNTHETIC, "qwen3.6", "glm5"])
def test_detection_matches_vllm(name):
    hf = pytest.importorskip("vllm.renderers.hf")
    text = SYNTHETIC.get(name) or template_text(name)
    assert detect_content_format(text) == hf._detect_content_format(text, default="string")


def test_the_demo_templates_are_detected_as_openai():
    assert detect_content_format(template_text("qwen3.6")) == detect_content_format(template_text("glm5")) == "openai"


def test_a_template_that_prints_parts_as_dicts_fails_with_the_detected_format(tmp_path):
    r = check(tmp_path, PARTS_FOR_USERS)
    detail = r["template.render"].detail
    assert r["template.render"].status == "fail", detail
    assert "is not in the prompt as text with content format 'openai' (vllm's auto detection on the template)" in detail
    assert "system instruction" in detail and "on the route hop" in detail and "\n" not in detail
    pinned = check(tmp_path / "pinned", PARTS_FOR_USERS, "tiny", ("engine.args.chat-template-content-format", "string"))
    assert pinned["template.render"].status == "pass", pinned["template.render"].detail


def test_a_template_that_drops_tool_results_fails(tmp_path):
    detail = check(tmp_path, DROPS_TOOLS)["template.render"].detail
    assert "the tool result" in detail and "on the answer hop for shape 'tool result'" in detail, detail


def test_the_multi_part_shapes_render_their_text_on_the_demo_templates(tmp_path):
    for name in ("qwen3.6", "glm5"):
        for profile in ("tiny", "venti"):
            r = check(tmp_path / name / profile, template_text(name), profile)
            assert r["template.render"].status == "pass", (name, profile, r["template.render"].detail)
            assert "of 12 shapes" in r["template.render"].detail


def test_the_glm_profile_pins_string_content():
    venti = load_profile("venti", profile_dirs())
    assert venti.engine.args["chat-template-content-format"] == "string"
    assert tc.content_format(venti, tc.Template("t", {"default": template_text("glm5")}, {})) == (
        "string",
        "engine.args.chat-template-content-format",
    )
    tiny = load_profile("tiny", profile_dirs())
    assert tc.content_format(tiny, tc.Template("t", {"default": template_text("qwen3.6")}, {}))[0] == "openai"
