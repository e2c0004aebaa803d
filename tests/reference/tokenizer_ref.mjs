// Reference tokenizers for Loom's tests.
//
//   node tokenizer_ref.mjs TOKENIZER_DIR STRINGS_FILE [--decode]
//   node tokenizer_ref.mjs TOKENIZER_DIR STRINGS_FILE --rust
//
// STRINGS_FILE holds one JSON string literal per line.
//
// Default: @huggingface/tokenizers (the pure JS port of HF tokenizers). For
// each string, prints one line: the JSON array of ids that encode(text)
// gives (special tokens parsed, the post-processor's BOS added). With
// --decode it prints instead the JSON string decode(ids, skip_special_tokens)
// gives for those ids.
//
// --rust: `tokenizers`, the Node binding of the Rust library itself. For each
// string, prints {"ids": [...], "text": "..."}: the ids of
// encode(text, addSpecialTokens: false) (special tokens written in the text
// are still matched) and decode(ids, skipSpecialTokens: true), followed by
// transformers' clean_up_tokenization_spaces when tokenizer_config.json
// sets it, as transformers' decode does.
import { readFileSync, existsSync } from "node:fs";
import { join } from "node:path";

const [dir, stringsFile, mode] = process.argv.slice(2);
if (!dir || !stringsFile) {
  console.error("usage: node tokenizer_ref.mjs TOKENIZER_DIR STRINGS_FILE [--decode | --rust]");
  process.exit(2);
}
const configPath = join(dir, "tokenizer_config.json");
const config = existsSync(configPath) ? JSON.parse(readFileSync(configPath, "utf8")) : {};
const texts = readFileSync(stringsFile, "utf8")
  .split("\n")
  .filter((line) => line.trim() !== "")
  .map((line) => JSON.parse(line));

// transformers' PreTrainedTokenizerBase.clean_up_tokenization
function cleanUp(s) {
  return s
    .replaceAll(" .", ".")
    .replaceAll(" ?", "?")
    .replaceAll(" !", "!")
    .replaceAll(" ,", ",")
    .replaceAll(" ' ", "'")
    .replaceAll(" n't", "n't")
    .replaceAll(" 'm", "'m")
    .replaceAll(" 's", "'s")
    .replaceAll(" 've", "'ve")
    .replaceAll(" 're", "'re");
}

const out = [];
if (mode === "--rust") {
  const { Tokenizer } = await import("tokenizers");
  const tok = Tokenizer.fromFile(join(dir, "tokenizer.json"));
  for (const text of texts) {
    const ids = (await tok.encode(text, null, { addSpecialTokens: false })).getIds();
    let decoded = ids.length ? await tok.decode(ids, true) : "";
    if (config.clean_up_tokenization_spaces === true) decoded = cleanUp(decoded);
    out.push(JSON.stringify({ ids, text: decoded }));
  }
} else {
  const { Tokenizer } = await import("@huggingface/tokenizers");
  const tokenizerJson = JSON.parse(readFileSync(join(dir, "tokenizer.json"), "utf8"));
  const tok = new Tokenizer(tokenizerJson, config);
  for (const text of texts) {
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
}
process.stdout.write(out.join("\n") + "\n");
