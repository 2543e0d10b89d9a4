"""`molctl check`'s template category: real template files in generated layouts, rendered against
the requests the proxy sends for its sample conversations (molctl/proxy/samples.py)."""

from __future__ import annotations

import json

import pytest

from molctl.checks import template as tc
from molctl.checks.result import Probes
from molctl.demo import template_text
from molctl.errors import ExitStatus
from molctl.profiles import load_profile, profile_dirs
from tests.layouts import make_layout, tall_layout

SIMPLE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
RAISES_ON_TOOL = (
    "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('tool results are not "
    "supported') }}{% endif %}{{ m.content }}{% endfor %}"
)


def layout(tmp_path, **kw):
    args = dict(model_type="llama", shards=2, rank=8, base_name="tiny-mol-llama")
    args.update(kw)
    return make_layout(tmp_path / "m", **args)


def profile_for(root, name="tiny", *sets):
    return load_profile(name, profile_dirs(), [("model_root", str(root)), *sets])


def write_config(base, **fields):
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "<|im_end|>"}
    config.update(fields)
    (base / "tokenizer_config.json").write_text(json.dumps(config))


def results(profile, state_dir=None):
    return {r.id: r for r in tc.run(profile, Probes(state_dir=state_dir))}


def test_chat_template_jinja_found_and_every_hop_renders(tmp_path):
    lay = layout(tmp_path)
    write_config(lay.base)
    (lay.base / "chat_template.jinja").write_text(template_text("qwen3.6"))
    r = results(profile_for(lay.root))
    assert r["template.found"].status == "pass" and "chat_template.jinja" in r["template.found"].detail
    assert r["template.render"].status == "pass", r["template.render"].detail
    assert "route, answer, summary" in r["template.render"].detail


def test_tokenizer_config_string_form(tmp_path):
    lay = layout(tmp_path)
    write_config(lay.base, chat_template=SIMPLE)
    r = results(profile_for(lay.root))
    assert r["template.found"].status == "pass" and "tokenizer_config.json chat_template" in r["template.found"].detail
    assert r["template.render"].status == "pass"


def test_chat_template_jinja_wins_over_tokenizer_config(tmp_path):
    lay = layout(tmp_path)
    write_config(lay.base, chat_template=RAISES_ON_TOOL)
    (lay.base / "chat_template.jinja").write_text(SIMPLE)
    r = results(profile_for(lay.root))
    assert "chat_template.jinja" in r["template.found"].detail
    assert r["template.render"].status == "pass"


def test_tokenizer_config_list_form_uses_tool_use_for_requests_with_tools(tmp_path):
    lay = layout(tmp_path)
    default = "{% if tools %}{{ raise_exception('default cannot render tools') }}{% endif %}" + SIMPLE
    write_config(
        lay.base, chat_template=[{"name": "default", "template": default}, {"name": "tool_use", "template": SIMPLE}]
    )
    r = results(profile_for(lay.root))
    assert "named: default, tool_use" in r["template.found"].detail
    assert r["template.render"].status == "pass", r["template.render"].detail


def test_list_form_without_tool_use_renders_tools_with_default(tmp_path):
    lay = layout(tmp_path)
    default = "{% if tools %}{{ raise_exception('default cannot render tools') }}{% endif %}" + SIMPLE
    write_config(
        lay.base, chat_template=[{"name": "default", "template": default}, {"name": "rag", "template": SIMPLE}]
    )
    r = results(profile_for(lay.root))
    assert r["template.render"].status == "fail"
    assert (
        "default cannot render tools" in r["template.render"].detail
        and "shape 'tool call'" in r["template.render"].detail
    )


def test_engine_flag_file_overrides_the_model_template(tmp_path):
    lay = layout(tmp_path)
    (lay.base / "chat_template.jinja").write_text(RAISES_ON_TOOL)
    flag = tmp_path / "override.jinja"
    flag.write_text(SIMPLE)
    r = results(profile_for(lay.root, "tiny", ("engine.args.chat-template", str(flag))))
    assert r["template.found"].status == "pass" and "engine flag chat-template" in r["template.found"].detail
    assert r["template.render"].status == "pass"


def test_engine_flag_inline_template(tmp_path):
    lay = layout(tmp_path)
    r = results(profile_for(lay.root, "tiny", ("engine.args.chat-template", RAISES_ON_TOOL)))
    assert "inline" in r["template.found"].detail
    assert r["template.render"].status == "fail" and "tool results are not supported" in r["template.render"].detail


def test_engine_flag_naming_no_file_warns(tmp_path):
    lay = layout(tmp_path)
    r = results(profile_for(lay.root, "tiny", ("engine.args.chat-template", "template_chatml.jinja")))
    assert r["template.found"].status == "warn" and "template_chatml.jinja" in r["template.found"].detail
    assert r["template.render"].status == "skip"


