#!/usr/bin/env bash
# The simulator against a real measurement: four replicas of stories260K
# behind loom-router (tools/sim/measure.py: prefix_repetition through
# `loom bench`, policies prefix and round-robin), then loomsim with the
# cpu-tiny calibration on the same setup (five seeds, the median of their
# TTFT p50). Prints both and exits 1 when a policy's simulated TTFT p50 is
# off the measured one by more than the bound (25%).
#
#   tools/sim/validate.sh [MEASURED.json]   (a measure.py result: check it again without measuring)
#   LOOM_BIN=build/bin  VALIDATE_BOUND=0.25  VALIDATE_OUT=FILE (both sides as JSON)
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
py=${LOOM_PYTHON:-/usr/bin/python3}
measured=${1:-}
if [ -z "$measured" ]; then
    measured=$(mktemp --suffix=.json)
    "$py" "$here/measure.py" --out "$measured" >&2
fi
"$py" - "$measured" "$here" "${VALIDATE_BOUND:-0.25}" "${VALIDATE_OUT:-}" <<'PY'
import json, statistics, sys
measured, here, bound, out = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
sys.path.insert(0, here)
import loomsim
m = json.load(open(measured))
c = m["config"]
rows, ok = [], True
print("policy        TTFT p50 measured   simulated  (error)   TTFT p90 meas/sim     hit rate meas/sim   TPOT p50 meas/sim")
for i, (pol, r) in enumerate(m["policies"].items()):
    argv = ["--calib", "cpu-tiny", "--replicas", str(c["replicas"]), "--policy", pol, "--workload", "prefix-rep",
            "--num-prefixes", str(c["num_prefixes"]), "--prefix-len", str(c["prefix_len"]),
            "--suffix-len", str(c["suffix_len"]), "--output-len", str(c["output_len"]), "--rate", str(c["rate"]),
            "--burstiness", str(c["burstiness"]), "--num-requests", str(c["num_requests"]), "--bench-span"]
    if c.get("kv_blocks"):
        argv += ["--kv-blocks", str(c["kv_blocks"])]
    sims = [loomsim.simulate(argv + ["--seed", str(s)]) for s in range(5)]
    p50 = statistics.median(s["ttft_ms"]["p50"] for s in sims)
    p90 = statistics.median(s["ttft_ms"]["p90"] for s in sims)
    hit = statistics.median(s["prefix_hit_rate_blocks"] for s in sims)
    tpot = statistics.median(s["tpot_ms"]["p50"] for s in sims)
    mp50 = r["ttft_ms"]["p50"]
    err = p50 / mp50 - 1
    ok &= abs(err) <= bound
    print("%-12s  %10.2f ms  %10.2f ms  (%+5.0f%%)   %6.2f / %6.2f ms     %.2f / %.2f          %.3f / %.3f ms" %
          (pol, mp50, p50, 100 * err, r["ttft_ms"]["p90"], p90, r["hit_rate_blocks"], hit, r["tpot_ms"]["p50"], tpot))
    rows.append({"policy": pol, "measured": {"ttft_p50_ms": mp50, "ttft_p90_ms": r["ttft_ms"]["p90"],
                                             "hit_rate": r["hit_rate_blocks"], "tpot_p50_ms": r["tpot_ms"]["p50"]},
                 "simulated": {"ttft_p50_ms": p50, "ttft_p90_ms": p90, "hit_rate": hit, "tpot_p50_ms": tpot},
                 "ttft_p50_error": err})
if out:
    json.dump({"config": c, "bound": bound, "rows": rows}, open(out, "w"), indent=1)
print("TTFT p50 within %.0f%%: %s" % (100 * bound, "yes" if ok else "NO"))
sys.exit(0 if ok else 1)
PY
