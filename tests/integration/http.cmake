# The HTTP gateway end to end (test_http.py): the OpenAI Node SDK (npm ci
# --prefix tests/reference), curl-style error paths, /metrics, disconnects,
# 429 and shutdown on real processes.
loom_add_it(it_http test_http.py)
# The Responses API (test_responses.py + sdk_responses.mjs: the openai SDK's
# responses.create, the AI SDK's responses model, LangChain with
# useResponsesApi) and streamed n > 1 on chat and completions.
loom_add_it(it_responses test_responses.py)
