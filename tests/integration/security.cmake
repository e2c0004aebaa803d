# HTTP hardening (test_http_sec.py): the probe listener, slow-loris and
# slow-body deadlines, 256 streams beside /health, the per-client cap,
# HTTPS (curl, Python, the OpenAI Node SDK) and refused certificates,
# strict JSON bodies, special-token text in chat messages. Sorted after
# integration.cmake, whose loom_add_it it uses.
loom_add_it(it_httpsec test_http_sec.py)
