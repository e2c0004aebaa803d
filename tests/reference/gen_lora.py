#!/usr/bin/env python3
"""PEFT LoRA adapters for a model directory, and the merged model they stand for.

  gen_lora.py adapter MODEL_DIR OUT_DIR [--r 8] [--alpha 16] [--targets q_proj,v_proj | --targets-regex RE
                                        | --targets all-linear] [--rslora] [--rank-pattern JSON]
                                        [--alpha-pattern JSON] [--zero-b] [--seed N] [--std S] [--extra JSON]
  gen_lora.py merge MODEL_DIR ADAPTER_DIR OUT_DIR

`adapter` writes adapter_config.json and adapter_model.safetensors as PEFT's
save_pretrained does (tensors base_model.model.<module>.lora_A.weight (r, in)
and .lora_B.weight (out, r), float32). `merge` folds an adapter into a copy
of the model offline, W' = W + scale * B @ A in float64 with PEFT's scaling
(lora_alpha / r, or / sqrt(r) with use_rslora; rank_pattern / alpha_pattern
match the end of a module's name as a regular expression): the independent
reference a served adapter must agree with. Fused Phi-3 modules (qkv_proj,
gate_up_proj) are adapted and merged as one matrix, as PEFT does.
"""

import argparse
import json
import math
import os
import re
import shutil
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import safetensors_io as stio  # noqa: E402

PREFIX = "base_model.model."


def modules_of(model_dir):
    """{module name: (out, in)} of the model's linear layers, from its checkpoint."""
    tensors = stio.read_model_dir(model_dir)[0]
    mods = {}
    for name, w in tensors.items():
        if not name.endswith(".weight") or w.ndim != 2 or ".layers." not in name:
            continue
        mod = name[: -len(".weight")]
        if mod.split(".")[-1].endswith("proj") and "experts" not in mod:
            mods[mod] = w.shape
    return mods


def targeted(mod, targets, regex):
    if regex is not None:
        return re.fullmatch(regex, mod) is not None
    if targets == "all-linear":
        return True
    return any(mod == t or mod.endswith("." + t) for t in targets)


def pattern_value(patterns, mod, default):
    for key, val in patterns.items():
        if re.match(rf"(.*\.)?({key})$", mod):
            return val
    return default


def cmd_adapter(a):
    rng = np.random.default_rng(a.seed)
    mods = modules_of(a.model_dir)
    targets = a.targets if a.targets == "all-linear" else a.targets.split(",")
    rank_pattern = json.loads(a.rank_pattern) if a.rank_pattern else {}
    alpha_pattern = json.loads(a.alpha_pattern) if a.alpha_pattern else {}
    tensors = {}
    for mod in sorted(mods):
        if not targeted(mod, targets, a.targets_regex):
            continue
        out, inn = mods[mod]
        r = pattern_value(rank_pattern, mod, a.r)
        tensors[PREFIX + mod + ".lora_A.weight"] = (rng.standard_normal((r, inn)) * a.std).astype(np.float32)
        b = np.zeros((out, r), np.float32) if a.zero_b else (rng.standard_normal((out, r)) * a.std).astype(np.float32)
        tensors[PREFIX + mod + ".lora_B.weight"] = b
    if not tensors:
        sys.exit("gen_lora: no module of %s matches the targets" % a.model_dir)
    cfg = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": os.path.basename(os.path.normpath(a.model_dir)),
        "r": a.r,
        "lora_alpha": a.alpha,
        "lora_dropout": 0.0,
        "use_rslora": a.rslora,
        "use_dora": False,
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "layer_replication": None,
        "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern,
        "target_modules": a.targets_regex if a.targets_regex is not None
        else (targets if targets == "all-linear" else sorted(set(t for t in targets))),
        "inference_mode": True,
    }
    if a.extra:
        cfg.update(json.loads(a.extra))
    os.makedirs(a.out_dir, exist_ok=True)
    with open(os.path.join(a.out_dir, "adapter_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    stio.write(os.path.join(a.out_dir, "adapter_model.safetensors"), sorted(tensors.items()), dtype="F32")


def cmd_merge(a):
    with open(os.path.join(a.adapter_dir, "adapter_config.json")) as f:
        cfg = json.load(f)
    lora = stio.read(os.path.join(a.adapter_dir, "adapter_model.safetensors"))[0]
    src = os.path.join(a.model_dir, "model.safetensors")
    tensors, dtypes, metadata = stio.read(src)
    for name in lora:
        if not name.endswith(".lora_A.weight"):
            continue
        mod = name[len(PREFIX): -len(".lora_A.weight")]
        A = lora[name].astype(np.float64)
        B = lora[PREFIX + mod + ".lora_B.weight"].astype(np.float64)
        r = pattern_value(cfg.get("rank_pattern") or {}, mod, cfg.get("r", 8))
        alpha = pattern_value(cfg.get("alpha_pattern") or {}, mod, cfg.get("lora_alpha", 8))
        assert A.shape[0] == r, (mod, A.shape, r)
        scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        w = mod + ".weight"
        tensors[w] = (tensors[w].astype(np.float64) + scale * (B @ A)).astype(np.float32)
    if os.path.exists(a.out_dir):
        shutil.rmtree(a.out_dir)
    # plain copies: the source may be read-only (shared/), the copy must not be
    shutil.copytree(a.model_dir, a.out_dir, copy_function=shutil.copyfile)
    os.chmod(a.out_dir, 0o755)
    stio.write(os.path.join(a.out_dir, "model.safetensors"),
               [(n, tensors[n], dtypes[n]) for n in sorted(tensors)], metadata=metadata or None)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("adapter")
    g.add_argument("model_dir")
    g.add_argument("out_dir")
    g.add_argument("--r", type=int, default=8)
    g.add_argument("--alpha", type=float, default=16)
    g.add_argument("--targets", default="all-linear")
    g.add_argument("--targets-regex", default=None)
    g.add_argument("--rslora", action="store_true")
    g.add_argument("--rank-pattern", default=None)
    g.add_argument("--alpha-pattern", default=None)
    g.add_argument("--zero-b", action="store_true")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--std", type=float, default=0.05)
    g.add_argument("--extra", default=None, help="JSON merged into adapter_config.json")
    m = sub.add_parser("merge")
    m.add_argument("model_dir")
    m.add_argument("adapter_dir")
    m.add_argument("out_dir")
    a = p.parse_args()
    cmd_adapter(a) if a.cmd == "adapter" else cmd_merge(a)


if __name__ == "__main__":
    main()
