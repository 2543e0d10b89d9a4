"""`template.prefix`: each hop's rendered prompt starts with the same hop's prompt of the previous
turn on the same adapter, so the engine's prefix cache serves the history (issue 30). A break is a
warning naming the hop, the turns and the first differing characters, escaped."""

from __future__ import annotations

from molctl.checks import template as tc
from molctl.checks.result import Probes
from molctl.demo import template_text
from molctl.profiles import load_profile, profile_dirs
from tests.layouts import make_layout

SIMPLE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def check(tmp_path, text, profile="tiny"):
    lay = make_layout(tmp_path / "m", model_type="llama", shards=2, rank=8, base_name="tiny-mol-llama")
    (lay.base / "chat_template.jinja").write_text(text)
    prof = load_profile(profile, profile_dirs(), [("model_root", str(lay.root))])
    return {r.id: r for r in tc.run(prof, Probes(state_dir=None))}


def test_prefix_breaks_compares_each_hop_with_its_previous_turn_on_the_same_adapter():
    steps = [
        ("answer", "L1", "<s>a"),
        ("answer", "L2", "<x>"),
        ("route", "L0", "<s>a"),
        ("answer", "L1", "<s>ab"),
        ("answer", "L2", "<y>"),
        ("route", "L0", "<s>b"),
    ]
    compared, breaks = tc.prefix_breaks(steps)
    assert compared == 3
    assert [(b.step.hop, b.step.adapter, b.at) for b in breaks] == [("answer", "L2", 1), ("route", "L0", 3)]


def test_conversations_are_compared_apart():
    steps = [
        tc.Step("answer", "L1", "abc", "t1", "one"),
        tc.Step("answer", "L1", "xyz", "t1", "two"),
        tc.Step("answer", "L1", "abcd", "t2", "one"),
    ]
    assert tc.prefix_breaks(steps) == (1, [])


def test_a_hop_built_as_a_continuation_can_join_the_check():
    """The extension point for a summary hop that continues its answer's prompt."""
    steps = [("answer", "L1", "P"), ("summary", "L1", "PAS"), ("answer", "L1", "PAU"), ("summary", "L1", "XX")]
    assert tc.prefix_breaks(steps)[0] == 1  # summary is not compared by default
    compared, breaks = tc.prefix_breaks(steps, {**tc.CONTINUES, "summary": ("answer",)})
    assert compared == 3 and [(b.step.hop, b.previous.prompt) for b in breaks] == [("summary", "PAU")]


def test_the_warning_names_the_hop_and_shows_the_divergence_escaped():
    result = tc.prefix_result(
        [
            ("answer", "L1", "<|im_start|>system\nBe brief.\n<|im_start|>assistant\n<think>\n"),
            ("answer", "L1", "<|im_start|>system\nBe brief.\n<|im_start|>assistant\nhello"),
        ]
    )
    assert result.id == "template.prefix" and result.status == "warn"
    assert "\n" not in result.detail
    assert "the answer hop on L1" in result.detail and "part at character 51 of 59" in result.detail
    assert "expected '...im_start|>assistant\\n|<think>\\n'" in result.detail
    assert "rendered '...im_start|>assistant\\n|hello'" in result.detail
    assert tc.prefix_result([("answer", "L1", "ab"), ("answer", "L1", "abc")]).status == "pass"


def test_the_demo_templates_warn_on_molctl_check(tmp_path):
    """Both demo templates render the route hop of each turn afresh (the router sees the new
    message only) and, like the real ones, the answer's <think> opening differently once it is
    history: the check says where."""
    for name in ("qwen3.6", "glm5"):
        r = check(tmp_path / name, template_text(name))
        assert r["template.render"].status == "pass"
        prefix = r["template.prefix"]
        assert prefix.status == "warn" and "the route hop on L0 for shape 'folded turn'" in prefix.detail, prefix.detail
        assert "of 9 continuations break" in prefix.detail


def test_a_template_with_stable_answers_breaks_only_on_the_route_hop(tmp_path):
    r = check(tmp_path, SIMPLE)
    detail = r["template.prefix"].detail
    assert r["template.prefix"].status == "warn" and "the route hop" in detail and "answer/" not in detail, detail


def test_prefix_is_skipped_when_a_request_does_not_render(tmp_path):
    r = check(
        tmp_path,
        "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools') }}"
        "{% endif %}{{ m.content }}{% endfor %}",
    )
    assert r["template.render"].status == "fail" and r["template.prefix"].status == "skip"
