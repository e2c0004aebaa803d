/* The paged KV pool: its allocation, a block's bytes and copy-on-write
 * block copies. The one place a KV layout lives. Two layouts, in one
 * allocation each; each layer's loom_kv_layer_t points into it and
 * attention reads nothing else:
 *   block-contiguous (backends with loom_backend_kv_block_strided: CPU;
 *     per-head K and V): block b is one span at b * block_bytes holding,
 *     per layer, K codes, V codes, then (I8) K scales and V scales of its
 *     tokens, so a block moves (offload, transfer, copy-on-write) with one
 *     copy;
 *   layer-major (the others): per layer K codes, V codes, then (I8) K
 *     scales and V scales of every block.
 * The latent layout (MLA, DeepSeek; layer-major): one KV head whose row
 * (kv_lora_rank + rope values: the latent and the rope key) is both K and
 * V, so a layer keeps one array and v points at k. DeepSeek with
 * opt.mla_disable (decompressed) keeps per-head K and V instead, V rows
 * narrower than K's (v_head_dim against nope + rope: loom_kv_layer_t.v_dim),
 * in either layout. */
#include "common/util.h"
#include "worker/engine/model_impl.h"

loom_dtype_t loom_model_kv_dtype(const loom_model_t *m) { return m->opt.kv_dtype; }
int loom_model_kv_blocks(const loom_model_t *m) { return m->n_blocks; }
int loom_model_kv_block_size(const loom_model_t *m) { return m->block_size; }

/* K and V arrays a layer keeps: 1 in the latent layout (V is K's memory), else 2. */
static size_t kv_arrays(const loom_model_t *m) { return m->cfg.deepseek && !m->opt.mla_disable ? 1 : 2; }
/* V's head dim: K's but for decompressed MLA (v_head_dim; K's is nope + rope, m->cfg.head_dim). */
static int kv_vd(const loom_model_t *m) {
    return m->cfg.deepseek && m->opt.mla_disable ? m->cfg.v_head_dim : m->cfg.head_dim;
}

/* Bytes of one layer's K (or V) codes and scales in one block, each
 * rounded up to KV_SPAN_ALIGN in the block-contiguous layout. */
#define KV_SPAN_ALIGN 64
static size_t span_align(size_t b) { return (b + KV_SPAN_ALIGN - 1) / KV_SPAN_ALIGN * KV_SPAN_ALIGN; }
static size_t blk_codes(const loom_model_t *m, int block_size, int hd) {
    return span_align((size_t)block_size * m->dims.n_kv_heads * hd * loom_dtype_size(m->opt.kv_dtype));
}
static size_t blk_scales(const loom_model_t *m, int block_size) {
    return m->opt.kv_dtype == LOOM_DT_I8 ? span_align((size_t)block_size * m->dims.n_kv_heads * sizeof(float)) : 0;
}

int loom_model_kv_block_contiguous(const loom_model_t *m) {
    return !m->opt.kv_layer_major && kv_arrays(m) == 2 && loom_backend_kv_block_strided(m->be);
}

size_t loom_model_kv_block_bytes(const loom_model_t *m, int block_size) {
    if (loom_model_kv_block_contiguous(m))
        return (size_t)m->dims.n_layers * (blk_codes(m, block_size, m->cfg.head_dim) +
                                           blk_codes(m, block_size, kv_vd(m)) + 2 * blk_scales(m, block_size));
    const size_t k = loom_kv_head_bytes(m->opt.kv_dtype, m->cfg.head_dim);
    return (size_t)m->dims.n_layers * (size_t)block_size * (size_t)m->dims.n_kv_heads *
           (kv_arrays(m) == 2 ? k + loom_kv_head_bytes(m->opt.kv_dtype, kv_vd(m)) : k);
}

void *loom_model_kv_block_ptr(const loom_model_t *m, int block) {
    if (!loom_model_kv_block_contiguous(m) || block < 0 || block >= m->n_blocks) return NULL;
    return (char *)m->kv_mem + (size_t)block * loom_model_kv_block_bytes(m, m->block_size);
}

int loom_model_kv_scratch_blocks(const loom_model_t *m) {
    return m->opt.decode_buckets > 0 || (m->opt.decode_buckets == 0 && loom_backend_has_graphs(m->be));
}

/* The pool is one allocation: per layer K codes, V codes, then (I8) K
 * scales and V scales, each array starting on a 256-byte boundary. */
#define KV_ALIGN 256
static size_t kv_align(size_t b) { return (b + KV_ALIGN - 1) / KV_ALIGN * KV_ALIGN; }

/* The block-contiguous pool: block b is one span of block_bytes at
 * b * block_bytes, holding per layer K codes, V codes, then (I8) K scales
 * and V scales of its block_size tokens; each layer's loom_kv_layer_t
 * points at block 0's arrays with the block's span as its stride. */
