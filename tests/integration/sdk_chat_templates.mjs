// A model served with its own chat template (Hermes 3's, tool calls in
// <tool_call> blocks), through the official clients: the OpenAI Node SDK
// forces a call (tool_choice "required"), sends the call and its result
// back as the next turn (the round trip) and gets an answer; LangChain JS's
// bindTools gets a parsed call. Exits non-zero on a failure; prints one
// JSON line for test_chat_templates.py.
//
//   node sdk_chat_templates.mjs BASE_URL API_KEY
import { createRequire } from "node:module";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const require = createRequire(join(here, "..", "reference", "package.json"));
const { default: OpenAI } = require("openai");
const { ChatOpenAI } = require("@langchain/openai");

const [baseURL, apiKey] = process.argv.slice(2);
const fail = (m) => {
  console.error(m);
  process.exit(1);
};
const schema = {
  type: "object",
  properties: { city: { type: "string", maxLength: 8 } },
  required: ["city"],
  additionalProperties: false,
};
const tools = [{ type: "function", function: { name: "get_weather", description: "Weather in a city", parameters: schema } }];
const client = new OpenAI({ baseURL, apiKey, maxRetries: 0, timeout: 120000 });
const model = (await client.models.list()).data[0].id;
const messages = [{ role: "user", content: "What is the weather in Oslo?" }];
const out = {};

// tools auto: the tiny model writes no call, the answer is text
const auto = await client.chat.completions.create({ model, messages, tools, max_tokens: 8, temperature: 0 });
if (typeof auto.choices[0].message.content !== "string") fail("auto: no text " + JSON.stringify(auto.choices[0]));
out.auto = auto.choices[0].finish_reason;

let call = null;
for (let seed = 0; seed < 4 && !call; seed++) {
  const r = await client.chat.completions.create({
    model, messages, tools, tool_choice: "required", parallel_tool_calls: false, max_tokens: 200, temperature: 0.7, seed,
  });
  const c = r.choices[0];
  if (c.finish_reason === "length") continue;
  if (c.finish_reason !== "tool_calls" || c.message.tool_calls?.length !== 1) fail("required: " + JSON.stringify(c));
  call = c.message.tool_calls[0];
}
if (!call) fail("no forced call finished in 4 tries");
const args = JSON.parse(call.function.arguments);
if (call.function.name !== "get_weather" || typeof args.city !== "string" || Object.keys(args).length !== 1)
  fail("call " + JSON.stringify(call));
out.call = call.function;

// the round trip: the call and its result go back; the model answers
const next = await client.chat.completions.create({
  model, tools, max_tokens: 8, temperature: 0,
  messages: [...messages, { role: "assistant", content: null, tool_calls: [call] },
             { role: "tool", tool_call_id: call.id, content: "{\"temp\": 3}" }],
});
if (typeof next.choices[0].message.content !== "string") fail("round trip: " + JSON.stringify(next.choices[0]));
if (next.usage.prompt_tokens <= auto.usage.prompt_tokens) fail("the round trip's history did not render");
out.round_trip = next.usage.prompt_tokens;

const lc = new ChatOpenAI({ model, apiKey, configuration: { baseURL }, temperature: 0.7, maxTokens: 200, maxRetries: 0 });
let lcCall = null;
for (let i = 0; i < 4 && !lcCall; i++) {
  const m = await lc.bindTools(tools, { tool_choice: "required", parallel_tool_calls: false }).invoke(messages, { seed: i });
  if (m.response_metadata?.finish_reason === "length") continue;
  if (m.tool_calls?.length !== 1 || m.tool_calls[0].name !== "get_weather") fail("bindTools: " + JSON.stringify(m));
  lcCall = m.tool_calls[0].args;
}
if (!lcCall) fail("bindTools: no call finished");
out.langchain = lcCall;
console.log(JSON.stringify(out));
