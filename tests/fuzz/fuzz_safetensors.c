/* Fuzz target: a safetensors file (8-byte header length, JSON header,
 * data) through the reader's validation, then reads of every tensor the
 * reader accepted, which must stay inside the mapping. */
#include <fcntl.h>
#include <string.h>
#include <unistd.h>

#include "common/safetensors.h"
#include "tests/fuzz/fuzz.h"

static char g_path[64];
static int g_fd = -1;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    fuzz_quiet();
    snprintf(g_path, sizeof g_path, "/tmp/loom-fuzz-st-%d.safetensors", (int)getpid());
    g_fd = open(g_path, O_RDWR | O_CREAT | O_TRUNC, 0600);
    return g_fd < 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (g_fd < 0 || ftruncate(g_fd, 0) < 0 || pwrite(g_fd, data, size, 0) != (ssize_t)size)
        return 0;
    loom_st_t *st = NULL;
    loom_err_t err = {0};
    if (loom_st_open_file(g_path, &st, &err) < 0) return 0;
    int n = loom_st_count(st);
    for (int i = 0; i < n; i++) {
        const loom_st_tensor_t *t = loom_st_at(st, i);
        FUZZ_ASSERT(t && t->name && t->n_dims >= 0 && t->n_dims <= LOOM_ST_MAX_DIMS);
        FUZZ_ASSERT(loom_st_find(st, t->name) == t);
        const loom_st_tensor_t *g = NULL;
        if (loom_st_get(st, t->name, t->n_dims, t->shape, &g, &err) == LOOM_OK) FUZZ_ASSERT(g == t);
        /* the first and the last row, raw and (for float dtypes) as f32 */
        int64_t cols = t->n_dims ? t->shape[t->n_dims - 1] : 1, rows = 1;
        for (int d = 0; d + 1 < t->n_dims; d++)
            rows *= t->shape[d];
        if (cols <= 0 || rows <= 0 || cols > (1 << 16)) continue;
        unsigned char *raw = malloc((size_t)cols * 8);
        float *f = malloc((size_t)cols * sizeof *f);
        int64_t last = rows - 1;
        loom_st_read_raw(st, t, 0, 1, 0, cols, raw, &err);
        loom_st_read_raw(st, t, last, 1, 0, cols, raw, &err);
        loom_st_read_f32(st, t, 0, 1, 0, cols, f, &err);
        loom_st_read_f32(st, t, last, 1, cols / 2, cols - cols / 2, f, &err);
        /* out of range: refused, never read */
        FUZZ_ASSERT(loom_st_read_raw(st, t, rows, 1, 0, cols, raw, &err) < 0);
        FUZZ_ASSERT(loom_st_read_raw(st, t, 0, 1, 1, cols, raw, &err) < 0);
        free(raw);
        free(f);
    }
    loom_st_close(&st);
    return 0;
}
