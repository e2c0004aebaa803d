#!/usr/bin/env bash
# Draws the simulator's results (tools/sim/results/results.jsonl, from
# sweep.py; the .dat files are written from it here) into docs/img/: sim_goodput_multiturn.png,
# sim_goodput_rag.png and sim_router_cost.png (gnuplot).
#
#   tools/sim/plot.sh [OUT_DIR]
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
out=${1:-$here/../../docs/img}
res=$here/results
py=${LOOM_PYTHON:-/usr/bin/python3}
"$py" "$here/sweep.py" --dat
"$py" "$here/router_cost.py" > /dev/null
gnuplot <<GP
if (strstrt(GPVAL_TERMINALS, 'pngcairo') > 0) { set terminal pngcairo size 1000,420 font ',9' } else { set terminal png size 1000,420 }
set output '$out/sim_goodput_multiturn.png'
set multiplot layout 1,2 title 'Simulated goodput (TTFT <= 1 s, TPOT <= 50 ms), multi-turn chat, 8B on H200 replicas, Poisson arrivals'
set xlabel 'offered requests/s per replica'
set ylabel 'goodput, requests/s per replica'
set grid
set key top left Left reverse samplen 2
set xrange [0:140]
set yrange [0:130]
f(n, v) = sprintf('$res/goodput_multiturn_%d_%s.dat', n, v)
mt(n) = sprintf("plot f(%d, 'session') u 1:4 w lp lw 2 pt 7 t 'session', \\
     f(%d, 'prefix-l0.02') u 1:4 w lp lw 2 pt 5 t 'prefix, lambda 0.02', \\
     f(%d, 'prefix') u 1:4 w lp lw 2 pt 9 t 'prefix (default lambda 1)', \\
     f(%d, 'least-loaded') u 1:4 w lp lw 1 pt 11 t 'least-loaded', \\
     f(%d, 'round-robin') u 1:4 w lp lw 1 pt 13 t 'round-robin', \\
     x lc rgb '#bbbbbb' dt 2 t 'offered'", n, n, n, n, n)
set title '4 replicas'
eval mt(4)
set title '64 replicas'
eval mt(64) . sprintf(", f(64, 'prefix-l0.02-ix4M') u 1:4 w lp lw 1 dt 2 pt 5 t 'prefix, lambda 0.02, 4M-block index'")
unset multiplot

set terminal pngcairo size 900,400 font ',9'
set output '$out/sim_goodput_rag.png'
set multiplot layout 1,2 title 'Simulated goodput, RAG (1024 shared documents of about 2k tokens, Zipf 1), Poisson and bursty (gamma 0.25) arrivals'
set xrange [0:90]
set yrange [0:90]
set key top left Left reverse samplen 2
g(n, v) = sprintf('$res/goodput_rag_%s_%s.dat', n, v)
do for [n in "4 64"] {
  set title sprintf('%s replicas', n)
  plot g(n, 'prefix-l0.02') u 1:4 w lp lw 2 pt 5 t 'prefix, lambda 0.02', \
       g(n, 'prefix') u 1:4 w lp lw 2 pt 9 t 'prefix (lambda 1)', \
       g(n, 'round-robin') u 1:4 w lp lw 1 pt 13 t 'round-robin', \
       g(n, 'prefix@0.25') u 1:4 w lp lw 2 dt 2 pt 9 t 'prefix, bursty', \
       g(n, 'round-robin@0.25') u 1:4 w lp lw 1 dt 2 pt 13 t 'round-robin, bursty', \
       x lc rgb '#bbbbbb' dt 2 t 'offered'
}
unset multiplot

set terminal pngcairo size 700,420 font ',9'
set output '$out/sim_router_cost.png'
set title "Router cores needed to route what N replicas serve within the SLO"
set xlabel 'replicas'
set ylabel 'router cores (CPU seconds per second)'
set logscale xy
set xrange [3:5000]
set yrange [0.01:1000]
set key top left Left reverse samplen 2
set format y '%g'
plot '$res/router_cost.dat' u 1:5:4 w filledcurves lc rgb '#ccddff' t 'at 9k-16k decisions/core-s', \
     '' u 1:3 w lp lw 2 pt 7 t 'at 12.5k decisions/core-s, match O(blocks x replicas) as today', \
     '' u 1:6 w lp lw 2 pt 5 t 'the same with a match of O(blocks + replicas)', \
     1 lc rgb '#888888' dt 2 t 'one reactor thread'
GP
ls -la "$out"/sim_*.png
