# DeepSeek-V3/V2 on every grid and against the float64 reference (tests/integration/test_deepseek.py).
loom_add_it(it_deepseek test_deepseek.py)
set_property(TEST it_deepseek APPEND PROPERTY LABELS release)
# DeepSeek's MTP module drafting on the grid and in loom serve (tests/integration/test_deepseek_mtp.py).
loom_add_it(it_deepseek_mtp test_deepseek_mtp.py)
# DeepSeek with data-parallel attention: grids, the float64 reference, the ledger's partitions under a small pool,
# refusals (tests/integration/test_deepseek_dp.py).
loom_add_it(it_deepseek_dp test_deepseek_dp.py)
# DeepSeek's MLA decompressed (--disable-mla): the latent's ids and logits and the float64 reference's on 1x1 and
# TP 2, the decompressed block bytes, a small pool, LOOM_MLA_DISABLE and the refusals
# (tests/integration/test_deepseek_mla_disable.py).
loom_add_it(it_deepseek_mla_disable test_deepseek_mla_disable.py)
# DeepSeek's MLA prefill decompressed over the latent cache (LOOM_MLA_PREFILL_ROWS, CPU): the absorbed grid's ids
# and logits and the float64 reference's on 1x1 and TP 2 across several context chunks, chunked prefill, prefix
# hits and each KV dtype (tests/integration/test_deepseek_mla_prefill.py).
loom_add_it(it_deepseek_mla_prefill test_deepseek_mla_prefill.py)
