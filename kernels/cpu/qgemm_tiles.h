/* The INT8 / Q4 integer GEMM of qgemv.c (prefill and batched decode),
 * written once and included once per instruction set (no include guard).
 * The includer defines:
 *   QG(name)            the name with the instruction set's suffix
 *   QG_BLK_Q4(c, xp)    int32x8: lane a = row a's dot over one 32-column
 *                       block; c[8] the block's Q4 codes (c[t] lane a = row
 *                       a, columns 4t..4t+3), xp the block's 32 int8 of x
 *   QG_BLK_I8(c, xp)    the same for INT8 codes as QG_I8_XOR leaves them
 *   QG_I8_XOR           0x80 when the kernel wants signed INT8 codes (AVX2:
 *                       |q| and sign(x, q)), 0 for q + 128 (VNNI)
 *   QG_I8_BIAS          the 128 · sum(x) QG_BLK_I8 adds (0 if none)
 *   QG_NX               rows of x per tile
 * and must compile it under a target that has AVX2, FMA and F16C.
 *
 * Layout: the stored 8-row panels of qgemv.h, read in place. For Q4 the
 * low nibbles of vector t are columns 4t..4t+3 and the high nibbles
 * columns 16 + 4t.., so one broadcast 4-byte word of x feeds eight rows in
 * one vpmaddubsw / vpdpbusd, and each output lane is one row: the block's
 * dot for 8 rows is one vector, and one conversion and one FMA with the 8
 * rows' scales (one vector load, stored interleaved alike) times x's block
 * scale finish it.
 * Napkin math per block, 8 rows × NX rows of x (256 · NX MACs): Q4 AVX2
 * 8 vpmaddubsw + 7 vpaddw + 1 vpmaddwd + cvt + mul + FMA ≈ 19 ops per x row
 * (vs ≈ 28 in the 4-row tiles of qgemv_tiles.h) plus 12 to unpack the
 * nibbles once per block; VNNI 8 vpdpbusd + 3. */

#define QG_KB 16 /* blocks (512 columns) per pass over x: 2 KB (Q4) or 4 KB (INT8) of the panel, in L1 */

/* Blocks ahead of the one in use that the panel stream is prefetched. */
#ifndef QG_PF_BLOCKS
#define QG_PF_BLOCKS 8
#endif

/* Blocks [k0, k1) of the panel of rows [r, r + 8) (pk: its block k0; pks,
 * pko: its Q4 scales and mins from group k0 / gb, pko NULL for symmetric
 * Q4) against x rows [i, i + NX): y[(i + b) * ldy + r + a] holds the running
 * sums between runs of blocks; `last` finishes INT8 (row scales, bias and
 * the float columns past the last block). */
static inline __attribute__((always_inline)) void QG(gtile)(const int NX, const int q4, float *y,
                                                           int64_t ldy, const loom_cpu_qx_t *qx,
                                                           int i, const loom_weight_t *w,
                                                           int64_t r, const uint32_t *pk,
                                                           const float *pks, const float *pko,
                                                           int k0, int k1, int last) {
    const int nb = qx->nb, words = q4 ? 4 : 8;
    const int gb = q4 ? w->group / LOOM_QBLOCK : 1, gshift = __builtin_ctz((unsigned)gb);
    __m256 acc[QG_NX];
    for (int b = 0; b < NX; b++)
        acc[b] = k0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(y + (int64_t)(i + b) * ldy + r);
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    for (int k = k0; k < k1; k++) {
        const __m256i *pv = (const __m256i *)(pk + (size_t)(k - k0) * words * 8);
        __m256i c[8];
        __m256 sc = _mm256_setzero_ps();
        for (int l = 0; l < words; l += 2) /* an address: it may run past W */
            __builtin_prefetch((const char *)(pv + QG_PF_BLOCKS * words + l), 0, 2);
        if (q4) {
            const int g = (k >> gshift) - (k0 >> gshift);
            for (int t = 0; t < 4; t++) {
                const __m256i v = _mm256_loadu_si256(pv + t);
                c[t] = _mm256_and_si256(v, m4);
                c[t + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            }
            sc = _mm256_loadu_ps(pks + g * 8);
            if ((k & (gb - 1)) == 0) { /* the group's offset: (-8 · scale or min) · sum(x) */
                const __m256 off = pko ? _mm256_loadu_ps(pko + g * 8)
                                       : _mm256_mul_ps(sc, _mm256_set1_ps(-8.0f));
                for (int b = 0; b < NX; b++)
                    acc[b] = _mm256_fmadd_ps(
                        off, _mm256_set1_ps(qx->s[(int64_t)(i + b) * qx->ng + (k >> gshift)]),
                        acc[b]);
            }
        } else {
            for (int t = 0; t < 8; t++)
                c[t] = _mm256_xor_si256(_mm256_loadu_si256(pv + t),
                                        _mm256_set1_epi8((char)QG_I8_XOR));
        }
        for (int b = 0; b < NX; b++) {
            const int8_t *xp = qx->q + ((int64_t)(i + b) * nb + k) * LOOM_QBLOCK;
            const __m256i dot = q4 ? QG_BLK_Q4(c, xp) : QG_BLK_I8(c, xp);
            const __m256 xs = _mm256_set1_ps(qx->d[(int64_t)(i + b) * nb + k]);
            acc[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), q4 ? _mm256_mul_ps(sc, xs) : xs,
                                     acc[b]);
        }
    }
    for (int b = 0; b < NX; b++) {
        float *yo = y + (int64_t)(i + b) * ldy + r;
        if (q4 || !last) {
            _mm256_storeu_ps(yo, acc[b]);
            continue;
        }
        /* INT8: y = scale[row] · (sum - bias + tail columns in float) */
        float v[8];
        _mm256_storeu_ps(v, acc[b]);
        const float *x = qx->x + (int64_t)(i + b) * qx->cols;
        const int64_t whole = (int64_t)nb * LOOM_QBLOCK, tail = qx->cols - whole;
        const uint8_t *tails = (const uint8_t *)w->data + r * w->cols + whole * 8;
        for (int a = 0; a < 8; a++) {
            v[a] -= (float)QG_I8_BIAS * qx->s[(int64_t)(i + b) * qx->ng];
            for (int64_t cc = 0; cc < tail; cc++)
                v[a] += (float)(int8_t)(tails[a * tail + cc] ^ 0x80) * x[whole + cc];
            yo[a] = ((const float *)w->scales)[r + a] * v[a];
        }
    }
}

