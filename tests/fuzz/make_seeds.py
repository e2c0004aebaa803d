#!/usr/bin/env python3
"""Writes the seed corpus of the fuzz targets (corpus/<target>/): small
valid inputs of every kind each target reads, plus a few near misses.
Protobuf seeds are encoded by hand (no protoc here) from the field numbers
of proto/loom/v1/*.proto. Run it again after changing the formats; inputs
that once crashed a target (regression seeds, named crash-*) are kept."""
import json
import os
import shutil
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "corpus")
MODELS = os.environ.get("LOOM_MODELS_DIR", os.path.join(HERE, "..", "..", "..", "shared", "models"))


def write(target, name, data):
    d = os.path.join(CORPUS, target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def reset(target):
    d = os.path.join(CORPUS, target)
    if os.path.isdir(d):
        for f in os.listdir(d):
            if not f.startswith("crash-"):
                os.remove(os.path.join(d, f))


# ---- protobuf wire format -----------------------------------------------------------------

def varint(v):
    v &= (1 << 64) - 1
    out = b""
    while True:
        b = v & 0x7F
        v >>= 7
        if v:
            out += bytes([b | 0x80])
        else:
            return out + bytes([b])


def f_varint(n, v):
    return varint(n << 3) + varint(v)


def f_bytes(n, b):
    if isinstance(b, str):
        b = b.encode()
    return varint((n << 3) | 2) + varint(len(b)) + b


def f_fixed32(n, v):
    return varint((n << 3) | 5) + struct.pack("<I", v)


def f_float(n, v):
    return varint((n << 3) | 5) + struct.pack("<f", v)


def f_double(n, v):
    return varint((n << 3) | 1) + struct.pack("<d", v)


def packed(n, values):
    return f_bytes(n, b"".join(varint(v) for v in values))


def envelope(body_field, body, extra=b""):
    return f_fixed32(1, 0x4D4F4F4C) + f_varint(2, 1) + extra + f_bytes(body_field, body)


def api_seeds():
    t = "fuzz_api_proto"
    reset(t)
    rid = f_varint(3, 7)
    gen = (f_bytes(1, "stories260K") + f_bytes(2, "Once upon a time") + f_varint(4, 16) + f_float(5, 0.7) +
           f_bytes(6, "\n\n") + f_bytes(6, "The end"))
    write(t, "req-generate", envelope(10, gen, rid + f_bytes(4, "sk-key")))
    write(t, "req-generate-ids", envelope(10, packed(3, [1, 403, 407, 261]) + f_varint(10, 1), rid))
    write(t, "req-cancel", envelope(11, f_varint(1, 7), rid))
    write(t, "req-health", envelope(12, b"", rid))
    write(t, "req-models", envelope(13, b"", rid))
    write(t, "req-stats", envelope(14, b"", rid))
    usage = f_varint(1, 4) + f_varint(2, 16)
    write(t, "rep-chunk", envelope(10, packed(1, [261, 300]) + f_bytes(2, " there was") + f_varint(3, 1) +
                                   f_varint(4, 1) + f_bytes(5, usage), rid + f_varint(4, 0)))
    write(t, "rep-error", f_fixed32(1, 0x4D4F4F4C) + f_varint(2, 1) + rid + f_varint(4, 3) +
          f_bytes(5, "max_tokens 100000 exceeds the context length 512") + f_bytes(10, b""))
    write(t, "rep-health", envelope(12, f_varint(1, 1) + f_bytes(2, "ready"), rid))
    write(t, "wrong-version", f_fixed32(1, 0x4D4F4F4C) + f_varint(2, 2) + f_bytes(12, b""))
    write(t, "no-body", f_fixed32(1, 0x4D4F4F4C) + f_varint(2, 1))
    write(t, "empty", b"")


def control_seeds():
    t = "fuzz_control_proto"
    reset(t)
    write(t, "register", envelope(10, f_bytes(1, "worker-0") + f_bytes(2, "vm") + f_varint(3, 1234)))
    write(t, "assign", envelope(11, f_varint(1, 1) + f_bytes(2, "/models/stories260K") + f_varint(3, 0) +
                                f_varint(4, 1)))
    write(t, "loaded", envelope(12, f_varint(1, 1) + f_varint(2, 1 << 20)))
    write(t, "kvconfig", envelope(13, f_varint(1, 1) + f_varint(2, 2048)))
    write(t, "ready", envelope(14, f_varint(1, 1)))
    write(t, "heartbeat", envelope(15, f_varint(1, 1)))
    samp = f_float(1, 0.8) + f_varint(2, 40) + f_float(3, 0.9)
    # a plan check_plan accepts with the first limits of the target: 3 tokens of one sequence
    plan = (f_varint(1, 1) + f_varint(2, 5) + packed(3, [1, 403, 407]) + packed(4, [0, 1, 2]) +
            packed(5, [0, 1, 2]) + packed(6, [0, 0, 0]) + f_varint(7, 1) + f_varint(8, 2) + packed(9, [0, -1]) +
            packed(10, [2]) + f_bytes(11, samp) + packed(12, [0]) + packed(13, [1]))
    write(t, "step", envelope(16, plan))
    # two sequences, the second at a later position
    plan2 = (f_varint(1, 2) + f_varint(2, 9) + packed(3, [5, 6]) + packed(4, [0, 17]) + packed(5, [16, 33]) +
             packed(6, [0, 1]) + f_varint(7, 2) + f_varint(8, 2) + packed(9, [1, -1, 3, 2]) + packed(10, [0, 1]) +
             f_bytes(11, samp) + f_bytes(11, f_float(1, 0.0)))
    write(t, "step-two-seqs", envelope(16, plan2))
    write(t, "step-bad-block", envelope(16, plan.replace(packed(9, [0, -1]), packed(9, [0, 99999]))))
    write(t, "result", envelope(17, f_varint(1, 1) + f_varint(2, 5) + packed(3, [261]) + f_double(6, 0.001)))
    write(t, "shutdown", envelope(18, f_bytes(1, "bye")))
    write(t, "error", envelope(19, f_varint(1, 3) + f_bytes(2, "bad plan")))
    write(t, "abort", envelope(20, f_varint(1, 1) + f_bytes(2, "peer died")))


# ---- text formats ---------------------------------------------------------------------------

def safetensors(header, data=b""):
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data


def st_seeds():
    t = "fuzz_safetensors"
    reset(t)
    write(t, "f32", safetensors({"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}}, bytes(24)))
    write(t, "mixed", safetensors({"__metadata__": {"format": "pt"},
                                   "w": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 8]},
                                   "b": {"dtype": "F16", "shape": [2, 2], "data_offsets": [8, 16]},
                                   "q": {"dtype": "I8", "shape": [1, 8], "data_offsets": [16, 24]},
                                   "s": {"dtype": "I32", "shape": [], "data_offsets": [24, 28]}}, bytes(28)))
    write(t, "overlap", safetensors({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                     "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12)))
    write(t, "short", safetensors({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, bytes(8)))
    write(t, "empty-header", safetensors({}))
    write(t, "huge-length", struct.pack("<Q", 1 << 62) + b"{}")
    write(t, "truncated", b"\x10\x00\x00")


def config_seeds():
    t = "fuzz_config"
    reset(t)
    src = os.path.join(MODELS, "stories260K", "config.json")
    base = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 172,
            "num_hidden_layers": 5, "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 512,
            "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "bos_token_id": 1,
            "eos_token_id": 2, "tie_word_embeddings": True, "torch_dtype": "float32"}
    if os.path.exists(src):
        with open(src, "rb") as f:
            write(t, "stories260K", f.read())
    write(t, "llama", json.dumps(base))
    write(t, "gqa-rope-scaling", json.dumps(dict(base, eos_token_id=[2, 7], head_dim=16, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256})))
    write(t, "quantized", json.dumps(dict(base, quantization_config={"quant_method": "awq", "bits": 4,
                                                                     "group_size": 32})))
    write(t, "zero-heads", json.dumps(dict(base, num_attention_heads=0)))
    write(t, "trailing", json.dumps(base) + " x")


def tok_seeds():
    t = "fuzz_tokenizer"
    reset(t)
    src = os.path.join(MODELS, "stories260K", "tokenizer.json")
    if os.path.exists(src):
        with open(src, "rb") as f:
            write(t, "stories260K", f.read())
    vocab = {c: i for i, c in enumerate(["<unk>", "<s>", "</s>", "a", "b", "ab", "\u2581", "\u2581a", "<0x0A>"])}
    sp = {"version": "1.0", "added_tokens": [
        {"id": 1, "content": "<s>", "special": True, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False},
        {"id": 2, "content": "</s>", "special": True, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False}],
        "normalizer": {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "\u2581"},
                                                            {"type": "Replace", "pattern": {"String": " "},
                                                             "content": "\u2581"}]},
        "pre_tokenizer": None,
        "decoder": {"type": "Sequence", "decoders": [{"type": "Replace", "pattern": {"String": "\u2581"},
                                                      "content": " "}, {"type": "ByteFallback"}, {"type": "Fuse"},
                                                     {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "unk_token": "<unk>", "byte_fallback": True, "fuse_unk": True, "vocab": vocab,
                  "merges": ["a b", "\u2581 a"]}}
    write(t, "sentencepiece-mini", json.dumps(sp))
    bl = {"version": "1.0", "added_tokens": [
        {"id": 6, "content": "<|eot_id|>", "special": True, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False}],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "decoder": {"type": "ByteLevel"},
        "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2, "\u0120": 3, "\u0120a": 4, "c": 5},
                  "merges": [["a", "b"], ["\u0120", "a"]]}}
    write(t, "bytelevel-mini", json.dumps(bl))
    write(t, "not-json", "{\"model\": ")


def chat_seeds():
    t = "fuzz_chat_template"
    reset(t)
    # byte 0: family (low 2 bits), add_generation_prompt (bit 2), a default system turn (bit 3);
    # then messages, each a role byte (mod 5: system user assistant developer tool) and its text, NUL-separated
    write(t, "chatml", b"\x06\x01hello<|im_end|>\x00\x02hi\x00\x01more")
    write(t, "llama2-sys", b"\x00\x00  be brief  \x00\x01<s>[INST] x [/INST]\x00\x02 ok </s>")
    write(t, "llama3", b"\x05\x01\t\n\x00\x02<|eot_id|>")
    write(t, "mistral-bad-order", b"\x03\x02first\x00\x02second")
    write(t, "jinja-llama3", b"\x01{% for message in messages %}<|start_header_id|>{{ message['role'] }}"
                             b"<|end_header_id|>\n\n{{ message['content'] | trim }}<|eot_id|>{% endfor %}")
    write(t, "unknown-role", b"\x02\x04tool text")


def http_seeds():
    t = "fuzz_http_request"
    reset(t)
    # byte 0: chat (bit 0), --chat-special-tokens-in-content (bit 1), no template (bit 2), family (bits 3-4)
    comp = {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0.7, "top_p": 0.9, "top_k": 40,
            "seed": 7, "stop": ["\n\n", "The end"], "stream": True, "stream_options": {"include_usage": True},
            "stop_token_ids": [2], "ignore_eos": False, "priority": 1, "model": "stories260K"}
    write(t, "completions", b"\x00" + json.dumps(comp).encode())
    write(t, "completions-ids", b"\x00" + json.dumps({"prompt": [1, 403, 407], "add_special_tokens": False}).encode())
    chat = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "text", "text": "<s>[INST] hi"},
                                                      {"type": "text", "text": "</s>"}]}],
            "max_completion_tokens": 8, "add_generation_prompt": True, "response_format": {"type": "text"}}
    write(t, "chat-llama2", b"\x01" + json.dumps(chat).encode())
    write(t, "chat-chatml", b"\x11" + json.dumps({"messages": [{"role": "user", "content": "<|im_start|>x"}]}).encode())
    write(t, "chat-special", b"\x03" + json.dumps(chat).encode())
    write(t, "duplicate-key", b"\x00" + b'{"prompt": "a", "prompt": "b"}')
    write(t, "nested-duplicate", b"\x01" + b'{"messages": [{"role": "user", "content": "x", "role": "system"}]}')
    write(t, "trailing", b"\x00" + b'{"prompt": "a"} {}')
    write(t, "escaped-nul", b"\x00" + b'{"prompt": "a\\u0000"}')
    write(t, "unknown-field", b"\x00" + b'{"prompt": "a", "guided_json": {"type": "object"}}')
    # the no-content message (a jump over an initialisation once freed garbage in parse_messages)
    write(t, "crash-no-content", b"\x09" + b'{"messages": [{"role": "user"}]}')


if __name__ == "__main__":
    api_seeds()
    control_seeds()
    st_seeds()
    config_seeds()
    tok_seeds()
    chat_seeds()
    http_seeds()
    for d in sorted(os.listdir(CORPUS)):
        files = os.listdir(os.path.join(CORPUS, d))
        print("%-22s %3d seeds, %6d bytes" % (d, len(files), sum(os.path.getsize(os.path.join(CORPUS, d, f))
                                                                   for f in files)))
