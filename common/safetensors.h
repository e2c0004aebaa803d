/* Safetensors reader: mmaps one file or a sharded checkpoint (through
 * model.safetensors.index.json) and exposes its tensors without copying.
 * Every header is validated on open: JSON shape, dtype names, shapes, and
 * offsets that must lie inside the file and match numel * dtype size. */
#ifndef LOOM_SAFETENSORS_H
#define LOOM_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "common/dtype.h"
#include "common/status.h"

#define LOOM_ST_MAX_DIMS 8

typedef struct loom_st_tensor {
    const char *name;
    loom_dtype_t dtype;
    int n_dims;
    int64_t shape[LOOM_ST_MAX_DIMS];
    const void *data; /* points into the mapping; may be unaligned, read via memcpy */
    size_t nbytes;
    const char *file; /* path of the file that holds it, for error messages */
} loom_st_tensor_t;

typedef struct loom_st loom_st_t; /* one or more mapped files */

/* Opens DIR/model.safetensors.index.json when present (sharded checkpoint),
 * else DIR/model.safetensors, else the only *.safetensors file in DIR. */
loom_status_t loom_st_open_dir(const char *dir, loom_st_t **out, loom_err_t *err);
/* Opens a single file. */
loom_status_t loom_st_open_file(const char *path, loom_st_t **out, loom_err_t *err);
void loom_st_close(loom_st_t **st_p); /* safe on NULL and twice */

int loom_st_count(const loom_st_t *st);
const loom_st_tensor_t *loom_st_at(const loom_st_t *st, int i);
const loom_st_tensor_t *loom_st_find(const loom_st_t *st, const char *name); /* NULL if absent */
/* Renames every tensor whose name starts with `from` to start with `to`
 * instead (a checkpoint layout's prefix onto the one the loader reads);
 * refuses, naming both, when a new name is already taken. */
loom_status_t loom_st_rename_prefix(loom_st_t *st, const char *from, const char *to, int *n_renamed,
                                    loom_err_t *err);

/* Looks up a weight and checks it before use: present (else NOT_FOUND), dtype
 * F32/F16/BF16 (else UNSUPPORTED), and exactly the expected shape (n_dims
 * entries; else FORMAT). Errors name the file and the tensor, e.g. "tensor
 * 'lm_head.weight' in DIR/model.safetensors has shape [512, 64], expected
 * [500, 64]". */
loom_status_t loom_st_get(const loom_st_t *st, const char *name, int n_dims, const int64_t *shape,
                          const loom_st_tensor_t **out, loom_err_t *err);
/* The same for a tensor of exactly one dtype (MXFP4's U8 blocks and scales). */
loom_status_t loom_st_get_dtype(const loom_st_t *st, const char *name, loom_dtype_t dtype,
                                int n_dims, const int64_t *shape, const loom_st_tensor_t **out,
                                loom_err_t *err);

/* Copies the 2-D block rows [row0, row0+nrows) x cols [col0, col0+ncols) of a
 * tensor into dst (nrows x ncols, row-major), converting F32/F16/BF16 to
 * float. A 1-D tensor is treated as one row; leading dimensions of a 3-D+
 * tensor fold into rows. A block outside the tensor is INVALID_ARGUMENT.
 * Counts the bytes it reads so a shard can report how much of the checkpoint
 * it touched. Safe to call from several threads on one loom_st_t. */
loom_status_t loom_st_read_f32(loom_st_t *st, const loom_st_tensor_t *t, int64_t row0, int64_t nrows,
                               int64_t col0, int64_t ncols, float *dst, loom_err_t *err);
/* Copies the same kind of block without conversion, for any dtype (quantized
 * codes, packed int32 words, scales): dst receives nrows x ncols elements of
 * the tensor's own size. Counted like loom_st_read_f32. */
loom_status_t loom_st_read_raw(loom_st_t *st, const loom_st_tensor_t *t, int64_t row0, int64_t nrows,
                               int64_t col0, int64_t ncols, void *dst, loom_err_t *err);
uint64_t loom_st_bytes_read(const loom_st_t *st);

#endif
