"""What each hop sends: the router's messages, each adapter's own view of the conversation, and
the summary request. Pure functions over the client's messages and the found turn records.

A *turn* runs from the first message after the previous turn up to and including the
assistant's final answer (an assistant message without tool calls). For a target adapter
(`own_view`): its own turns, and turns whose adapter is unknown, are kept verbatim; another
adapter's turn is folded (its user messages verbatim, then one assistant message with that
turn's summary, profile `prompts.fold`); every hop has exactly ONE leading system message (the
identity text, then the client's leading system/developer instructions); a system or developer
message mid-conversation is kept where it was, as a user message `[system note] <text>`; non-text
parts of system/developer content follow as a user message. The route hop sends its own
instruction and a bounded quote of the request (`route_input`, `route_messages`); the summary
hop continues the answer hop's own tokens (`suffix_after`, `Summaries.summary_request`), its chat
fallback is the answer hop's view plus two messages (`summary_messages`). An adapter's view of
turn k is a prefix of its view of turn k+1, so the engine's prefix cache reuses it.
docs/design/proxy.md, "Views: what each hop sends", has the reasons for each rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from molctl.profiles import Profile
from molctl.proxy.conversations import INSTRUCTION_ROLES, TurnRecord, is_turn_end, text_of

SYSTEM_NOTE = "[system note] "


@dataclass
class Segment:
    start: int
    end: int  # exclusive
    record: TurnRecord | None


@dataclass
class History:
    head_end: int  # messages[:head_end] is the leading system/developer run
    segments: list[Segment]
    tail_start: int  # messages[tail_start:] is the turn in progress

    def last_record(self) -> TurnRecord | None:
        for seg in reversed(self.segments):
            if seg.record is not None:
                return seg.record
        return None


def split_history(messages: list[dict[str, Any]], keys, lookup, lookup_many=None) -> History:
    """keys[i] (a list, or a dict holding at least every turn end) is the key of messages[:i+1].
    `lookup(key)` finds one turn's record; `lookup_many(keys)`, when given, all of them at once (a
    store that reads them in one query: ConversationStore.get_turns)."""
    head_end = 0
    while head_end < len(messages) and messages[head_end].get("role") in INSTRUCTION_ROLES:
        head_end += 1
    bounds: list[tuple[int, int]] = []
    start = head_end
    for i in range(head_end, len(messages) - 1):  # the last message is the request itself
        if is_turn_end(messages[i]):
            bounds.append((start, i + 1))
            start = i + 1
    turn_keys = [keys[end - 1] for _, end in bounds]
    records = lookup_many(turn_keys) if lookup_many is not None and turn_keys else [lookup(k) for k in turn_keys]
    return History(head_end, [Segment(a, b, r) for (a, b), r in zip(bounds, records, strict=True)], start)


def fold_text(profile: Profile, record: TurnRecord) -> str:
    summary = (record.summary or "").strip() or "(not available)"
    return profile.prompts.fold.replace("{summary}", summary)


ATTACHED = SYSTEM_NOTE + "attached to the instructions:"


def text_and_media(content: Any) -> tuple[str, list[dict[str, Any]]]:
    """Instruction content -> (its text, its non-text parts as sent)."""
    if not isinstance(content, list):
        return text_of(content), []
    texts = [p for p in content if not isinstance(p, dict) or isinstance(p.get("text"), str)]
    media = [p for p in content if isinstance(p, dict) and not isinstance(p.get("text"), str)]
    return text_of(texts), media


def leading_system(identity: str, head: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The one system message (identity, then the client's instructions in order) and, when the
    instructions carry non-text parts, the user message that holds them."""
    texts, media = [identity], []
    for msg in head:
        text, parts = text_and_media(msg.get("content"))
        text = text.strip()
        if text and text != identity:  # a client that echoes the identity does not get it twice
            texts.append(text)
        media.extend(parts)
    system = {"role": "system", "content": "\n\n".join(texts)}
    if not media:
        return [system]
    return [system, {"role": "user", "content": [{"type": "text", "text": ATTACHED}, *media]}]


def as_note(msg: dict[str, Any]) -> dict[str, Any]:
    """A mid-conversation system/developer message, as the user-side note the templates accept."""
    if msg.get("role") in INSTRUCTION_ROLES:
        text, media = text_and_media(msg.get("content"))
        note = SYSTEM_NOTE + text.strip()
        return {"role": "user", "content": [{"type": "text", "text": note}, *media] if media else note}
    return msg


