#!/usr/bin/env bash
# The CUDA backend's checks on a GPU machine, in one go (docs/cuda.md):
#   1. standalone build with the CUDA toolkit alone (tests/gpu/CMakeLists.txt,
#      sm_90 by default: CUDA_ARCH=80 for an A100);
#   2. test_cuda_ops: every op against the CPU backend on fresh random inputs;
#   3. test_cuda_e2e: stories260K through worker/model.c on cuda:0 against the
#      CPU, bf16 and exact f32, >= 32 greedy tokens; plus a generated model
#      with head_dim 128 (the tensor-core attention tiles) and a Mixtral-shaped
#      Mixture of Experts (f32) when numpy is there;
#      test_nccl_comm: the NCCL data plane between two GPU processes (skipped
#      with fewer than 2 GPUs);
#   4. bench_gpu: decode tokens/s and MBU against the measured copy bandwidth,
#      prefill TFLOP/s against cuBLAS, on a random Llama-3-8B-shaped model;
#      the quantized matmul alone (GEMV GB/s per scheme, prefill against
#      bf16) and a short decode of the same model with 4-bit weights;
#   5. the regular build with ctest -L gpu, `loom run --device cuda:0` and
#      speculative decoding on cuda:0 (tests/gpu/spec_check.sh: ngram and an
#      int8 self-draft give the ids of plain decoding, greedy and seeded), when
#      its packages (OpenBLAS, ZeroMQ, libsodium, protobuf-c, cJSON,
#      libmicrohttpd, GnuTLS, libcurl) are installed, unpacked under
#      LOOM_DEPS_PREFIX, or given as .deb files in LOOM_DEPS_DEBS (made by
#      tests/gpu/fetch-debs.sh); skipped with a message otherwise.
# Usage: tests/gpu/run.sh OUT_DIR. Everything is logged to OUT_DIR/run.log
# (with per-step logs and bench.json beside it); a short table ends the
# output. Exit 0 when every check passed, 1 when one failed, 77 with no GPU.
# Environment: LOOM_MODELS_DIR (holds stories260K), LOOM_DEPS_PREFIX, LOOM_DEPS_DEBS,
# CUDA_ARCH, BENCH_ARGS (extra bench_gpu options), JOBS.
set -uo pipefail

out=${1:?usage: tests/gpu/run.sh OUT_DIR}
root=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$out"
out=$(cd "$out" && pwd)
log=$out/run.log
: >"$log"
exec > >(tee -a "$log") 2>&1

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    echo "skipped: no GPU"
    exit 77
fi
t_start=$(date +%s)
jobs=${JOBS:-$(nproc)}
arch=${CUDA_ARCH:-90}
py=${LOOM_PYTHON:-python3}
declare -a rows=()
failed=0
models=${LOOM_MODELS_DIR:-}
stories=

# step NAME TIMEOUT_S CMD...: runs CMD with its output in OUT/NAME.log (and here)
step() {
    local name=$1 limit=$2
    shift 2
    local t0 rc verdict
    t0=$(date +%s)
    echo
    echo "=== $name: $*"
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$out/$name.log"
    rc=${PIPESTATUS[0]}
    case $rc in
    0) verdict=PASS ;;
    77) verdict=SKIP ;;
    124 | 137) verdict="FAIL (timeout ${limit}s)"; failed=1 ;;
    *) verdict="FAIL (exit $rc)"; failed=1 ;;
    esac
    rows+=("$(printf '%-26s %-22s %4ss' "$name" "$verdict" $(($(date +%s) - t0)))")
    return "$rc"
}

skip_row() {
    rows+=("$(printf '%-26s %-22s %4s' "$1" "SKIP ($2)" -)")
    echo
    echo "=== $1: skipped: $2"
}

echo "loom GPU checks, $(date -u +%FT%TZ), $(hostname)"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
command -v nvcc >/dev/null && nvcc --version | tail -2
echo "source: $root ($(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo 'no git')), logs: $out"

# --- 1. standalone build ---------------------------------------------------------------
bld=$out/build-gpu
if ! step build 600 bash -c "cmake -S '$root/tests/gpu' -B '$bld' -DCMAKE_CUDA_ARCHITECTURES=$arch \
        -DCMAKE_BUILD_TYPE=Release >/dev/null && cmake --build '$bld' -j $jobs"; then
    echo "the standalone build failed; nothing else can run"
