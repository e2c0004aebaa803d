/* Fuzz target: config.json text through the model config parser, which
 * must refuse what it cannot use with an error and never crash. */
#include "common/model_config.h"
#include "tests/fuzz/fuzz.h"

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    fuzz_quiet();
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    loom_model_config_t cfg;
    loom_err_t err = {0};
    if (loom_model_config_parse((const char *)data, size, "fuzz/config.json", &cfg, &err) < 0) {
        FUZZ_ASSERT(err.msg[0]);
        return 0;
    }
    /* what the rest of Loom divides by and sizes buffers with */
    FUZZ_ASSERT(cfg.dim > 0 && cfg.n_layers > 0 && cfg.n_heads > 0 && cfg.n_kv_heads > 0 &&
                cfg.head_dim > 0 && cfg.vocab_size > 0 && cfg.hidden_dim > 0);
    for (int id = -1; id < 4; id++)
        (void)loom_model_config_is_eos(&cfg, id);
    return 0;
}
