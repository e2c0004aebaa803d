/* The CUDA kernels' per-element math (kernels/cuda/opmath.h), run on the
 * CPU: the soft cap, activations and clamped SwiGLU against float64 and the
 * CPU backend's ops; the int8 KV quantiser bit for bit against the CPU
 * backend's kv_write; the window and split key ranges; and the attention
 * kernels' online softmax -- the decode kernel's 8 warps of 32 keys, the
 * tile kernel's rows against 32-key steps, flash-decoding splits and their
 * combine, the sink folded in at the end, and the wide kernel's tiles of
 * (token, head) rows over MLA's latent rows -- emulated with the same
 * helpers and tile boundaries and compared with the CPU backend's attention
 * on odd shapes with windows, soft caps, sinks and int8 caches; and the
 * FA2-style prefill kernel (flash.cu), replayed lane by lane through
 * flash.h's fragment layouts and per-tile update against a float64
 * softmax(QK^T)V. Needs no GPU and no CUDA toolkit. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "kernels/backend.h"
#include "kernels/cuda/flash.h"
#include "kernels/cuda/fp8act.h"
#include "kernels/cuda/opmath.h"
#include "kernels/cuda/qformat.h"
#include "kernels/cuda/qmma.h"
#include "kernels/quant.h"
#include "tests/test.h"
#include "worker/moe_ds.h"

static unsigned long long g_st = 0x9e3779b97f4a7c15ull;

static loom_backend_t *cpu_backend(void) {
    loom_backend_config_t cfg = {.version = LOOM_BACKEND_CONFIG_VERSION,
                                 .kind = LOOM_DEVICE_CPU,
                                 .n_threads = 1,
                                 .weight_dtype = LOOM_DT_F32};
    loom_backend_t *be = NULL;
    loom_err_t err = {0};
    if (loom_backend_create(&cfg, &be, &err) != LOOM_OK) return NULL;
    return be;
}

static double act64(int act, double x) {
    switch (act) {
    case LOOM_OM_ACT_GELU:
        return 0.5 * x * (1.0 + erf(x / sqrt(2.0)));
    case LOOM_OM_ACT_GELU_TANH:
        return 0.5 * x *
               (1.0 + tanh(sqrt(2.0 / 3.14159265358979323846) * (x + 0.044715 * x * x * x)));
    case LOOM_OM_ACT_QUICK_GELU:
        return x / (1.0 + exp(-1.702 * x));
    case LOOM_OM_ACT_RELU:
        return x > 0 ? x : 0.0;
    case LOOM_OM_ACT_RELU2:
        return x > 0 ? x * x : 0.0;
    default:
        return x / (1.0 + exp(-x));
    }
}

/* Element math against float64, and the gated ops against the CPU backend. */
static void test_elementwise(void) {
    for (int i = 0; i < 4000; i++) {
        const float x = test_randf(&g_st, 60.0f), cap = i % 2 ? 30.0f : 50.0f;
        const double want = cap * tanh((double)x / cap);
        CHECKF(fabs(loom_om_softcap(x, cap) - want) <= 1e-6 + 1e-5 * fabs(want), "softcap(%g, %g)",
               (double)x, (double)cap);
        CHECK(loom_om_softcap(x, 0.0f) == x);
        const float g = test_randf(&g_st, 8.0f);
        for (int act = LOOM_OM_ACT_SILU; act <= LOOM_OM_ACT_RELU2; act++) {
            const double w = act64(act, g);
            CHECKF(fabs(loom_om_act(act, g) - w) <= 1e-6 + 1e-5 * fabs(w),
                   "act %d (%g): %g, want %g", act, (double)g, (double)loom_om_act(act, g), w);
        }
        const float u = test_randf(&g_st, 12.0f), lim = 7.0f, al = 1.702f;
        const double gc = g < lim ? g : lim, uc = u < -lim ? -lim : u > lim ? lim : u;
        const double sw = (uc + 1.0) * gc / (1.0 + exp(-al * gc));
        CHECKF(fabs(loom_om_swiglu_clamp(g, u, al, lim) - sw) <= 1e-5 + 1e-5 * fabs(sw),
               "swiglu_clamp(%g, %g)", (double)g, (double)u);
        const float f = test_randf(&g_st, 1000.0f);
        CHECK(loom_om_fp8_clamp(f) == (f > 448.0f ? 448.0f : f < -448.0f ? -448.0f : f));
    }
    loom_backend_t *be = cpu_backend();
    REQUIRE(be);
    const int n = 3, hidden = 37; /* odd: the CPU's SIMD loops and their tails */
    float gu[3 * 2 * 37], out[3 * 37], caps[3 * 37], ref[3 * 37];
    for (int i = 0; i < 2 * n * hidden; i++)
        gu[i] = test_randf(&g_st, 9.0f);
    for (int act = LOOM_OM_ACT_SILU; act <= LOOM_OM_ACT_RELU2; act++) {
        loom_op_act_mul(be, (loom_act_t)act, out, gu, n, hidden);
        for (int r = 0; r < n; r++)
            for (int j = 0; j < hidden; j++)
                ref[r * hidden + j] =
                    loom_om_act(act, gu[r * 2 * hidden + j]) * gu[r * 2 * hidden + hidden + j];
        char what[32];
        snprintf(what, sizeof what, "act_mul %d", act);
        test_allclose(what, ref, out, n * hidden, 1e-6, 1e-5);
    }
    loom_op_swiglu_clamp(be, out, gu, n, hidden, 1.702f, 7.0f);
    for (int r = 0; r < n; r++)
        for (int j = 0; j < hidden; j++)
            ref[r * hidden + j] = loom_om_swiglu_clamp(
                gu[r * 2 * hidden + j], gu[r * 2 * hidden + hidden + j], 1.702f, 7.0f);
    test_allclose("swiglu_clamp", ref, out, n * hidden, 1e-6, 1e-5);
    for (int i = 0; i < n * hidden; i++)
        caps[i] = gu[i] * 10.0f;
    loom_op_softcap(be, caps, n * hidden, 30.0f);
    for (int i = 0; i < n * hidden; i++)
        ref[i] = loom_om_softcap(gu[i] * 10.0f, 30.0f);
    test_allclose("softcap", ref, caps, n * hidden, 1e-6, 1e-5);
    loom_backend_destroy(&be);
}

/* The int8 quantiser is the CPU backend's, code for code and scale for scale. */
static void test_i8_kv(void) {
    loom_backend_t *be = cpu_backend();
    REQUIRE(be);
    enum { NKV = 3, HD = 40, NT = 5 };
    int8_t kc[NT * NKV * HD], vc[NT * NKV * HD];
    float ks[NT * NKV], vs[NT * NKV], k[NT * NKV * HD], v[NT * NKV * HD];
    for (int i = 0; i < NT * NKV * HD; i++) {
        k[i] = test_randf(&g_st, 4.0f);
        v[i] = i < NKV * HD ? 0.0f : test_randf(&g_st, 0.01f); /* an all-zero token, small values */
    }
    int32_t slots[NT] = {4, 0, 2, 1, 3};
    loom_kv_layer_t kv = {.k = kc, .v = vc, .k_scale = ks, .v_scale = vs, .dtype = LOOM_DT_I8};
    loom_op_kv_write(be, &kv, k, v, NKV * HD, slots, NT, NKV, HD);
    for (int t = 0; t < NT; t++)
        for (int h = 0; h < NKV; h++)
            for (int which = 0; which < 2; which++) {
                const float *x = (which ? v : k) + (t * NKV + h) * HD;
                float amax = 0.0f;
                for (int j = 0; j < HD; j++)
                    amax = fmaxf(amax, fabsf(x[j]));
                const float sc = loom_om_i8_scale(amax), inv = loom_om_i8_inv(amax);
                const float *scales = which ? vs : ks;
                const int8_t *codes = (which ? vc : kc) + (slots[t] * NKV + h) * HD;
                CHECKF(scales[slots[t] * NKV + h] == sc, "token %d head %d: scale", t, h);
                for (int j = 0; j < HD; j++)
                    CHECKF(codes[j] == loom_om_i8_code(x[j], inv),
                           "token %d head %d elem %d: code %d vs %d", t, h, j, codes[j],
                           loom_om_i8_code(x[j], inv));
            }
    CHECK(loom_om_i8_code(0.5f, 1.0f) == 0 && loom_om_i8_code(1.5f, 1.0f) == 2 &&
          loom_om_i8_code(-2.5f, 1.0f) == -2);
    CHECK(loom_om_i8_code(1000.0f, 1.0f) == 127 && loom_om_i8_code(-1000.0f, 1.0f) == -127);
    loom_backend_destroy(&be);
}

/* Window bounds and split slices: the slices tile [lo, hi) in order, whole
 * steps of 32 keys except the last. */
static void test_ranges(void) {
    CHECK(loom_om_window_lo(10, 0) == 0 && loom_om_window_lo(10, 11) == 0 &&
          loom_om_window_lo(10, 4) == 7);
    CHECK(loom_om_window_lo(0, 1) == 0 && loom_om_window_lo(5, 1) == 5);
    for (int lo = 0; lo < 70; lo += 7)
        for (int hi = lo + 1; hi < lo + 600; hi += 37)
            for (int ns = 1; ns <= 32; ns++) {
                int next = lo, bad = 0;
                for (int s = 0; s < ns; s++) {
                    int k0, k1;
                    loom_om_split_range(lo, hi, ns, s, &k0, &k1);
                    if (k0 >= k1) continue; /* an empty slice past the end */
                    bad |= k0 != next || ((k1 - k0) % LOOM_OM_KEYS && k1 != hi);
                    next = k1;
                }
                CHECKF(!bad && next == hi, "lo %d hi %d n_split %d", lo, hi, ns);
            }
}

/* --- the attention kernels' online softmax, emulated ------------------------------- */

typedef struct {
    int nh, nkv, hd, B, max_blocks, window;
    float scale, softcap;
    const float *q, *sinks;
    int q_stride;
    loom_kv_layer_t kv;
    const int32_t *bt, *tok_seq, *tok_pos;
} emu_t;

typedef struct {
    float m, l;
    double o[LOOM_OM_WIDE_MAX_HD]; /* float accumulators, widened only for storage */
} state_t;

static float kv_elem(const emu_t *e, int which, int slot, int kvh, int d) {
    const int64_t off = ((int64_t)slot * e->nkv + kvh) * e->hd + d;
    if (e->kv.dtype == LOOM_DT_I8) {
        const int8_t *c = which ? e->kv.v : e->kv.k;
        return (float)c[off];
    }
    return ((const float *)(which ? e->kv.v : e->kv.k))[off];
}
static float kv_scale(const emu_t *e, int which, int slot, int kvh) {
    if (e->kv.dtype != LOOM_DT_I8) return 1.0f;
    return (which ? e->kv.v_scale : e->kv.k_scale)[(int64_t)slot * e->nkv + kvh];
}

