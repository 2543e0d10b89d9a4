"""The demo templates (molctl/templates/) follow the documented rules of the real vendor templates
that decide whether one hop's prompt is a prefix of the next (issue 30), rendered with molctl's
own renderer:
- the tools block first: Qwen3.6 opens the system turn with `# Tools` and puts the client's system
  text after the tools; GLM lists the tools right after `[gMASK]<sop>` (and GLM-5.x's effort header);
- the last-query rendering: Qwen adds a `<think>` block to each assistant message after the last
  user query (`loop.index0 > ns.last_query_index`), every one with `preserve_thinking`; GLM keeps
  reasoning only after the last user message (`ns.last_user_index`);
- GLM-5.x's `Reasoning Effort: ...` header from `reasoning_effort`."""

from __future__ import annotations

from molctl.checks.template import Template, render
from molctl.demo import template_text

SYS = {"role": "system", "content": "Be brief."}
USER = {"role": "user", "content": "hi"}
TOOLS = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}]
CALL = {
    "role": "assistant",
    "content": "",
    "reasoning_content": "need f",
    "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
}
RESULT = {"role": "tool", "tool_call_id": "c", "content": "ok"}


def draw(name, messages, **payload):
    return render(Template(name, {"default": template_text(name)}, {}), {"messages": messages, **payload})


def test_qwen_tools_block_opens_the_system_turn_before_the_clients_text():
    text = draw("qwen3.6", [SYS, USER], tools=TOOLS)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n# Tools\n")
    assert system.endswith("</tool_call>\n\nBe brief.")  # the client's text after the tools
    # without tools the system turn is the client's text alone
    assert draw("qwen3.6", [SYS, USER]).startswith("<|im_start|>system\nBe brief.<|im_end|>")


def test_glm_tools_block_right_after_the_prompt_start():
    text = draw("glm5", [SYS, USER], tools=TOOLS)
    assert text.startswith("[gMASK]<sop><|system|>Reasoning Effort: Max<|system|>\n# Tools\n")
    assert text.index("</tools>") < text.index("<|system|>Be brief.")


def test_qwen_think_block_only_after_the_last_user_query():
    turn = [SYS, USER, CALL, RESULT]  # the tool turn: its assistant message is after the last query
    assert "<|im_start|>assistant\n<think>\nneed f\n</think>\n\n<tool_call>" in draw("qwen3.6", turn, tools=TOOLS)
    later = draw(
        "qwen3.6", [*turn, {"role": "assistant", "content": "done"}, {"role": "user", "content": "next"}], tools=TOOLS
    )
    assert "<|im_start|>assistant\n<tool_call>" in later and "need f" not in later  # now before the last query
    # an assistant message after the last query without reasoning still gets an (empty) block
    assert "<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>" in draw(
        "qwen3.6", [SYS, USER, {**CALL, "reasoning_content": None}, RESULT], tools=TOOLS
    )


def test_qwen_preserve_thinking_keeps_every_block():
    msgs = [
        SYS,
        USER,
        {"role": "assistant", "content": "x", "reasoning_content": "r"},
        {"role": "user", "content": "again"},
    ]
    assert "<think>" not in draw("qwen3.6", msgs).split("<|im_start|>assistant\n")[1]
    kept = draw("qwen3.6", msgs, chat_template_kwargs={"preserve_thinking": True})
    assert "<|im_start|>assistant\n<think>\nr\n</think>\n\nx<|im_end|>" in kept


def test_glm_reasoning_kept_only_after_the_last_user_message():
    turn = [USER, CALL, RESULT]
    assert "<|assistant|><think>need f</think><tool_call>f" in draw("glm5", turn, tools=TOOLS)
    later = draw("glm5", [*turn, {"role": "assistant", "content": "done"}, USER], tools=TOOLS)
    assert "<|assistant|></think><tool_call>f" in later and "need f" not in later


def test_glm_effort_header_from_reasoning_effort():
    def header(**payload):
        return draw("glm5", [USER], chat_template_kwargs=payload).split("<|user|>")[0]

    assert header() == "[gMASK]<sop><|system|>Reasoning Effort: Max"
    assert header(reasoning_effort="high") == "[gMASK]<sop><|system|>Reasoning Effort: High"
    assert header(reasoning_effort="low") == "[gMASK]<sop><|system|>Reasoning Effort: Low"
    assert header(reasoning_effort="max") == header(reasoning_effort="none") == header()
