# Observability and hardening of the HTTP gateway (test_obs.py): timings,
# stage histograms (Loom's and vLLM's names), X-Request-Id, JSON logs, 503
# over the connection limit, refused fields, /tokenize and /detokenize,
# the stage breakdown of loom bench. Sorted after integration.cmake, whose
# loom_add_it it uses.
loom_add_it(it_obs test_obs.py)