static int slot_of(const emu_t *e, int seq, int key) {
    const int blk = e->bt[seq * e->max_blocks + key / e->B];
    return blk < 0 ? -1 : blk * e->B + key % e->B;
}

/* One online-softmax step over keys [kb, kb + nk) of [.., k1) for query row
 * (token i, head h), masking keys outside [lo, pos]: what a warp (decode
 * kernel) or a row's owner (tile and wide kernels) does per step. */
static void step(const emu_t *e, state_t *st, int i, int h, int kb, int nk, int k1, int lo, int pos) {
    const int kvh = h / (e->nh / e->nkv), seq = e->tok_seq[i];
    const float *q = e->q + (int64_t)i * e->q_stride + (int64_t)h * e->hd;
    float s[LOOM_OM_KEYS], mx = -INFINITY;
    int slot[LOOM_OM_KEYS];
    for (int j = 0; j < nk; j++) {
        const int key = kb + j;
        slot[j] = key < k1 && key >= lo && key <= pos ? slot_of(e, seq, key) : -1;
        s[j] = -INFINITY;
        if (slot[j] < 0) continue;
        float acc = 0.0f;
        for (int d = 0; d < e->hd; d++)
            acc += q[d] * e->scale * kv_elem(e, 0, slot[j], kvh, d);
        s[j] = loom_om_softcap(acc * kv_scale(e, 0, slot[j], kvh), e->softcap);
        mx = fmaxf(mx, s[j]);
    }
    const float mn = fmaxf(st->m, mx);
    const float alpha = mn == -INFINITY ? 1.0f : expf(st->m - mn);
    float sum = 0.0f;
    for (int d = 0; d < e->hd; d++)
        st->o[d] *= alpha;
    for (int j = 0; j < nk; j++) {
        if (slot[j] < 0) continue;
        const float p = expf(s[j] - mn);
        sum += p;
        const float pv = p * kv_scale(e, 1, slot[j], kvh);
        for (int d = 0; d < e->hd; d++)
            st->o[d] += pv * kv_elem(e, 1, slot[j], kvh, d);
    }
    st->l = st->l * alpha + sum;
    st->m = mn;
}

/* Merges b into a (the warps' merge, the combine kernel). */
static void merge(state_t *a, const state_t *b, int hd) {
    const float M = fmaxf(a->m, b->m);
    const float fa = loom_om_rescale(a->m, M), fb = loom_om_rescale(b->m, M);
    a->l = a->l * fa + b->l * fb;
    for (int d = 0; d < hd; d++)
        a->o[d] = a->o[d] * fa + b->o[d] * fb;
    a->m = M;
}

static void init(state_t *st, int hd) {
    st->m = -INFINITY;
    st->l = 0.0f;
    for (int d = 0; d < hd; d++)
        st->o[d] = 0.0;
}

/* Output row i of head h: n_split slices of the key range [rlo, rhi) (the
 * unit's: one token's own range in the decode kernel, the tile's rows' hull
 * in the tile and wide kernels), each walked by 8 warps taking every 8th
 * step of 32 keys (decode) or by one owner in order (tile: steps of 32
 * keys; wide: of LOOM_OM_WIDE_KEYS), merged, combined, and the sink folded
 * in. */
static void emulate_row(const emu_t *e, int i, int h, int rlo, int rhi, int n_split, int tile, int wide,
                        float *out) {
    const int pos = e->tok_pos[i], lo = loom_om_window_lo(pos, e->window);
    state_t tot, part, w;
    init(&tot, e->hd);
    for (int s = 0; s < n_split; s++) {
        int k0, k1;
        loom_om_split_range(rlo, rhi, n_split, s, &k0, &k1);
        init(&part, e->hd);
        if (k0 < k1) {
            const int warps = tile || wide ? 1 : 8, nk = wide ? LOOM_OM_WIDE_KEYS : LOOM_OM_KEYS;
            for (int wi = 0; wi < warps; wi++) {
                init(&w, e->hd);
                for (int kb = k0 + wi * nk; kb < k1; kb += warps * nk)
                    step(e, &w, i, h, kb, nk, k1, lo, pos);
                merge(&part, &w, e->hd);
            }
        }
        merge(&tot, &part, e->hd);
    }
    float f = 1.0f;
    if (e->sinks) f = loom_om_sink_fold(&tot.m, &tot.l, e->sinks[h]);
    for (int d = 0; d < e->hd; d++)
        out[d] = tot.l > 0.0f ? (float)(tot.o[d] * f) / tot.l : 0.0f;
}

typedef struct {
    int nh, nkv, hd, B, window, sinks, tq, n_split;
    float softcap;
    loom_dtype_t dt;
    int latent; /* MLA's latent layout: V is K's memory (and scales), one KV head */
} acase_t;

static void run_case(const acase_t *c) {
    loom_backend_t *be = cpu_backend();
    REQUIRE(be);
    /* two sequences: a decode token at 150 and a prefill chunk of 45 tokens at 60..104 */
    enum { NSEQ = 2 };
    const int n = 1 + 45, max_blocks = (151 + c->B - 1) / c->B, n_blocks = NSEQ * max_blocks;
    const int nh = c->nh, nkv = c->nkv, hd = c->hd, kv_dim = nkv * hd;
    int32_t *bt = malloc(sizeof(int32_t) * NSEQ * max_blocks), tok_seq[46], tok_pos[46],
            slots[151 + 105];
    for (int b = 0; b < NSEQ * max_blocks; b++)
        bt[b] = (b * 7 + 3) % n_blocks; /* scattered blocks */
    const size_t es = c->dt == LOOM_DT_I8 ? 1 : 4, cells = (size_t)n_blocks * c->B;
    loom_kv_layer_t kv = {.k = malloc(cells * kv_dim * es), .dtype = c->dt};
    kv.v = c->latent ? kv.k : malloc(cells * kv_dim * es);
    if (c->dt == LOOM_DT_I8) {
        kv.k_scale = malloc(cells * nkv * sizeof(float));
        kv.v_scale = c->latent ? kv.k_scale : malloc(cells * nkv * sizeof(float));
    }
    /* fill both sequences' caches through the CPU backend's kv_write */
    const int lens[NSEQ] = {151, 105};
    int ns = 0;
    for (int s = 0; s < NSEQ; s++)
        for (int p = 0; p < lens[s]; p++)
            slots[ns++] = bt[s * max_blocks + p / c->B] * c->B + p % c->B;
    float *kx = malloc(sizeof(float) * ns * kv_dim), *vx = malloc(sizeof(float) * ns * kv_dim);
    for (int e = 0; e < ns * kv_dim; e++) {
        kx[e] = test_randf(&g_st, 1.5f);
        vx[e] = c->latent ? kx[e] : test_randf(&g_st, 1.0f); /* one row, written twice */
    }
    loom_op_kv_write(be, &kv, kx, vx, kv_dim, slots, ns, nkv, hd);
    tok_seq[0] = 0, tok_pos[0] = 150;
    for (int j = 0; j < 45; j++)
        tok_seq[1 + j] = 1, tok_pos[1 + j] = 60 + j;
    const int q_stride = nh * hd + 5;
    float *q = malloc(sizeof(float) * n * q_stride), *out = malloc(sizeof(float) * n * nh * hd),
          *emu = malloc(sizeof(float) * n * nh * hd), sinks[64];
    for (int e = 0; e < n * q_stride; e++)
        q[e] = test_randf(&g_st, 2.0f);
    for (int h = 0; h < nh; h++)
        sinks[h] = test_randf(&g_st, 3.0f);
    loom_attn_args_t a = {.n = n,
                          .n_heads = nh,
                          .n_kv_heads = nkv,
                          .head_dim = hd,
                          .scale = 1.0f / sqrtf((float)hd),
                          .q = q,
                          .q_stride = q_stride,
                          .out = out,
                          .out_stride = nh * hd,
                          .kv = kv,
                          .block_size = c->B,
                          .tok_seq = tok_seq,
                          .tok_pos = tok_pos,
                          .block_tables = bt,
                          .max_blocks = max_blocks,
                          .max_ctx = 151,
                          .window = c->window,
                          .softcap = c->softcap,
                          .sinks = c->sinks ? sinks : NULL};
    loom_op_attention(be, &a);
    const emu_t e = {.nh = nh,
                     .nkv = nkv,
                     .hd = hd,
                     .B = c->B,
                     .max_blocks = max_blocks,
                     .window = c->window,
                     .scale = a.scale,
                     .softcap = c->softcap,
                     .q = q,
                     .sinks = a.sinks,
                     .q_stride = q_stride,
                     .kv = kv,
                     .bt = bt,
                     .tok_seq = tok_seq,
                     .tok_pos = tok_pos};
    /* units as attention.cu cuts them: the decode token alone; the chunk in
     * tiles of tq rows that never cross a multiple of tq (token index). The
     * wide kernel (head_dim above 256) takes every unit, of its own tq. */
    const int wide = hd > 256;
    CHECK(!wide || c->tq == loom_om_wide_tq(nh / nkv));
    for (int i = 0; i < n;) {
        int r = 1;
        while (c->tq > 1 && i + r < n && (i + r) % c->tq != 0 && tok_seq[i + r] == tok_seq[i])
            r++;
        int lo = 1 << 30, hi = 0;
        for (int t = i; t < i + r; t++) {
            lo = tok_pos[t] < lo ? tok_pos[t] : lo;
            hi = tok_pos[t] + 1 > hi ? tok_pos[t] + 1 : hi;
        }
        lo = loom_om_window_lo(lo, c->window);
        for (int t = i; t < i + r; t++)
            for (int h = 0; h < nh; h++) {
                const int rlo = r > 1 ? lo : loom_om_window_lo(tok_pos[t], c->window);
                const int rhi = r > 1 ? hi : tok_pos[t] + 1;
                emulate_row(&e, t, h, rlo, rhi, c->n_split, r > 1, wide,
                            emu + ((int64_t)t * nh + h) * hd);
            }
        i += r;
    }
    char what[160];
    snprintf(what, sizeof what,
             "emulated attention %s nh%d nkv%d hd%d B%d window%d softcap%g sinks%d tq%d split%d%s",
             loom_kv_dtype_name(c->dt), nh, nkv, hd, c->B, c->window, (double)c->softcap, c->sinks,
             c->tq, c->n_split, c->latent ? " latent" : "");
    test_allclose(what, emu, out, (long)n * nh * hd, 1e-5, 1e-4);
    free(q), free(out), free(emu), free(kx), free(vx), free(bt);
    if (c->latent) kv.v = NULL, kv.v_scale = NULL;
    free(kv.k), free(kv.v), free(kv.k_scale), free(kv.v_scale);
    loom_backend_destroy(&be);
}

