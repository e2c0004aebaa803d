#!/usr/bin/env bash
# Loom against llama.cpp on one generated Llama model, CPU only: decode and
# prefill (pp128, pp512) tokens/s for f32 / int8 / q4 / q4_min next to
# llama.cpp's F32 / Q8_0 / Q4_0 / Q4_1 (the closest formats: 32-column
# groups; Q4_1 has a scale and a min like q4_min), run in interleaved rounds
# (Loom, llama.cpp, Loom, ...) so both see the same machine load, with the
# Loom/llama.cpp ratio of the best and of the median round printed per
# figure. Nothing of llama.cpp lives in this repository: give its source tree.
#
#   LLAMA_CPP_DIR=/path/to/llama.cpp bench/vs_llamacpp.sh [rounds]
#   MODE=serve LLAMA_CPP_DIR=/path/to/llama.cpp bench/vs_llamacpp.sh [rounds]
#
# MODE=serve compares the servers instead, at concurrency 1: `loom serve`
# (coordinator and one worker, --threads THREADS) against llama-server
# (-t THREADS -np 1), each started in turn for each scheme and round and
# loaded by `loom bench --max-concurrency 1` through /v1/completions with
# the same random token-id prompts (PROMPT tokens, OUTPUT tokens generated,
# ignore_eos, greedy, REQUESTS requests); the model directory gets the
# GGUF's placeholder vocabulary as tokenizer.json (hf_to_gguf.py
# --hf-tokenizer), which Loom's coordinator needs. The table gives output
# tokens/s, median TPOT and TTFT, and the Loom/llama-server ratios.
#
# Environment:
#   LLAMA_CPP_DIR  llama.cpp source tree (required); built once into
#                  $WORK/llama-build with -DGGML_NATIVE=ON (CPU only)
#   BUILD          Loom's Release build directory (default build); needs
#                  bin/bench_decode
#   WORK           scratch directory (default $BUILD/vs-llamacpp)
#   THREADS        threads for both (default 2)
#   MODEL_ARGS     tests/reference/gen_model.py shape (default: dim 768,
#                  hidden 2048, 4 layers, 12/4 heads, vocab 32000: ~76M
#                  parameters with the LM head)
#   LOOM_PYTHON    a python3 with numpy (default /usr/bin/python3)
#   SCHEMES        Loom schemes (default "none int8 q4 q4_min")
#   MODE           decode (default: bench_decode against llama-bench) or serve
#   PROMPT, OUTPUT, REQUESTS  MODE=serve: prompt and output tokens, requests
#                  per server and round (defaults 128, 64, 8)
#   PORT           MODE=serve: Loom's HTTP port; llama-server takes PORT+1
#                  (default 18300)
#
# The f32 GGUF is written by bench/hf_to_gguf.py (numpy only; llama.cpp's
# convert_hf_to_gguf.py would need its python requirements and a real
# tokenizer); the quantized GGUFs come from llama.cpp's llama-quantize.
# Each round runs bench_decode --reps 1 per prompt length and llama-bench
# -r 1 (-p 128,512 -n 64); the tables print best and median over rounds.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
rounds=${1:-3}
: "${LLAMA_CPP_DIR:?set LLAMA_CPP_DIR to a llama.cpp source tree}"
build=${BUILD:-$here/build}
work=${WORK:-$build/vs-llamacpp}
threads=${THREADS:-2}
py=${LOOM_PYTHON:-/usr/bin/python3}
schemes=${SCHEMES:-"none int8 q4 q4_min"}
mode=${MODE:-decode}
case $mode in decode | serve) ;; *) echo "vs_llamacpp: MODE is decode or serve, not $mode" >&2; exit 2 ;; esac
model_args=${MODEL_ARGS:-"--dim 768 --hidden-dim 2048 --layers 4 --heads 12 --kv-heads 4 --vocab 32000 --seed 7"}
declare -A gguf_type=([none]=F32 [int8]=Q8_0 [q4]=Q4_0 [q4_min]=Q4_1)

