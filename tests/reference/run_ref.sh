#!/usr/bin/env bash
# Golden test: the engine against the independent reference (llama_ref.py).
#   run_ref.sh CHECK_REF WORKDIR stories MODELS_DIR
#   run_ref.sh CHECK_REF WORKDIR random  [gen_model.py flags...]
#   run_ref.sh CHECK_REF WORKDIR awq|gptq|gptq_v2 MODELS_DIR [gen_quant_ckpt.py flags...]
#   run_ref.sh CHECK_REF WORKDIR deepseek [gen_deepseek.py flags...]   (against deepseek_ref.py)
# (4-bit checkpoints of stories260K; the reference runs their dequantized twin)
set -euo pipefail
check=$1 work=$2 kind=$3
shift 3
here=$(cd "$(dirname "$0")" && pwd)
py=${LOOM_PYTHON:-/usr/bin/python3}
mkdir -p "$work"
if [ "$kind" = stories ]; then
    model="$1/stories260K"
    # "<s> Once upon a time, there was a little girl named Lily. She loved to play outside in the"
    ids=1,403,407,261,378,432,383,286,261,376,298,315,421,395,317,426,338,401,396,267,337,410,408,419,292,411,322,265,282,295,433,426,385
elif [ "$kind" = awq ] || [ "$kind" = gptq ] || [ "$kind" = gptq_v2 ]; then
    model="$work/model" ref_model="$work/model-dequantized"
    rm -rf "$model" "$ref_model"
    "$py" "$here/gen_quant_ckpt.py" --src "$1/stories260K" --format "$kind" --out "$model" \
        --dequantized-out "$ref_model" "${@:2}"
    # the weights are exact; the CPU backend rounds activations to int8 per 32 columns
    tol=3e-2
    ids=1,403,407,261,378,432,383,286,261,376,298,315,421,395,317,426,338,401,396,267,337,410,408,419,292,411,322,265,282,295,433,426,385
elif [ "$kind" = deepseek ]; then
    model="$work/model"
    rm -rf "$model"
    "$py" "$here/gen_deepseek.py" --out "$model" "$@" >/dev/null
    ref=deepseek_ref.py
    ids=$("$py" -c 'import random; r = random.Random(7); print(",".join(str(r.randrange(3, 500)) for _ in range(40)))')
else
    model="$work/model"
    rm -rf "$model"
    "$py" "$here/gen_model.py" --out "$model" "$@" >/dev/null
    ids=$("$py" -c 'import random; r = random.Random(7); print(",".join(str(r.randrange(3, 500)) for _ in range(40)))')
fi
n_greedy=48
ref_model=${ref_model:-$model}
ref=${ref:-llama_ref.py}
greedy=$("$py" "$here/$ref" --model "$ref_model" --ids "$ids" --greedy $n_greedy)
"$py" "$here/$ref" --model "$ref_model" --ids "$ids,$greedy" --logits-out "$work/ref_logits.bin"
tol=${tol:-1e-4}
for threads in 1 2; do
    "$check" --model "$model" --ids "$ids" --ref-logits "$work/ref_logits.bin" --ref-greedy "$greedy" --threads $threads --chunk 7 --tol $tol
done
"$check" --model "$model" --ids "$ids" --ref-logits "$work/ref_logits.bin" --ref-greedy "$greedy" --threads 2 --chunk 256 --tol $tol