static void test_attention_emulated(void) {
    const acase_t cases[] = {
        {4, 4, 16, 16, 0, 0, 1, 1, 0.0f, LOOM_DT_F32, 0}, /* plain */
        {6, 2, 20, 7, 0, 0, 21, 3, 0.0f,
         LOOM_DT_F32, 0}, /* GQA, odd B and hd, tiles of 21 rows, 3 splits */
        {8, 2, 32, 16, 33, 0, 16, 1, 0.0f, LOOM_DT_F32, 0},  /* Mistral-like window */
        {8, 4, 24, 5, 50, 0, 32, 7, 0.0f, LOOM_DT_F32, 0},   /* window inside a tile, 7 splits */
        {4, 2, 16, 16, 0, 0, 32, 2, 20.0f, LOOM_DT_F32, 0},  /* Gemma 2 soft cap */
        {4, 2, 16, 16, 17, 0, 32, 5, 20.0f, LOOM_DT_F32, 0}, /* Gemma 2's local layer: window + cap */
        {8, 2, 16, 16, 0, 1, 1, 4, 0.0f, LOOM_DT_F32, 0},    /* GPT-OSS sinks, splits */
        {8, 2, 16, 16, 40, 1, 32, 3, 0.0f,
         LOOM_DT_F32, 0},                                  /* GPT-OSS's banded layer: window + sinks */
        {4, 2, 40, 16, 0, 0, 16, 1, 0.0f, LOOM_DT_I8, 0},  /* int8 KV */
        {6, 3, 36, 9, 30, 1, 32, 6, 15.0f, LOOM_DT_I8, 0}, /* int8, everything at once */
        /* the wide kernel: MLA's latent rows (576: DeepSeek-V3's 512 + 64), MQA, V = K's memory; 16 heads
         * (one chunk, tq 1), 20 (a chunk and a partial one), 4 (tq 4: prefill tiles of 4 tokens) */
        {16, 1, 576, 16, 0, 0, 1, 1, 0.0f, LOOM_DT_F32, 1},
        {20, 1, 576, 7, 0, 0, 1, 5, 0.0f, LOOM_DT_F32, 1},
        {4, 1, 576, 16, 0, 0, 4, 3, 0.0f, LOOM_DT_I8, 1},
        /* and the rest of its arithmetic on wide GQA heads: separate V, windows, caps, sinks, splits */
        {8, 2, 288, 9, 40, 1, 4, 6, 20.0f, LOOM_DT_F32, 0},
        {6, 2, 300, 5, 0, 1, 5, 2, 0.0f, LOOM_DT_I8, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        run_case(&cases[i]);
}

/* --- the decode GEMV's variants ------------------------------------------------------------ */

/* gemv.cu's loops for every variant: the grid's warps take R rows each
 * (rows past the end masked), a lane walks its 16-byte vectors U at a time;
 * every (row, vector) is read exactly once, by lane v % 32, and each lane
 * meets its vectors of a row in increasing order, the same order for every
 * variant: so the variants give the same sums. */
static void test_gemv_plan(void) {
    static const int shapes[][2] = {{1, 8}, {7, 40}, {33, 4096 / 8}, {4096, 14336 / 8}, {5, 7}};
    for (int q = 0; q < 2; q++) { /* the float GEMV's variants, then the quantized one's */
        for (int variant = 0; variant < (q ? LOOM_OM_QGEMV_VARIANTS : LOOM_OM_GEMV_VARIANTS); variant++)
            for (int nt = 1; nt <= (q ? 8 : 4); nt++) {
                int R, U;
                if (q)
                    loom_om_qgemv_plan(variant, nt, &R, &U);
                else
                    loom_om_gemv_plan(variant, nt, &R, &U);
                CHECK(R >= 1 && U >= 1 && R * U >= (q ? 2 : 8) && R * U <= (q ? 8 : 16));
                if (q && nt > 2) { /* more tokens keep the default */
                    int R0, U0;
                    loom_om_qgemv_plan(0, nt, &R0, &U0);
                    CHECK(R == R0 && U == U0);
                }
                for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
                    const int64_t rows = shapes[s][0], nv = shapes[s][1];
                    const int64_t blocks = (rows + 8 * R - 1) / (8 * R);
                    unsigned char *seen = calloc((size_t)(rows * nv), 1);
                    int bad = 0;
                    for (int64_t b = 0; b < blocks; b++)
                        for (int warp = 0; warp < 8; warp++) {
                            const int64_t row0 = (b * 8 + warp) * R;
                            if (row0 >= rows) continue;
                            for (int lane = 0; lane < 32; lane++) {
                                int64_t last[4] = {-1, -1, -1, -1};
                                for (int64_t v0 = lane; v0 < nv; v0 += 32 * U)
                                    for (int u = 0; u < U; u++) {
                                        const int64_t v = v0 + u * 32;
                                        if (v >= nv) break;
                                        for (int r = 0; r < R; r++) {
                                            if (row0 + r >= rows) continue;
                                            bad += v % 32 != lane || v != last[r] + (last[r] < 0 ? lane + 1 : 32);
                                            last[r] = v;
                                            seen[(row0 + r) * nv + v]++;
                                        }
                                    }
                            }
                        }
                    for (int64_t e = 0; e < rows * nv; e++) bad += seen[e] != 1;
                    CHECKF(!bad, "%sgemv variant %d nt %d (R %d U %d) rows %lld vectors %lld: %d errors", q ? "q" : "",
                           variant, nt, R, U, (long long)rows, (long long)nv, bad);
                    free(seen);
                }
            }
    }
}

/* --- fp8 KV with per-tensor scales ----------------------------------------------------- */

/* The write's arithmetic, and the identity the attention kernels rely on:
 * attention over the dequantized cache (code * scale) equals attention
 * over the raw codes with q times K's scale and the output times V's. */
static void test_fp8_scale(void) {
    CHECK(loom_om_fp8_scale(0.0f) == 1.0f && loom_om_fp8_scale(-2.0f) == 1.0f &&
          loom_om_fp8_scale(INFINITY) == 1.0f && loom_om_fp8_scale(NAN) == 1.0f && loom_om_fp8_scale(2.5f) == 2.5f);
    for (int i = 0; i < 4000; i++) {
        const float x = test_randf(&g_st, 2000.0f), s = 2000.0f / 440.0f;
        CHECK(loom_om_fp8_store(x, 1.0f) == loom_om_fp8_clamp(x)); /* no scale: exactly the old write */
        const float st = loom_om_fp8_store(x, 1.0f / s);
        CHECKF(st == x * (1.0f / s) && fabsf(st) <= LOOM_OM_FP8_MAX, "store(%g, 1/%g) = %g", (double)x, (double)s,
               (double)st);
    }
    loom_backend_t *be = cpu_backend();
    REQUIRE(be);
    enum { NH = 6, NKV = 2, HD = 24, B = 8, CTX = 70, N = 3 };
    const float sk = 700.0f / 400.0f, sv = 900.0f / 400.0f;
    static float kd[CTX * NKV * HD], vd[CTX * NKV * HD], kc[CTX * NKV * HD], vc[CTX * NKV * HD];
    for (int e = 0; e < CTX * NKV * HD; e++) {
        kc[e] = loom_fp8_e4m3_to_f32(loom_f32_to_fp8_e4m3(loom_om_fp8_store(test_randf(&g_st, 700.0f), 1.0f / sk)));
        vc[e] = loom_fp8_e4m3_to_f32(loom_f32_to_fp8_e4m3(loom_om_fp8_store(test_randf(&g_st, 900.0f), 1.0f / sv)));
        kd[e] = kc[e] * sk, vd[e] = vc[e] * sv;
    }
    int32_t bt[(CTX + B - 1) / B], seq[N] = {0, 0, 0}, pos[N] = {CTX - 1, 30, 0};
    for (int b = 0; b < (CTX + B - 1) / B; b++) bt[b] = b;
    float q[N * NH * HD], qk[N * NH * HD], ref[N * NH * HD], out[N * NH * HD];
    for (int e = 0; e < N * NH * HD; e++) q[e] = test_randf(&g_st, 3.0f / 700.0f), qk[e] = q[e] * sk;
    loom_attn_args_t a = {.n = N, .n_heads = NH, .n_kv_heads = NKV, .head_dim = HD, .scale = 0.2f, .q = q,
                          .q_stride = NH * HD, .out = ref, .out_stride = NH * HD,
                          .kv = {.k = kd, .v = vd, .dtype = LOOM_DT_F32}, .block_size = B, .tok_seq = seq,
                          .tok_pos = pos, .block_tables = bt, .max_blocks = (CTX + B - 1) / B, .max_ctx = CTX};
    loom_op_attention(be, &a);
    a.q = qk, a.out = out, a.kv.k = kc, a.kv.v = vc;
    loom_op_attention(be, &a);
    for (int e = 0; e < N * NH * HD; e++) out[e] *= sv;
    test_allclose("fp8 per-tensor scales folded into q and the output", ref, out, N * NH * HD, 1e-3, 1e-5);
    loom_backend_destroy(&be);
}

/* --- DeepSeekMoE's router, as moe.cu's ds_route_kernel runs it ---------------------- */

/* The warp's arg-max: 32 lanes' candidates folded by the shuffle tree of
 * warp_best (lane ^ 16, ^ 8, ...), every lane ending with the same. */
static void warp_best_emu(float *v, int *idx, int none) {
    for (int o = 16; o > 0; o >>= 1) {
        float nv[32];
        int ni[32];
        for (int l = 0; l < 32; l++) {
            nv[l] = v[l], ni[l] = idx[l];
            if (loom_om_better(v[l ^ o], idx[l ^ o], v[l], idx[l], none)) nv[l] = v[l ^ o], ni[l] = idx[l ^ o];
        }
        memcpy(v, nv, sizeof nv), memcpy(idx, ni, sizeof ni);
    }
}

/* ds_route_kernel for one token: lanes, their strided experts and taken
 * bits, the groups one per lane, the arg-max rounds and the ascending
 * ranks, the weights' sum in rank order. */
static void ds_route_emu(const loom_moe_ds_route_t *r, const float *l, const float *bias, int *ids, float *w) {
    const int E = r->n_experts, K = r->top_k, G = r->n_group, TG = r->topk_group;
    float sc[1024], ch[1024];
    if (r->sigmoid) {
        for (int e = 0; e < E; e++) sc[e] = 1.0f / (1.0f + expf(-l[e]));
    } else {
        float mx = -INFINITY;
        for (int e = 0; e < E; e++) mx = fmaxf(mx, l[e]);
        double lane_sum[32] = {0}, sum = 0;
        for (int e = 0; e < E; e++) lane_sum[e % 32] += sc[e] = expf(l[e] - mx);
        for (int o = 16; o > 0; o >>= 1) { /* the xor tree: every lane ends with the same sum */
            double ns[32];
            for (int ln = 0; ln < 32; ln++) ns[ln] = lane_sum[ln] + lane_sum[ln ^ o];
            memcpy(lane_sum, ns, sizeof ns);
        }
        sum = lane_sum[0];
        for (int e = 0; e < E; e++) sc[e] = (float)(sc[e] / sum);
    }
    for (int e = 0; e < E; e++) ch[e] = sc[e] + (bias ? bias[e] : 0.0f);
    const int method = (int)r->method, grouped = method != LOOM_OM_DS_GREEDY && G > 1, per = grouped ? E / G : E;
    unsigned keep = 0xffffffffu;
    if (grouped) {
        float gs[32];
        int gtaken[32];
        for (int ln = 0; ln < 32; ln++) {
            gs[ln] = ln < G ? loom_om_ds_group_score(ch + ln * per, per, method == LOOM_OM_DS_NOAUX_TC) : 0.0f;
            gtaken[ln] = ln >= G;
        }
        keep = 0;
        for (int j = 0; j < TG; j++) {
            float v[32];
            int idx[32];
            for (int ln = 0; ln < 32; ln++) v[ln] = gs[ln], idx[ln] = gtaken[ln] ? G : ln;
            warp_best_emu(v, idx, G);
            keep |= 1u << idx[0];
            gtaken[idx[0]] = 1;
        }
    }
    unsigned taken[32] = {0};
    for (int e = 0; e < E; e++)
        if (!(keep >> (e / per) & 1u)) taken[e % 32] |= 1u << (e / 32);
    int mine[32];
    float msc[32];
    for (int j = 0; j < K; j++) {
        float v[32];
        int idx[32];
        for (int ln = 0; ln < 32; ln++) {
            v[ln] = 0.0f, idx[ln] = E;
            for (int q = 0, e = ln; e < E; q++, e += 32)
                if (!(taken[ln] >> q & 1u) && loom_om_better(ch[e], e, v[ln], idx[ln], E)) v[ln] = ch[e], idx[ln] = e;
        }
        warp_best_emu(v, idx, E);
        const int be = idx[0];
        taken[be & 31] |= 1u << (be >> 5);
        mine[j] = be, msc[j] = sc[be];
    }
    int rank[32];
    for (int j = 0; j < K; j++) {
        rank[j] = 0;
        for (int i = 0; i < K; i++) rank[j] += mine[i] < mine[j];
    }
    double sum = 0;
    for (int rr = 0; rr < K; rr++)
        for (int j = 0; j < K; j++)
            if (rank[j] == rr) {
                sum += (double)msc[j];
                break;
            }
    for (int j = 0; j < K; j++) {
        ids[rank[j]] = mine[j];
        w[rank[j]] = loom_om_ds_weight(msc[j], sum, r->sigmoid && r->norm_topk_prob, r->routed_scaling_factor);
    }
}

/* Against the host router (worker/moe_ds.c): V3's and Kimi-K2's shapes (sigmoid, bias, noaux_tc), V2's
 * (softmax, greedy and group-limited), transformers' tiny test shape; ties in the logits and in the groups. */
static void test_ds_route(void) {
    static const loom_moe_ds_route_t shapes[] = {
        {256, 8, 1, LOOM_DS_TOPK_NOAUX_TC, 8, 4, 1, 2.5f},     /* DeepSeek-V3 */
        {384, 8, 1, LOOM_DS_TOPK_NOAUX_TC, 1, 1, 1, 2.827f},   /* Kimi-K2: one group */
        {8, 2, 1, LOOM_DS_TOPK_NOAUX_TC, 2, 1, 1, 2.5f},       /* transformers' test shape */
        {160, 6, 0, LOOM_DS_TOPK_GROUP_LIMITED, 8, 3, 0, 16.0f}, /* DeepSeek-V2 */
        {64, 6, 0, LOOM_DS_TOPK_GREEDY, 1, 1, 0, 1.0f},        /* V2-Lite */
        {1024, 32, 1, LOOM_DS_TOPK_NOAUX_TC, 32, 3, 1, 1.0f},  /* the kernel's limits */
        {64, 4, 1, LOOM_DS_TOPK_NOAUX_TC, 32, 2, 0, 1.0f},     /* groups of two */
    };
    CHECK(LOOM_OM_DS_GREEDY == (int)LOOM_DS_TOPK_GREEDY && LOOM_OM_DS_GROUP_LIMITED == (int)LOOM_DS_TOPK_GROUP_LIMITED &&
          LOOM_OM_DS_NOAUX_TC == (int)LOOM_DS_TOPK_NOAUX_TC);
    float l[1024], bias[1024], scratch[2048], w0[32], w1[32];
    int id0[32], id1[32];
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        const loom_moe_ds_route_t *r = &shapes[s];
        for (int trial = 0; trial < 60; trial++) {
            const int E = r->n_experts;
            for (int e = 0; e < E; e++) {
                l[e] = test_randf(&g_st, 4.0f);
                bias[e] = test_randf(&g_st, 0.3f);
                if (trial % 3 == 1 && e % 5 == 2) l[e] = l[e - 1]; /* ties */
                if (trial % 3 == 2) l[e] = (float)(e % 7) * 0.25f, bias[e] = 0.0f; /* many ties, groups too */
            }
            const float *b = r->sigmoid ? bias : NULL;
            loom_moe_route_deepseek(r, l, b, scratch, id0, w0);
            ds_route_emu(r, l, b, id1, w1);
            int same = 1;
            for (int k = 0; k < r->top_k; k++) same &= id0[k] == id1[k] && w0[k] == w1[k];
            CHECKF(same, "ds route shape %zu trial %d: ids/weights differ (first %d/%d %g/%g)", s, trial, id0[0],
                   id1[0], (double)w0[0], (double)w1[0]);
        }
    }
}


