// Drives Loom's /v1/embeddings through two real clients -- the official
// OpenAI Node SDK (embeddings.create, which asks for base64 by default and
// decodes it) and LangChain JS's OpenAIEmbeddings -- and prints the vectors
// each got as one JSON object for test_embed.py to check.
//
//   node embed_sdk.mjs BASE_URL API_KEY '["text", ...]'
import { createRequire } from "node:module";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const require = createRequire(join(here, "..", "reference", "package.json"));
const { default: OpenAI, APIError } = require("openai");
const { OpenAIEmbeddings } = require("@langchain/openai");

const [baseURL, apiKey, textsJson] = process.argv.slice(2);
if (!baseURL || !apiKey || !textsJson) {
  console.error("usage: node embed_sdk.mjs BASE_URL API_KEY TEXTS_JSON");
  process.exit(2);
}
const texts = JSON.parse(textsJson);
const client = new OpenAI({ baseURL, apiKey, maxRetries: 0, timeout: 60000 });
const model = (await client.models.list()).data[0].id;
const out = {};

const r = await client.embeddings.create({ model, input: texts });
out.openai = r.data.map((d) => d.embedding);
out.openai_usage = r.usage.prompt_tokens;
const f = await client.embeddings.create({ model, input: texts, encoding_format: "float" });
out.openai_float = f.data.map((d) => d.embedding);
try {
  await client.embeddings.create({ model, input: texts, encoding_format: "int8" });
  out.openai_bad = { status: 200 };
} catch (e) {
  out.openai_bad = e instanceof APIError ? { status: e.status, message: e.message } : { status: -1, message: String(e) };
}

// LangChain: strips newlines by default and batches documents itself
const lc = new OpenAIEmbeddings({ model, apiKey, configuration: { baseURL }, maxRetries: 0 });
out.langchain_docs = await lc.embedDocuments(texts);
out.langchain_query = await lc.embedQuery(texts[0]);

console.log(JSON.stringify(out));
