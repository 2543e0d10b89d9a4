// Drive the proxy with one JavaScript client library, every case, and print one JSON object:
// case -> {"text": the final answer, ...} or {"error": "Type: message"} (the shape
// tests/clients/cases.py checks, as for py_clients.py).
//
//   node clients.mjs CLIENT [CASE...]   (MOL_BASE_URL, MOL_KEY, MOL_MODEL in the environment)
// CLIENT: ai-sdk-responses, ai-sdk-chat, openai-chat, openai-responses.
// The libraries are those package-lock.json pins, installed by `make clients` (npm ci).
//
// The prompts carry the fake engine's directives ([tool:get_weather]: the answer hop calls it;
// its answer to a tool result is "answer-N using RESULT"). MOL_FORCE_TOOL=1 (a real engine, whose
// tiny random model calls no tool of its own accord): the request that must call the tool names it
// in its tool choice, which vLLM enforces with structured outputs.

import { createOpenAI } from "@ai-sdk/openai";
import { generateText, jsonSchema, stepCountIs, streamText, tool } from "ai";
import OpenAI from "openai";

const BASE = process.env.MOL_BASE_URL, KEY = process.env.MOL_KEY, MODEL = process.env.MOL_MODEL;
const WEATHER = "sunny in Paris" + (process.env.MOL_WEATHER_TAG ?? ""); // the tag: which driver's tool result it is
const ASK = "[route:L2] hello";
const TOOL_ASK = "[route:L2] [tool:get_weather] what is the weather in Paris?";
const FOLLOW_UP = "[route:L2] and then?";
const SCHEMA = { type: "object", properties: { city: { type: "string" } }, required: ["city"] };
const CHAT_TOOL = { type: "function", function: { name: "get_weather", description: "Weather for a city", parameters: SCHEMA } };
const RESP_TOOL = { type: "function", name: "get_weather", description: "Weather for a city", parameters: SCHEMA };
const FORCE = process.env.MOL_FORCE_TOOL === "1";
const CHAT_FORCED = FORCE ? { tool_choice: { type: "function", function: { name: "get_weather" } } } : {};
const RESP_FORCED = FORCE ? { tool_choice: { type: "function", name: "get_weather" } } : {};

// A tiny random model forced to call it writes `{}` as vLLM's structured outputs let it
// (whitespace until the token limit), also directly: the city is then Paris.
function getWeather({ city = "Paris" }) {
  if (typeof city !== "string") throw new Error(`get_weather called with a city that is no string: ${JSON.stringify(city)}`);
  return WEATHER;
}

// ------------------------------------------------------------------------ Vercel AI SDK

function aiSdk(responsesApi) {
  const provider = createOpenAI({ baseURL: BASE, apiKey: KEY });
  const model = responsesApi ? provider.responses(MODEL) : provider.chat(MODEL);
  const common = { model, maxRetries: 0 };
  const weather = tool({ description: "Weather for a city", inputSchema: jsonSchema(SCHEMA), execute: async (args) => getWeather(args) });

  async function toolLoop(extra = {}) {
    // forced: the first step only, so that the step after the tool result may answer in text
    const forced = FORCE ? { prepareStep: ({ stepNumber }) => (stepNumber === 0 ? { toolChoice: { type: "tool", toolName: "get_weather" } } : {}) } : {};
    const result = await generateText({ ...common, prompt: TOOL_ASK, tools: { get_weather: weather }, stopWhen: stepCountIs(4), ...forced, ...extra });
    const calls = result.steps.flatMap((s) => s.toolCalls);
    return { text: result.text, called: calls[0]?.toolName ?? null, steps: result.steps.length };
  }

  const cases = {
    plain: async () => ({ text: (await generateText({ ...common, prompt: ASK })).text }),
    stream: async () => {
      let failure; // streamText reports a failed request to onError, not by throwing
      const result = streamText({ ...common, prompt: ASK, onError: ({ error }) => { failure = error; } });
      const pieces = [];
      for await (const piece of result.textStream) if (piece) pieces.push(piece);
      if (failure) throw failure;
      return { text: pieces.join(""), chunks: pieces.length, finish: await result.finishReason };
    },
    multi_turn: async () => {
      // the SDK's way: the first result's response messages go back as the history
      const history = [{ role: "user", content: ASK }];
      const first = await generateText({ ...common, messages: history });
      const second = await generateText({ ...common, messages: [...history, ...first.response.messages, { role: "user", content: FOLLOW_UP }] });
      return { first: first.text, text: second.text };
    },
    tool_loop: () => toolLoop(),
  };
  if (responsesApi) {
    cases.chain = async () => {
      const first = await generateText({ ...common, prompt: ASK });
      const id = first.providerMetadata?.openai?.responseId;
      if (!id) throw new Error(`no responseId in providerMetadata: ${JSON.stringify(first.providerMetadata)}`);
      const second = await generateText({ ...common, prompt: FOLLOW_UP, providerOptions: { openai: { previousResponseId: id } } });
      return { first: first.text, text: second.text, previous: id };
    };
    // a tool loop with store: false: each step resends the whole history, its items inline
    cases.store_false = () => toolLoop({ providerOptions: { openai: { store: false } } });
  }
  return cases;
}

// ------------------------------------------------------------------------ openai (npm)

