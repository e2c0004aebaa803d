// Structured output through the official clients' own calls -- the OpenAI
// Node SDK (response_format json_schema, its zod helper, streamed too),
// LangChain JS (withStructuredOutput, method jsonSchema) and the Vercel AI
// SDK (generateObject / streamObject over @ai-sdk/openai-compatible with
// supportsStructuredOutputs) -- from tests/reference/node_modules. Prints
// {"schema": ..., "results": {name: {text, finish, error}}} for
// test_structured.py, which validates every text against the schema.
//
//   node sdk_structured.mjs BASE_URL API_KEY
import { createRequire } from "node:module";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const require = createRequire(join(here, "..", "reference", "package.json"));
const { default: OpenAI } = require("openai");
const { zodResponseFormat } = require("openai/helpers/zod");
const { z } = require("zod");
const { ChatOpenAI } = require("@langchain/openai");
const { generateObject, streamObject, jsonSchema } = require("ai");
const { createOpenAICompatible } = require("@ai-sdk/openai-compatible");

const [baseURL, apiKey] = process.argv.slice(2);
if (!baseURL || !apiKey) {
  console.error("usage: node sdk_structured.mjs BASE_URL API_KEY");
  process.exit(2);
}
// strict-mode style: every property required, no others
const schema = {
  type: "object",
  properties: { name: { type: "string", maxLength: 10 }, pet: { type: "string", enum: ["cat", "dog", "bird"] },
                happy: { type: "boolean" } },
  required: ["name", "pet", "happy"],
  additionalProperties: false,
};
const zPerson = z.object({ name: z.string().max(10), pet: z.enum(["cat", "dog", "bird"]), happy: z.boolean() });
const client = new OpenAI({ baseURL, apiKey, maxRetries: 0, timeout: 120000 });
const model = (await client.models.list()).data[0].id;
const messages = [{ role: "user", content: "Tell me about a child and a pet." }];
const greedy = { model, max_tokens: 120, temperature: 0 };
const results = {};

async function record(name, fn) {
  try {
    results[name] = await fn();
  } catch (e) {
    results[name] = { error: String(e && e.message ? e.message : e) };
  }
}

await record("openai_json_schema", async () => {
  const r = await client.chat.completions.create({
    ...greedy, messages, response_format: { type: "json_schema", json_schema: { name: "person", schema, strict: true } },
  });
  return { text: r.choices[0].message.content, finish: r.choices[0].finish_reason };
});
await record("openai_json_schema_stream", async () => {
  const s = await client.chat.completions.create({
    ...greedy, messages, stream: true,
    response_format: { type: "json_schema", json_schema: { name: "person", schema, strict: true } },
  });
  let text = "", finish = null;
  for await (const c of s) {
    for (const ch of c.choices) {
      text += ch.delta?.content ?? "";
      finish = ch.finish_reason ?? finish;
    }
  }
  return { text, finish };
});
await record("openai_zod_parse", async () => {
  const r = await client.chat.completions.parse({ ...greedy, messages, response_format: zodResponseFormat(zPerson, "person") });
  const m = r.choices[0].message;
  if (r.choices[0].finish_reason === "stop" && !m.parsed) throw new Error("no parsed object");
  return { text: m.content, finish: r.choices[0].finish_reason };
});
await record("openai_completions_guided_json", async () => {
  const r = await client.completions.create({ ...greedy, prompt: "Once upon a time", guided_json: schema });
  return { text: r.choices[0].text, finish: r.choices[0].finish_reason };
});
await record("langchain_with_structured_output", async () => {
  const lc = new ChatOpenAI({ model, apiKey, configuration: { baseURL }, temperature: 0, maxTokens: 120, maxRetries: 0 });
  const o = await lc.withStructuredOutput(zPerson, { name: "person", method: "jsonSchema" }).invoke(messages);
  return { text: JSON.stringify(o), finish: "stop" };
});
const provider = createOpenAICompatible({ name: "loom", baseURL, apiKey, supportsStructuredOutputs: true });
await record("vercel_generate_object", async () => {
  const r = await generateObject({ model: provider.chatModel(model), schema: jsonSchema(schema), messages,
                                   maxOutputTokens: 120, temperature: 0, maxRetries: 0 });
  return { text: JSON.stringify(r.object), finish: r.finishReason };
});
await record("vercel_stream_object", async () => {
  const r = streamObject({ model: provider.chatModel(model), schema: jsonSchema(schema), messages,
                           maxOutputTokens: 120, temperature: 0, maxRetries: 0 });
  for await (const _ of r.partialObjectStream) { /* drain */ }
  return { text: JSON.stringify(await r.object), finish: await r.finishReason };
});

console.log(JSON.stringify({ schema, results }));
