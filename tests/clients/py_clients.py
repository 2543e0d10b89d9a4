"""Drive the proxy with one Python client library, every case, and print one JSON object:
case -> {"text": the final answer, ...} or {"error": "Type: message"}.

Run under the clients' own environment (.venv-clients, made by `make test`), not molctl's: the
client libraries pin versions of httpx, pydantic and openai that vLLM's environment must not get.
  python py_clients.py CLIENT [CASE...]   (MOL_BASE_URL, MOL_KEY, MOL_MODEL in the environment;
  MOL_WEATHER_TAG, optional, is appended to the tool's result)
CLIENT: openai-chat, openai-responses, litellm-completion, litellm-responses, langchain-chat,
langchain-responses, pydantic-ai-chat, pydantic-ai-responses.

The prompts carry the fake engine's directives ([tool:get_weather]: the answer hop calls it;
its answer to a tool result is "answer-N using RESULT"). MOL_FORCE_TOOL=1 (a real engine, whose
tiny random model calls no tool of its own accord): the `openai` drivers name the tool in
`tool_choice` (LiteLLM and LangChain likewise) on the request that must call it, which vLLM enforces with structured outputs."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import traceback

BASE, KEY, MODEL = os.environ["MOL_BASE_URL"], os.environ["MOL_KEY"], os.environ["MOL_MODEL"]
WEATHER = "sunny in Paris" + os.environ.get("MOL_WEATHER_TAG", "")  # the tag: which driver's tool result it is
ASK = "[route:L2] hello"
TOOL_ASK = "[route:L2] [tool:get_weather] what is the weather in Paris?"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CHAT_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather for a city", "parameters": SCHEMA},
}
RESP_TOOL = {"type": "function", "name": "get_weather", "description": "Weather for a city", "parameters": SCHEMA}
FORCE = os.environ.get("MOL_FORCE_TOOL") == "1"
CHAT_FORCED = {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}} if FORCE else {}
RESP_FORCED = {"tool_choice": {"type": "function", "name": "get_weather"}} if FORCE else {}


def get_weather(city: str = "Paris") -> str:
    """Weather for a city. The default: a tiny random model forced to call it (MOL_FORCE_TOOL) writes
    `{}` as vLLM's structured outputs let it (whitespace until the token limit), as directly."""
    return WEATHER


# ------------------------------------------------------------------------ openai


def openai_client():
    import openai

    return openai.OpenAI(base_url=BASE, api_key=KEY, max_retries=0, timeout=60)


def openai_chat():
    c = openai_client()
    out = {}
    out["plain"] = lambda: {
        "text": c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK}])
        .choices[0]
        .message.content
    }

    def stream():
        pieces = [
            ch.choices[0].delta.content or ""
            for ch in c.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": ASK}],
                stream=True,
                stream_options={"include_usage": True},
            )
            if ch.choices
        ]
        return {"text": "".join(pieces), "chunks": len(pieces)}

    def multi_turn():
        msgs = [{"role": "user", "content": ASK}]
        first = c.chat.completions.create(model=MODEL, messages=msgs).choices[0].message.content
        msgs += [{"role": "assistant", "content": first}, {"role": "user", "content": "[route:L2] and then?"}]
        return {
            "first": first,
            "text": c.chat.completions.create(model=MODEL, messages=msgs).choices[0].message.content,
        }

    def tool_loop():
        msgs = [{"role": "user", "content": TOOL_ASK}]
        msg = c.chat.completions.create(model=MODEL, messages=msgs, tools=[CHAT_TOOL], **CHAT_FORCED).choices[0].message
        call = msg.tool_calls[0]
        msgs += [
            msg.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": get_weather(**json.loads(call.function.arguments))},
        ]
        final = c.chat.completions.create(model=MODEL, messages=msgs, tools=[CHAT_TOOL]).choices[0].message.content
        return {"text": final, "called": call.function.name}

    out.update(stream=stream, multi_turn=multi_turn, tool_loop=tool_loop)
    return out


