#!/usr/bin/env bash
# Decode speed of the dense families against a Llama of the same shape.
#   bench/bench_families.sh [BUILD_DIR] [WORK_DIR] [ROUNDS]
# Generates random checkpoints of one shape (dim 768, intermediate 2048, 8
# layers, GQA 12/4, vocab 8192: 241 MB of f32 weights, beyond the L3) in the
# Llama, Qwen3 (q/k norms), Mistral (a sliding window), Phi-3 (fused
# projections) and gelu-tanh layouts, then runs bench_decode on each in
# interleaved rounds and reports each family's best batch-1 decode tok/s and
# its ratio to Llama's (best of the rounds: the least disturbed run on a
# shared machine). Every family reads the same 226.5 MB per token.
set -euo pipefail
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
    sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'
    exit 0
fi
build=${1:-build} work=${2:-/tmp/loom-bench-families} rounds=${3:-4}
here=$(cd "$(dirname "$0")/.." && pwd)
py=${LOOM_PYTHON:-/usr/bin/python3}
shape="--dim 768 --hidden-dim 2048 --layers 8 --heads 12 --kv-heads 4 --vocab 8192 --seed 5 --max-pos 4096"
declare -A flags=([llama]="" [qwen3]="--arch qwen3" [mistral]="--arch mistral --sliding-window 4095"
                  [phi3]="--arch phi3" [gelu]="--hidden-act gelu_pytorch_tanh")
families="llama qwen3 mistral phi3 gelu"
mkdir -p "$work"
for f in $families; do
    [ -f "$work/$f/config.json" ] || "$py" "$here/tests/reference/gen_model.py" --out "$work/$f" $shape ${flags[$f]} >/dev/null
done
declare -A best
for r in $(seq "$rounds"); do
    for f in $families; do
        tps=$("$build/bin/bench_decode" --model "$work/$f" --threads 2 --prompt 64 --tokens 32 --reps 2 2>&1 |
              sed -n 's/.*decode *\([0-9.]*\) .*/\1/p' | head -1)
        if [ -z "${best[$f]:-}" ] || awk "BEGIN{exit !($tps > ${best[$f]})}"; then best[$f]=$tps; fi
        echo "round $r $f decode $tps tok/s" >&2
    done
done
for f in $families; do
    awk -v f="$f" -v t="${best[$f]}" -v l="${best[llama]}" 'BEGIN{printf "%-8s best decode %7.2f tok/s  ratio to llama %.3f\n", f, t, t / l}'
done