function openaiClient() {
  return new OpenAI({ baseURL: BASE, apiKey: KEY, maxRetries: 0, timeout: 60_000 });
}

function openaiChat() {
  const c = openaiClient();
  const ask = async (messages, extra = {}) => (await c.chat.completions.create({ model: MODEL, messages, ...extra })).choices[0].message;
  return {
    plain: async () => ({ text: (await ask([{ role: "user", content: ASK }])).content }),
    stream: async () => {
      const stream = await c.chat.completions.create({ model: MODEL, messages: [{ role: "user", content: ASK }], stream: true,
        stream_options: { include_usage: true } });
      const pieces = [];
      for await (const chunk of stream) if (chunk.choices.length) pieces.push(chunk.choices[0].delta.content ?? "");
      return { text: pieces.join(""), chunks: pieces.length };
    },
    multi_turn: async () => {
      const msgs = [{ role: "user", content: ASK }];
      const first = (await ask(msgs)).content;
      msgs.push({ role: "assistant", content: first }, { role: "user", content: FOLLOW_UP });
      return { first, text: (await ask(msgs)).content };
    },
    tool_loop: async () => {
      const msgs = [{ role: "user", content: TOOL_ASK }];
      const msg = await ask(msgs, { tools: [CHAT_TOOL], ...CHAT_FORCED });
      const call = msg.tool_calls[0];
      // the SDK's documented loop: the assistant message goes back as it came
      msgs.push(msg, { role: "tool", tool_call_id: call.id, content: getWeather(JSON.parse(call.function.arguments)) });
      return { text: (await ask(msgs, { tools: [CHAT_TOOL] })).content, called: call.function.name };
    },
  };
}

function openaiResponses() {
  const c = openaiClient();
  const create = (body) => c.responses.create({ model: MODEL, ...body });
  return {
    plain: async () => ({ text: (await create({ input: ASK })).output_text }),
    stream: async () => {
      const stream = c.responses.stream({ model: MODEL, input: ASK }); // the SDK's streaming helper
      const deltas = [];
      for await (const event of stream) if (event.type === "response.output_text.delta") deltas.push(event.delta);
      const final = await stream.finalResponse();
      return { text: final.output_text, chunks: deltas.length, deltas: deltas.join("") };
    },
    multi_turn: async () => {
      const first = await create({ input: ASK });
      const second = await create({ input: [{ role: "user", content: ASK }, { role: "assistant", content: first.output_text },
        { role: "user", content: FOLLOW_UP }] });
      return { first: first.output_text, text: second.output_text };
    },
    tool_loop: async () => {
      const first = await create({ input: TOOL_ASK, tools: [RESP_TOOL], ...RESP_FORCED });
      const call = first.output.find((i) => i.type === "function_call");
      const final = await create({ previous_response_id: first.id, tools: [RESP_TOOL], input: [
        { type: "function_call_output", call_id: call.call_id, output: getWeather(JSON.parse(call.arguments)) }] });
      return { text: final.output_text, called: call.name };
    },
    chain: async () => {
      const first = await create({ input: ASK });
      const second = await create({ input: FOLLOW_UP, previous_response_id: first.id });
      return { first: first.output_text, text: second.output_text, previous: second.previous_response_id === first.id };
    },
    store_false: async () => {
      const opts = { tools: [RESP_TOOL], store: false, include: ["reasoning.encrypted_content"] };
      const first = await create({ input: TOOL_ASK, ...opts, ...RESP_FORCED });
      const call = first.output.find((i) => i.type === "function_call");
      // the output items go back as they came (the documented stateless loop)
      const history = [{ role: "user", content: TOOL_ASK }, ...first.output,
        { type: "function_call_output", call_id: call.call_id, output: getWeather(JSON.parse(call.arguments)) }];
      const final = await create({ input: history, ...opts });
      return { text: final.output_text, stored: final.store };
    },
  };
}

const CLIENTS = {
  "ai-sdk-responses": () => aiSdk(true), "ai-sdk-chat": () => aiSdk(false),
  "openai-chat": openaiChat, "openai-responses": openaiResponses,
};

function describe(err) {
  let message = `${err?.name ?? typeof err}: ${err?.message ?? String(err)}`;
  if (err?.responseBody) message += ` | response: ${err.responseBody}`; // the AI SDK's APICallError
  else if (err?.error) message += ` | response: ${JSON.stringify(err.error)}`; // the openai SDK's APIError
  if (err?.cause) message += ` | cause: ${err.cause?.message ?? err.cause}`;
  return message.slice(0, 2000);
}

async function main() {
  const make = CLIENTS[process.argv[2]];
  if (!make) throw new Error(`unknown client ${process.argv[2]}; one of ${Object.keys(CLIENTS).join(", ")}`);
  const results = {}, only = process.argv.slice(3);
  for (const [name, run] of Object.entries(make())) {
    if (only.length && !only.includes(name)) continue;
    try {
      results[name] = await run();
    } catch (err) { // reported per case: the test names the case that failed
      results[name] = { error: describe(err), trace: String(err?.stack ?? "").slice(-3000) };
    }
  }
  process.stdout.write(JSON.stringify(results) + "\n", () => process.exit(0));
}

main().catch((err) => {
  console.error(err);
  process.exit(1);
});