/* --- e4m3 decodes: software and the hardware conversion ------------------------------- */

/* An e4m3 byte by the format's definition (bias 7, subnormals m/8 * 2^-6,
 * S.1111.111 NaN, no infinities). */
static double e4m3_spec(int b) {
    const int e = (b >> 3) & 15, m = b & 7;
    const double v = e ? ldexp(1.0 + m / 8.0, e - 7) : ldexp(m / 8.0, -6);
    return b & 0x80 ? -v : v;
}

/* An IEEE binary16 from its bits, written out. */
static double f16_value(uint32_t h) {
    const int e = (int)((h >> 10) & 31u), m = (int)(h & 0x3ffu);
    double v;
    if (e == 31) v = m ? NAN : INFINITY;
    else v = e ? ldexp(1.0 + m / 1024.0, e - 15) : ldexp(m / 1024.0, -14);
    return h & 0x8000u ? -v : v;
}

/* Every code: the software decode (qformat.h, the FP8 GEMV below sm_89 and
 * the host) equals the definition; the f16 the hardware conversion
 * cvt.rn.f16x2.e4m3x2 gives (loom_qd_fp8_f16bits) holds that same value,
 * so the sm_89+ paths decode to the same floats; and the value is exact
 * in bf16, as the tensor-core kernel's tile keeps it. */
static void test_fp8_decode(void) {
    int bad = 0;
    for (int b = 0; b < 256; b++) {
        const int nan = (b & 0x7f) == 0x7f;
        const uint32_t h = loom_qd_fp8_f16bits((uint32_t)b);
        if (nan) {
            bad += !isnan(f16_value(h));
            bad += loom_qd_fp8((uint32_t)b) != (b & 0x80 ? -480.0f : 480.0f);
            continue;
        }
        const double v = e4m3_spec(b);
        float f4[4];
        loom_qd_fp8x4((uint32_t)b << 16, f4);
        float ff[4];
        loom_qd_fp8x4_fast((uint32_t)b << 8, ff); /* the host takes the software path */
        const uint32_t bf = loom_qm_bf16((float)v) << 16;
        float bv;
        memcpy(&bv, &bf, sizeof bv);
        const int ok = (double)loom_qd_fp8((uint32_t)b) == v && f16_value(h) == v && (double)f4[2] == v &&
                       (double)ff[1] == v && signbit(f16_value(h)) == signbit(v) && (double)bv == v &&
                       (double)loom_fp8_e4m3_to_f32((uint8_t)b) == v;
        if (!ok && bad < 5)
            fprintf(stderr, "code 0x%02x: spec %g, software %g, f16 %g (0x%04x), bf16 %g\n", b, v,
                    (double)loom_qd_fp8((uint32_t)b), f16_value(h), h, (double)bv);
        bad += !ok;
    }
    CHECKF(!bad, "%d e4m3 codes decode differently", bad);
}

/* --- the quantized small-n tensor-core kernel (qmma.cu) --------------------------------- */

/* The fragment layouts as the PTX ISA's tables for mma.m16n8k16 (.bf16)
 * state them, written out independently of qmma.h. */
static void ptx_a(int lane, int i, int *r, int *c) {
    const int g = lane >> 2, t = lane % 4;
    *r = (i == 0 || i == 1 || i == 4 || i == 5) ? g : g + 8;
    *c = i < 4 ? t * 2 + (i & 1) : t * 2 + 8 + (i & 1);
}
static void ptx_b(int lane, int i, int *k, int *n) {
    const int g = lane >> 2, t = lane % 4;
    *k = i < 2 ? t * 2 + (i & 1) : t * 2 + 8 + (i & 1);
    *n = g;
}
static void ptx_c(int lane, int i, int *r, int *n) {
    const int g = lane >> 2, t = lane % 4;
    *r = i < 2 ? g : g + 8;
    *n = t * 2 + (i & 1);
}

