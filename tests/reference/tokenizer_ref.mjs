// Reference tokenizer for Loom's tests: @huggingface/tokenizers (the pure JS
// port of HF tokenizers) encodes each test string the way HF does.
//
//   node tokenizer_ref.mjs TOKENIZER_DIR STRINGS_FILE [--decode]
//
// STRINGS_FILE holds one JSON string literal per line. For each one, prints
// one line: the JSON array of ids that encode(text) gives (special tokens
// parsed, the post-processor's BOS added). With --decode it prints instead
// the JSON string decode(ids, skip_special_tokens) gives for those ids.
import { readFileSync, existsSync } from "node:fs";
import { join } from "node:path";
import { Tokenizer } from "@huggingface/tokenizers";

const [dir, stringsFile, mode] = process.argv.slice(2);
if (!dir || !stringsFile) {
  console.error("usage: node tokenizer_ref.mjs TOKENIZER_DIR STRINGS_FILE [--decode]");
  process.exit(2);
}
const tokenizerJson = JSON.parse(readFileSync(join(dir, "tokenizer.json"), "utf8"));
const configPath = join(dir, "tokenizer_config.json");
const config = existsSync(configPath) ? JSON.parse(readFileSync(configPath, "utf8")) : {};
const tok = new Tokenizer(tokenizerJson, config);

const out = [];
for (const line of readFileSync(stringsFile, "utf8").split("\n")) {
  if (line.trim() === "") continue;
  const text = JSON.parse(line);
  const ids = tok.encode(text).ids;
  if (mode === "--decode") {
    const decoded = ids.length
      ? tok.decode(ids, { skip_special_tokens: true, clean_up_tokenization_spaces: false })
      : "";
    out.push(JSON.stringify(decoded));
  } else {
    out.push(JSON.stringify(ids));
  }
}
process.stdout.write(out.join("\n") + "\n");
