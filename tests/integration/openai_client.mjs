// Drives Loom's HTTP gateway with the official OpenAI Node SDK (openai@6,
// installed by `npm ci --prefix tests/reference`) and prints what it got as
// one JSON object, for test_http.py to compare with the ZeroMQ client.
//
//   node openai_client.mjs BASE_URL API_KEY SPEC_JSON
//
// SPEC_JSON: {"prompt": TEXT, "messages": [...], "max_tokens": N, "seed": S}
// The SDK is loaded from tests/reference/node_modules wherever this file
// lives (ESM imports would only search next to it).
import { createRequire } from "node:module";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const require = createRequire(join(here, "..", "reference", "package.json"));
const { default: OpenAI, APIError } = require("openai");

const [baseURL, apiKey, specJson] = process.argv.slice(2);
if (!baseURL || !apiKey || !specJson) {
  console.error("usage: node openai_client.mjs BASE_URL API_KEY SPEC_JSON");
  process.exit(2);
}
const spec = JSON.parse(specJson);
const client = new OpenAI({ baseURL, apiKey, maxRetries: 0, timeout: 60000 });
const out = {};

async function expectError(name, fn) {
  try {
    await fn();
    out[name] = { status: null };
  } catch (e) {
    out[name] = e instanceof APIError
      ? { status: e.status, type: e.type ?? null, code: e.code ?? null, message: e.message }
      : { status: -1, message: String(e) };
  }
}

const models = await client.models.list();
out.models = [];
for await (const m of models) out.models.push(m.id);
const model = out.models[0];

const greedy = { model, max_tokens: spec.max_tokens, temperature: 0 };

// completions, non-streaming and streaming
const c1 = await client.completions.create({ ...greedy, prompt: spec.prompt });
out.completion = {
  object: c1.object, id: c1.id, text: c1.choices[0].text, finish_reason: c1.choices[0].finish_reason,
  usage: c1.usage, n_choices: c1.choices.length,
};
const s1 = await client.completions.create({
  ...greedy, prompt: spec.prompt, stream: true, stream_options: { include_usage: true },
});
let text = "", chunks = 0, finish = null, usage = null, objects = new Set();
for await (const ch of s1) {
  objects.add(ch.object);
  if (ch.usage) usage = ch.usage;
  if (ch.choices.length === 0) continue;
  chunks++;
  text += ch.choices[0].text;
  if (ch.choices[0].finish_reason) finish = ch.choices[0].finish_reason;
}
out.completion_stream = { text, chunks, finish_reason: finish, usage, objects: [...objects] };

// chat, non-streaming and streaming (without usage this time)
const c2 = await client.chat.completions.create({ ...greedy, messages: spec.messages });
out.chat = {
  object: c2.object, id: c2.id, role: c2.choices[0].message.role, content: c2.choices[0].message.content,
  finish_reason: c2.choices[0].finish_reason, usage: c2.usage,
};
const s2 = await client.chat.completions.create({ ...greedy, messages: spec.messages, stream: true });
text = ""; chunks = 0; finish = null; usage = null; objects = new Set();
let role = null;
for await (const ch of s2) {
  objects.add(ch.object);
  if (ch.usage) usage = ch.usage;
  const d = ch.choices[0]?.delta ?? {};
  if (d.role) role = d.role;
  if (d.content) text += d.content;
  chunks++;
  if (ch.choices[0]?.finish_reason) finish = ch.choices[0].finish_reason;
}
out.chat_stream = { text, chunks, role, finish_reason: finish, usage, objects: [...objects] };

// a seeded sampled completion gives the same text twice
const seeded = { model, prompt: spec.prompt, max_tokens: spec.max_tokens, temperature: 0.9, top_p: 0.95,
                 seed: spec.seed };
const a = await client.completions.create(seeded);
const b = await client.completions.create({ ...seeded, stream: false });
out.seeded_same = a.choices[0].text === b.choices[0].text;

// errors as the SDK sees them
await expectError("err_n", () => client.completions.create({ ...greedy, prompt: spec.prompt, n: 0 }));
await expectError("err_model", () => client.chat.completions.create({ ...greedy, model: "no-such-model",
                                                                      messages: spec.messages }));
await expectError("err_key", () => new OpenAI({ baseURL, apiKey: apiKey + "-wrong", maxRetries: 0 })
  .completions.create({ ...greedy, prompt: spec.prompt }));

console.log(JSON.stringify(out));
