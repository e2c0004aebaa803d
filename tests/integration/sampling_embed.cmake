# Embeddings end to end (test_embed.py): /v1/embeddings and the Embed
# method, last and mean pooling against the float64 torch reference on 1x1,
# 2x1 and 1x2, every input shape, the openai SDK and LangChain, bad input.
# Sorted after integration.cmake, whose loom_add_it it uses.
loom_add_it(it_embed test_embed.py)
