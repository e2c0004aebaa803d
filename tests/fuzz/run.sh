#!/usr/bin/env bash
# One bounded libFuzzer run: run.sh TARGET CORPUS_DIR WORK_DIR SECONDS [MAX_LEN]
# (MAX_LEN: the largest input in bytes, 8192 unless given; seeds longer
# than it are truncated when read.)
# Fuzzes a scratch copy of the committed corpus (which stays untouched) for
# SECONDS, prints a one-line summary, and fails when the target crashed,
# leaked or broke a property; the input that did it is kept under
# WORK_DIR/<target>/artifacts/ (add it to the corpus once fixed).
set -uo pipefail
target=$1 corpus=$2 work=$3 seconds=$4 max_len=${5:-8192}
name=$(basename "$target")
dir="$work/$name"
rm -rf "$dir"
mkdir -p "$dir/corpus" "$dir/artifacts"
cp "$corpus"/* "$dir/corpus/" 2>/dev/null || { echo "$name: no seed corpus in $corpus" >&2; exit 1; }
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}"
"$target" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len="$max_len" -print_final_stats=1 \
    -artifact_prefix="$dir/artifacts/" "$dir/corpus" >"$dir/log" 2>&1
rc=$?
execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$dir/log" | grep -o '[0-9]*$')
cov=$(grep -o 'cov: [0-9]*' "$dir/log" | tail -1 | grep -o '[0-9]*')
if [ $rc -ne 0 ]; then
    echo "FUZZ FAIL $name (exit $rc) after ${execs:-?} runs; artifacts:" $(ls "$dir/artifacts") >&2
    grep -m1 -A30 -E 'ERROR: (AddressSanitizer|LeakSanitizer|libFuzzer)|runtime error|fuzz property failed' "$dir/log" >&2
    exit 1
fi
echo "fuzz ok  $name: ${execs:-?} runs in ${seconds} s, coverage ${cov:-?}, corpus $(ls "$dir/corpus" | wc -l) inputs"