else
    bin=$bld/bin
    # --- 2. ops --------------------------------------------------------------------------
    step ops 300 "$bin/test_cuda_ops"

    # --- 3. end to end -------------------------------------------------------------------
    for d in "$models" "$root/../shared/models" "$root/shared/models"; do
        if [ -n "$d" ] && [ -f "$d/stories260K/config.json" ]; then models=$d; break; fi
    done
    gen=$out/models
    have_numpy=0
    "$py" -c 'import numpy' 2>/dev/null && have_numpy=1
    if [ -f "$models/stories260K/config.json" ]; then
        stories=$models/stories260K
    elif [ $have_numpy = 1 ]; then
        echo "stories260K not found (set LOOM_MODELS_DIR); using a generated model of its shape"
        stories=$gen/stories-shape
        "$py" "$root/tests/reference/gen_model.py" --out "$stories" --dim 64 --hidden-dim 172 --layers 5 \
            --heads 8 --kv-heads 4 --vocab 512 --max-pos 512 --tie --seed 3 >/dev/null
    else
        stories=
    fi
    if [ -n "$stories" ]; then
        step e2e-stories-bf16 120 "$bin/test_cuda_e2e" --model "$stories" --dtype bf16 --tokens 40
        step e2e-stories-f32 120 "$bin/test_cuda_e2e" --model "$stories" --dtype f32 --tokens 40
    else
        skip_row e2e-stories "no stories260K, no numpy"
    fi
    if [ $have_numpy = 1 ]; then
        "$py" "$root/tests/reference/gen_model.py" --out "$gen/hd128" --dim 512 --hidden-dim 1400 --layers 3 \
            --heads 8 --kv-heads 2 --head-dim 128 --vocab 1000 --max-pos 1024 --seed 9 >/dev/null &&
            step e2e-hd128-bf16 120 "$bin/test_cuda_e2e" --model "$gen/hd128" --dtype bf16 --tokens 40
    else
        skip_row e2e-hd128 "no numpy"
    fi
    if [ $have_numpy = 1 ]; then # Mixture of Experts (run_moe's generic ops; decode without graphs), f32 so
        # that no near-tie of the router picks another expert on one side
        "$py" "$root/tests/reference/gen_model.py" --out "$gen/mixtral" --arch mixtral --experts 8 --top-k 2 \
            --dim 256 --hidden-dim 512 --layers 3 --heads 8 --kv-heads 2 --vocab 1000 --max-pos 1024 \
            --expert-spread 0.35 --seed 11 >/dev/null &&
            step e2e-mixtral-f32 120 "$bin/test_cuda_e2e" --model "$gen/mixtral" --dtype f32 --tokens 40
    else
        skip_row e2e-mixtral "no numpy"
    fi

    if [ -x "$bin/test_nccl_comm" ]; then
        step nccl 180 "$bin/test_nccl_comm"
    else
        skip_row nccl "built without NCCL"
    fi

    # --- 4. benchmark ----------------------------------------------------------------------
    # shellcheck disable=SC2086
    step bench 420 "$bin/bench_gpu" --json "$out/bench.json" ${BENCH_ARGS:-}
    step bench-quant 120 "$bin/bench_gpu" --skip-model --quant-gemv int8,fp8,q4,q4:128,q4_min,q4_min:128 \
        --json "$out/quant.json"
    step bench-q4 180 "$bin/bench_gpu" --quantization q4 --batches 1,8 --ctx 512 --tokens 16 --prefill 256 \
        --json "$out/bench-q4.json"
    if [ $have_numpy = 1 ]; then # LoRA: no adapter, one rank-16 all-linear adapter, 8 mixed (docs/lora.md)
        "$py" "$root/tests/reference/gen_model.py" --out "$gen/m100" --dim 768 --hidden-dim 2048 --layers 12 \
            --heads 12 --kv-heads 4 --vocab 32000 --seed 1 >/dev/null &&
            step bench-lora 180 "$bin/bench_lora" --model "$gen/m100" --device cuda:0 --batches 1,8,32 --reps 3
    else
        skip_row bench-lora "no numpy"
    fi
fi

