#!/usr/bin/env bash
# Speculative decoding on a device: `loom run` with ngram and with an int8
# self-draft gives the ids of the same run without speculation (greedy, and
# seeded sampling with ngram), and the device's plain greedy ids equal the
# CPU's (f32). The verify step is the prefill path with several logit rows,
# the draft a second model on the same device (docs/speculative.md).
# Usage: tests/gpu/spec_check.sh LOOM_BINARY MODEL_DIR DEVICE (cuda:0; cpu checks the script itself)
set -uo pipefail
loom=${1:?usage: spec_check.sh LOOM MODEL_DIR DEVICE}
model=${2:?model dir}
dev=${3:-cuda:0}
prompt="Once upon a time, there was a little girl named Lily. Lily"

ids() { # DEVICE ARGS...: the generated ids, or "error: ..." with the run's last line
    local d=$1 err
    shift
    err=$("$loom" run --model "$model" --prompt "$prompt" --device "$d" --dtype f32 --max-tokens 64 --ignore-eos \
        --threads 1 --ids "$@" 2>&1 >/dev/null) || { echo "error: $(tail -1 <<<"$err")"; return; }
    grep '^ids:' <<<"$err" || echo "error: no ids line"
    grep -m1 '^tokens per target step' <<<"$err" >&2
}

fail=0
expect() { # NAME GOT WANT
    if [ "$2" = "$3" ] && [ "${2#error}" = "$2" ]; then
        echo "PASS $1"
    else
        echo "FAIL $1"
        echo "  got:  $2"
        echo "  want: $3"
        fail=1
    fi
}

greedy=$(ids "$dev" --temperature 0)
expect "$dev plain f32 = cpu" "$greedy" "$(ids cpu --temperature 0)"
expect "$dev ngram K=8 fixed" "$(ids "$dev" --temperature 0 --speculative-method ngram --num-speculative-tokens 8 \
    --speculative-fixed-k)" "$greedy"
expect "$dev int8 self-draft K=4" "$(ids "$dev" --temperature 0 --speculative-method draft \
    --speculative-quantization int8 --num-speculative-tokens 4)" "$greedy"
seeded=$(ids "$dev" --temperature 0.8 --seed 5)
expect "$dev seeded ngram" "$(ids "$dev" --temperature 0.8 --seed 5 --speculative-method ngram \
    --num-speculative-tokens 4 --speculative-fixed-k)" "$seeded"
expect "$dev seeded int8 self-draft" "$(ids "$dev" --temperature 0.8 --seed 5 --speculative-method draft \
    --speculative-quantization int8 --speculative-fixed-k)" "$seeded"
exit $fail