def test_missing_template_warns_with_the_engine_fallback(tmp_path):
    lay = tall_layout(tmp_path / "t")
    r = results(profile_for(lay.root, "tall"))
    assert r["template.found"].status == "warn"
    assert (
        "vLLM has no default" in r["template.found"].detail
        and "engine.args.chat-template" in r["template.found"].detail
    )
    assert r["template.render"].status == "skip"
    r = results(profile_for(lay.root, "venti-sglang"))
    assert r["template.found"].status == "warn" and "SGLang" in r["template.found"].detail


def test_missing_base_dir_is_skipped(tmp_path):
    r = results(profile_for(tmp_path / "nothing"))
    assert r["template.found"].status == "skip" and r["template.render"].status == "skip"


def test_unreadable_tokenizer_config_fails(tmp_path):
    lay = layout(tmp_path)
    (lay.base / "tokenizer_config.json").write_text("{not json")
    r = results(profile_for(lay.root))
    assert r["template.found"].status == "fail" and "tokenizer_config.json" in r["template.found"].detail


def test_a_raising_template_names_the_message_hop_and_shape(tmp_path):
    lay = layout(tmp_path)
    (lay.base / "chat_template.jinja").write_text(RAISES_ON_TOOL)
    r = results(profile_for(lay.root))
    detail = r["template.render"].detail
    assert r["template.render"].status == "fail"
    assert "'tool results are not supported'" in detail
    assert "answer hop for shape 'tool result'" in detail
    assert "4 of" in detail and "summary/tool result" in detail  # the summary hop resends the tool exchange
    assert "answer/multi-part tool result" in detail  # tool results as lists of text parts too


def test_a_template_that_breaks_on_a_shape_is_reported_with_its_exception_type(tmp_path):
    lay = layout(tmp_path)
    (lay.base / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content + 1 }}{% endfor %}")
    r = results(profile_for(lay.root))
    assert r["template.render"].status == "fail" and "TypeError" in r["template.render"].detail


def test_hf_environment_features(tmp_path):
    """tojson (non-ASCII kept, indent), strftime_now, loopcontrols, {% generation %}, bos/eos tokens
    (also in the AddedToken form), tools and tool-call arguments as objects."""
    lay = layout(tmp_path)
    write_config(lay.base, bos_token={"content": "<s>", "special": True}, eos_token="<|im_end|>")
    tpl = (
        "{% if bos_token != '<s>' or eos_token != '<|im_end|>' %}{{ raise_exception('tokens: ' ~ bos_token) }}{% endif %}"
        "{{ strftime_now('%Y') }}{% if tools %}{{ tools | tojson(indent=2) }}{% endif %}"
        "{% for m in messages %}{% if loop.index > 50 %}{% break %}{% endif %}"
        "{% generation %}{{ m.content | tojson }}{% endgeneration %}"
        "{% for c in m.tool_calls or [] %}{% if c.function.arguments is not mapping %}"
        "{{ raise_exception('arguments must be an object') }}{% endif %}{{ c.function.arguments.city }}{% endfor %}"
        "{% endfor %}"
    )
    (lay.base / "chat_template.jinja").write_text(tpl)
    r = results(profile_for(lay.root))
    assert r["template.render"].status == "pass", r["template.render"].detail
    out = tc.render(
        tc.find_template(profile_for(lay.root)),
        {"messages": [{"role": "user", "content": "café"}], "tools": [{"type": "function", "function": {"name": "f"}}]},
    )
    assert '"café"' in out and '\n    "type": "function"' in out


def test_cli_fails_with_exit_3_and_remembers_the_result(molctl, tmp_path, state_dir, free_ports):
    lay = layout(tmp_path)
    (lay.base / "chat_template.jinja").write_text(RAISES_ON_TOOL)
    engine_port, proxy_port = free_ports
    args = (
        "check",
        "tiny",
        "--model-root",
        str(lay.root),
        "--skip",
        "gpu",
        "--skip",
        "engine",
        "--set",
        f"engine.port={engine_port}",
        "--set",
        f"proxy.port={proxy_port}",
        "--json",
    )
    first = molctl(*args)
    assert first.exit_code == ExitStatus.CHECK_FAILED
    checks = {c["id"]: c for c in first.json()["checks"]}
    assert (
        checks["template.render"]["status"] == "fail" and "shape 'tool result'" in checks["template.render"]["detail"]
    )
    again = {c["id"]: c for c in molctl(*args).json()["checks"]}
    assert again["template.render"]["status"] == "fail" and "remembered" in again["template.render"]["detail"]
    (lay.base / "chat_template.jinja").write_text(SIMPLE)  # a new template is checked afresh
    fixed = molctl(*args)
    assert fixed.exit_code == ExitStatus.OK, fixed.stdout
    assert "remembered" not in {c["id"]: c for c in fixed.json()["checks"]}["template.render"]["detail"]


