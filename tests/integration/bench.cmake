# `loom bench` as a peer of `vllm bench serve` (test_bench.py): against an
# independent OpenAI-compatible stub server and against Loom; vLLM's result
# keys; ShareGPT, random, prefix_repetition and multiturn datasets; burstiness; bad
# input.
loom_add_it(it_bench test_bench.py)
