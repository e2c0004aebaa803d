#!/usr/bin/env bash
# The CUDA backend's checks on a lent GPU machine, in one go, ordered so that
# every device minute counts (docs/cuda.md, "Running the GPU checks"):
#   0. while the standalone build compiles (tests/gpu/CMakeLists.txt: the CUDA
#      toolkit alone, sm_90 by default, CUDA_ARCH=80 for an A100), a tiny
#      model of every family is generated on the CPU (needs numpy);
#   A. correctness, budget LOOM_RUN_CORRECT_S (180 s) after the build:
#      test_cuda_ops --flash first (the FA2-style prefill kernel, flash.cu),
#      then test_cuda_ops (every op against the CPU backend, fresh random inputs);
#      test_cuda_e2e for stories260K (bf16, exact f32) and every family's tiny
#      model (greedy ids equal to the CPU's in f32, within bf16 tolerance in
#      bf16; int8 KV on two of them); the Mixture-of-Experts models (the LoRA
#      kernels are one of test_cuda_ops's checks, test_lora); the NCCL data
#      plane (one GPU: a step bracket with no peers; two: TP all-reduce,
#      pipeline, abort, an all-reduce captured in a graph and the step
#      watchdog against a silent peer);
#   B. measurements, budget LOOM_RUN_MEASURE_S (240 s): bench_gpu's decode MBU
#      at batch 1/8/32 and prefill TFLOP/s against cuBLAS on a Llama-3-8B
#      shape, the quantized GEMVs alone, a 4-bit decode; then the tuning table
#      (OUT_DIR/loom-cuda-tuning.tsv): each candidate of a kernel knob timed,
#      the fastest kept, the prefill attention kernel (attn_prefill_variant)
#      among them (docs/cuda.md, "Tuning");
#   C. only when LOOM_RUN_FULL=1 (it needs our Debian packages and ~10
#      minutes): the regular build with ctest -L gpu, `loom run --device
#      cuda:0` and speculative decoding on cuda:0 (tests/gpu/spec_check.sh).
# A step that does not fit what is left of its phase's budget is skipped
# ("SKIP (budget)"), so a slow early step cannot eat the measurements.
# Usage: tests/gpu/run.sh [OUT_DIR] (default $OUT). Writes OUT_DIR/run.log
# (with per-step logs beside it), OUT_DIR/run.json (every step with its
# phase, verdict and seconds, and the benchmark figures) and OUT_DIR/run.tsv
# (the same steps as a table), and OUT_DIR/loom-cuda-tuning.tsv. Exit 0 when every check passed, 1 when one
# failed. Without a GPU every step is "SKIP (no GPU)", the JSON and the table
# are still written, and the exit status is LOOM_RUN_NO_GPU_RC (0; ctest sets
# 77, its skip code).
# Environment: LOOM_MODELS_DIR (holds stories260K), LOOM_DEPS_PREFIX, LOOM_DEPS_DEBS,
# CUDA_ARCH, BENCH_ARGS (extra bench_gpu options), JOBS, LOOM_RUN_FULL.
set -uo pipefail

out=${1:-${OUT:-}}
if [ -z "$out" ]; then
    echo "usage: tests/gpu/run.sh OUT_DIR (or set OUT)" >&2
    exit 2
fi
root=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$out"
out=$(cd "$out" && pwd)
log=$out/run.log
: >"$log"
exec > >(tee -a "$log") 2>&1

t_start=$(date +%s)
jobs=${JOBS:-$(nproc)}
arch=${CUDA_ARCH:-90}
py=${LOOM_PYTHON:-python3}
correct_budget=${LOOM_RUN_CORRECT_S:-180}
measure_budget=${LOOM_RUN_MEASURE_S:-240}
declare -a rows=() jrows=()
failed=0
ops_ok=0 flash_ok=0 # test_cuda_ops (--flash) passed on this device: the tune step may turn the never-run paths on
models=${LOOM_MODELS_DIR:-}
stories=
phase=setup
phase_end=0 # epoch second the current phase's budget runs out (0: none)
gpu=1
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    gpu=0
fi

record() { # record NAME VERDICT SECONDS LIMIT
    rows+=("$(printf '%-9s %-26s %-22s %5s %5s' "$phase" "$1" "$2" "$3" "$4")")
    jrows+=("$(printf '{"phase": "%s", "name": "%s", "verdict": "%s", "seconds": %s, "limit_s": %s}' \
        "$phase" "$1" "$2" "${3/-/null}" "${4/-/null}")")
}

