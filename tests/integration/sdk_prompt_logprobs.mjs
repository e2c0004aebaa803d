// Drives echo with logprobs and vLLM's prompt_logprobs on Loom's
// /v1/completions through the official OpenAI Node SDK (from
// tests/reference/node_modules), and prints what it got as one JSON object
// for test_prompt_logprobs.py to check against the float64 reference.
//
//   node sdk_prompt_logprobs.mjs BASE_URL API_KEY PROMPT
import { createRequire } from "node:module";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const require = createRequire(join(here, "..", "reference", "package.json"));
const { default: OpenAI, APIError } = require("openai");

const [baseURL, apiKey, prompt] = process.argv.slice(2);
if (!baseURL || !apiKey || !prompt) {
  console.error("usage: node sdk_prompt_logprobs.mjs BASE_URL API_KEY PROMPT");
  process.exit(2);
}
const client = new OpenAI({ baseURL, apiKey, maxRetries: 0, timeout: 60000 });
const model = (await client.models.list()).data[0].id;
const greedy = { model, max_tokens: 4, temperature: 0, ignore_eos: true };
const out = {};

// OpenAI's legacy echo: the prompt's tokens open the choice's logprobs
const echo = await client.completions.create({ ...greedy, prompt, echo: true, logprobs: 2 });
out.echo = { text: echo.choices[0].text, logprobs: echo.choices[0].logprobs };
// vLLM's extension, passed through the SDK's body as vLLM's docs show
const plp = await client.completions.create({ ...greedy, prompt, prompt_logprobs: 2 });
out.prompt_logprobs = plp.choices[0].prompt_logprobs ?? null;
try {
  await client.completions.create({ ...greedy, prompt, prompt_logprobs: 21 });
  out.bad = { status: 200 };
} catch (e) {
  out.bad = e instanceof APIError ? { status: e.status, message: e.message } : { status: -1, message: String(e) };
}
console.log(JSON.stringify(out));
