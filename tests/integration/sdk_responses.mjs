// The Responses API (/v1/responses) through the official clients: the
// OpenAI Node SDK's responses.create (plain, streamed, with logprobs, a function tool and
// then its function_call_output, text.format json_schema,
// previous_response_id, an unknown id), the Vercel AI SDK's responses model
// (@ai-sdk/openai's openai.responses) and LangChain's ChatOpenAI with
// useResponsesApi, and streamed n = 2 on chat and completions through the
// openai SDK, from tests/reference/node_modules. Prints one JSON line
// {schema, results: {name: {...} | {error}}} for test_responses.py.
//
//   node sdk_responses.mjs BASE_URL API_KEY
import { createRequire } from "node:module";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const require = createRequire(join(here, "..", "reference", "package.json"));
const { default: OpenAI } = require("openai");
const { ChatOpenAI } = require("@langchain/openai");
const { generateText, streamText } = require("ai");
const { createOpenAI } = require("@ai-sdk/openai");

const [baseURL, apiKey] = process.argv.slice(2);
if (!baseURL || !apiKey) {
  console.error("usage: node sdk_responses.mjs BASE_URL API_KEY");
  process.exit(2);
}
const schema = {
  type: "object",
  properties: { city: { type: "string", maxLength: 12 }, unit: { type: "string", enum: ["c", "f"] } },
  required: ["city", "unit"],
  additionalProperties: false,
};
const client = new OpenAI({ baseURL, apiKey, maxRetries: 0, timeout: 120000 });
const model = (await client.models.list()).data[0].id;
const results = {};

async function record(name, fn) {
  try {
    results[name] = await fn();
  } catch (e) {
    results[name] = { error: String(e && e.message ? e.message : e), status: e && e.status };
  }
}
const base = { model, max_output_tokens: 24, temperature: 0, instructions: "Tell a story." };

await record("plain", async () => {
  const r = await client.responses.create({ ...base, input: "Once upon a time" });
  return { id: r.id, object: r.object, status: r.status, text: r.output_text, output: r.output, usage: r.usage };
});

await record("stream", async () => {
  const stream = await client.responses.create({ ...base, input: "Once upon a time", stream: true });
  const types = [], seqs = [];
  let text = "", final = null;
  for await (const ev of stream) {
    types.push(ev.type);
    seqs.push(ev.sequence_number);
    if (ev.type === "response.output_text.delta") text += ev.delta;
    if (ev.type === "response.completed" || ev.type === "response.incomplete") final = ev.response;
  }
  return { types, seqs, text, final_text: final && final.output_text !== undefined ? final.output_text : null,
           final_output: final && final.output, status: final && final.status };
});

// the SDK's stream helper accumulates the events into a final response
await record("stream_helper", async () => {
  const stream = client.responses.stream({ ...base, input: "Once upon a time" });
  const r = await stream.finalResponse();
  return { text: r.output_text, status: r.status };
});

// log probabilities: include message.output_text.logprobs with top_logprobs, plain and streamed
await record("logprobs", async () => {
  const req = { ...base, input: "Once upon a time", include: ["message.output_text.logprobs"], top_logprobs: 2 };
  const r = await client.responses.create(req);
  const part = r.output.find((o) => o.type === "message").content[0];
  const stream = await client.responses.create({ ...req, stream: true });
  const streamed = [];
  let done = null;
  for await (const ev of stream) {
    if (ev.type === "response.output_text.delta") streamed.push(...ev.logprobs);
    if (ev.type === "response.output_text.done") done = ev.logprobs;
  }
  return { text: r.output_text, logprobs: part.logprobs, streamed, done, top_logprobs: r.top_logprobs };
});

const tools = [
  { type: "function", name: "get_weather", description: "Weather in a city", parameters: schema, strict: true },
];
await record("tool_call", async () => {
  const input = [{ role: "user", content: "What is the weather in Paris?" }];
  const r = await client.responses.create({ model, input, tools, tool_choice: "required", max_output_tokens: 200,
                                            temperature: 0, parallel_tool_calls: false });
  const calls = r.output.filter((o) => o.type === "function_call");
  if (!calls.length) return { calls: [], status: r.status, output: r.output };
  // the call's result, sent back as a function_call_output
  const output = { type: "function_call_output", call_id: calls[0].call_id, output: "21 C, sunny" };
  const input2 = [...input, ...calls, output];
  const r2 = await client.responses.create({ model, input: input2, tools, max_output_tokens: 12, temperature: 0 });
  return {
    calls: calls.map((c) => ({ name: c.name, arguments: c.arguments, call_id: c.call_id, id: c.id })),
    status: r.status, after: { status: r2.status, text: r2.output_text, input_tokens: r2.usage.input_tokens },
    input_tokens: r.usage.input_tokens,
  };
});

