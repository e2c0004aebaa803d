# bench_tokenizer DIR [DIR...]: encode/decode MB/s (see bench/bench_tokenizer.c).
loom_add_bench(bench_tokenizer SOURCES bench_tokenizer.c LIBS loom_tokenizer)
