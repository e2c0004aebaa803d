#!/usr/bin/env bash
# The whole test suite: installs the dependencies, builds (Release, warnings
# as errors, CUDA code compiled and linked when nvcc is present), runs every
# test under AddressSanitizer + UBSan (a Debug build: unit, reference and the
# integration tests with sanitized coordinator and workers), runs each
# libFuzzer target for 20 s on its seed corpus (clang, ASan + UBSan), then
# the Release build's tests: every unit, reference, kernel and tokenizer test,
# and the integration tests labelled `release` (tests/CMakeLists.txt: the
# optimised kernels' grids, families and benchmark, and the first commands a
# user runs), ending with ctest's summary. Integration tests run side by side
# (ctest -j), each in its own work directory.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
jobs=$(nproc)
"$root/scripts/setup-debian.sh"
# How loaded this machine is, measured once before anything of ours runs: the
# integration tests stretch their deadlines by it (tests/integration/harness.py).
LOOM_TEST_SPEED=$(/usr/bin/python3 -c 'import sys; sys.path.insert(0, sys.argv[1]); import harness; print("%.2f" % harness.measure_speed())' "$root/tests/integration")
export LOOM_TEST_SPEED
echo "== speed factor $LOOM_TEST_SPEED (1: an idle 2-core machine)" >&2
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DLOOM_WERROR=ON
cmake --build build -j "$jobs"
echo "== sanitizer build (address, undefined): every test" >&2
cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DCMAKE_C_FLAGS_DEBUG="-g -O1" -DLOOM_CUDA=OFF -DLOOM_WERROR=ON \
      -DLOOM_SANITIZE=address,undefined >/dev/null
cmake --build build-asan -j "$jobs"
(cd build-asan && ASAN_OPTIONS=detect_leaks=1 ctest --no-tests=error --output-on-failure -j "$jobs")
echo "== fuzz targets (libFuzzer, ASan + UBSan, 20 s each; docs/fuzzing.md)" >&2
CC=clang cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=Debug -DLOOM_CUDA=OFF -DLOOM_FUZZ=ON \
      -DLOOM_FUZZ_SECONDS=20 >/dev/null
cmake --build build-fuzz -j "$jobs" --target fuzz_all
(cd build-fuzz && ctest --no-tests=error --output-on-failure -L fuzz -j "$jobs")
echo "== Release build: unit, reference, kernel and tokenizer tests" >&2
cd build
ctest --no-tests=error --output-on-failure -j "$jobs" -LE integration
echo "== Release build: the integration tests labelled release" >&2
ctest --no-tests=error --output-on-failure -j "$jobs" -L release
