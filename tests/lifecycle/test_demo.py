"""`molctl demo init`: deterministic, in the upstream layout, passing the model/adapter/template checks, with
chat templates as strict as the real bases (Qwen3.6 rules by default, GLM-5 rules with --template glm5)."""

from __future__ import annotations

import hashlib
import json

import pytest

from molctl.checks.jinja_sandbox import compile_template
from molctl.checks.template import Template, render
from molctl.demo import TEMPLATES, init_tiny, template_text
from molctl.errors import ExitStatus


def digest(root) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_deterministic_per_seed(tmp_path):
    init_tiny(tmp_path / "a", seed=0)
    init_tiny(tmp_path / "b", seed=0)
    init_tiny(tmp_path / "c", seed=1)
    a, b, c = digest(tmp_path / "a"), digest(tmp_path / "b"), digest(tmp_path / "c")
    assert a == b
    assert a["base/model-00001-of-00002.safetensors"] != c["base/model-00001-of-00002.safetensors"]
    adapters = {a[f"loras/{r}/adapter_model.safetensors"] for r in ("L0", "L1", "L2", "L3")}
    assert len(adapters) == 4  # four different adapters


def test_layout_passes_the_model_and_adapter_checks(molctl, tmp_path):
    result = molctl("demo", "init", str(tmp_path / "tiny"), "--json")
    assert result.exit_code == ExitStatus.OK and result.json()["created"] is True
    report = molctl(
        "check", "tiny", "--model-root", str(tmp_path / "tiny"), "--skip", "engine", "--skip", "port", "--json"
    )
    assert report.exit_code == ExitStatus.OK, [c for c in report.json()["checks"] if c["status"] != "pass"]
    statuses = {c["id"]: c["status"] for c in report.json()["checks"]}
    assert statuses["template.found"] == statuses["template.render"] == "pass"
    config = json.loads((tmp_path / "tiny" / "base" / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]


def test_refuses_to_overwrite_and_if_missing(molctl, tmp_path):
    assert molctl("demo", "init", str(tmp_path / "tiny")).exit_code == ExitStatus.OK
    again = molctl("demo", "init", str(tmp_path / "tiny"))
    assert again.exit_code == ExitStatus.USAGE and "--force" in again.stderr
    kept = molctl("demo", "init", str(tmp_path / "tiny"), "--if-missing")
    assert kept.exit_code == ExitStatus.OK and "already present" in kept.stdout
    assert molctl("demo", "init", str(tmp_path / "tiny"), "--force").exit_code == ExitStatus.OK


# ---------------------------------------------------------------- chat templates (--template)
SYS, USER = {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}
ANSWER = {"role": "assistant", "content": "hello"}


def render_demo(name, messages, **payload):
    return render(
        Template(name, {"default": template_text(name)}, {"bos_token": "<s>", "eos_token": "<|im_end|>"}),
        {"messages": messages, **payload},
    )


def test_both_templates_written_and_selectable(molctl, tmp_path):
    for name in TEMPLATES:
        result = molctl("demo", "init", str(tmp_path / name), "--template", name, "--json")
        assert result.exit_code == ExitStatus.OK and result.json()["template"] == name
        written = (tmp_path / name / "base" / "chat_template.jinja").read_text()
        assert written == template_text(name)
        assert "chat_template" not in json.loads((tmp_path / name / "base" / "tokenizer_config.json").read_text())
    # same weights and tokenizer for both: only the template differs
    a, b = digest(tmp_path / "qwen3.6"), digest(tmp_path / "glm5")
    assert {k for k in a if a[k] != b.get(k)} == {"base/chat_template.jinja"}
    bad = molctl("demo", "init", str(tmp_path / "x"), "--template", "llama")
    assert bad.exit_code == ExitStatus.USAGE and "qwen3.6" in bad.stderr


def test_default_template_is_qwen_and_the_tokenizer_loads_it(tmp_path):
    init_tiny(tmp_path / "t")
    assert (tmp_path / "t" / "base" / "chat_template.jinja").read_text() == template_text("qwen3.6")
    import transformers  # installed with the cpu extra (vLLM), which `make test` always has

    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "t" / "base"))
    text = tok.apply_chat_template([SYS, USER], tokenize=False, add_generation_prompt=True)
    assert (
        text
        == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    )
    with pytest.raises(Exception, match="System message must be at the beginning"):
        tok.apply_chat_template([USER, SYS, USER], tokenize=False)