static loom_status_t alloc_contiguous(loom_model_t *m, int n_blocks, int total, int block_size,
                                      loom_err_t *err) {
    const loom_dtype_t dt = m->opt.kv_dtype;
    const size_t codes = blk_codes(m, block_size, m->cfg.head_dim), vcodes = blk_codes(m, block_size, kv_vd(m));
    const size_t scales = blk_scales(m, block_size);
    const size_t span = loom_model_kv_block_bytes(m, block_size);
    size_t bytes = span * (size_t)total;
    if (bytes == 0) bytes = 64; /* a stage with no layers */
    m->kv_mem = loom_backend_alloc(m->be, bytes);
    if (!m->kv_mem)
        return loom_err_set(err, LOOM_ERR_NOMEM, "out of device memory for a KV pool of %d blocks (%.1f MB)",
                            n_blocks, (double)bytes / 1e6);
    loom_backend_memset(m->be, m->kv_mem, 0, bytes);
    char *p = m->kv_mem;
    for (int i = 0; i < m->dims.n_layers; i++) {
        loom_kv_layer_t *kv = &m->layers[i].kv;
        kv->dtype = dt;
        kv->k = p;
        kv->v = p + codes;
        p += codes + vcodes;
        kv->k_scale = scales ? (float *)p : NULL;
        kv->v_scale = scales ? (float *)(p + scales) : NULL;
        p += 2 * scales;
        kv->block_stride = (int64_t)(span / loom_dtype_size(dt));
        kv->scale_block_stride = (int64_t)(span / sizeof(float));
        kv->block_size = block_size;
        kv->v_dim = kv_vd(m) != m->cfg.head_dim ? kv_vd(m) : 0;
    }
    m->n_blocks = n_blocks;
    m->block_size = block_size;
    m->scratch_block = total > n_blocks ? n_blocks : -1;
    return LOOM_OK;
}

loom_status_t loom_model_alloc_kv(loom_model_t *m, int n_blocks, int block_size, loom_err_t *err) {
    if (n_blocks < 1 || block_size < 1)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "KV pool of %d blocks of %d tokens", n_blocks, block_size);
    loom_backend_free(m->be, m->kv_mem);
    m->kv_mem = NULL;
    int pad = loom_model_kv_scratch_blocks(m);
    int total = n_blocks + pad;
    const loom_dtype_t dt = m->opt.kv_dtype;
    if (loom_model_kv_block_contiguous(m)) return alloc_contiguous(m, n_blocks, total, block_size, err);
    const size_t tokens = (size_t)total * block_size * m->dims.n_kv_heads; /* token-heads per layer */
    const size_t codes = kv_align(tokens * m->cfg.head_dim * loom_dtype_size(dt));
    const size_t vcodes = kv_arrays(m) == 2 ? kv_align(tokens * kv_vd(m) * loom_dtype_size(dt)) : 0;
    const size_t scales = dt == LOOM_DT_I8 ? kv_align(tokens * sizeof(float)) : 0;
    size_t bytes = (size_t)m->dims.n_layers * (codes + vcodes + kv_arrays(m) * scales);
    if (bytes == 0) bytes = 64; /* a stage with no layers */
    m->kv_mem = loom_backend_alloc(m->be, bytes);
    if (!m->kv_mem)
        return loom_err_set(err, LOOM_ERR_NOMEM, "out of device memory for a KV pool of %d blocks (%.1f MB)",
                            n_blocks, (double)bytes / 1e6);
    loom_backend_memset(m->be, m->kv_mem, 0, bytes);
    char *p = m->kv_mem;
    for (int i = 0; i < m->dims.n_layers; i++) {
        loom_kv_layer_t *kv = &m->layers[i].kv;
        kv->dtype = dt;
        const int two = kv_arrays(m) == 2;
        kv->k = p;
        kv->v = two ? p + codes : p;
        p += codes + vcodes;
        kv->k_scale = scales ? (float *)p : NULL;
        kv->v_scale = scales ? (float *)(two ? p + scales : p) : NULL;
        p += (two ? 2 : 1) * scales;
        kv->block_stride = kv->scale_block_stride = 0;
        kv->block_size = block_size;
        kv->v_dim = kv_vd(m) != m->cfg.head_dim ? kv_vd(m) : 0;
    }
    m->n_blocks = n_blocks;
    m->block_size = block_size;
    m->scratch_block = pad ? n_blocks : -1;
    return LOOM_OK;
}

