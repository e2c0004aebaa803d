// A forced call in a marked syntax (DeepSeek V3's blocks) streamed through
// the official OpenAI Node SDK: the call's first delta (index, id, type,
// function.name) comes well before the stream ends, its arguments come in
// several pieces after it, and the pieces add up to the arguments of the
// same request (same seed) unstreamed; the SDK's stream helper rebuilds
// the same call. Exits non-zero on a failure; prints one JSON line for
// test_chat_templates.py.
//
//   node sdk_tool_stream.mjs BASE_URL API_KEY
import { createRequire } from "node:module";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const require = createRequire(join(here, "..", "reference", "package.json"));
const { default: OpenAI } = require("openai");

const [baseURL, apiKey] = process.argv.slice(2);
const fail = (m) => {
  console.error(m);
  process.exit(1);
};
const tools = [{
  type: "function",
  function: {
    name: "get_weather", description: "Weather in a city",
    parameters: { type: "object", properties: { city: { type: "string", maxLength: 8 } }, required: ["city"],
                  additionalProperties: false },
  },
}];
const client = new OpenAI({ baseURL, apiKey, maxRetries: 0, timeout: 120000 });
const model = (await client.models.list()).data[0].id;
const messages = [{ role: "user", content: "What is the weather in Oslo?" }];
const body = (seed) => ({
  model, messages, tools, tool_choice: { type: "function", function: { name: "get_weather" } }, max_tokens: 500,
  temperature: 0.8, seed,
});

const out = { checked: 0 };
for (let seed = 0; seed < 6 && out.checked < 2; seed++) {
  const whole = await client.chat.completions.create(body(seed));
  if (whole.choices[0].finish_reason === "length") continue;
  const want = whole.choices[0].message.tool_calls?.[0];
  if (!want) fail("unstreamed: no call " + JSON.stringify(whole.choices[0]));

  const chunks = [];
  for await (const ch of await client.chat.completions.create({ ...body(seed), stream: true })) chunks.push(ch);
  let nameAt = -1, pieces = 0, args = "", finish = null;
  chunks.forEach((ch, i) => {
    const d = ch.choices[0]?.delta ?? {};
    finish = ch.choices[0]?.finish_reason ?? finish;
    for (const tc of d.tool_calls ?? []) {
      if (tc.index !== 0) fail("call index " + JSON.stringify(tc));
      if (tc.function?.name) {
        if (nameAt >= 0) fail("the name twice");
        if (!tc.id?.startsWith("call_") || tc.type !== "function" || tc.function.name !== "get_weather")
          fail("first delta " + JSON.stringify(tc));
        nameAt = i;
      } else if (nameAt < 0) {
        fail("arguments before the name");
      }
      if (tc.function?.arguments) {
        pieces++;
        args += tc.function.arguments;
      }
    }
  });
  if (finish !== "stop") fail("finish " + finish);
  if (nameAt < 0 || nameAt > chunks.length - 4) fail(`the name came in chunk ${nameAt} of ${chunks.length}`);
  if (pieces < 3) fail(`arguments in ${pieces} piece(s): ${args}`);
  if (args !== want.function.arguments) fail(`streamed ${args}, unstreamed ${want.function.arguments}`);
  JSON.parse(args);

  // the SDK's helper accumulates the deltas into the same call
  const helper = client.chat.completions.stream(body(seed));
  let helperDeltas = 0;
  helper.on("tool_calls.function.arguments.delta", () => helperDeltas++);
  const fin = await helper.finalChatCompletion();
  const got = fin.choices[0].message.tool_calls?.[0];
  if (!got || got.function.name !== "get_weather" || got.function.arguments !== want.function.arguments)
    fail("stream helper: " + JSON.stringify(fin.choices[0].message));
  if (helperDeltas < pieces) fail(`stream helper: ${helperDeltas} argument deltas, ${pieces} raw`);
  out.checked++;
  out.example = { chunks: chunks.length, name_chunk: nameAt, argument_pieces: pieces, arguments: args };
}
if (!out.checked) fail("no forced call finished in 6 tries");
console.log(JSON.stringify(out));