def test_if_missing_adds_the_template_to_an_older_tiny_model(molctl, tmp_path):
    init_tiny(tmp_path / "t")
    (tmp_path / "t" / "base" / "chat_template.jinja").unlink()
    result = molctl("demo", "init", str(tmp_path / "t"), "--if-missing")
    assert result.exit_code == ExitStatus.OK and "added the qwen3.6 chat template" in result.stdout
    assert (tmp_path / "t" / "base" / "chat_template.jinja").read_text() == template_text("qwen3.6")


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_strict_rules_refuse_developer_and_unknown_roles(name):
    with pytest.raises(Exception, match="developer"):
        render_demo(name, [{"role": "developer", "content": "x"}, USER])
    with pytest.raises(Exception, match="Unexpected message role"):
        render_demo(name, [{"role": "critic", "content": "x"}, USER])
    # arguments as the JSON string of the OpenAI API (vLLM parses them to an object first)
    with pytest.raises(Exception, match="arguments must be an object"):
        compile_template(template_text(name)).render(
            messages=[
                USER,
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}],
                },
                {"role": "tool", "content": "r"},
            ]
        )


def test_qwen_rules():
    with pytest.raises(Exception, match="System message must be at the beginning"):
        render_demo("qwen3.6", [USER, ANSWER, SYS, USER])
    with pytest.raises(Exception, match="System message must be at the beginning"):
        render_demo("qwen3.6", [SYS, SYS, USER])
    with pytest.raises(Exception, match="No user query found"):
        render_demo("qwen3.6", [SYS])
    with pytest.raises(Exception, match="No messages provided"):
        render_demo("qwen3.6", [])
    with pytest.raises(Exception, match="System message cannot contain images"):
        render_demo(
            "qwen3.6", [{"role": "system", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, USER]
        )
    off = render_demo("qwen3.6", [SYS, USER], chat_template_kwargs={"enable_thinking": False})
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    on = render_demo("qwen3.6", [SYS, USER, {"role": "assistant", "content": "<think>plan</think>done"}, USER])
    assert "<think>" not in on.split("<|im_start|>assistant\n")[1]  # reasoning dropped before the last query
    assert on.endswith("<|im_start|>assistant\n<think>\n")


def test_glm_rules():
    text = render_demo("glm5", [SYS, USER, ANSWER, {"role": "system", "content": "Now in French."}, USER])
    assert text == (
        "[gMASK]<sop><|system|>Reasoning Effort: Max<|system|>Be brief.<|user|>hi<|assistant|></think>hello"
        "<|system|>Now in French.<|user|>hi<|assistant|><think>"
    )
    off = render_demo("glm5", [USER], chat_template_kwargs={"enable_thinking": False})
    assert off == "[gMASK]<sop><|system|>Reasoning Effort: Max<|user|>hi<|assistant|></think>"
    kept = render_demo(
        "glm5",
        [USER, {"role": "assistant", "content": "", "reasoning_content": "why"}, USER, ANSWER],
        chat_template_kwargs={"clear_thinking": False},
    )
    assert "<think>why</think>" in kept


def test_a_non_empty_target_without_force_is_a_usage_error(molctl, tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "notes.txt").write_text("mine")
    r = molctl("demo", "init", str(tmp_path / "x"))
    assert r.exit_code == ExitStatus.USAGE and "is not empty; use --force" in r.stderr
    assert (tmp_path / "x" / "notes.txt").read_text() == "mine"


def test_force_keeps_the_old_model_when_the_new_one_cannot_be_built(molctl, tmp_path, monkeypatch):
    """`--force` deleted the old model before building the new one: `--seed -1` (a numpy
    ValueError, a traceback, exit 1) or a full disk left no model and a half-built .tmp-init."""
    import errno

    from molctl import demo

    root = tmp_path / "tiny"
    assert molctl("demo", "init", str(root)).exit_code == ExitStatus.OK
    before = digest(root)
    bad = molctl("demo", "init", str(root), "--force", "--seed", "-1")
    assert bad.exit_code == ExitStatus.USAGE and "--seed -1: expected 0 or more" in bad.stderr, bad.stderr
    assert digest(root) == before

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(demo, "_write_adapter", full_disk)
    r = molctl("demo", "init", str(root), "--force", "--seed", "3")
    assert r.exit_code == ExitStatus.ERROR and "No space left on device" in r.stderr and "Traceback" not in r.stderr
    assert digest(root) == before and sorted(p.name for p in tmp_path.iterdir() if p.name != "state") == ["tiny"]
    monkeypatch.undo()
    assert molctl("demo", "init", str(root), "--force", "--seed", "3").exit_code == ExitStatus.OK
    assert digest(root) != before and sorted(p.name for p in tmp_path.iterdir() if p.name != "state") == ["tiny"]


# ---------------------------------------------------------------- adapters with no effect (--no-effect)
def tensor_bytes(path, name: str) -> bytes:
    from molctl.safetensors import read_header

    header = read_header(path)
    start, end = header.tensors[name]["data_offsets"]
    return path.read_bytes()[header.header_size + start : header.header_size + end]


def test_no_effect_writes_a_zero_b_and_an_off_target_adapter_that_pass_the_checks(molctl, tmp_path):
    """--no-effect L1=zero-b: L1's lora_B weights are all zero (its lora_A as usual); L3=off-target:
    a working adapter on o_proj only. Both pass the static adapter checks: only the efficacy canary
    of `up` can tell (tests/e2e/test_e2e.py proves it on the real vLLM)."""
    r = molctl(
        "demo", "init", str(tmp_path / "tiny"), "--no-effect", "L1=zero-b", "--no-effect", "L3=off-target", "--json"
    )
    assert r.exit_code == ExitStatus.OK and r.json()["no_effect"] == {"L1": "zero-b", "L3": "off-target"}
    loras = tmp_path / "tiny" / "loras"
    zero = loras / "L1" / "adapter_model.safetensors"
    b = tensor_bytes(zero, "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight")
    a = tensor_bytes(zero, "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight")
    assert set(b) == {0} and set(a) != {0}
    assert json.loads((loras / "L3" / "adapter_config.json").read_text())["target_modules"] == ["o_proj"]
    from molctl.safetensors import read_header

    names = read_header(loras / "L3" / "adapter_model.safetensors").tensors
    assert {n.split(".")[-3] for n in names if n != "__metadata__"} == {"o_proj"}
    assert json.loads((loras / "L0" / "adapter_config.json").read_text())["target_modules"] == ["q_proj", "v_proj"]
    report = molctl(
        "check", "tiny", "--model-root", str(tmp_path / "tiny"), "--skip", "engine", "--skip", "port", "--json"
    )
    assert report.exit_code == ExitStatus.OK, [c for c in report.json()["checks"] if c["status"] != "pass"]


@pytest.mark.parametrize("item", ["L4=zero-b", "L1=half", "L1"])
def test_a_bad_no_effect_item_is_a_usage_error(molctl, tmp_path, item):
    r = molctl("demo", "init", str(tmp_path / "tiny"), "--no-effect", item)
    assert r.exit_code == ExitStatus.USAGE and f"--no-effect {item!r}: expected ROUTE=KIND" in r.stderr
    assert not (tmp_path / "tiny").exists()