[ -x "$build/bin/bench_decode" ] && [ -x "$build/bin/loom" ] ||
    { echo "vs_llamacpp: build $build/bin/bench_decode and loom first" >&2; exit 1; }
mkdir -p "$work"

# llama.cpp, CPU only, once.
lb=$work/llama-build
if [ ! -x "$lb/bin/llama-bench" ] || [ ! -x "$lb/bin/llama-quantize" ] ||
    { [ "$mode" = serve ] && [ ! -x "$lb/bin/llama-server" ]; }; then
    cmake -S "$LLAMA_CPP_DIR" -B "$lb" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
        -DGGML_CUDA=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=ON >"$work/llama-cmake.log" 2>&1
    cmake --build "$lb" -j"$(nproc)" --target llama-bench llama-quantize llama-server >"$work/llama-build.log" 2>&1
fi

# The model, its GGUF and the quantized GGUFs, once.
m=$work/model
[ -f "$m/config.json" ] || "$py" "$here/tests/reference/gen_model.py" --out "$m" $model_args >/dev/null
[ -f "$work/model-F32.gguf" ] || "$py" "$here/bench/hf_to_gguf.py" "$m" "$work/model-F32.gguf"
for s in $schemes; do
    t=${gguf_type[$s]}
    [ "$t" = F32 ] || [ -f "$work/model-$t.gguf" ] ||
        "$lb/bin/llama-quantize" "$work/model-F32.gguf" "$work/model-$t.gguf" "$t" >"$work/quantize-$t.log" 2>&1
done

grep -o -w 'avx2\|avx512f\|avx512_vnni\|avx512vnni\|avx_vnni\|fma\|f16c' /proc/cpuinfo | sort -u | tr '\n' ' ' \
    >"$work/cpu-flags.txt" || true
echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-) | flags: $(cat "$work/cpu-flags.txt")| $threads threads"

if [ "$mode" = serve ]; then
    prompt=${PROMPT:-128} output=${OUTPUT:-64} requests=${REQUESTS:-8} port=${PORT:-18300}
    [ -f "$m/tokenizer.json" ] || "$py" "$here/bench/hf_to_gguf.py" --hf-tokenizer "$m" >/dev/null
    res=$work/serve.jsonl
    : >"$res"
    pid=
    stop() { [ -z "$pid" ] || { kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null || true; pid=; }; }
    trap stop EXIT
    up() { # URL: wait for /health (60 s)
        for _ in $(seq 300); do curl -sf "$1/health" >/dev/null && return 0; sleep 0.2; done
        echo "vs_llamacpp: $1 did not come up" >&2; return 1
    }
    load() { # WHO SCHEME URL ROUND: one concurrency-1 run, a JSON line
        "$build/bin/loom" bench --base-url "$3" --backend openai --model m --vocab 32000 --seed "$4" \
            --num-prompts "$requests" --max-concurrency 1 --random-input-len "$prompt" \
            --random-output-len "$output" --percentile-metrics ttft,tpot --json "$work/serve.json" \
            >"$work/bench-$1.log" 2>&1 || { echo "vs_llamacpp: loom bench against $1 failed" >&2; exit 1; }
        "$py" -c 'import json,sys; d=json.load(open(sys.argv[1]))
print(json.dumps({"who":sys.argv[2],"scheme":sys.argv[3],"tok_s":d["output_throughput"],
  "tpot":d["median_tpot_ms"],"ttft":d["median_ttft_ms"],"out":d["total_output_tokens"]}))' \
            "$work/serve.json" "$1" "$2" >>"$res"
    }
    for r in $(seq "$rounds"); do
        for s in $schemes; do
            "$build/bin/loom" serve "$m" --served-model-name m --port "$port" --threads "$threads" \
                --quantization "$s" --max-num-seqs 1 >"$work/serve-loom.log" 2>&1 &
            pid=$!
            up "http://127.0.0.1:$port"
            load loom "$s" "http://127.0.0.1:$port" "$r"
            stop
            "$lb/bin/llama-server" -m "$work/model-${gguf_type[$s]}.gguf" --port $((port + 1)) -t "$threads" \
                -c 4096 -np 1 >"$work/serve-llama.log" 2>&1 &
            pid=$!
            up "http://127.0.0.1:$((port + 1))"
            load llama "$s" "http://127.0.0.1:$((port + 1))" "$r"
            stop
        done
        echo "round $r of $rounds done (load average $(cut -d' ' -f1-3 /proc/loadavg))" >&2
    done
    "$py" - "$res" "$schemes" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
