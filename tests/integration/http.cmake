# The HTTP gateway end to end (test_http.py): the OpenAI Node SDK (npm ci
# --prefix tests/reference), curl-style error paths, /metrics, disconnects,
# 429 and shutdown on real processes.
loom_add_it(it_http test_http.py)