await record("tool_call_stream", async () => {
  const stream = await client.responses.create({ model, input: "What is the weather in Paris?", tools,
                                                 tool_choice: "required", max_output_tokens: 200, temperature: 0,
                                                 parallel_tool_calls: false, stream: true });
  const types = [];
  let args = "", done = null;
  for await (const ev of stream) {
    types.push(ev.type);
    if (ev.type === "response.function_call_arguments.delta") args += ev.delta;
    if (ev.type === "response.output_item.done" && ev.item.type === "function_call") done = ev.item;
  }
  return { types, args, done };
});

await record("json_schema", async () => {
  const r = await client.responses.create({
    model, input: "Weather report as JSON.", max_output_tokens: 120, temperature: 0,
    text: { format: { type: "json_schema", name: "weather", schema, strict: true } },
  });
  return { status: r.status, text: r.output_text, value: r.status === "completed" ? JSON.parse(r.output_text) : null };
});

await record("previous", async () => {
  const r1 = await client.responses.create({ ...base, input: "Lily had a red ball." });
  const r2 = await client.responses.create({ model, input: "What happened next?", previous_response_id: r1.id,
                                             max_output_tokens: 8, temperature: 0 });
  const solo = await client.responses.create({ model, input: "What happened next?", max_output_tokens: 8,
                                               temperature: 0 });
  const got = await client.responses.retrieve(r1.id);
  return { first: r1.usage, second: r2.usage, solo: solo.usage, prev: r2.previous_response_id,
           retrieved: got.id === r1.id && got.output_text === r1.output_text };
});

await record("unknown_previous", async () => {
  try {
    await client.responses.create({ model, input: "x", previous_response_id: "resp_nope", max_output_tokens: 4 });
    return { status: 200 };
  } catch (e) {
    return { status: e.status, param: e.param, code: e.code };
  }
});

// the AI SDK's Responses model
const provider = createOpenAI({ baseURL, apiKey });
await record("ai_sdk", async () => {
  const r = await generateText({ model: provider.responses(model), system: "Tell a story.", prompt: "Once upon a time",
                                 maxOutputTokens: 24,
                                 temperature: 0, maxRetries: 0 });
  return { text: r.text, finish: r.finishReason, usage: r.usage };
});
await record("ai_sdk_stream", async () => {
  const r = streamText({ model: provider.responses(model), system: "Tell a story.", prompt: "Once upon a time",
                         maxOutputTokens: 24,
                         temperature: 0, maxRetries: 0 });
  let text = "";
  for await (const part of r.textStream) text += part;
  return { text, finish: await r.finishReason };
});

// LangChain over the Responses API
await record("langchain", async () => {
  const llm = new ChatOpenAI({ model, apiKey, configuration: { baseURL }, useResponsesApi: true, maxTokens: 24,
                               temperature: 0, maxRetries: 0 });
  const m = await llm.invoke([["system", "Tell a story."], ["human", "Once upon a time"]]);
  return { text: typeof m.content === "string" ? m.content : m.content.map((p) => p.text ?? "").join("") };
});

// streamed n = 2 (chat and completions): each index's text and finish equal
// the unstreamed seeded answer's
async function n2(create, textOf) {
  const body = { model, n: 2, max_tokens: 16, temperature: 1.0, seed: 7 };
  const whole = await create({ ...body });
  const stream = await create({ ...body, stream: true });
  const got = {};
  for await (const ch of stream)
    for (const c of ch.choices) {
      got[c.index] ??= { text: "", finish: null };
      got[c.index].text += textOf(c, true) ?? "";
      if (c.finish_reason) got[c.index].finish = c.finish_reason;
    }
  return {
    indexes: Object.keys(got).map(Number).sort(),
    streamed: [0, 1].map((i) => got[i]),
    whole: whole.choices.map((c) => ({ text: textOf(c, false), finish: c.finish_reason })),
  };
}
await record("chat_n2_stream", () =>
  n2((b) => client.chat.completions.create({ ...b, messages: [{ role: "user", content: "Once upon a time" }] }),
     (c, streamed) => (streamed ? c.delta.content : c.message.content)));
await record("completions_n2_stream", () =>
  n2((b) => client.completions.create({ ...b, prompt: "Once upon a time" }), (c) => c.text));

console.log(JSON.stringify({ schema, results }));