# step NAME LIMIT_S CMD...: runs CMD with its output in OUT/NAME.log (and here),
# within LIMIT_S and what is left of the phase's budget
step() {
    local name=$1 limit=$2
    shift 2
    local t0 rc verdict left
    if [ $gpu = 0 ]; then
        record "$name" "SKIP (no GPU)" - "$limit"
        echo "=== $name: skipped: no GPU"
        return 77
    fi
    if [ "$phase_end" -gt 0 ]; then
        left=$((phase_end - $(date +%s)))
        if [ "$left" -lt 5 ]; then
            record "$name" "SKIP (budget)" - "$limit"
            echo "=== $name: skipped: the $phase budget is spent"
            return 77
        fi
        [ "$left" -lt "$limit" ] && limit=$left
    fi
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
    record "$name" "$verdict" $(($(date +%s) - t0)) "$limit"
    return "$rc"
}

skip_row() {
    record "$1" "SKIP ($2)" - -
    echo
    echo "=== $1: skipped: $2"
}

begin_phase() { # begin_phase NAME BUDGET_S
    phase=$1
    phase_end=$(($(date +%s) + $2))
    echo
    echo "##### phase $1 (budget $2 s)"
}

echo "loom GPU checks, $(date -u +%FT%TZ), $(hostname)"
device="none"
if [ $gpu = 1 ]; then
    device=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
else
    echo "skipped: no GPU (every step below is listed as skipped)"
fi
command -v nvcc >/dev/null && nvcc --version | tail -2
commit=$(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo 'no git')
echo "source: $root ($commit), logs: $out"

# --- 0. the families' tiny models, generated while the build compiles -------------------------
for d in "$models" "$root/../shared/models" "$root/shared/models"; do
    if [ -n "$d" ] && [ -f "$d/stories260K/config.json" ]; then models=$d; break; fi
