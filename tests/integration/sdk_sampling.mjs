// Drives the sampling controls and logprobs of Loom's HTTP gateway through
// three real clients -- the official OpenAI Node SDK, LangChain JS
// (@langchain/openai) and the Vercel AI SDK (ai + @ai-sdk/openai-compatible),
// all from tests/reference/node_modules -- and prints what each got as one
// JSON object for test_sampling.py to check.
//
//   node sdk_sampling.mjs BASE_URL API_KEY
import { createRequire } from "node:module";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const require = createRequire(join(here, "..", "reference", "package.json"));
const { default: OpenAI, APIError } = require("openai");
const { ChatOpenAI } = require("@langchain/openai");
const { generateText } = require("ai");
const { createOpenAICompatible } = require("@ai-sdk/openai-compatible");

const [baseURL, apiKey] = process.argv.slice(2);
if (!baseURL || !apiKey) {
  console.error("usage: node sdk_sampling.mjs BASE_URL API_KEY");
  process.exit(2);
}
const client = new OpenAI({ baseURL, apiKey, maxRetries: 0, timeout: 60000 });
const model = (await client.models.list()).data[0].id;
const prompt = "Once upon a time";
const messages = [{ role: "user", content: "Tell me a story." }];
const greedy = { model, max_tokens: 24, temperature: 0 };
const out = {};

async function status(fn) {
  try {
    await fn();
    return { status: 200 };
  } catch (e) {
    return e instanceof APIError ? { status: e.status, message: e.message } : { status: -1, message: String(e) };
  }
}

// openai: completions with logprobs, penalties, logit_bias; chat with logprobs; bad input
const plain = await client.completions.create({ ...greedy, prompt });
out.openai_plain = plain.choices[0].text;
const lp = await client.completions.create({ ...greedy, prompt, logprobs: 3 });
out.openai_logprobs = { text: lp.choices[0].text, logprobs: lp.choices[0].logprobs };
// penalties need repeats to bite: 60 tokens
const long = { ...greedy, max_tokens: 60 };
out.openai_long = (await client.completions.create({ ...long, prompt })).choices[0].text;
const pen = await client.completions.create({ ...long, prompt, presence_penalty: 2, frequency_penalty: 2 });
out.openai_penalized = pen.choices[0].text;
const chat = await client.chat.completions.create({ ...greedy, messages, logprobs: true, top_logprobs: 2 });
out.openai_chat = { text: chat.choices[0].message.content, logprobs: chat.choices[0].logprobs };
out.openai_top21 = await status(() => client.chat.completions.create({ ...greedy, messages, logprobs: true,
                                                                         top_logprobs: 21 }));
out.openai_bad_bias = await status(() => client.completions.create({ ...greedy, prompt, logit_bias: { x: 1 } }));
// n = 2 and a two-prompt batch
const n2 = await client.completions.create({ model, prompt, max_tokens: 24, temperature: 1.5, seed: 4, n: 2 });
out.openai_n2 = n2.choices.sort((x, y) => x.index - y.index).map((c) => c.text);
const batch = await client.completions.create({ ...greedy, prompt: [prompt, "The little dog"] });
out.openai_batch = batch.choices.sort((x, y) => x.index - y.index).map((c) => c.text);
out.openai_batch_b = (await client.completions.create({ ...greedy, prompt: "The little dog" })).choices[0].text;
out.openai_n0 = await status(() => client.completions.create({ ...greedy, prompt, n: 0 }));
out.openai_after = (await client.completions.create({ ...greedy, prompt })).choices[0].text;

// LangChain: penalties and logprobs on ChatOpenAI
const lc = new ChatOpenAI({ model, apiKey, configuration: { baseURL }, temperature: 0, maxTokens: 60, maxRetries: 0 });
const lcPlain = await lc.invoke(messages);
const lcPen = await new ChatOpenAI({ model, apiKey, configuration: { baseURL }, temperature: 0, maxTokens: 60,
                                     maxRetries: 0, presencePenalty: 2, frequencyPenalty: 2,
                                     logprobs: true, topLogprobs: 2 }).invoke(messages);
out.langchain = { plain: lcPlain.content, penalized: lcPen.content,
                  logprobs: lcPen.response_metadata?.logprobs ?? null };

// Vercel AI SDK: generateText with penalties and a seed
const provider = createOpenAICompatible({ name: "loom", baseURL, apiKey });
const v1 = await generateText({ model: provider.chatModel(model), prompt, maxOutputTokens: 60, temperature: 0,
                                maxRetries: 0 });
const v2 = await generateText({ model: provider.chatModel(model), prompt, maxOutputTokens: 60, temperature: 0,
                                presencePenalty: 2, frequencyPenalty: 2, maxRetries: 0 });
out.vercel = { plain: v1.text, penalized: v2.text };

console.log(JSON.stringify(out));
