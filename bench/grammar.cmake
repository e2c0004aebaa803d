# bench_grammar DIR [DIR...]: grammar compile and per-step token mask latency (see bench/bench_grammar.c).
loom_add_bench(bench_grammar SOURCES bench_grammar.c LIBS loom_grammar)
