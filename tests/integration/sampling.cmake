# Sampling controls end to end (test_sampling.py): penalties against the
# float64 torch reference on every grid, min_p / logit_bias / allowed ids /
# bad words / min_tokens / include_stop_str_in_output over HTTP, unknown
# fields ignored, bad input refused. Sorted after integration.cmake, whose
# loom_add_it it uses.
loom_add_it(it_sampling test_sampling.py)
# Constrained decoding end to end (test_structured.py): every spec kind on
# both routes, streamed or not; 50 generated schemas on tp 2; a constrained
# and free batch mix; bad specs; the three SDKs' structured-output calls.
loom_add_it(it_structured test_structured.py)
loom_add_it(it_tools test_tools.py)
# Prompt logprobs and echo with logprobs (test_prompt_logprobs.py): against
# the float64 reference on every grid with chunked prefill, the openai SDK.
loom_add_it(it_prompt_logprobs test_prompt_logprobs.py)
