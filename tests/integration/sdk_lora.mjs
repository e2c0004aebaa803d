// LoRA adapters through the official OpenAI Node SDK (openai@6, installed by
// `npm ci --prefix tests/reference`): /v1/models lists the adapters (vLLM's
// parent and root), a completion names one by "model", an unknown model is
// the SDK's NotFoundError. Prints one JSON object for test_lora_serving.py.
//
//   node sdk_lora.mjs BASE_URL SPEC_JSON
//
// SPEC_JSON: {"prompt": TEXT, "max_tokens": N, "adapters": [NAME, ...]}
import { createRequire } from "node:module";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const require = createRequire(join(here, "..", "reference", "package.json"));
const { default: OpenAI, APIError } = require("openai");

const [baseURL, specJson] = process.argv.slice(2);
if (!baseURL || !specJson) {
  console.error("usage: node sdk_lora.mjs BASE_URL SPEC_JSON");
  process.exit(2);
}
const spec = JSON.parse(specJson);
const client = new OpenAI({ baseURL, apiKey: "none", maxRetries: 0, timeout: 60000 });
const out = { models: [], text: {} };

for await (const m of await client.models.list())
  out.models.push({ id: m.id, parent: m.parent ?? null, root: m.root ?? null });

for (const name of spec.adapters) {
  const r = await client.completions.create({
    model: name, prompt: spec.prompt, max_tokens: spec.max_tokens, temperature: 0, ignore_eos: true,
  });
  out.text[name] = { text: r.choices[0].text, model: r.model };
}

try {
  await client.completions.create({ model: "no-such-adapter", prompt: spec.prompt, max_tokens: 2 });
  out.unknown = { status: null };
} catch (e) {
  out.unknown = e instanceof APIError
    ? { status: e.status, code: e.code ?? null, message: e.message, not_found: e instanceof OpenAI.NotFoundError }
    : { status: -1, message: String(e) };
}
console.log(JSON.stringify(out));