void loom_model_kv_block_xfer(loom_model_t *m, int block, void *host, int to_host) {
    LOOM_ASSERT(block >= 0 && block < m->n_blocks);
    char *h = host;
    if (loom_model_kv_block_contiguous(m)) {
        const size_t span = loom_model_kv_block_bytes(m, m->block_size);
        char *d = (char *)m->kv_mem + (size_t)block * span;
        loom_backend_xfer(m->be, to_host ? (void *)h : d, to_host ? (void *)d : h, span, to_host);
        return;
    }
    const size_t heads = (size_t)m->block_size * m->dims.n_kv_heads; /* token-heads per block */
    const size_t code_bytes = heads * m->cfg.head_dim * loom_dtype_size(m->opt.kv_dtype);
    const size_t vcode_bytes = heads * kv_vd(m) * loom_dtype_size(m->opt.kv_dtype);
    const size_t b = (size_t)block;
    for (int l = 0; l < m->dims.n_layers; l++) {
        loom_kv_layer_t *kv = &m->layers[l].kv;
        void *piece[4] = {(char *)kv->k + b * code_bytes, kv->v != kv->k ? (char *)kv->v + b * vcode_bytes : NULL,
                          kv->k_scale ? kv->k_scale + b * heads : NULL,
                          kv->v_scale && kv->v_scale != kv->k_scale ? kv->v_scale + b * heads : NULL};
        const size_t bytes[4] = {code_bytes, vcode_bytes, heads * sizeof(float), heads * sizeof(float)};
        for (int i = 0; i < 4; i++) {
            if (!piece[i]) continue;
            loom_backend_xfer(m->be, to_host ? (void *)h : piece[i], to_host ? piece[i] : (void *)h, bytes[i],
                              to_host);
            h += bytes[i];
        }
    }
    LOOM_ASSERT((size_t)(h - (char *)host) == loom_model_kv_block_bytes(m, m->block_size));
}

int loom_model_kv_span_pieces(const loom_model_t *m, size_t *codes, size_t *scales) {
    const int B = m->block_size;
    if (m->cfg.deepseek && m->opt.mla_disable) return 0;
    if (loom_model_kv_block_contiguous(m)) {
        *codes = blk_codes(m, B, m->cfg.head_dim); /* K and V alike: no family with narrower V heads gets here */
        *scales = blk_scales(m, B);
    } else {
        const size_t heads = (size_t)B * m->dims.n_kv_heads;
        *codes = heads * m->cfg.head_dim * loom_dtype_size(m->opt.kv_dtype);
        *scales = m->opt.kv_dtype == LOOM_DT_I8 ? heads * sizeof(float) : 0;
    }
    return (int)kv_arrays(m);
}

/* Copy-on-write copies a block's codes and, for I8, its scales. */
void loom_model_copy_blocks(loom_model_t *m, const int32_t *src, const int32_t *dst, int n) {
    if (loom_model_kv_block_contiguous(m)) { /* one copy per block */
        const size_t span = loom_model_kv_block_bytes(m, m->block_size);
        for (int i = 0; i < n; i++) {
            LOOM_ASSERT(src[i] >= 0 && src[i] < m->n_blocks && dst[i] >= 0 && dst[i] < m->n_blocks);
            loom_backend_copy(m->be, (char *)m->kv_mem + (size_t)dst[i] * span,
                              (char *)m->kv_mem + (size_t)src[i] * span, span);
        }
        return;
    }
    const size_t heads = (size_t)m->block_size * m->dims.n_kv_heads; /* token-heads per block */
    const size_t code_bytes = heads * m->cfg.head_dim * loom_dtype_size(m->opt.kv_dtype);
    const size_t vcode_bytes = heads * kv_vd(m) * loom_dtype_size(m->opt.kv_dtype);
    for (int i = 0; i < n; i++) {
        LOOM_ASSERT(src[i] >= 0 && src[i] < m->n_blocks && dst[i] >= 0 && dst[i] < m->n_blocks);
        const size_t s = (size_t)src[i], d = (size_t)dst[i];
        for (int l = 0; l < m->dims.n_layers; l++) {
            loom_kv_layer_t *kv = &m->layers[l].kv;
            loom_backend_copy(m->be, (char *)kv->k + d * code_bytes, (char *)kv->k + s * code_bytes,
                              code_bytes);
            if (kv->v != kv->k)
                loom_backend_copy(m->be, (char *)kv->v + d * vcode_bytes, (char *)kv->v + s * vcode_bytes,
                                  vcode_bytes);
            if (kv->k_scale) {
                loom_backend_copy(m->be, kv->k_scale + d * heads, kv->k_scale + s * heads,
                                  heads * sizeof(float));
                if (kv->v_scale != kv->k_scale)
                    loom_backend_copy(m->be, kv->v_scale + d * heads, kv->v_scale + s * heads,
                                      heads * sizeof(float));
            }
        }
    }
}
