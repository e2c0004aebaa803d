/* Paged GQA attention (see attention.h). Per task, block by block of the
 * sequence's block table: pass 1 computes the scaled scores q·k of every
 * cached position [0, pos] for each query head of the task into scratch,
 * four keys at a time; a numerically stable softmax follows (subtract the
 * max, exp, sum); pass 2 accumulates the value rows weighted by the
 * unnormalised probabilities, one KV block (B rows, in L1) at a time, and
 * divides by the sum at the end. Each K and V row is read from memory once
 * per task, for all its heads.
 * A BF16 or I8 cache is widened to float32 one block of this KV head at a
 * time (B x hd floats in the task's scratch, in L1), so the f32 loops run
 * unchanged on half or a quarter of the bytes.
 * Decode napkin math: 2 * ctx * hd * e bytes of K/V per KV head (e = 4 f32,
 * 2 bf16, 1 + 4/hd int8), and 4 * ctx * hd FLOPs per query head. */
#include "kernels/cpu/attention.h"

#include "common/util.h"
#include "kernels/cpu/vec.h"

int loom_cpu_attention_heads_per_task(const loom_attn_args_t *a, int n_threads) {
    const int group = a->n_heads / a->n_kv_heads;
    int hpt = group;
    for (; hpt > 1; hpt--) {
        if (group % hpt) continue;
        if ((int64_t)a->n * (a->n_heads / hpt) >= 2 * (int64_t)n_threads) break;
    }
    return hpt;
}

size_t loom_cpu_attention_scratch_floats(const loom_attn_args_t *a, int heads_per_task) {
    size_t tile = a->kv.dtype == LOOM_DT_F32 ? 0 : (size_t)a->block_size * (size_t)a->head_dim;
    return (size_t)heads_per_task * ((size_t)(a->max_ctx > 0 ? a->max_ctx : 1) + 1) + tile;
}

/* Asks for the next block's rows of this KV head while the current block is
 * computed: the rows are nkv*hd elements apart, a stride the hardware
 * prefetchers do not follow across pages. */
static void prefetch_block(const void *cache, size_t esize, const int32_t *bt, int next_p0, int L,
                           int B, int64_t kv_dim, int kvh, int hd) {
    if (next_p0 >= L) return;
    const int64_t row_bytes = kv_dim * (int64_t)esize;
    const char *row = (const char *)cache + (int64_t)bt[next_p0 / B] * B * row_bytes +
                      (int64_t)kvh * hd * (int64_t)esize;
    const int np = LOOM_MIN(B, L - next_p0);
    const int64_t bytes = (int64_t)hd * (int64_t)esize;
    for (int p = 0; p < np; p++, row += row_bytes)
        for (int64_t off = 0; off < bytes; off += 64)
            __builtin_prefetch(row + off, 0, 3);
}

/* The rows [p0, p0 + np) of KV head kvh in one cache (K or V) as float32:
 * straight from an F32 cache (rows *stride_out apart), else widened into
 * tile (rows hd apart). */
static const float *kv_rows(const loom_attn_args_t *a, const void *cache, const float *scales,
                            const int32_t *bt, int p0, int np, int kvh, float *tile,
                            int64_t *stride_out) {
    const int hd = a->head_dim, B = a->block_size, nkv = a->n_kv_heads;
    const int64_t kv_dim = (int64_t)nkv * hd, slot0 = (int64_t)bt[p0 / B] * B + p0 % B;
    if (a->kv.dtype == LOOM_DT_F32) {
        *stride_out = kv_dim;
        return (const float *)cache + slot0 * kv_dim + (int64_t)kvh * hd;
    }
    *stride_out = hd;
    for (int p = 0; p < np; p++) {
        const int64_t e = (slot0 + p) * kv_dim + (int64_t)kvh * hd;
        if (a->kv.dtype == LOOM_DT_BF16)
            loom_vec_bf16_to_f32(tile + (int64_t)p * hd, (const uint16_t *)cache + e, hd);
        else
            loom_vec_i8_to_f32(tile + (int64_t)p * hd, (const int8_t *)cache + e,
                               scales[(slot0 + p) * nkv + kvh], hd);
    }
    return tile;
}

void loom_cpu_attention_task(const loom_attn_args_t *a, int hpt, int task, float *scores) {
    const int nh = a->n_heads, hd = a->head_dim, B = a->block_size;
    const int group = nh / a->n_kv_heads, tasks_per_token = nh / hpt;
    const int i = task / tasks_per_token, h0 = (task % tasks_per_token) * hpt, kvh = h0 / group;
    const int64_t kv_dim = (int64_t)a->n_kv_heads * hd;
    const int32_t *bt = a->block_tables + (int64_t)a->tok_seq[i] * a->max_blocks;
    const int L = a->tok_pos[i] + 1;
    LOOM_ASSERT(L >= 1 && L <= a->max_ctx);
    LOOM_ASSERT(a->kv.dtype == LOOM_DT_F32 || a->kv.dtype == LOOM_DT_BF16 ||
                (a->kv.dtype == LOOM_DT_I8 && a->kv.k_scale && a->kv.v_scale));
    const float *q = a->q + (int64_t)i * a->q_stride + (int64_t)h0 * hd;
    float *out = a->out + (int64_t)i * a->out_stride + (int64_t)h0 * hd;
    const float scale = a->scale;
    const size_t esize = loom_dtype_size(a->kv.dtype);
    float *inv_sum = scores + (int64_t)hpt * a->max_ctx; /* (hpt) after the scores */
    float *tile = inv_sum + hpt;                         /* (B, hd) when widening */

    for (int p0 = 0; p0 < L; p0 += B) {
        const int np = LOOM_MIN(B, L - p0);
        int64_t ks;
        const float *k = kv_rows(a, a->kv.k, a->kv.k_scale, bt, p0, np, kvh, tile, &ks);
        prefetch_block(a->kv.k, esize, bt, p0 + B, L, B, kv_dim, kvh, hd);
        for (int g = 0; g < hpt; g++) {
            const float *qg = q + (int64_t)g * hd;
            float *s = scores + (int64_t)g * L + p0;
            int p = 0;
            for (; p + 4 <= np; p += 4) {
                loom_vec_dot4(qg, k + p * ks, ks, hd, s + p);
                for (int j = 0; j < 4; j++)
                    s[p + j] *= scale;
            }
            for (; p < np; p++)
                s[p] = loom_vec_dot(qg, k + p * ks, hd) * scale;
        }
    }
    for (int g = 0; g < hpt; g++) {
        float *s = scores + (int64_t)g * L;
        inv_sum[g] = 1.0f / loom_vec_exp_sub_sum(s, L, loom_vec_max(s, L));
    }
    for (int g = 0; g < hpt; g++)
        for (int d = 0; d < hd; d++)
            out[(int64_t)g * hd + d] = 0.0f;
    for (int p0 = 0; p0 < L; p0 += B) {
        const int np = LOOM_MIN(B, L - p0);
        int64_t vs;
        const float *v = kv_rows(a, a->kv.v, a->kv.v_scale, bt, p0, np, kvh, tile, &vs);
        prefetch_block(a->kv.v, esize, bt, p0 + B, L, B, kv_dim, kvh, hd);
        for (int g = 0; g < hpt; g++)
            loom_vec_wsum_rows(out + (int64_t)g * hd, scores + (int64_t)g * L + p0, v, vs, np, hd);
    }
    for (int g = 0; g < hpt; g++)
        loom_vec_scale(out + (int64_t)g * hd, inv_sum[g], out + (int64_t)g * hd, hd);
}