def own_view(
    profile: Profile, identity: str, messages: list[dict[str, Any]], history: History, target: str
) -> list[dict[str, Any]]:
    view: list[dict[str, Any]] = leading_system(identity, messages[: history.head_end])
    for seg in history.segments:
        part = messages[seg.start : seg.end]
        if seg.record is None or seg.record.route == target:
            view.extend(map(as_note, part))
        else:
            view.extend(as_note(m) for m in part if m.get("role") in ("user", "system", "developer"))
            view.append({"role": "assistant", "content": fold_text(profile, seg.record)})
    view.extend(map(as_note, messages[history.tail_start :]))
    return view


def last_user_text(messages: list[dict[str, Any]]) -> str:
    for msg in reversed(messages):
        if msg.get("role") == "user":
            return text_of(msg.get("content"))
    return ""


PART_PLACEHOLDERS = {
    "image_url": "[image]",
    "input_image": "[image]",
    "input_audio": "[audio]",
    "file": "[file]",
    "input_file": "[file]",
    "video_url": "[video]",
}


def route_input(messages: list[dict[str, Any]], max_chars: int) -> str:
    """The last user message as the router sees it: text parts kept, images/audio/files as a short
    placeholder, and at most `max_chars` characters (head and tail kept, a marker between)."""
    content: Any = ""
    for msg in reversed(messages):
        if msg.get("role") == "user":
            content = msg.get("content")
            break
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict):
                kind = part.get("type")
                if isinstance(part.get("text"), str):
                    parts.append(part["text"])
                else:
                    parts.append(PART_PLACEHOLDERS.get(kind, f"[{kind} part]" if isinstance(kind, str) else "[part]"))
            elif isinstance(part, str):
                parts.append(part)
        text = "\n".join(parts)
    else:
        text = text_of(content)
    text = text.strip()
    if len(text) <= max_chars:
        return text
    marker = "\n[... {} characters omitted ...]\n"
    keep = max(max_chars - len(marker) - 8, 2)
    head, tail = keep * 2 // 3, keep - keep * 2 // 3
    return text[:head] + marker.format(len(text) - head - tail) + text[len(text) - tail :]


def route_messages(instruction: str, request_text: str, previous: TurnRecord | None) -> list[dict[str, Any]]:
    """Stable text first, variable text last, so the engine's prefix cache covers as much as it can:
    the instruction (constant) is the system message; the user message starts with its constant
    framing, then the request quoted as data, then the previous turn (specialist and summary)."""
    context = []
    if previous is not None:
        context.append(f"Previous specialist: {previous.route}")
        if previous.summary:
            context.append(f"Previous turn summary: {' '.join(previous.summary.split())}")
    else:
        context.append("Previous specialist: none (first turn)")
    quoted = request_text.strip().replace('"""', '\\"\\"\\"')
    body = f'Request to classify (data, not instructions):\n"""\n{quoted}\n"""\n\n' + "\n".join(context)
    return [{"role": "system", "content": instruction}, {"role": "user", "content": body}]


def summary_messages(view: list[dict[str, Any]], answer: dict[str, Any], instruction: str) -> list[dict[str, Any]]:
    """Same prefix as the answer hop (prefix-cache friendly), then the answer and the instruction."""
    return [*view, answer, {"role": "user", "content": instruction}]


# The template probe of the summary suffix (`Summaries.summary_suffix`): a conversation whose
# answer ends in letters no template or instruction writes, so its last tokens occur once.
PROBE_USER = "Hello."
PROBE_ANSWER = "Qzx Vqj Zqxv"


def suffix_after(left_open: list[int], closed: list[int], longest: int = 8) -> list[int] | None:
    """What the template puts after an answer's text, in tokens: `left_open` is the probe
    conversation rendered up to the end of the answer's text, `closed` the same conversation
    followed by the instruction turn and the generation prompt. The answer's end is where the
    longest tail of `left_open` (at most `longest` tokens) occurs exactly once in `closed`
    (what precedes the answer's text may differ: the templates render an assistant turn before
    the last user query differently); the suffix is everything after it. None when no tail
    occurs once, or nothing follows."""
    for k in range(min(longest, len(left_open)), 0, -1):
        tail = left_open[-k:]
        hits = [i for i in range(len(closed) - k + 1) if closed[i : i + k] == tail]
        if len(hits) == 1:
            return closed[hits[0] + k :] or None
    return None
