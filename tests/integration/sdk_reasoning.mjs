// A streamed /v1/responses answer of a server with a reasoning parser
// through the OpenAI Node SDK (tests/reference/node_modules): the event
// types, the reasoning_text deltas and done text, the final response's
// reasoning item and usage. Prints one JSON line for test_chat_templates.py.
//
//   node sdk_reasoning.mjs BASE_URL
import { createRequire } from "node:module";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const require = createRequire(join(here, "..", "reference", "package.json"));
const { default: OpenAI } = require("openai");

const client = new OpenAI({ baseURL: process.argv[2], apiKey: "none" });
const model = (await client.models.list()).data[0].id;
const out = { types: [], deltas: "", done: null, item: null, usage: null };
const stream = await client.responses.create({
  model, input: "2+2?", max_output_tokens: 16, temperature: 0, stream: true,
});
for await (const e of stream) {
  out.types.push(e.type);
  if (e.type === "response.reasoning_text.delta") out.deltas += e.delta;
  if (e.type === "response.reasoning_text.done") out.done = e.text;
  if (e.type === "response.completed" || e.type === "response.incomplete") {
    out.item = e.response.output.find((o) => o.type === "reasoning") ?? null;
    out.usage = e.response.usage;
  }
}
console.log(JSON.stringify(out));