/* x rows [i, n) against one run of blocks, in tiles of QG_NX rows and one
 * tile of what is left (NX a constant in each call, so acc[] stays in
 * registers). */
static inline __attribute__((always_inline)) void QG(grun)(const int q4, float *y, int64_t ldy,
                                                          const loom_cpu_qx_t *qx,
                                                          const loom_weight_t *w, int64_t r,
                                                          const uint32_t *pk, const float *pks,
                                                          const float *pko, int k0, int k1,
                                                          int last) {
    const int n = qx->n;
    int i = 0;
    for (; i + QG_NX <= n; i += QG_NX)
        QG(gtile)(QG_NX, q4, y, ldy, qx, i, w, r, pk, pks, pko, k0, k1, last);
    switch (n - i) {
#if QG_NX > 4
    case 7: QG(gtile)(7, q4, y, ldy, qx, i, w, r, pk, pks, pko, k0, k1, last); break;
    case 6: QG(gtile)(6, q4, y, ldy, qx, i, w, r, pk, pks, pko, k0, k1, last); break;
    case 5: QG(gtile)(5, q4, y, ldy, qx, i, w, r, pk, pks, pko, k0, k1, last); break;
    case 4: QG(gtile)(4, q4, y, ldy, qx, i, w, r, pk, pks, pko, k0, k1, last); break;
#endif
    case 3: QG(gtile)(3, q4, y, ldy, qx, i, w, r, pk, pks, pko, k0, k1, last); break;
    case 2: QG(gtile)(2, q4, y, ldy, qx, i, w, r, pk, pks, pko, k0, k1, last); break;
    case 1: QG(gtile)(1, q4, y, ldy, qx, i, w, r, pk, pks, pko, k0, k1, last); break;
    default: break;
    }
}

/* Whole stored panels of rows [r0, r0 + 8 · np) (r0 a multiple of 8):
 * every x row per run of QG_KB blocks, so the run is read from memory once
 * and from L1 for the other rows of x. */
static inline __attribute__((always_inline)) void QG(gpanels)(const int q4, float *y, int64_t ldy,
                                                             const loom_cpu_qx_t *qx,
                                                             const loom_weight_t *w, int64_t r0,
                                                             int64_t np) {
    const int nb = qx->nb, words = q4 ? 4 : 8;
    const int64_t row_bytes = q4 ? w->cols / 2 : w->cols, ng = q4 ? w->cols / w->group : 1;
    const int gb = q4 ? w->group / LOOM_QBLOCK : 1;
    for (int64_t p = 0; p < np; p++) {
        const int64_t r = r0 + 8 * p;
        const uint32_t *panel = (const uint32_t *)((const uint8_t *)w->data + r * row_bytes);
        const float *ps = q4 ? (const float *)w->scales + r * ng : NULL;
        const float *pm = q4 && w->mins ? (const float *)w->mins + r * ng : NULL;
        for (int k0 = 0; k0 < nb; k0 += QG_KB) {
            const int k1 = LOOM_MIN(k0 + QG_KB, nb), last = k1 == nb;
            QG(grun)(q4, y, ldy, qx, w, r, panel + (size_t)k0 * words * 8,
                     ps ? ps + (k0 / gb) * 8 : NULL, pm ? pm + (k0 / gb) * 8 : NULL, k0, k1, last);
        }
    }
}

__attribute__((noinline)) static void QG(panels_q4)(float *y, int64_t ldy, const loom_cpu_qx_t *qx,
                                                    const loom_weight_t *w, int64_t r0,
                                                    int64_t np) {
    QG(gpanels)(1, y, ldy, qx, w, r0, np);
}

__attribute__((noinline)) static void QG(panels_i8)(float *y, int64_t ldy, const loom_cpu_qx_t *qx,
                                                    const loom_weight_t *w, int64_t r0,
                                                    int64_t np) {
    QG(gpanels)(0, y, ldy, qx, w, r0, np);
}