def vals(who, s, key):
    return [r[key] for r in rows if r["who"] == who and r["scheme"] == s]
print("concurrency 1, /v1/completions; ratios Loom/llama-server (tokens/s), llama-server/Loom (TPOT, TTFT)")
print("%-7s %10s %10s %7s %7s %10s %10s %7s %10s %10s %7s" % ("scheme", "loom t/s", "llama t/s", "best", "median",
      "loom tpot", "llama tpot", "median", "loom ttft", "llama ttft", "median"))
md = statistics.median
for s in sys.argv[2].split():
    a, b = vals("loom", s, "tok_s"), vals("llama", s, "tok_s")
    if not a or not b:
        print("%-7s (missing)" % s)
        continue
    at, bt = vals("loom", s, "tpot"), vals("llama", s, "tpot")
    af, bf = vals("loom", s, "ttft"), vals("llama", s, "ttft")
    print("%-7s %10.1f %10.1f %6.2fx %6.2fx %8.2fms %8.2fms %6.2fx %8.1fms %8.1fms %6.2fx" % (
        s, max(a), max(b), max(a) / max(b), md(a) / md(b), md(at), md(bt), md(bt) / md(at), md(af), md(bf),
        md(bf) / md(af)))
EOF
    exit 0
fi

# Rounds: every scheme, Loom then llama.cpp, results appended as JSON lines.
res=$work/results.jsonl
: >"$res"
for r in $(seq "$rounds"); do
    for s in $schemes; do
        for p in 128 512; do
            "$build/bin/bench_decode" --model "$m" --threads "$threads" --prompt "$p" --tokens 64 --reps 1 \
                --quantization "$s" --json "$work/loom.json" >/dev/null 2>&1
            "$py" -c 'import json,sys; d=json.load(open(sys.argv[1]))[0]
print(json.dumps({"who":"loom","scheme":sys.argv[2],"p":int(sys.argv[3]),
  "pp":d["prefill_tok_s"],"tg":d["decode_tok_s"]}))' "$work/loom.json" "$s" "$p" >>"$res"
        done
        "$lb/bin/llama-bench" -m "$work/model-${gguf_type[$s]}.gguf" -t "$threads" -p 128,512 -n 64 -r 1 \
            -o json >"$work/llama.json" 2>/dev/null
        "$py" -c 'import json,sys
for d in json.load(open(sys.argv[1])):
    k = "pp" if d["n_prompt"] else "tg"
    print(json.dumps({"who":"llama","scheme":sys.argv[2],"p":d["n_prompt"],k:d["avg_ts"]}))' \
            "$work/llama.json" "$s" >>"$res"
    done
    echo "round $r of $rounds done" >&2
done

# Table: best and median over rounds, Loom/llama.cpp.
"$py" - "$res" "$schemes" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
def vals(who, s, key, p=None):
    return [r[key] for r in rows if r["who"] == who and r["scheme"] == s and key in r
            and (p is None or r["p"] == p)]
print("%-7s %-8s %12s %12s %8s %8s" % ("scheme", "figure", "loom tok/s", "llama tok/s", "best", "median"))
for s in sys.argv[2].split():
    for fig, key, p in (("pp128", "pp", 128), ("pp512", "pp", 512), ("decode", "tg", None)):
        a = vals("loom", s, key, p if key == "pp" else 128)
        b = vals("llama", s, key, p)
        if not a or not b:
            print("%-7s %-8s (missing)" % (s, fig))
            continue
        print("%-7s %-8s %12.1f %12.1f %7.2fx %7.2fx" % (s, fig, max(a), max(b), max(a) / max(b),
              statistics.median(a) / statistics.median(b)))
EOF
