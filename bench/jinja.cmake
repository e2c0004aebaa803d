# bench_jinja [TEMPLATE_DIR] [RENDERS] [LLAMA3_TOK_DIR QWEN3_TOK_DIR]: µs per chat-template render (see bench/bench_jinja.c).
loom_add_bench(bench_jinja SOURCES bench_jinja.c LIBS loom_jinja loom_tokenizer)
