// Tool calling through the official clients: the OpenAI Node SDK
// (tool_choice "required" and a named function, streamed and not, with the
// streamed deltas), LangChain
// JS (bindTools with tool_choice "required") and the Vercel AI SDK
// (generateText with tools and toolChoice "required"), from
// tests/reference/node_modules. Prints {"schema": ..., "results": {name:
// {calls: [{name, arguments}], finish, error}}} for test_tools.py, which
// validates every call's arguments against the tool's schema.
//
//   node sdk_tools.mjs BASE_URL API_KEY
import { createRequire } from "node:module";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const require = createRequire(join(here, "..", "reference", "package.json"));
const { default: OpenAI } = require("openai");
const { ChatOpenAI } = require("@langchain/openai");
const { generateText, jsonSchema, tool } = require("ai");
const { createOpenAICompatible } = require("@ai-sdk/openai-compatible");

const [baseURL, apiKey] = process.argv.slice(2);
if (!baseURL || !apiKey) {
  console.error("usage: node sdk_tools.mjs BASE_URL API_KEY");
  process.exit(2);
}
const schema = {
  type: "object",
  properties: { city: { type: "string", maxLength: 12 }, unit: { type: "string", enum: ["c", "f"] } },
  required: ["city", "unit"],
  additionalProperties: false,
};
const tools = [{ type: "function", function: { name: "get_weather", description: "Weather in a city", parameters: schema } }];
const client = new OpenAI({ baseURL, apiKey, maxRetries: 0, timeout: 120000 });
const model = (await client.models.list()).data[0].id;
const messages = [{ role: "user", content: "What is the weather in Paris?" }];
const base = { model, max_tokens: 250, temperature: 0, tools, messages };
const results = {};

async function record(name, fn) {
  try {
    results[name] = await fn();
  } catch (e) {
    results[name] = { error: String(e && e.message ? e.message : e) };
  }
}
const plain = (calls) => (calls ?? []).map((c) => ({ name: c.function.name, arguments: c.function.arguments }));

await record("openai_required", async () => {
  const r = await client.chat.completions.create({ ...base, tool_choice: "required", parallel_tool_calls: false });
  return { calls: plain(r.choices[0].message.tool_calls), finish: r.choices[0].finish_reason };
});
await record("openai_named", async () => {
  const r = await client.chat.completions.create({ ...base, tool_choice: { type: "function", function: { name: "get_weather" } } });
  return { calls: plain(r.choices[0].message.tool_calls), finish: r.choices[0].finish_reason };
});
// streamed: the SDK's own accumulation of delta.tool_calls, and the deltas
// as they came (test_tools.py checks their shape and that they add up to
// the unstreamed answer above)
async function streamed(body) {
  const deltas = [];
  const s = client.chat.completions.stream(body);
  s.on("chunk", (c) => {
    for (const ch of c.choices) for (const tc of ch.delta?.tool_calls ?? []) deltas.push(JSON.parse(JSON.stringify(tc)));
  });
  const done = await s.finalChatCompletion();
  return { calls: plain(done.choices[0].message.tool_calls), finish: done.choices[0].finish_reason, deltas };
}
await record("openai_required_stream", () => streamed({ ...base, tool_choice: "required", parallel_tool_calls: false }));
await record("openai_named_stream", () =>
  streamed({ ...base, tool_choice: { type: "function", function: { name: "get_weather" } } }));
await record("langchain_bind_tools", async () => {
  const lc = new ChatOpenAI({ model, apiKey, configuration: { baseURL }, temperature: 0, maxTokens: 250, maxRetries: 0 });
  const m = await lc.bindTools(tools, { tool_choice: "required", parallel_tool_calls: false }).invoke(messages);
  return { calls: (m.tool_calls ?? []).map((c) => ({ name: c.name, arguments: JSON.stringify(c.args) })),
           finish: m.response_metadata?.finish_reason };
});
await record("vercel_tools_required", async () => {
  const provider = createOpenAICompatible({ name: "loom", baseURL, apiKey, fetch: async (u, init) => { const r = await fetch(u, init); if (process.env.LOOM_SDK_DEBUG) { console.error(init.body); console.error(await r.clone().text()); } return r; } });
  const r = await generateText({
    model: provider.chatModel(model), messages, maxOutputTokens: 250, temperature: 0, maxRetries: 0,
    tools: { get_weather: tool({ description: "Weather in a city", inputSchema: jsonSchema(schema) }) },
    toolChoice: "required",
    providerOptions: { loom: { parallel_tool_calls: false } }, // passed through to the request body
  });
  return { calls: r.toolCalls.map((c) => ({ name: c.toolName, arguments: JSON.stringify(c.input) })),
           finish: r.finishReason };
});

console.log(JSON.stringify({ schema, results }));