done
gen=$out/models
have_numpy=0
"$py" -c 'import numpy' 2>/dev/null && have_numpy=1
# name | gen_model.py arguments (ds: gen_deepseek.py's; =NAME: NAME's model) | test_cuda_e2e arguments
families=(
    "llama-hd128|--dim 512 --hidden-dim 1400 --layers 3 --heads 8 --kv-heads 2 --head-dim 128 --vocab 1000 --seed 9|--dtype bf16"
    "mistral-window|--arch mistral --sliding-window 24 --dim 128 --hidden-dim 344 --layers 3 --heads 4 --kv-heads 2 --vocab 512 --seed 21|--dtype f32"
    "qwen2-bias|--arch qwen2 --dim 128 --hidden-dim 344 --layers 3 --heads 4 --kv-heads 2 --vocab 512 --seed 22|--dtype f32"
    "qwen3-qknorm|--arch qwen3 --dim 128 --hidden-dim 344 --layers 3 --heads 4 --kv-heads 2 --head-dim 64 --vocab 512 --seed 23|--dtype f32"
    "phi3|--arch phi3 --dim 128 --hidden-dim 344 --layers 3 --heads 4 --kv-heads 2 --vocab 512 --seed 24|--dtype f32"
    "gemma2-softcap|--arch gemma2 --sliding-window 20 --dim 128 --hidden-dim 344 --layers 4 --heads 4 --kv-heads 2 --head-dim 32 --vocab 512 --seed 25|--dtype f32"
    "gemma2-softcap-bf16|=gemma2-softcap|--dtype bf16"
    "gemma3-geglu|--arch gemma3 --sliding-window 20 --sliding-pattern 3 --dim 128 --hidden-dim 344 --layers 4 --heads 4 --kv-heads 2 --head-dim 32 --vocab 512 --seed 26|--dtype f32"
    "mixtral|--arch mixtral --experts 8 --top-k 2 --dim 256 --hidden-dim 512 --layers 3 --heads 8 --kv-heads 2 --vocab 1000 --expert-spread 0.35 --seed 11|--dtype f32"
    "qwen3-moe|--arch qwen3_moe --experts 8 --top-k 2 --dim 128 --hidden-dim 256 --layers 3 --heads 4 --kv-heads 2 --head-dim 32 --vocab 512 --expert-spread 0.35 --seed 27|--dtype f32"
    "qwen2-moe|--arch qwen2_moe --experts 8 --top-k 2 --dim 128 --hidden-dim 256 --layers 3 --heads 4 --kv-heads 2 --vocab 512 --expert-spread 0.35 --seed 28|--dtype f32"
    "gpt-oss-sinks|--arch gpt_oss --experts 4 --top-k 2 --sliding-window 12 --dim 128 --hidden-dim 256 --layers 4 --heads 4 --kv-heads 2 --head-dim 32 --vocab 512 --seed 29|--dtype f32"
    "deepseek-v3|ds:--shape v3 --seed 31|--dtype f32"
    "deepseek-v3-latent576|ds:--shape v3 --seed 32 --set kv_lora_rank=512 --set qk_rope_head_dim=64|--dtype f32"
    "deepseek-v3-latent576-bf16|=deepseek-v3-latent576|--dtype bf16"
    "deepseek-v2lite|ds:--shape v2lite --seed 33|--dtype f32"
    "deepseek-kv-int8|=deepseek-v3-latent576|--dtype f32 --kv int8"
    # DeepSeek decompressed (--disable-mla: K heads of 48, V heads of 32; V2-Lite's 24 and 16, one token at a
    # time) and the latent cache's prefill attended decompressed in context chunks of 16 merged by log-sum-exp
    "deepseek-mla-disable|=deepseek-v3|--dtype f32 --disable-mla"
    "deepseek-mla-disable-kv-bf16|=deepseek-v3|--dtype f32 --disable-mla --kv bf16"
    "deepseek-mla-disable-kv-int8|=deepseek-v3|--dtype f32 --disable-mla --kv int8"
    "deepseek-v2lite-mla-disable|=deepseek-v2lite|--dtype f32 --disable-mla"
    "deepseek-mla-prefill|=deepseek-v3-latent576|--dtype f32 --mla-prefill 2 --mla-chunk 16"
    "deepseek-mla-prefill-kv-int8|=deepseek-v3-latent576|--dtype f32 --kv int8 --mla-prefill 2 --mla-chunk 16"
    "llama-kv-int8|=llama-hd128|--dtype f32 --kv int8"
    "gemma2-kv-int8|=gemma2-softcap|--dtype f32 --kv int8"
)
gen_pid=
if [ $gpu = 1 ] && [ $have_numpy = 1 ]; then
    (
        for f in "${families[@]}"; do
            IFS='|' read -r name gargs _ <<<"$f"
            case $gargs in =*) continue ;; esac
            gen_py=gen_model.py
            case $gargs in ds:*) gen_py=gen_deepseek.py; gargs=${gargs#ds:} ;; *) gargs="--max-pos 1024 $gargs" ;; esac
            # shellcheck disable=SC2086
            "$py" "$root/tests/reference/$gen_py" --out "$gen/$name" $gargs \
                >"$out/gen-$name.log" 2>&1 || echo "$gen_py failed for $name (see gen-$name.log)"
        done
        if [ ! -f "$models/stories260K/config.json" ]; then
            "$py" "$root/tests/reference/gen_model.py" --out "$gen/stories-shape" --dim 64 --hidden-dim 172 \
                --layers 5 --heads 8 --kv-heads 4 --vocab 512 --max-pos 512 --tie --seed 3 >/dev/null 2>&1
        fi
    ) &
    gen_pid=$!
fi

# --- 1. standalone build ---------------------------------------------------------------
bld=$out/build-gpu
built=0
step build 600 bash -c "cmake -S '$root/tests/gpu' -B '$bld' -DCMAKE_CUDA_ARCHITECTURES=$arch \
        -DCMAKE_BUILD_TYPE=Release >/dev/null && cmake --build '$bld' -j $jobs" && built=1
[ -n "$gen_pid" ] && wait "$gen_pid"
bin=$bld/bin
if [ $gpu = 1 ] && [ $built = 0 ]; then
    echo "the standalone build failed; nothing else can run"
fi
run_steps=$((gpu == 0 || built == 1))