# --- 5. the regular build ---------------------------------------------------------------------
full=$out/build-full
cm_args=(-DLOOM_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$arch" -DCMAKE_BUILD_TYPE=Release)
if [ -n "${LOOM_DEPS_DEBS:-}" ] && [ -z "${LOOM_DEPS_PREFIX:-}" ]; then
    # .deb files from tests/gpu/fetch-debs.sh, unpacked without dpkg's database
    LOOM_DEPS_PREFIX=$out/deps
    mkdir -p "$LOOM_DEPS_PREFIX" "$out/debx"
    debs=$(cd "$LOOM_DEPS_DEBS" && pwd)
    for f in "$debs"/*.deb; do
        if command -v dpkg-deb >/dev/null; then
            dpkg-deb -x "$f" "$LOOM_DEPS_PREFIX"
        else
            (cd "$out/debx" && rm -f data.tar.* && ar x "$f" && tar -xf data.tar.* -C "$LOOM_DEPS_PREFIX")
        fi
    done
    # Debian points libopenblas.so at the pthread build through update-alternatives
    l=$LOOM_DEPS_PREFIX/usr/lib/x86_64-linux-gnu
    ln -sf openblas-pthread/libopenblas.so "$l/libopenblas.so"
    ln -sf openblas-pthread/libopenblas.so.0 "$l/libopenblas.so.0"
fi
if [ -n "${LOOM_DEPS_PREFIX:-}" ]; then
    p=$LOOM_DEPS_PREFIX
    cm_args+=(-DCMAKE_PREFIX_PATH="$p/usr;$p")
    export PATH="$p/usr/bin:$PATH"
    export LD_LIBRARY_PATH="$p/usr/lib/x86_64-linux-gnu:$p/usr/lib:${LD_LIBRARY_PATH:-}"
fi
if [ -n "$models" ]; then cm_args+=(-DLOOM_MODELS_DIR="$models"); fi
if cmake -S "$root" -B "$full" "${cm_args[@]}" >"$out/full-configure.log" 2>&1; then
    if step full-build 600 cmake --build "$full" -j "$jobs"; then
        step full-ctest-gpu 600 ctest --test-dir "$full" -L gpu -E gpu_run_sh --output-on-failure
        if [ -n "$stories" ] && [ -f "$stories/tokenizer.json" ]; then
            step loom-run-cuda 120 "$full/bin/loom" run --model "$stories" --prompt "Once upon a time" \
                --device cuda:0 --dtype bf16 --temperature 0 --max-tokens 48 --ids --ignore-eos
            step spec-cuda 180 "$root/tests/gpu/spec_check.sh" "$full/bin/loom" "$stories" cuda:0
        fi
    fi
else
    skip_row full-build "packages missing: $(grep -m1 -iE 'could not find|not found|error' "$out/full-configure.log" | cut -c1-60)"
fi

# --- summary ------------------------------------------------------------------------------------
echo
echo "=== summary ($(($(date +%s) - t_start)) s; logs in $out)"
printf '%s\n' "${rows[@]}"
# the first failed checks of the op tests, so a failure names its op and shape here
if [ -f "$out/ops.log" ] && grep -q '^FAIL' "$out/ops.log"; then
    echo
    echo "test_cuda_ops failures (first 20; all in $out/ops.log):"
    grep '^FAIL\|^  ' "$out/ops.log" | grep -B3 '^FAIL' | head -40 | grep -v '^--' | head -20
fi
if [ -f "$out/bench.json" ]; then
    "$py" - "$out/bench.json" <<'EOF' || true
import json, sys
b = json.load(open(sys.argv[1]))
print(f"\n{b['device']}: copy {b['copy_gbs']:.0f} GB/s, {b['params']/1e9:.2f}B params {b['dtype']}")
print(f"prefill {b['prefill_tokens']} tokens: {b['prefill_tflops']:.0f} TFLOP/s, cuBLAS {b['gemm_tflops']:.0f} "
      f"-> ratio {b['prefill_ratio']:.2f} (target >= 0.60)")
print(f"{'decode':<24}{'batch':>6}{'ms/step':>9}{'tok/s':>9}{'MBU':>7}")
for d in b["decode"]:
    t = "  (target >= 0.75)" if d["batch"] == 1 and d["variant"].startswith("graph, fused") else ""
    print(f"{d['variant']:<24}{d['batch']:>6}{d['step_s']*1e3:>9.2f}{d['tok_s']:>9.1f}{d['mbu']:>7.3f}{t}")
EOF
fi
if [ -f "$out/quant.json" ] || [ -f "$out/bench-q4.json" ]; then
    "$py" - "$out/quant.json" "$out/bench-q4.json" <<'EOF' || true
import json, os, sys
if os.path.exists(sys.argv[1]):
    q = json.load(open(sys.argv[1]))
    print(f"\nquantized matmul alone, copy {q['copy_gbs']:.0f} GB/s; prefill {q['prefill_tokens']} tokens vs bf16 (>1: faster)")
    print(f"{'scheme':<12}{'shape':<9}{'n=1 GB/s':>9}{'MBU':>7}{'n=8 GB/s':>9}{'MBU':>7}{'prefill':>9}")
    for r in q["quant_gemv"]:
        print(f"{r['scheme']:<12}{r['shape']:<9}{r['gemv1_gbs']:>9.0f}{r['mbu1']:>7.3f}{r['gemv8_gbs']:>9.0f}"
              f"{r['mbu8']:>7.3f}{r['prefill_vs_bf16']:>9.2f}")
if os.path.exists(sys.argv[2]):
    b = json.load(open(sys.argv[2]))
    print(f"\n{b['dtype']} weights: prefill {b['prefill_tokens']} tokens {b['prefill_tflops']:.0f} TFLOP/s")
    for d in b["decode"]:
        print(f"{d['variant']:<24}{d['batch']:>6}{d['step_s']*1e3:>9.2f}{d['tok_s']:>9.1f}{d['mbu']:>7.3f}")
EOF
fi
exit $failed
