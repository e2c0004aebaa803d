# bench_jinja [TEMPLATE_DIR] [RENDERS]: µs per chat-template render (see bench/bench_jinja.c).
loom_add_bench(bench_jinja SOURCES bench_jinja.c LIBS loom_jinja)
