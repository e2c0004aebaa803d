#!/usr/bin/python3
"""Writes a small GPT-2 byte-level BPE tokenizer (tokenizer.json and
tokenizer_config.json) for Loom's tokenizer tests, in the layout of a real
model family. The merges come from a tiny BPE trainer run on a built-in
corpus, so the output is deterministic and needs only the standard library.

    gen_bytelevel_tokenizer.py OUTDIR [--layout llama3|qwen2|gpt2|tekken]
                               [--merges 400] [--merge-format strings|pairs]
    gen_bytelevel_tokenizer.py OUTDIR --all   # every layout, in OUTDIR/<layout>
                                              # (and llama3-pairs)

Layouts (pre-tokenizer, post-processor, BOS):
  llama3  Split(Llama 3 regex) + ByteLevel, ignore_merges, BOS added by a
          TemplateProcessing inside a Sequence post-processor
  qwen2   NFC normalizer, Split(Qwen2 regex) + ByteLevel, no BOS
  gpt2    ByteLevel with use_regex (the GPT-2 pattern), TemplateProcessing BOS
  tekken  Split(Mistral tekken regex) + ByteLevel, TemplateProcessing BOS
"""
import argparse
import collections
import json
import os
import re

PATTERNS = {
    "llama3": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "tekken": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}

CORPUS = """\
Once upon a time, there was a little girl named Lily. She loved to play outside
in the sunshine. One day, she saw a big, red ball in the park. "Can I play with
it?" she asked her mom. Her mom said, "Yes, but be careful!" Lily played with
the ball all day long, and when the sun went down, she went home happy.
The quick brown fox jumps over the lazy dog. It's a test; they're here, we've
seen it, I'm sure, they'll come, he'd know. THE END. Don't stop believing!
In 2024, the company reported revenue of $1,234,567.89 (up 12.5% from 2023).
Call 555-0100 or email info@example.com before 10:30 a.m. on 2024-06-01.
def encode(self, text: str) -> list[int]:
    return [self.vocab[t] for t in text.split()]
for (int i = 0; i < n; i++) { sum += x[i] * y[i]; }
Le café est très bon, naïve señor. Über die Straße gehen wir zusammen.
日本語のテキストも少し含めます。東京は大きな都市です。中文也是一样的。
Привет, как дела? Всё хорошо. Ελληνικά γράμματα. مرحبا بالعالم
😀 🙂 👍 🎉 — “quotes” and ‘single’ … ellipsis • bullet → arrow

class Node:
    def __init__(self, value):
        self.value = value
        self.next = None

    def walk(self):
        node = self
        while node:
            yield node.value
            node = node.next


if __name__ == "__main__":
	print("tabs\tand\tnewlines")
	print("windows line ends")
  
  

  	 

"""


def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + \
        list(range(0xAE, 0xFF + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return bs, {b: chr(c) for b, c in zip(bs, cs)}


def train(num_merges, byte_char):
    # A rough word split for training only; the exact regex does not matter
    # for the merges to be valid.
    words = collections.Counter(re.findall(r" ?\w+| ?[^\w\s]+|\s+", CORPUS))
    seqs = {w: [byte_char[b] for b in w.encode("utf-8")] for w in words}
    merges = []
    for _ in range(num_merges):
        pairs = collections.Counter()
        for w, count in words.items():
            s = seqs[w]
            for a, b in zip(s, s[1:]):
                pairs[(a, b)] += count
        if not pairs:
            break
        best = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))[0]  # ties: largest pair
        merges.append(best)
        for w in words:
            s = seqs[w]
            out, i = [], 0
            while i < len(s):
                if i + 1 < len(s) and (s[i], s[i + 1]) == best:
                    out.append(s[i] + s[i + 1])
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            seqs[w] = out
    return merges


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("outdir")
    ap.add_argument("--layout", default="llama3", choices=["llama3", "qwen2", "gpt2", "tekken"])
    ap.add_argument("--merges", type=int, default=400)
    ap.add_argument("--merge-format", default="strings", choices=["strings", "pairs"])
    ap.add_argument("--all", action="store_true")
    args = ap.parse_args()
    if not args.all:
        write(args.outdir, args.layout, args.merges, args.merge_format)
        return
    for layout in ["llama3", "qwen2", "gpt2", "tekken"]:
        write(os.path.join(args.outdir, layout), layout, args.merges, "strings")
    write(os.path.join(args.outdir, "llama3-pairs"), "llama3", args.merges, "pairs")


def write(outdir, layout, num_merges, merge_format):
    order, byte_char = bytes_to_unicode()
    vocab = {byte_char[b]: i for i, b in enumerate(order)}
    merges = train(num_merges, byte_char)
    for a, b in merges:
        if a + b not in vocab:
            vocab[a + b] = len(vocab)

    n = len(vocab)
    if layout == "qwen2":
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    elif layout == "tekken":
        specials = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"]
    else:
        specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                    "<|end_header_id|>", "<|eot_id|>", "<|reserved_special_token_0|>"]
    added = []
    for i, content in enumerate(specials):
        added.append({"id": n + i, "content": content, "single_word": False, "lstrip": False,
                      "rstrip": False, "normalized": False, "special": True})
    n += len(specials)
    # Tokens that exercise lstrip / rstrip and a non-special added token.
    added.append({"id": n, "content": "<mask>", "single_word": False, "lstrip": True,
                  "rstrip": False, "normalized": False, "special": True})
    added.append({"id": n + 1, "content": "<sep>", "single_word": False, "lstrip": False,
                  "rstrip": True, "normalized": False, "special": True})
    added.append({"id": n + 2, "content": "ANSWER:", "single_word": False, "lstrip": False,
                  "rstrip": False, "normalized": True, "special": False})

    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                  "use_regex": False}
    if layout == "gpt2":
        pre = dict(byte_level, use_regex=True)
    else:
        pre = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": PATTERNS[layout]},
             "behavior": "Isolated", "invert": False},
            byte_level]}

    bos = {"qwen2": None, "tekken": "<s>"}.get(layout, "<|begin_of_text|>")
    eos = {"qwen2": "<|endoftext|>", "tekken": "</s>"}.get(layout, "<|eot_id|>")
    if bos is None:
        post = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                "use_regex": False}
    else:
        bos_id = next(a["id"] for a in added if a["content"] == bos)
        template = {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos, "type_id": 0}},
                     {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": bos, "type_id": 1}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}},
        }
        post = template if layout != "llama3" else {
            "type": "Sequence",
            "processors": [{"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False,
                            "use_regex": True}, template]}

    merge_list = [f"{a} {b}" for a, b in merges] if merge_format == "strings" \
        else [[a, b] for a, b in merges]
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"} if layout == "qwen2" else None,
        "pre_tokenizer": pre,
        "post_processor": post,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None,
            "continuing_subword_prefix": None, "end_of_word_suffix": None,
            "fuse_unk": False, "byte_fallback": False,
            "ignore_merges": layout == "llama3",
            "vocab": vocab, "merges": merge_list,
        },
    }
    config = {
        "bos_token": bos if layout != "llama3" else {"content": bos, "lstrip": False,
                                                          "normalized": False, "rstrip": False,
                                                          "single_word": False},
        "eos_token": eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 8192,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    os.makedirs(outdir, exist_ok=True)
    with open(os.path.join(outdir, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tokenizer, f, ensure_ascii=False, indent=1)
    with open(os.path.join(outdir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False, indent=1)


if __name__ == "__main__":
    main()