if [ $run_steps = 1 ]; then
    # --- A. correctness --------------------------------------------------------------------
    begin_phase correct "$correct_budget"
    # the FA2-style prefill kernel first (flash.cu: it has the least device time behind it)
    step flash 40 "$bin/test_cuda_ops" --flash && flash_ok=1
    step ops 150 "$bin/test_cuda_ops" && ops_ok=1
    if [ -f "$models/stories260K/config.json" ]; then
        stories=$models/stories260K
    elif [ -f "$gen/stories-shape/config.json" ]; then
        stories=$gen/stories-shape
    fi
    if [ -n "$stories" ] || [ $gpu = 0 ]; then
        step e2e-stories-bf16 40 "$bin/test_cuda_e2e" --model "$stories" --dtype bf16 --tokens 40
        step e2e-stories-f32 40 "$bin/test_cuda_e2e" --model "$stories" --dtype f32 --tokens 40
        # the host KV tier's copies (pinned arena, transfer stream) in the middle of the decodes
        step e2e-stories-kv-host 40 "$bin/test_cuda_e2e" --model "$stories" --dtype f32 --tokens 40 --kv-host
        step e2e-stories-kv-dir 40 "$bin/test_cuda_e2e" --model "$stories" --dtype f32 --tokens 40 --kv-dir
    else
        skip_row e2e-stories "no stories260K, no numpy"
    fi
    for f in "${families[@]}"; do
        IFS='|' read -r name gargs eargs <<<"$f"
        dir=$gen/$name
        case $gargs in =*) dir=$gen/${gargs#=} ;; esac
        if [ $gpu = 1 ] && [ ! -f "$dir/config.json" ]; then
            skip_row "e2e-$name" "$([ $have_numpy = 1 ] && echo 'model not generated' || echo 'no numpy')"
            continue
        fi
        # shellcheck disable=SC2086
        step "e2e-$name" 30 "$bin/test_cuda_e2e" --model "$dir" $eargs --tokens 32
    done
    if [ -x "$bin/test_nccl_comm" ] || [ $gpu = 0 ]; then
        step nccl 90 "$bin/test_nccl_comm" # 1 GPU: the single-process case; 2: all (graph, watchdog)
    else
        skip_row nccl "built without NCCL"
    fi

    # --- B. measurements -------------------------------------------------------------------
    begin_phase measure "$measure_budget"
    # shellcheck disable=SC2086
    step bench 150 "$bin/bench_gpu" --batches 1,8,32 --tokens 24 --json "$out/bench.json" ${BENCH_ARGS:-}
    step bench-quant 50 "$bin/bench_gpu" --skip-model --quant-gemv int8,fp8,q4,q4:128,q4_min,q4_min:128 \
        --json "$out/quant.json"
    step bench-mla 40 "$bin/bench_gpu" --skip-model --mla 16,128 --batches 1,8,32 --ctx 4096 --prefill 1024 \
        --json "$out/mla.json"
    step bench-q4 60 "$bin/bench_gpu" --quantization q4 --batches 1,8 --ctx 512 --tokens 16 --prefill 256 \
        --json "$out/bench-q4.json"
    # where a batch-1 decode step's time goes beyond reading the weights: every kernel's launches and time
    # over 32 decode steps of the 8B shape (divide by 32 for a step), kernels inside the decode graphs
    # traced one by one, from nsys (the toolkit's profiler) when the machine has it
    nsys_bin=$(command -v nsys || true)
    [ -n "$nsys_bin" ] || nsys_bin=$(ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1)
    if [ -n "$nsys_bin" ]; then
        step profile 90 "$nsys_bin" profile --force-overwrite true --cuda-graph-trace=node --stats=true \
            -o "$out/decode-profile" "$bin/bench_gpu" --batches 1 --tokens 32 --ctx 512 --prefill 16
    else
        skip_row profile "no nsys"
    fi
    # the tuning table: each candidate of a knob on a short 4-layer decode at
    # context 4096, the fastest batch-1 step kept (kernels/cuda/backend_cuda.c
    # reads the table from LOOM_CUDA_TUNING or next to the binary)
    step tune 150 bash -c '
        set -e
        out=$1 bin=$2 py=$3 ops_ok=$4 flash_ok=$5
        # time(TABLE_LINES...): the batch-1 step of the short decode under those lines
        # (table lines, then bench_gpu options from the first argument starting with --)
        time_with() {
            : >"$out/tune-cur.tsv"
            while [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; do printf "%s\n" "$1" >>"$out/tune-cur.tsv"; shift; done
            LOOM_CUDA_TUNING="$out/tune-cur.tsv" "$bin/bench_gpu" --layers 4 --batches 1 --ctx 4096 --tokens 8 \
                --prefill 256 --json "$out/tune-cur.json" "$@" >>"$out/tune.log" 2>&1
            "$py" -c "import json,sys; print(min(d[\"step_s\"] for d in json.load(open(sys.argv[1]))[\"decode\"] if d[\"batch\"] == 1))" "$out/tune-cur.json"
        }
        faster() { "$py" -c "import sys; sys.exit(0 if float(sys.argv[1]) < float(sys.argv[2]) else 1)" "$1" "$2"; }
        best= best_s=
        for w in 1 2 4; do
            s=$(time_with "attn_split_waves $w")
            echo "attn_split_waves $w: batch-1 step $s s"
            if [ -z "$best" ] || faster "$s" "$best_s"; then best=$w best_s=$s; fi
        done
        # the decode GEMV variants (opmath.h loom_om_gemv_plan: 0 default, 1 one row a warp, 2 16 loads in flight)
        gbest=0 gbest_s=$best_s
        for g in 1 2; do
            s=$(time_with "attn_split_waves $best" "gemv_variant $g")
            echo "gemv_variant $g: batch-1 step $s s (default 0: $best_s s)"
            if faster "$s" "$gbest_s"; then gbest=$g gbest_s=$s; fi
        done
        # the quantized GEMV variants (loom_om_qgemv_plan: 0 default, 1 twice the loads in flight, 2 that with
        # half the rows) on the same decode with 4-bit weights
        qbase=$(time_with "attn_split_waves $best" "gemv_variant $gbest" --quantization q4)
        qbest=0 qbest_s=$qbase
        for g in 1 2; do
            s=$(time_with "attn_split_waves $best" "gemv_variant $gbest" "qgemv_variant $g" --quantization q4)
            echo "qgemv_variant $g (q4): batch-1 step $s s (default 0: $qbase s)"
            if faster "$s" "$qbest_s"; then qbest=$g qbest_s=$s; fi
        done
        # the quantized tensor-core kernel (qmma.cu) up to the largest n of bench-quant at which it beat
        # dequantize + cuBLAS on every scheme and shape, and at every smaller n (none: the default stays)
        qmma=$("$py" -c "import json,sys; q=json.load(open(sys.argv[1]))[\"quant_gemv\"]; ns=sorted({c[\"n\"] for r in q for c in r.get(\"mma_crossover\", [])}); ok=[all(c[\"mma_gbs\"] > c[\"dequant_gbs\"] for r in q for c in r[\"mma_crossover\"] if c[\"n\"] == n) for n in ns]; k=ok.index(False) if False in ok else len(ok); print((ns[k - 1] if k else 0) if ns else \"\")" "$out/quant.json" 2>/dev/null || true)
        # the never-run paths are on only once this device ran them right (test_cuda_ops: test_quant_mma,
        # test_matmul_bias): their compiled defaults are off
        [ "$ops_ok" = 1 ] || qmma=
        echo "qmma_max_n: ${qmma:-no measurement (bench-quant) or test_cuda_ops failed: the default (off) stays}"
        # the attention kernel of prefill chunks (flash.h: 0 the tile kernel, 1 the FA2-style kernel) on a
        # 4-layer prefill of 2048 tokens, where attention is a fair share of the step
        time_prefill() {
            : >"$out/tune-cur.tsv"
            for l in "$@"; do printf "%s\n" "$l" >>"$out/tune-cur.tsv"; done
            if ! LOOM_CUDA_TUNING="$out/tune-cur.tsv" "$bin/bench_gpu" --layers 4 --batches 1 --ctx 2048 --tokens 2 \
                --prefill 2048 --json "$out/tune-cur.json" >>"$out/tune.log" 2>&1; then
                echo inf # a failed run never wins
                return 0
            fi
            "$py" -c "import json,sys; print(json.load(open(sys.argv[1]))[\"prefill_s\"])" "$out/tune-cur.json"
        }
        p0=$(time_prefill "attn_split_waves $best")
        p1=$(time_prefill "attn_split_waves $best" "attn_prefill_variant 1")
        pbest=0
        if [ "$flash_ok" = 1 ] && [ "$ops_ok" = 1 ] && faster "$p1" "$p0"; then pbest=1; fi
        echo "attn_prefill_variant 1 (fa2): prefill 2048 tokens $p1 s (0, tile: $p0 s)"
        {
            echo "# loom CUDA tuning table, measured by tests/gpu/run.sh on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
            echo "attn_split_waves $best"
            echo "gemv_variant $gbest"
            echo "qgemv_variant $qbest"
            if [ -n "$qmma" ]; then echo "qmma_max_n $qmma"; fi
            if [ "$ops_ok" = 1 ]; then echo "lt_bias 1"; fi
            echo "attn_prefill_variant $pbest"
        } >"$out/loom-cuda-tuning.tsv"
        cat "$out/loom-cuda-tuning.tsv"
    ' tune "$out" "$bin" "$py" "$ops_ok" "$flash_ok"
    if [ $have_numpy = 1 ]; then # LoRA: no adapter, one rank-16 all-linear adapter, 8 mixed (docs/lora.md)
        "$py" "$root/tests/reference/gen_model.py" --out "$gen/m100" --dim 768 --hidden-dim 2048 --layers 12 \
            --heads 12 --kv-heads 4 --vocab 32000 --seed 1 >/dev/null &&
            step bench-lora 60 "$bin/bench_lora" --model "$gen/m100" --device cuda:0 --batches 1,8,32 --reps 1
    else
        skip_row bench-lora "no numpy"
    fi
fi
phase_end=0
phase=full

# --- C. the regular build (LOOM_RUN_FULL=1) ---------------------------------------------------------
full=$out/build-full
if [ "${LOOM_RUN_FULL:-0}" != 1 ] || [ $gpu = 0 ]; then
    skip_row full-build "$([ $gpu = 0 ] && echo 'no GPU' || echo 'LOOM_RUN_FULL is not 1')"
else
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
fi # LOOM_RUN_FULL

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
    print("tensor-core qmma vs dequantize + cuBLAS, GB/s of weight bytes (qmma|dequant) at n =")
    for r in q["quant_gemv"]:
        cells = " ".join(f"{c['n']}: {c['mma_gbs']:.0f}|{c['dequant_gbs']:.0f}" for c in r.get("mma_crossover", []))
        fp8 = r.get("prefill_fp8_gemm_vs_bf16", 0)
        extra = f"   cuBLASLt FP8 prefill vs bf16: {fp8:.2f}" if r["scheme"] == "fp8" else ""
        print(f"{r['scheme']:<12}{r['shape']:<9}{cells}{extra}")
if os.path.exists(sys.argv[2]):
    b = json.load(open(sys.argv[2]))
    print(f"\n{b['dtype']} weights: prefill {b['prefill_tokens']} tokens {b['prefill_tflops']:.0f} TFLOP/s")
    for d in b["decode"]:
        print(f"{d['variant']:<24}{d['batch']:>6}{d['step_s']*1e3:>9.2f}{d['tok_s']:>9.1f}{d['mbu']:>7.3f}")
EOF
fi

# --- run.json and run.tsv --------------------------------------------------------------------------
{
    printf 'phase\tname\tverdict\tseconds\tlimit_s\n'
    for r in "${jrows[@]}"; do
        "$py" -c 'import json,sys; r=json.loads(sys.argv[1]); print("\t".join("-" if r[k] is None else str(r[k]) for k in ("phase","name","verdict","seconds","limit_s")))' "$r" 2>/dev/null ||
            echo "$r"
    done
} >"$out/run.tsv"
{
    printf '{"device": "%s", "commit": "%s", "gpu": %s, "seconds": %s, "failed": %s,\n "steps": [\n' \
        "$device" "$commit" "$([ $gpu = 1 ] && echo true || echo false)" $(($(date +%s) - t_start)) "$failed"
    n=${#jrows[@]}
    for i in "${!jrows[@]}"; do
        printf '  %s%s\n' "${jrows[$i]}" "$([ "$i" -lt $((n - 1)) ] && echo ,)"
    done
    printf ' ],\n "results": {'
    sep=
    for f in bench quant bench-q4 mla; do
        if [ -s "$out/$f.json" ]; then
            printf '%s\n  "%s": ' "$sep" "$f"
            cat "$out/$f.json"
            sep=,
        fi
    done
    printf '}}\n'
} >"$out/run.json"
echo "wrote $out/run.json and $out/run.tsv"
if [ $gpu = 0 ]; then
    exit "${LOOM_RUN_NO_GPU_RC:-0}"
fi
exit $failed