static float bf16_f(uint32_t h) {
    const uint32_t u = (h & 0xffffu) << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* One mma.sync.m16n8k16 of a warp as the PTX ISA defines it: the lanes'
 * registers placed by the tables above, D = A B + C (sums in double). */
static void mma_emu(float c[32][4], uint32_t a[32][4], uint32_t b[32][2]) {
    float A[16][16], B[16][8];
    for (int lane = 0; lane < 32; lane++) {
        for (int i = 0; i < 8; i++) {
            int r, k;
            ptx_a(lane, i, &r, &k);
            A[r][k] = bf16_f(a[lane][i / 2] >> (16 * (i & 1)));
        }
        for (int i = 0; i < 4; i++) {
            int k, n;
            ptx_b(lane, i, &k, &n);
            B[k][n] = bf16_f(b[lane][i / 2] >> (16 * (i & 1)));
        }
    }
    for (int lane = 0; lane < 32; lane++)
        for (int i = 0; i < 4; i++) {
            int r, n;
            ptx_c(lane, i, &r, &n);
            double d = c[lane][i];
            for (int k = 0; k < 16; k++) d += (double)A[r][k] * B[k][n];
            c[lane][i] = (float)d;
        }
}

typedef struct qm_case {
    int quant, with_min, group;
    int64_t rows, cols;
    int n, n_sms;
} qm_case_t;

/* qmma_kernel and qmma_reduce_kernel on the CPU: the grid of (row block,
 * split) blocks, each step's loads (qmma.h's load_rc and decode_word, as
 * store() runs them) into the bf16 tiles, the warps' fragment reads
 * (a_rc, b_kn) into mma_emu, the epilogue's c_rn scatter and the split
 * sums in order; against float64 over the reference dequantization. */
static void qmma_replay(const qm_case_t *k) {
    const int quant = k->quant, Q4 = quant == LOOM_QD_Q4, n = k->n, NT = loom_qm_nt(n);
    const int64_t rows = k->rows, cols = k->cols, group = Q4 ? k->group : cols;
    const int64_t row_bytes = Q4 ? cols / 2 : cols, gpr = cols / group;
    uint8_t *q = malloc((size_t)(rows * row_bytes));
    float *sc = malloc(sizeof(float) * (size_t)(rows * gpr)), *mn = k->with_min ? malloc(sizeof(float) * (size_t)(rows * gpr)) : NULL;
    float *x = malloc(sizeof(float) * (size_t)(n * cols));
    for (int64_t i = 0; i < rows * row_bytes; i++) {
        g_st = g_st * 6364136223846793005ull + 1442695040888963407ull;
        q[i] = (uint8_t)(g_st >> 33);
        if (quant == LOOM_QD_FP8 && (q[i] & 0x7f) == 0x7f) q[i] ^= 1; /* no NaN codes */
    }
    for (int64_t i = 0; i < rows * gpr; i++) {
        sc[i] = 0.01f + fabsf(test_randf(&g_st, 0.05f));
        if (mn) mn[i] = test_randf(&g_st, 0.2f);
    }
    for (int64_t i = 0; i < n * cols; i++) x[i] = test_randf(&g_st, 2.0f);

    const int ksplit = loom_qm_ksplit(rows, cols, k->n_sms);
    const int64_t ksteps = (cols + LOOM_QM_BK - 1) / LOOM_QM_BK, blocks = (rows + LOOM_QM_BM - 1) / LOOM_QM_BM;
    float *part = calloc((size_t)(ksplit * n * rows), sizeof(float)), *y = malloc(sizeof(float) * (size_t)(n * rows));
    enum { XS = LOOM_QM_BK + LOOM_QM_PAD };
    static uint32_t ws[LOOM_QM_BM * XS / 2], xs[LOOM_QM_MAX_N * XS / 2];
    static float acc[4][LOOM_QM_MAX_N / 8][32][4];
    int covered = 1;
    int64_t steps_seen = 0;
    for (int64_t bx = 0; bx < blocks; bx++)
        for (int split = 0; split < ksplit; split++) {
            const int64_t row0 = bx * LOOM_QM_BM;
            int64_t k0, k1;
            loom_qm_split_range(ksteps, ksplit, split, &k0, &k1);
            if (bx == 0) steps_seen += k1 > k0 ? k1 - k0 : 0;
            memset(acc, 0, sizeof acc);
            for (int64_t ks = k0; ks < k1; ks++) {
                memset(ws, 0xff, sizeof ws), memset(xs, 0xff, sizeof xs); /* stale tiles show up */
                for (int i = 0; i < loom_qm_loads(quant); i++) {
                    int r, c;
                    loom_qm_load_rc(quant, i, &r, &c);
                    const int64_t gr = row0 + r, gc = ks * LOOM_QM_BK + c;
                    uint32_t wd[4] = {0, 0, 0, 0};
                    float s = 0.0f, m = 0.0f;
                    if (gr < rows && gc < cols) {
                        memcpy(wd, q + gr * row_bytes + (Q4 ? gc / 2 : gc), 16);
                        if (Q4) s = sc[gr * gpr + gc / group], m = mn ? mn[gr * gpr + gc / group] : 0.0f;
                    }
                    const int wpw = Q4 ? 4 : 2;
                    uint32_t out[16];
                    for (int j = 0; j < 4; j++) loom_qm_decode_word(quant, mn != NULL, wd[j], s, m, out + j * wpw);
                    memcpy(ws + (r * XS + c) / 2, out, sizeof(uint32_t) * 4 * (size_t)wpw);
                }
                for (int i = 0; i < NT * LOOM_QM_BK / 4; i++) {
                    const int t = i / (LOOM_QM_BK / 4), c = (i % (LOOM_QM_BK / 4)) * 4;
                    const int64_t gc = ks * LOOM_QM_BK + c;
                    float v[4] = {0, 0, 0, 0};
                    if (t < n && gc < cols) memcpy(v, x + t * cols + gc, sizeof v);
                    xs[(t * XS + c) / 2] = loom_qm_pack(loom_qm_bf16(v[0]), loom_qm_bf16(v[1]));
                    xs[(t * XS + c) / 2 + 1] = loom_qm_pack(loom_qm_bf16(v[2]), loom_qm_bf16(v[3]));
                }
                for (int warp = 0; warp < 4; warp++)
                    for (int kk = 0; kk < LOOM_QM_BK; kk += 16) {
                        uint32_t a[32][4], b[32][2];
                        for (int lane = 0; lane < 32; lane++)
                            for (int p = 0; p < 4; p++) {
                                int r, c;
                                loom_qm_a_rc(lane, 2 * p, &r, &c);
                                a[lane][p] = ws[((warp * 16 + r) * XS + kk + c) / 2];
                            }
                        for (int j = 0; j < NT / 8; j++) {
                            for (int lane = 0; lane < 32; lane++)
                                for (int p = 0; p < 2; p++) {
                                    int kq, t;
                                    loom_qm_b_kn(lane, 2 * p, &kq, &t);
                                    b[lane][p] = xs[((j * 8 + t) * XS + kk + kq) / 2];
                                }
                            mma_emu(acc[warp][j], a, b);
                        }
                    }
            }
            for (int warp = 0; warp < 4; warp++)
                for (int j = 0; j < NT / 8; j++)
                    for (int lane = 0; lane < 32; lane++)
                        for (int i = 0; i < 4; i++) {
                            int r, t;
                            loom_qm_c_rn(lane, i, &r, &t);
                            const int64_t gr = row0 + warp * 16 + r;
                            t += j * 8;
                            if (gr >= rows || t >= n) continue;
                            part[((int64_t)split * n + t) * rows + gr] = acc[warp][j][lane][i];
                        }
        }
    covered = steps_seen == ksteps;
    for (int64_t i = 0; i < n * rows; i++) {
        float sum = 0.0f;
        for (int s = 0; s < ksplit; s++) sum += part[(int64_t)s * n * rows + i];
        y[i] = Q4 ? sum : sc[i % rows] * sum;
    }
    /* float64 over the reference dequantization; the bound: x rounded to
     * bf16 (2^-9 relative), 4-bit weights too, the f32 sums */
    double worst = 0.0;
    int bad = 0;
    for (int t = 0; t < n; t++)
        for (int64_t r = 0; r < rows; r++) {
            double ref = 0.0, mag = 0.0;
            for (int64_t c = 0; c < cols; c++) {
                const double wv = loom_qd_value(quant, q, sc, mn, cols, (int)group, r, c);
                ref += wv * x[t * cols + c], mag += fabs(wv * x[t * cols + c]);
            }
            const double err = fabs(y[t * rows + r] - ref), tol = (Q4 ? 2.0 : 1.0) * ldexp(mag, -8) + 1e-6;
            if (err / tol > worst) worst = err / tol;
            bad += !(err <= tol);
        }
    CHECKF(covered && !bad,
           "qmma quant %d min %d group %d rows %lld cols %lld n %d ksplit %d: %d of %lld outputs off (worst %.2f of "
           "the bound)",
           quant, k->with_min, k->group, (long long)rows, (long long)cols, n, ksplit, bad, (long long)(n * rows),
           worst);
    free(q), free(sc), free(mn), free(x), free(part), free(y);
}

static void test_qmma(void) {
    /* the fragment helpers against the PTX tables, every lane and element */
    int bad = 0;
    for (int lane = 0; lane < 32; lane++) {
        for (int i = 0; i < 8; i++) {
            int r0, c0, r1, c1;
            loom_qm_a_rc(lane, i, &r0, &c0), ptx_a(lane, i, &r1, &c1);
            bad += r0 != r1 || c0 != c1;
        }
        for (int i = 0; i < 4; i++) {
            int k0, n0, k1, n1;
            loom_qm_b_kn(lane, i, &k0, &n0), ptx_b(lane, i, &k1, &n1);
            bad += k0 != k1 || n0 != n1;
            loom_qm_c_rn(lane, i, &k0, &n0), ptx_c(lane, i, &k1, &n1);
            bad += k0 != k1 || n0 != n1;
        }
    }
    CHECKF(!bad, "%d fragment coordinates differ from the PTX tables", bad);
    /* the split plan: 1..16 splits, every k step in exactly one */
    static const int64_t shapes[][2] = {{4096, 4096}, {1024, 4096}, {14336, 4096}, {4096, 14336}, {64, 64}, {7, 16}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        for (int sms = 1; sms <= 264; sms += 131) {
            const int ks = loom_qm_ksplit(shapes[s][0], shapes[s][1], sms);
            const int64_t steps = (shapes[s][1] + LOOM_QM_BK - 1) / LOOM_QM_BK;
            int64_t next = 0, k0, k1;
            CHECK(ks >= 1 && ks <= LOOM_QM_MAX_SPLIT && (ks == 1 || steps / ks >= 4));
            for (int i = 0; i < ks; i++) {
                loom_qm_split_range(steps, ks, i, &k0, &k1);
                if (k1 > k0) {
                    CHECK(k0 == next);
                    next = k1;
                }
            }
            CHECK(next == steps);
        }
    CHECK(loom_qm_nt(1) == 8 && loom_qm_nt(9) == 16 && loom_qm_nt(17) == 32 && loom_qm_nt(33) == 64 &&
          loom_qm_nt(64) == 64);
    /* odd shapes: rows past a block, columns past a step, n past a tile,
     * splits (n_sms large) and none */
    static const qm_case_t cases[] = {
        {LOOM_QD_INT8, 0, 0, 77, 208, 9, 132},   {LOOM_QD_INT8, 0, 0, 130, 1040, 33, 132},
        {LOOM_QD_FP8, 0, 0, 64, 272, 17, 1},     {LOOM_QD_FP8, 0, 0, 45, 1024, 64, 132},
        {LOOM_QD_Q4, 0, 32, 70, 224, 12, 132},   {LOOM_QD_Q4, 1, 64, 129, 1088, 23, 132},
        {LOOM_QD_Q4, 1, 128, 16, 384, 1, 1},     {LOOM_QD_Q4, 0, 32, 64, 1024, 40, 132},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) qmma_replay(&cases[i]);
}

/* --- the FP8 prefill GEMM's scale math (fp8act.h) -------------------------------------- */

/* matmul_fp8's arithmetic on the CPU: x quantized per token as fp8act.cu
 * does (amax, loom_f8_token_scale, e4m3 of loom_f8_scaled, the CPU's
 * encoder being the same round-to-nearest-even saturating conversion as
 * the device's __nv_cvt_float_to_fp8), the product of codes scaled by the
 * weights' row scales and the token scales (cuBLASLt's outer vectors);
 * every output within fp8act.h's bound of the float64 product over the
 * dequantized weights, and the bound not loose by orders of magnitude. */
static void test_fp8_gemm_scales(void) {
    CHECK(loom_f8_token_scale(0.0f) == 1.0f && loom_f8_token_scale(INFINITY) == 1.0f &&
          loom_f8_token_scale(NAN) == 1.0f && loom_f8_token_scale(448.0f) == 1.0f);
    enum { ROWS = 37, COLS = 272, N = 9 };
    static uint8_t wq[ROWS * COLS], xq[N * COLS];
    static float x[N * COLS], ws[ROWS], xs[N];
    for (int r = 0; r < ROWS; r++) {
        ws[r] = 0.001f + fabsf(test_randf(&g_st, 0.01f));
        for (int c = 0; c < COLS; c++) {
            g_st = g_st * 6364136223846793005ull + 1442695040888963407ull;
            wq[r * COLS + c] = (uint8_t)(g_st >> 33);
            if ((wq[r * COLS + c] & 0x7f) == 0x7f) wq[r * COLS + c] ^= 1;
        }
    }
    for (int t = 0; t < N; t++) {
        const float mag = t == 0 ? 0.0f : (float)ldexp(1.0, 3 * t - 12); /* tokens from 0 to ~2^12 */
        float amax = 0.0f;
        for (int c = 0; c < COLS; c++) {
            x[t * COLS + c] = test_randf(&g_st, mag);
            if (t == 3 && c == 5) x[t * COLS + c] = 300.0f * mag; /* an outlier */
            amax = fmaxf(amax, fabsf(x[t * COLS + c]));
        }
        xs[t] = loom_f8_token_scale(amax);
        for (int c = 0; c < COLS; c++) xq[t * COLS + c] = loom_f32_to_fp8_e4m3(loom_f8_scaled(x[t * COLS + c], xs[t]));
    }
    int bad = 0;
    double worst = 0.0, sum_ratio = 0.0;
    for (int t = 0; t < N; t++)
        for (int r = 0; r < ROWS; r++) {
            float acc = 0.0f; /* f32 accumulation */
            double ref = 0.0, swx = 0.0, sw = 0.0;
            for (int c = 0; c < COLS; c++) {
                acc += loom_qd_fp8(wq[r * COLS + c]) * loom_qd_fp8(xq[t * COLS + c]);
                const double wv = (double)ws[r] * loom_qd_fp8(wq[r * COLS + c]);
                ref += wv * x[t * COLS + c], swx += fabs(wv * x[t * COLS + c]), sw += fabs(wv);
            }
            const double y = (double)ws[r] * xs[t] * acc, err = fabs(y - ref);
            const double bound = loom_f8_bound(swx, sw, xs[t]) + 1e-6 * swx;
            bad += !(err <= bound);
            if (bound > 0) worst = fmax(worst, err / bound), sum_ratio += err / bound;
        }
    CHECKF(!bad, "%d of %d fp8 GEMM outputs past the bound (worst %.2f of it)", bad, N * ROWS, worst);
    CHECKF(sum_ratio / (N * ROWS) > 1e-3, "the bound is loose: mean error %.2g of it", sum_ratio / (N * ROWS));
}

/* --- flash.cu's FA2-style prefill kernel, replayed lane by lane ----------------------- */

static float bf16r(float x) {
    return loom_bf16_to_f32(loom_f32_to_bf16(x));
}

/* flash.h's layouts and schedule: each fragment covers its matrix once, P's
 * A registers are S's accumulators of the same lane, the staged chunks
 * cover a tile once, and the tiles' rows read every key of the range once
 * through the block table; the layouts are the PTX ISA's (fa_mma's table). */
static void test_fa_layout(void) {
    int cc[16][8] = {{0}}, ca[16][16] = {{0}}, cb[16][8] = {{0}}, in = 1;
    for (int lane = 0; lane < 32; lane++) {
        for (int c = 0; c < 4; c++) {
            const int r = loom_fa_c_row(lane, c), k = loom_fa_c_col(lane, c);
            if (r < 0 || r >= 16 || k < 0 || k >= 8) in = 0;
            else cc[r][k]++;
        }
        for (int a = 0; a < 4; a++)
            for (int e = 0; e < 2; e++) {
                const int r = loom_fa_a_row(lane, a), k = loom_fa_a_col(lane, a) + e;
                if (r < 0 || r >= 16 || k < 0 || k >= 16) in = 0;
                else ca[r][k]++;
            }
        for (int b = 0; b < 2; b++)
            for (int e = 0; e < 2; e++) {
                const int k = loom_fa_b_k(lane, b) + e, n = loom_fa_b_n(lane);
                if (k < 0 || k >= 16 || n < 0 || n >= 8) in = 0;
                else cb[k][n]++;
            }
        const int g = lane / 4, t = lane % 4; /* the PTX ISA's table, as fa_mma places it */
        for (int i = 0; i < 8; i++)
            CHECKF(loom_fa_a_row(lane, i / 2) == g + 8 * ((i / 2) % 2) &&
                       loom_fa_a_col(lane, i / 2) + i % 2 == 2 * t + i % 2 + 8 * (i / 4),
                   "A element %d of lane %d", i, lane);
        for (int i = 0; i < 4; i++)
            CHECKF(loom_fa_b_k(lane, i / 2) + i % 2 == 2 * t + i % 2 + 8 * (i / 2) && loom_fa_b_n(lane) == g &&
                       loom_fa_c_row(lane, i) == g + 8 * (i / 2) && loom_fa_c_col(lane, i) == 2 * t + i % 2,
                   "B and C elements %d of lane %d", i, lane);
        for (int kc = 0; kc < LOOM_FA_KEYS / 16; kc++)
            for (int a = 0; a < 4; a++)
                for (int e = 0; e < 2; e++) {
                    const int c = loom_fa_p_elem(a, e), nt = loom_fa_p_tile(kc, a);
                    CHECKF(c >= 0 && c < 4 && nt >= 0 && nt < LOOM_FA_KEYS / 8 &&
                               loom_fa_c_row(lane, c) == loom_fa_a_row(lane, a) &&
                               8 * nt + loom_fa_c_col(lane, c) == 16 * kc + loom_fa_a_col(lane, a) + e,
                           "P's A register %d.%d of lane %d, keys %d..", a, e, lane, 16 * kc);
                }
    }
    CHECK(in);
    int once = 1;
    for (int r = 0; r < 16; r++)
        for (int k = 0; k < 16; k++) once &= ca[r][k] == 1 && (k >= 8 || (cc[r][k] == 1 && cb[r][k] == 1));
    CHECK(once);
    for (int hd = 64; hd <= 128; hd *= 2) {
        static int seen[LOOM_FA_KEYS][128];
        memset(seen, 0, sizeof seen);
        int ok = 1;
        for (int c = 0; c < LOOM_FA_KEYS * hd / 8; c++) {
            int row, col;
            loom_fa_chunk(c, hd, &row, &col);
            if (row < 0 || row >= LOOM_FA_KEYS || col < 0 || col + 8 > hd || col % 8) {
                ok = 0;
                continue;
            }
            for (int e = 0; e < 8; e++) seen[row][col + e]++;
        }
        for (int r = 0; r < LOOM_FA_KEYS; r++)
            for (int d = 0; d < hd; d++) ok &= seen[r][d] == 1;
        CHECKF(ok, "chunks of a tile, hd %d", hd);
        CHECK(loom_fa_head_dim_ok(hd) && loom_fa_ld(hd) % 8 == 0);
    }
    CHECK(!loom_fa_head_dim_ok(256) && !loom_fa_head_dim_ok(96) && !loom_fa_head_dim_ok(576));
    CHECK(loom_fa_smem_bytes(128) == 69632 && loom_fa_smem_bytes(64) == 36864);
    /* tiles over [k0, k1) of a table with holes, block sizes 1..33 */
    int32_t bt[720]; /* keys up to 700 at B = 1 */
    for (int B = 1; B <= 33; B += 4) {
        for (int b = 0; b < 720; b++) bt[b] = b % 7 == 3 ? -1 : (b * 37 + 11) % 997;
        for (int k0 = 0; k0 < 300; k0 += 41)
            for (int k1 = k0; k1 < k0 + 400; k1 += 23) {
                const int nt = loom_fa_n_tiles(k0, k1);
                int bad = !(nt * LOOM_FA_KEYS >= k1 - k0 && (nt == 0 || (nt - 1) * LOOM_FA_KEYS < k1 - k0));
                int next = k0;
                for (int t = 0; t < nt; t++)
                    for (int j = 0; j < LOOM_FA_KEYS; j++) {
                        const int key = k0 + t * LOOM_FA_KEYS + j, slot = loom_fa_tile_slot(bt, B, k0, k1, t, j);
                        const int want = key < k1 && bt[key / B] >= 0 ? bt[key / B] * B + key % B : -1;
                        bad |= slot != want;
                        if (key < k1) bad |= key != next++;
                    }
                CHECKF(!bad && next == (k1 > k0 ? k1 : k0), "tiles of [%d, %d), B %d", k0, k1, B);
            }
    }
    /* a warp skips a tile exactly when none of its rows sees one of its keys */
    for (int kb = 0; kb < 400; kb += 13)
        for (int lo = 0; lo < 300; lo += 17)
            for (int pos = lo; pos < 400; pos += 19) {
                const int any = !(kb > pos || kb + LOOM_FA_KEYS <= lo);
                CHECKF(loom_fa_tile_live(kb, lo, pos) == any, "tile at %d, rows [%d, %d]", kb, lo, pos);
            }
}

/* c += a b, mma.sync m16n8k16 on a warp's registers: a[lane][register][half],
 * b[lane][register][half], c[lane][element], placed as the PTX ISA's table
 * for .bf16 places them (written out here, not taken from flash.h, so the
 * replay checks the kernel's use of flash.h's layouts against the
 * hardware's): lane = 4 g + t; A's element i = 2 register + half at row
 * g + 8 ((i / 2) % 2), column 2 t + i % 2 + 8 (i / 4); B's at k row
 * 2 t + i % 2 + 8 (i / 2), column g; C's element i at row g + 8 (i / 2),
 * column 2 t + i % 2. */
static void fa_mma(float c[32][4], float a[32][4][2], float b[32][2][2]) {
    float A[16][16], Bm[16][8];
    for (int lane = 0; lane < 32; lane++) {
        const int g = lane / 4, t = lane % 4;
        for (int i = 0; i < 8; i++) A[g + 8 * ((i / 2) % 2)][2 * t + i % 2 + 8 * (i / 4)] = a[lane][i / 2][i % 2];
        for (int i = 0; i < 4; i++) Bm[2 * t + i % 2 + 8 * (i / 2)][g] = b[lane][i / 2][i % 2];
    }
    for (int lane = 0; lane < 32; lane++)
        for (int i = 0; i < 4; i++) {
            const int row = lane / 4 + 8 * (i / 2), col = 2 * (lane % 4) + i % 2;
            float s = c[lane][i];
            for (int k = 0; k < 16; k++) s = fmaf(A[row][k], Bm[k][col], s);
            c[lane][i] = s;
        }
}

typedef struct {
    int n, nh, nkv, hd, B, max_blocks, window, n_split, tq, q_stride, out_stride;
    float scale, softcap;
    const float *q, *sinks;
    const float *kc, *vc; /* the bf16 cache's values, (cells, nkv, hd) */
    const int32_t *bt, *tok_seq, *tok_pos;
    float *out, *part;
} fa_emu_t;

enum { FA_MAXD = 128, FA_DT = FA_MAXD / 8, FA_NT = LOOM_FA_KEYS / 8 };

/* One CTA (i, kvh, split) of flash_prefill_kernel, every lane's registers
 * and every step in the kernel's order; the warps' products through fa_mma. */
static void fa_emu_cta(const fa_emu_t *p, int i, int kvh, int split) {
    const int tq = p->tq, G = p->nh / p->nkv, hd = p->hd, KT = hd / 16, DT = hd / 8;
    if (!(i % tq == 0 || p->tok_seq[i - 1] != p->tok_seq[i])) return;
    if (!(tq > 1 && i + 1 < p->n && (i + 1) % tq != 0 && p->tok_seq[i + 1] == p->tok_seq[i])) return;
    const int seq = p->tok_seq[i], lim = tq - i % tq;
    int R = 1, pmin = p->tok_pos[i], pmax = pmin;
    while (R < lim && i + R < p->n && p->tok_seq[i + R] == seq) {
        pmin = p->tok_pos[i + R] < pmin ? p->tok_pos[i + R] : pmin;
        pmax = p->tok_pos[i + R] > pmax ? p->tok_pos[i + R] : pmax;
        R++;
    }
    const int QR = R * G;
    int k0, k1;
    loom_fa_unit_range(pmin, pmax, p->window, p->n_split, split, &k0, &k1);
    float *ml = p->part + (size_t)p->n * p->nh * p->n_split * hd;
    if (k0 >= k1) {
        for (int r = 0; r < QR; r++) {
            const size_t pi = ((size_t)(i + r / G) * p->nh + kvh * G + r % G) * p->n_split + split;
            ml[2 * pi] = -INFINITY, ml[2 * pi + 1] = 0.0f;
        }
        return;
    }
    const int32_t *bt = p->bt + (size_t)seq * p->max_blocks;
    static float qa[LOOM_FA_WARPS][FA_MAXD / 16][32][4][2], o[LOOM_FA_WARPS][FA_DT][32][4];
    static float m[LOOM_FA_WARPS][32][2], l[LOOM_FA_WARPS][32][2];
    static float Ks[LOOM_FA_KEYS][FA_MAXD], Vs[LOOM_FA_KEYS][FA_MAXD], s[FA_NT][32][4];
    static int posr[LOOM_FA_WARPS][32][2], lor[LOOM_FA_WARPS][32][2], kvalid[LOOM_FA_KEYS];
    int lo_min[LOOM_FA_WARPS], pos_max[LOOM_FA_WARPS];
    for (int w = 0; w < LOOM_FA_WARPS; w++) {
        lo_min[w] = 1 << 30, pos_max[w] = -1;
        for (int lane = 0; lane < 32; lane++) {
            for (int h = 0; h < 2; h++) {
                const int r = 16 * w + loom_fa_c_row(lane, 2 * h);
                posr[w][lane][h] = r < QR ? p->tok_pos[i + r / G] : -1;
                lor[w][lane][h] = r < QR ? loom_om_window_lo(posr[w][lane][h], p->window) : 1 << 30;
                lo_min[w] = lor[w][lane][h] < lo_min[w] ? lor[w][lane][h] : lo_min[w];
                pos_max[w] = posr[w][lane][h] > pos_max[w] ? posr[w][lane][h] : pos_max[w];
                m[w][lane][h] = -INFINITY, l[w][lane][h] = 0.0f;
            }
            for (int kk = 0; kk < KT; kk++)
                for (int a = 0; a < 4; a++)
                    for (int e = 0; e < 2; e++) {
                        const int r = 16 * w + loom_fa_a_row(lane, a), d = 16 * kk + loom_fa_a_col(lane, a) + e;
                        const float v = r < QR ? p->q[(size_t)(i + r / G) * p->q_stride + (size_t)(kvh * G + r % G) * hd + d]
                                               : 0.0f;
                        qa[w][kk][lane][a][e] = bf16r(v * p->scale);
                    }
            for (int d = 0; d < DT; d++)
                for (int c = 0; c < 4; c++) o[w][d][lane][c] = 0.0f;
        }
    }
    const int nt = loom_fa_n_tiles(k0, k1);
    for (int t = 0; t < nt; t++) {
        for (int c = 0; c < LOOM_FA_KEYS * hd / 8; c++) { /* the staging, chunk by chunk */
            int j, col;
            loom_fa_chunk(c, hd, &j, &col);
            const int slot = loom_fa_tile_slot(bt, p->B, k0, k1, t, j);
            for (int e = 0; e < 8; e++) {
                const size_t off = (size_t)slot * p->nkv * hd + (size_t)kvh * hd + col + e;
                Ks[j][col + e] = slot >= 0 ? p->kc[off] : 0.0f;
                Vs[j][col + e] = slot >= 0 ? p->vc[off] : 0.0f;
            }
            if (col == 0) kvalid[j] = slot >= 0;
        }
        const int kb = k0 + t * LOOM_FA_KEYS;
        for (int w = 0; w < LOOM_FA_WARPS; w++) {
            if (!loom_fa_tile_live(kb, lo_min[w], pos_max[w])) continue;
            static float b[32][2][2], pa[32][4][2];
            memset(s, 0, sizeof s);
            for (int kk = 0; kk < KT; kk++)
                for (int nn = 0; nn < FA_NT; nn++) {
                    for (int lane = 0; lane < 32; lane++)
                        for (int r = 0; r < 2; r++)
                            for (int e = 0; e < 2; e++)
                                b[lane][r][e] = Ks[8 * nn + loom_fa_b_n(lane)][16 * kk + loom_fa_b_k(lane, r) + e];
                    fa_mma(s[nn], qa[w][kk], b);
                }
            for (int h = 0; h < 2; h++) {
                float r[32][2 * FA_NT], mx[32];
                for (int lane = 0; lane < 32; lane++) {
                    for (int nn = 0; nn < FA_NT; nn++)
                        for (int e = 0; e < 2; e++) {
                            const int j = 8 * nn + loom_fa_c_col(lane, 2 * h + e);
                            r[lane][2 * nn + e] = loom_fa_score(s[nn][lane][2 * h + e], kb + j, kvalid[j] ? 0 : -1,
                                                                lor[w][lane][h], posr[w][lane][h], p->softcap);
                        }
                    mx[lane] = loom_fa_max(r[lane], 2 * FA_NT);
                }
                for (int lane = 0; lane < 32; lane += 4) { /* the quad's two shuffles */
                    float q4 = mx[lane];
                    for (int u = 1; u < 4; u++) q4 = fmaxf(q4, mx[lane + u]);
                    for (int u = 0; u < 4; u++) mx[lane + u] = q4;
                }
                for (int lane = 0; lane < 32; lane++) {
                    const float alpha = loom_fa_row_update(&m[w][lane][h], &l[w][lane][h], r[lane], 2 * FA_NT, mx[lane]);
                    for (int nn = 0; nn < FA_NT; nn++)
                        s[nn][lane][2 * h] = r[lane][2 * nn], s[nn][lane][2 * h + 1] = r[lane][2 * nn + 1];
                    for (int d = 0; d < DT; d++) o[w][d][lane][2 * h] *= alpha, o[w][d][lane][2 * h + 1] *= alpha;
                }
            }
            for (int kc = 0; kc < LOOM_FA_KEYS / 16; kc++) {
                for (int lane = 0; lane < 32; lane++)
                    for (int a = 0; a < 4; a++)
                        for (int e = 0; e < 2; e++)
                            pa[lane][a][e] = bf16r(s[loom_fa_p_tile(kc, a)][lane][loom_fa_p_elem(a, e)]);
                for (int d = 0; d < DT; d++) {
                    for (int lane = 0; lane < 32; lane++)
                        for (int r = 0; r < 2; r++)
                            for (int e = 0; e < 2; e++)
                                b[lane][r][e] = Vs[16 * kc + loom_fa_b_k(lane, r) + e][8 * d + loom_fa_b_n(lane)];
                    fa_mma(o[w][d], pa, b);
                }
            }
        }
    }
    for (int w = 0; w < LOOM_FA_WARPS; w++)
        for (int h = 0; h < 2; h++) {
            float l1[32], l2[32];
            for (int lane = 0; lane < 32; lane++) l1[lane] = l[w][lane][h] + l[w][lane ^ 1][h];
            for (int lane = 0; lane < 32; lane++) l2[lane] = l1[lane] + l1[lane ^ 2];
            for (int lane = 0; lane < 32; lane++) {
                const int r = 16 * w + loom_fa_c_row(lane, 2 * h);
                if (r >= QR) continue;
                const int token = i + r / G, head = kvh * G + r % G;
                const size_t pi = ((size_t)token * p->nh + head) * p->n_split + split;
                const float f = loom_fa_out_scale(m[w][lane][h], l2[lane], p->sinks ? p->sinks + head : NULL);
                for (int d = 0; d < DT; d++)
                    for (int e = 0; e < 2; e++) {
                        const int col = 8 * d + loom_fa_c_col(lane, 2 * h + e);
                        const float v = o[w][d][lane][2 * h + e];
                        if (p->n_split == 1) p->out[(size_t)token * p->out_stride + (size_t)head * hd + col] = v * f;
                        else p->part[pi * hd + col] = v;
                    }
                if (p->n_split > 1 && lane % 4 == 0) ml[2 * pi] = m[w][lane][h], ml[2 * pi + 1] = l2[lane];
            }
        }
}

/* attention.cu's attn_combine_kernel for one (token, head), step by step. */
static void fa_emu_combine(const fa_emu_t *p, int i, int head) {
    const float *ml = p->part + (size_t)p->n * p->nh * p->n_split * p->hd;
    const size_t p0 = ((size_t)i * p->nh + head) * p->n_split;
    float M = -INFINITY, L = 0.0f;
    for (int s = 0; s < p->n_split; s++) M = fmaxf(M, ml[2 * (p0 + s)]);
    for (int s = 0; s < p->n_split; s++)
        if (ml[2 * (p0 + s)] != -INFINITY) L += ml[2 * (p0 + s) + 1] * expf(ml[2 * (p0 + s)] - M);
    const float Ms = M;
    const float f = p->sinks ? loom_om_sink_fold(&M, &L, p->sinks[head]) : 1.0f;
    const float inv = L > 0.0f ? f / L : 0.0f;
    for (int d = 0; d < p->hd; d++) {
        float o = 0.0f;
        for (int s = 0; s < p->n_split; s++)
            if (ml[2 * (p0 + s)] != -INFINITY) o += p->part[(p0 + s) * p->hd + d] * expf(ml[2 * (p0 + s)] - Ms);
        p->out[(size_t)i * p->out_stride + (size_t)head * p->hd + d] = o * inv;
    }
}

typedef struct {
    int nh, nkv, hd, B, window;
    float softcap;
    int sinks, n_split;
    int n_seg, seg[5][3]; /* (sequence, first position, tokens): chunks, or single decode tokens */
} fa_case_t;

static void run_fa_case(const fa_case_t *c) {
    const int nh = c->nh, nkv = c->nkv, hd = c->hd, B = c->B, G = nh / nkv, kv_dim = nkv * hd;
    int n = 0, n_seqs = 0, max_blocks = 1;
    for (int g = 0; g < c->n_seg; g++) {
        n += c->seg[g][2];
        n_seqs = c->seg[g][0] + 1 > n_seqs ? c->seg[g][0] + 1 : n_seqs;
        const int nb = (c->seg[g][1] + c->seg[g][2] + B - 1) / B;
        max_blocks = nb > max_blocks ? nb : max_blocks;
    }
    const int n_blocks = n_seqs * max_blocks + 2;
    int32_t *bt = malloc(sizeof(int32_t) * n_seqs * max_blocks), *tok_seq = malloc(4 * n), *tok_pos = malloc(4 * n);
    for (int b = 0; b < n_seqs * max_blocks; b++) bt[b] = (b * 7 + 5) % n_blocks; /* scattered, distinct */
    for (int g = 0, t = 0; g < c->n_seg; g++)
        for (int j = 0; j < c->seg[g][2]; j++, t++) tok_seq[t] = c->seg[g][0], tok_pos[t] = c->seg[g][1] + j;
    if (c->window > 0) /* blocks wholly before every token's window are freed: never read */
        for (int sq = 0; sq < n_seqs; sq++) {
            int lo = 1 << 30;
            for (int t = 0; t < n; t++)
                if (tok_seq[t] == sq && loom_om_window_lo(tok_pos[t], c->window) < lo)
                    lo = loom_om_window_lo(tok_pos[t], c->window);
            for (int j = 0; j < max_blocks && (j + 1) * B <= lo; j++) bt[sq * max_blocks + j] = -1;
        }
    const size_t cache = (size_t)n_blocks * B * kv_dim;
    float *kc = malloc(sizeof(float) * cache), *vc = malloc(sizeof(float) * cache);
    for (size_t e = 0; e < cache; e++) kc[e] = bf16r(test_randf(&g_st, 1.0f)), vc[e] = bf16r(test_randf(&g_st, 1.0f));
    const int q_stride = (nh + 2 * nkv) * hd, out_stride = nh * hd;
    float *q = malloc(sizeof(float) * n * q_stride), *out = malloc(sizeof(float) * n * out_stride),
          *ref = malloc(sizeof(float) * n * out_stride), sinks[64];
    float *part = malloc(sizeof(float) * (size_t)n * nh * c->n_split * (hd + 2));
    for (int e = 0; e < n * q_stride; e++) q[e] = test_randf(&g_st, 3.0f); /* peaky, as test_cuda_ops */
    for (int h = 0; h < nh; h++) sinks[h] = test_randf(&g_st, 3.0f);
    for (int e = 0; e < n * out_stride; e++) out[e] = NAN, ref[e] = NAN;
    const fa_emu_t p = {.n = n, .nh = nh, .nkv = nkv, .hd = hd, .B = B, .max_blocks = max_blocks, .window = c->window,
                        .n_split = c->n_split, .tq = LOOM_FA_ROWS / G, .q_stride = q_stride, .out_stride = out_stride,
                        .scale = 1.0f / sqrtf((float)hd), .softcap = c->softcap, .q = q,
                        .sinks = c->sinks ? sinks : NULL, .kc = kc, .vc = vc, .bt = bt, .tok_seq = tok_seq,
                        .tok_pos = tok_pos, .out = out, .part = part};
    for (int i = 0; i < n; i++)
        for (int kvh = 0; kvh < nkv; kvh++)
            for (int sp = 0; sp < c->n_split; sp++) fa_emu_cta(&p, i, kvh, sp);
    /* the units of more than one row, and the float64 softmax(QK^T)V of their rows (q rounded as the
     * kernel rounds it: the rest of the error is P's rounding to bf16, ~2^-9 of |V|) */
    int rows = 0, alone_untouched = 1;
    for (int i = 0; i < n;) {
        int r = 1;
        while (i + r < n && (i + r) % p.tq != 0 && tok_seq[i + r] == tok_seq[i]) r++;
        for (int t = i; t < i + r; t++)
            for (int h = 0; h < nh; h++) {
                float *o = out + (size_t)t * out_stride + (size_t)h * hd, *w = ref + (size_t)t * out_stride + (size_t)h * hd;
                if (r == 1) { /* the decode kernel's: the flash kernel left it alone */
                    for (int d = 0; d < hd; d++) alone_untouched &= isnan(o[d]), o[d] = w[d] = 0.0f;
                    continue;
                }
                if (c->n_split > 1) fa_emu_combine(&p, t, h);
                rows++;
                const int pos = tok_pos[t], lo = loom_om_window_lo(pos, c->window), kvh = h / G;
                const int32_t *btr = bt + (size_t)tok_seq[t] * max_blocks;
                double mx = c->sinks ? sinks[h] : -INFINITY, sum = 0.0, acc[FA_MAXD] = {0};
                static double sc[4096];
                for (int k = lo; k <= pos; k++) {
                    const int blk = btr[k / B];
                    sc[k] = -INFINITY;
                    if (blk < 0) continue;
                    const float *kr = kc + ((size_t)(blk * B + k % B) * nkv + kvh) * hd;
                    double dot = 0.0;
                    for (int d = 0; d < hd; d++)
                        dot += (double)bf16r(q[(size_t)t * q_stride + (size_t)h * hd + d] * p.scale) * kr[d];
                    sc[k] = c->softcap > 0.0f ? c->softcap * tanh(dot / c->softcap) : dot;
                    mx = sc[k] > mx ? sc[k] : mx;
                }
                if (c->sinks) sum += exp(sinks[h] - mx);
                for (int k = lo; k <= pos; k++) {
                    if (sc[k] == -INFINITY) continue;
                    const double e = exp(sc[k] - mx);
                    const float *vr = vc + ((size_t)(btr[k / B] * B + k % B) * nkv + kvh) * hd;
                    sum += e;
                    for (int d = 0; d < hd; d++) acc[d] += e * vr[d];
                }
                for (int d = 0; d < hd; d++) w[d] = (float)(acc[d] / sum);
            }
        i += r;
    }
    char what[160];
    snprintf(what, sizeof what, "flash replay nh%d nkv%d hd%d B%d window%d softcap%g sinks%d split%d (%d rows)", nh,
             nkv, hd, B, c->window, (double)c->softcap, c->sinks, c->n_split, rows);
    CHECKF(rows > 0 && alone_untouched, "%s: one-row units untouched", what);
    test_allclose(what, out, ref, (long)n * out_stride, 4e-3, 4e-3);
    free(bt), free(tok_seq), free(tok_pos), free(kc), free(vc), free(q), free(out), free(ref), free(part);
}

static void test_fa_emulated(void) {
    static const fa_case_t cases[] = {
        /* Llama-3-8B's heads: tiles of 16 tokens x 4 heads, a prefill from 0 (the last tile of 6 tokens) */
        {32, 8, 128, 16, 0, 0.0f, 0, 1, 1, {{0, 0, 70}}},
        /* MHA, tiles of 64 tokens; a chunk after a cached prefix of 37, a partial last block of 7, 3 splits */
        {8, 8, 64, 7, 0, 0.0f, 0, 3, 1, {{0, 37, 100}}},
        /* group 7 (tiles of 9 tokens, 63 rows): a window, a soft cap and sinks at once, mid-sequence */
        {28, 4, 128, 16, 40, 30.0f, 1, 1, 1, {{0, 20, 50}}},
        /* a mixed batch: decode tokens around two chunks (one of 3 tokens), group 3 (21 tokens, 63 rows),
         * sinks, 2 splits */
        {12, 4, 64, 16, 0, 0.0f, 1, 2, 5, {{0, 90, 1}, {1, 60, 45}, {2, 10, 1}, {3, 0, 3}, {4, 300, 1}}},
        /* a window over freed blocks, block size 5, 4 splits, many tiles */
        {16, 2, 64, 5, 33, 0.0f, 0, 4, 1, {{0, 200, 40}}},
        /* a chunk deep into a sequence: 15 tiles a row in one slice, the running max moving */
        {8, 2, 128, 16, 0, 0.0f, 0, 1, 1, {{0, 900, 20}}},
        /* group 32: tiles of 2 tokens, a soft cap, keys past several tiles */
        {64, 2, 128, 16, 0, 20.0f, 0, 1, 1, {{0, 130, 5}}},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) run_fa_case(&cases[i]);
}

int main(void) {
    RUN(test_elementwise);
    RUN(test_i8_kv);
    RUN(test_ranges);
    RUN(test_attention_emulated);
    RUN(test_ds_route);
    RUN(test_fp8_scale);
    RUN(test_gemv_plan);
    RUN(test_fp8_decode);
    RUN(test_qmma);
    RUN(test_fp8_gemm_scales);
    RUN(test_fa_layout);
    RUN(test_fa_emulated);
    return test_summary();
}