def test_skip_template_category(molctl, tmp_path, free_ports):
    lay = layout(tmp_path)
    (lay.base / "chat_template.jinja").write_text(RAISES_ON_TOOL)
    engine_port, proxy_port = free_ports
    result = molctl(
        "check",
        "tiny",
        "--model-root",
        str(lay.root),
        "--skip",
        "gpu",
        "--skip",
        "engine",
        "--skip",
        "template",
        "--set",
        f"engine.port={engine_port}",
        "--set",
        f"proxy.port={proxy_port}",
        "--json",
    )
    assert result.exit_code == ExitStatus.OK
    assert {"template.skipped"} == {c["id"] for c in result.json()["checks"] if c["id"].startswith("template")}


@pytest.mark.parametrize("name", ["qwen3.6", "glm5"])
def test_demo_templates_pass_for_every_profile(tmp_path, name):
    lay = layout(tmp_path)
    (lay.base / "chat_template.jinja").write_text(template_text(name))
    for profile in ("tiny", "tall", "venti", "venti-sglang"):
        r = results(profile_for(lay.root, profile))
        assert r["template.render"].status == "pass", (profile, r["template.render"].detail)


@pytest.mark.parametrize(
    "text, expected",
    [
        # nested loops of the sandbox's largest range: 10**10 iterations, rendering for hours
        pytest.param(
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
            "still rendering after",
            id="nested-loops",
        ),
        pytest.param(
            "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "renders more than", id="100-MB-in-chunks"
        ),
        pytest.param(
            "{{ 'x' * 10**10 }}", "repeated 10000000000 times", id="10-GB-string"
        ),  # folded at compile time before
        pytest.param("{{ 'x' | center(10**10) }}", "a width of 10000000000", id="center-filter"),
        pytest.param("{{ 'x'.ljust(10**10) }}", "a width of 10000000000", id="ljust-method"),
        pytest.param("{{ 10 ** 100000000 }}", "too large to compute", id="huge-power"),
        # format widths: gigabytes each (left over by the review)
        pytest.param("{{ '%10000000000s' % 1 }}", "a width of 10000000000", id="percent-width"),
        pytest.param("{{ '%.10000000000f' % 1.5 }}", "a width of 10000000000", id="percent-precision"),
        pytest.param("{{ '%*s' % (10000000000, 'x') }}", "a width of 10000000000", id="percent-star"),
        pytest.param("{{ '{:>10000000000}'.format(1) }}", "a width of 10000000000", id="format-method"),
        pytest.param("{{ '{:{w}}'.format(1, w=10000000000) }}", "a width of 10000000000", id="format-method-nested"),
        pytest.param("{{ '%10000000000s' | format(1) }}", "a width of 10000000000", id="format-filter"),
    ],
)
def test_a_template_that_loops_or_renders_enormous_output_fails_bounded(tmp_path, monkeypatch, text, expected):
    """Were a hang (the check never ended) or gigabytes of memory: a render is bounded in time
    and size, and the unbounded operators are refused."""
    monkeypatch.setattr(tc, "RENDER_TIMEOUT_S", 0.2)
    lay = layout(tmp_path)
    (lay.base / "chat_template.jinja").write_text(text)
    r = results(profile_for(lay.root))
    assert r["template.render"].status == "fail" and expected in r["template.render"].detail, r[
        "template.render"
    ].detail


def test_large_numbers_that_are_only_formatted_are_fine(tmp_path):
    """The width checks look at widths: a timestamp formatted with % or str.format renders."""
    lay = layout(tmp_path)
    text = (
        "{{ '%d %s' % (1700000000, 'x') }}{{ '{} {:>8}'.format(1700000000, 5) }}{{ '%08d' | format(1700000000) }}"
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    )
    (lay.base / "chat_template.jinja").write_text(text)
    r = results(profile_for(lay.root))
    assert r["template.render"].status == "pass", r["template.render"].detail


def test_a_deeply_nested_tokenizer_config_fails_found(tmp_path):
    """Was a traceback: RecursionError escaped the JSON reader."""
    lay = layout(tmp_path)
    (lay.base / "tokenizer_config.json").write_text("[" * 100_000)
    r = results(profile_for(lay.root))
    assert r["template.found"].status == "fail" and "tokenizer_config.json" in r["template.found"].detail