def openai_responses():
    c = openai_client()

    def stream():
        deltas, incomplete = [], None
        with c.responses.stream(model=MODEL, input=ASK) as events:  # the SDK's streaming helper
            for event in events:
                if event.type == "response.output_text.delta":
                    deltas.append(event.delta)
                elif event.type == "response.incomplete":  # the token limit (a random model's usual end)
                    incomplete = event.response
            # get_final_response() raises without a `response.completed`, as against OpenAI
            final = incomplete or events.get_final_response()
        return {"text": final.output_text, "chunks": len(deltas), "status": final.status}

    def multi_turn():
        first = c.responses.create(model=MODEL, input=ASK)
        second = c.responses.create(
            model=MODEL,
            input=[
                {"role": "user", "content": ASK},
                {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "[route:L2] and then?"},
            ],
        )
        return {"first": first.output_text, "text": second.output_text}

    def tool_loop():
        first = c.responses.create(model=MODEL, input=TOOL_ASK, tools=[RESP_TOOL], **RESP_FORCED)
        call = next(i for i in first.output if i.type == "function_call")
        final = c.responses.create(
            model=MODEL,
            previous_response_id=first.id,
            tools=[RESP_TOOL],
            input=[
                {
                    "type": "function_call_output",
                    "call_id": call.call_id,
                    "output": get_weather(**json.loads(call.arguments)),
                }
            ],
        )
        return {"text": final.output_text, "called": call.name}

    def chain():
        first = c.responses.create(model=MODEL, input=ASK)
        second = c.responses.create(model=MODEL, input="[route:L2] and then?", previous_response_id=first.id)
        return {
            "first": first.output_text,
            "text": second.output_text,
            "previous": second.previous_response_id == first.id,
        }

    def store_false():
        first = c.responses.create(
            model=MODEL,
            input=TOOL_ASK,
            tools=[RESP_TOOL],
            store=False,
            include=["reasoning.encrypted_content"],
            **RESP_FORCED,
        )
        call = next(i for i in first.output if i.type == "function_call")
        history = [
            {"role": "user", "content": TOOL_ASK},
            *[i.model_dump(exclude_none=True) for i in first.output],
            {"type": "function_call_output", "call_id": call.call_id, "output": WEATHER},
        ]
        final = c.responses.create(
            model=MODEL, input=history, tools=[RESP_TOOL], store=False, include=["reasoning.encrypted_content"]
        )
        return {"text": final.output_text, "stored": final.store}

    return {
        "plain": lambda: {"text": c.responses.create(model=MODEL, input=ASK).output_text},
        "stream": stream,
        "multi_turn": multi_turn,
        "tool_loop": tool_loop,
        "chain": chain,
        "store_false": store_false,
    }


# ------------------------------------------------------------------------ LiteLLM


def litellm_common():
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download of the cost map
    import litellm

    litellm.telemetry = False
    return litellm, {"model": f"openai/{MODEL}", "api_base": BASE, "api_key": KEY}


def litellm_completion():
    litellm, kw = litellm_common()

    def text(r):
        return r.choices[0].message.content

    def stream():
        pieces = [
            ch.choices[0].delta.content or ""
            for ch in litellm.completion(messages=[{"role": "user", "content": ASK}], stream=True, **kw)
            if ch.choices
        ]
        return {"text": "".join(pieces), "chunks": len([p for p in pieces if p])}

    def multi_turn():
        msgs = [{"role": "user", "content": ASK}]
        first = text(litellm.completion(messages=msgs, **kw))
        msgs += [{"role": "assistant", "content": first}, {"role": "user", "content": "[route:L2] and then?"}]
        return {"first": first, "text": text(litellm.completion(messages=msgs, **kw))}

    def tool_loop():
        msgs = [{"role": "user", "content": TOOL_ASK}]
        msg = litellm.completion(messages=msgs, tools=[CHAT_TOOL], **CHAT_FORCED, **kw).choices[0].message
        call = msg.tool_calls[0]
        msgs += [
            {
                "role": "assistant",
                "content": msg.content,
                "tool_calls": [
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.function.name, "arguments": call.function.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.id, "content": get_weather(**json.loads(call.function.arguments))},
        ]
        return {"text": text(litellm.completion(messages=msgs, tools=[CHAT_TOOL], **kw)), "called": call.function.name}

    return {
        "plain": lambda: {"text": text(litellm.completion(messages=[{"role": "user", "content": ASK}], **kw))},
        "stream": stream,
        "multi_turn": multi_turn,
        "tool_loop": tool_loop,
    }


def litellm_responses():
    litellm, kw = litellm_common()

    def output_text(r):
        return "".join(
            p.text
            for i in r.output
            if getattr(i, "type", None) == "message"
            for p in i.content
            if getattr(p, "type", None) == "output_text"
        )

    def stream():
        deltas = [
            e.delta
            for e in litellm.responses(input=ASK, stream=True, **kw)
            if getattr(e, "type", None) == "response.output_text.delta"
        ]
        return {"text": "".join(deltas), "chunks": len(deltas)}

    def multi_turn():
        first = output_text(litellm.responses(input=ASK, **kw))
        second = litellm.responses(
            input=[
                {"role": "user", "content": ASK},
                {"role": "assistant", "content": first},
                {"role": "user", "content": "[route:L2] and then?"},
            ],
            **kw,
        )
        return {"first": first, "text": output_text(second)}

    def tool_loop():
        first = litellm.responses(input=TOOL_ASK, tools=[RESP_TOOL], **RESP_FORCED, **kw)
        call = next(i for i in first.output if getattr(i, "type", None) == "function_call")
        final = litellm.responses(
            previous_response_id=first.id,
            tools=[RESP_TOOL],
            input=[
                {
                    "type": "function_call_output",
                    "call_id": call.call_id,
                    "output": get_weather(**json.loads(call.arguments)),
                }
            ],
            **kw,
        )
        return {"text": output_text(final), "called": call.name}

    def chain():
        first = litellm.responses(input=ASK, **kw)
        second = litellm.responses(input="[route:L2] and then?", previous_response_id=first.id, **kw)
        return {"first": output_text(first), "text": output_text(second)}

    def store_false():
        first = litellm.responses(input=ASK, store=False, **kw)
        second = litellm.responses(
            input=[
                {"role": "user", "content": ASK},
                {"role": "assistant", "content": output_text(first)},
                {"role": "user", "content": "[route:L2] and then?"},
            ],
            store=False,
            **kw,
        )
        return {"first": output_text(first), "text": output_text(second)}

    return {
        "plain": lambda: {"text": output_text(litellm.responses(input=ASK, **kw))},
        "stream": stream,
        "multi_turn": multi_turn,
        "tool_loop": tool_loop,
        "chain": chain,
        "store_false": store_false,
    }


# ------------------------------------------------------------------------ LangChain


def langchain(responses_api: bool):
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    def llm(**kw):
        return ChatOpenAI(
            model=MODEL, base_url=BASE, api_key=KEY, max_retries=0, timeout=60, use_responses_api=responses_api, **kw
        )

    def text(message) -> str:
        return message.text if isinstance(message.text, str) else message.text()

    @tool
    def weather(city: str = "Paris") -> str:
        """Weather for a city."""
        return get_weather(city)

    weather.name = "get_weather"

    def stream():
        chunks = [text(ch) for ch in llm().stream(ASK)]
        return {"text": "".join(chunks), "chunks": len([c for c in chunks if c])}

    def multi_turn():
        first = llm().invoke([HumanMessage(ASK)])
        second = llm().invoke([HumanMessage(ASK), AIMessage(text(first)), HumanMessage("[route:L2] and then?")])
        return {"first": text(first), "text": text(second)}

    def tool_loop():
        bound = llm().bind_tools([weather])
        msgs = [HumanMessage(TOOL_ASK)]
        ai = (llm().bind_tools([weather], tool_choice="get_weather") if FORCE else bound).invoke(msgs)
        call = ai.tool_calls[0]
        msgs += [ai, ToolMessage(weather.invoke(call["args"]), tool_call_id=call["id"])]
        return {"text": text(bound.invoke(msgs)), "called": call["name"]}

    cases = {
        "plain": lambda: {"text": text(llm().invoke(ASK))},
        "stream": stream,
        "multi_turn": multi_turn,
        "tool_loop": tool_loop,
    }
    if responses_api:

        def chain():
            model = llm(use_previous_response_id=True)
            first = model.invoke([HumanMessage(ASK)])
            second = model.invoke([HumanMessage(ASK), first, HumanMessage("[route:L2] and then?")])
            return {"first": text(first), "text": text(second)}

        def store_false():
            model = llm(store=False)
            first = model.invoke([HumanMessage(ASK)])
            second = model.invoke([HumanMessage(ASK), first, HumanMessage("[route:L2] and then?")])
            return {"first": text(first), "text": text(second)}

        cases.update(chain=chain, store_false=store_false)
    return cases


# ------------------------------------------------------------------------ pydantic-ai


def pydantic_ai(responses_api: bool):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel, OpenAIResponsesModelSettings
    from pydantic_ai.providers.openai import OpenAIProvider

    provider = OpenAIProvider(base_url=BASE, api_key=KEY)
    model = (OpenAIResponsesModel if responses_api else OpenAIChatModel)(MODEL, provider=provider)

    def agent(**kw):
        return Agent(model, **kw)

    def stream():
        async def go():
            async with agent().run_stream(ASK) as run:
                pieces = [p async for p in run.stream_text(delta=True)]
            return {"text": "".join(pieces), "chunks": len(pieces)}

        return asyncio.run(go())

    def multi_turn():
        a = agent()
        first = a.run_sync(ASK)
        second = a.run_sync("[route:L2] and then?", message_history=first.all_messages())
        return {"first": first.output, "text": second.output}

    def tool_loop():
        a = agent()
        a.tool_plain(get_weather)
        result = a.run_sync(TOOL_ASK)
        called = [
            p.tool_name
            for m in result.all_messages()
            for p in getattr(m, "parts", ())
            if type(p).__name__ == "ToolCallPart"
        ]
        return {"text": result.output, "called": called[0] if called else None}

    cases = {
        "plain": lambda: {"text": agent().run_sync(ASK).output},
        "stream": stream,
        "multi_turn": multi_turn,
        "tool_loop": tool_loop,
    }
    if responses_api:

        def chain():
            a = agent(model_settings=OpenAIResponsesModelSettings(openai_previous_response_id="auto"))
            first = a.run_sync(ASK)
            second = a.run_sync("[route:L2] and then?", message_history=first.all_messages())
            return {"first": first.output, "text": second.output}

        def store_false():
            a = agent(model_settings=OpenAIResponsesModelSettings(openai_store=False))
            first = a.run_sync(ASK)
            second = a.run_sync("[route:L2] and then?", message_history=first.all_messages())
            return {"first": first.output, "text": second.output}

        cases.update(chain=chain, store_false=store_false)
    return cases


CLIENTS = {
    "openai-chat": openai_chat,
    "openai-responses": openai_responses,
    "litellm-completion": litellm_completion,
    "litellm-responses": litellm_responses,
    "langchain-chat": lambda: langchain(False),
    "langchain-responses": lambda: langchain(True),
    "pydantic-ai-chat": lambda: pydantic_ai(False),
    "pydantic-ai-responses": lambda: pydantic_ai(True),
}


def main() -> None:
    results = {}
    only = sys.argv[2:]
    for case, run in CLIENTS[sys.argv[1]]().items():
        if only and case not in only:
            continue
        try:
            results[case] = run()
        except Exception as exc:  # reported per case: the test names the case that failed
            results[case] = {"error": f"{type(exc).__name__}: {exc}"[:2000], "trace": traceback.format_exc()[-3000:]}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
