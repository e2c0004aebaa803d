/* The INT8 / Q4 decode tiles of qgemv.c, written once and included once per
 * instruction set (no include guard). The includer defines:
 *   QT(name)      the name with the instruction set's suffix
 *   QT_DOT_U8(w, x)  int32x8: per 32-bit lane, the sum of four u8·s8 products
 *   QT_DOT_U8_PAIR(w0, x0, w1, x1)  the same summed over two pairs
 *   QT_DOT_I8(w, x)  the same for INT8 codes stored as q + 128
 *   QT_I8_BIAS    the 128·sum(x) that QT_DOT_I8 adds (0 if it adds none)
 *   QT_RM, QT_NXM the tile shape for n > 1: rows of W × rows of x
 * and must compile it under a target that has AVX2, FMA and F16C. */

/* Rows [r, r + R) of W against rows [i, i + NX) of x. The accumulators
 * hold sum over blocks of d_x · (w-scale) · dot; the codes' offset (8 for
 * symmetric Q4, 128 for INT8 under VNNI) and Q4's mins are added at the end
 * through qx->s, the per-group sums of d_x · sum(q_x). */
static inline __attribute__((always_inline)) void QT(tile)(const int R, const int NX, const int q4,
                                                           float *y, int64_t ldy,
                                                           const loom_cpu_qx_t *qx, int i,
                                                           const loom_weight_t *w, int64_t r) {
    const int nb = qx->nb, ng = q4 ? qx->ng : 1, gb = q4 ? w->group / LOOM_QBLOCK : nb;
    const int64_t row_bytes = q4 ? w->cols / 2 : w->cols;
    const int blk_bytes = q4 ? LOOM_QBLOCK / 2 : LOOM_QBLOCK;
    const uint8_t *codes = (const uint8_t *)w->data + r * row_bytes;
    const float *ws = (const float *)w->scales + r * ng;
    const int8_t *xq = qx->q + (int64_t)i * nb * LOOM_QBLOCK;
    const float *xd = qx->d + (int64_t)i * nb;
    /* Rows QT_PF_TILES tiles ahead are prefetched to L2, spread over this
     * tile's blocks (as gemv.c does for the next tile; the hardware
     * prefetchers re-train on every new group of rows). An address: it may
     * run past W. */
    const int pf_lines = (R * blk_bytes + 63) / 64;
    const uintptr_t pf = (uintptr_t)(codes + QT_PF_TILES * R * row_bytes);
    __m256 acc[4][4];
    for (int a = 0; a < R; a++)
        for (int b = 0; b < NX; b++)
            acc[a][b] = _mm256_setzero_ps();
    /* One flat loop over blocks (a nest over groups made GCC keep acc[][]
     * on the stack); the group's scale is a broadcast load per block. */
    const int gshift = __builtin_ctz((unsigned)(q4 ? gb : 1));
    int blk = 0;
    if (q4) {
        /* Two blocks per step: one 32-byte load holds both blocks' codes;
         * v & 15 gives their columns 0-15 and v >> 4 their columns 16-31.
         * x's two blocks are regrouped alike with two lane permutes, so
         * lanes 0-3 of the dot belong to block blk and lanes 4-7 to blk + 1,
         * and one conversion and one FMA serve both blocks. */
        const __m256i m4 = _mm256_set1_epi8(0x0f);
        const int pf2 = (2 * R * blk_bytes + 63) / 64;
        for (; blk + 2 <= nb; blk += 2) {
            for (int l = 0; l < pf2; l++)
                __builtin_prefetch((const void *)(pf + (uintptr_t)(blk * R * blk_bytes + l * 64)),
                                   0, 2);
            __m256i lo[4], hi[4];
            __m256 wsv[4];
            for (int a = 0; a < R; a++) {
                const __m256i v = _mm256_loadu_si256(
                    (const __m256i *)(codes + a * row_bytes + (int64_t)blk * blk_bytes));
                lo[a] = _mm256_and_si256(v, m4);
                hi[a] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                const float *g = ws + a * ng + (blk >> gshift);
                wsv[a] = gb == 1 ? _mm256_set_m128(_mm_broadcast_ss(g + 1), _mm_broadcast_ss(g))
                                 : _mm256_broadcast_ss(g);
            }
            for (int b = 0; b < NX; b++) {
                const int8_t *xp = xq + ((int64_t)b * nb + blk) * LOOM_QBLOCK;
                const __m256i x0 = _mm256_loadu_si256((const __m256i *)xp);
                const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xp + LOOM_QBLOCK));
                const __m256i xlo = _mm256_permute2x128_si256(x0, x1, 0x20);
                const __m256i xhi = _mm256_permute2x128_si256(x0, x1, 0x31);
                const float *d = xd + (int64_t)b * nb + blk;
                const __m256 xs = _mm256_set_m128(_mm_broadcast_ss(d + 1), _mm_broadcast_ss(d));
                for (int a = 0; a < R; a++) {
                    __m256i dot = QT_DOT_U8_PAIR(lo[a], xlo, hi[a], xhi);
                    acc[a][b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                                                _mm256_mul_ps(wsv[a], xs), acc[a][b]);
                }
            }
        }
    }
    for (; blk < nb; blk++) { /* INT8, and an odd last Q4 block */
        for (int l = 0; l < pf_lines; l++)
            __builtin_prefetch((const void *)(pf + (uintptr_t)(blk * R * blk_bytes + l * 64)), 0,
                               2);
        __m256i wv[4];
        __m256 wsv[4];
        for (int a = 0; a < R; a++) {
            const uint8_t *p = codes + a * row_bytes + (int64_t)blk * blk_bytes;
            wv[a] = q4 ? q4_codes(p) : _mm256_loadu_si256((const __m256i *)p);
            if (q4) wsv[a] = _mm256_broadcast_ss(ws + a * ng + (blk >> gshift));
        }
        for (int b = 0; b < NX; b++) {
            const __m256i xv =
                _mm256_loadu_si256((const __m256i *)(xq + ((int64_t)b * nb + blk) * LOOM_QBLOCK));
            const __m256 xs = _mm256_broadcast_ss(xd + (int64_t)b * nb + blk);
            for (int a = 0; a < R; a++) {
                __m256i d = q4 ? QT_DOT_U8(wv[a], xv) : QT_DOT_I8(wv[a], xv);
                __m256 sc = q4 ? _mm256_mul_ps(wsv[a], xs) : xs;
                acc[a][b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), sc, acc[a][b]);
            }
        }
    }
    for (int a = 0; a < R; a++)
        for (int b = 0; b < NX; b++) {
            const float *xs_g = qx->s + (int64_t)(i + b) * qx->ng;
            float v = hsum8(acc[a][b]);
            if (q4) {
                if (w->mins)
                    v += dot_f32((const float *)w->mins + (r + a) * ng, xs_g, ng);
                else
                    v -= 8.0f * dot_f32(ws + a * ng, xs_g, ng);
                y[(int64_t)(i + b) * ldy + r + a] = v;
            } else {
                v -= (float)QT_I8_BIAS * xs_g[0];
                const float *x = qx->x + (int64_t)(i + b) * qx->cols;
                for (int64_t c = (int64_t)nb * LOOM_QBLOCK; c < qx->cols; c++)
                    v += (float)(int8_t)(codes[a * row_bytes + c] ^ 0x80) * x[c];
                y[(int64_t)(i + b) * ldy + r + a] = ws[a] * v;
            }
        }
}

/* Rows [r0, r1) for one scheme: tiles of 4 W rows at n = 1, QT_RM × up to
 * QT_NXM otherwise, with the x tiles of one group of W rows back to back so
 * the group is read from DRAM once. */
static inline __attribute__((always_inline)) void QT(rows)(const int q4, float *y, int64_t ldy,
                                                           const loom_cpu_qx_t *qx,
                                                           const loom_weight_t *w, int64_t r0,
                                                           int64_t r1) {
    const int n = qx->n;
    int64_t r = r0;
    if (n == 1) {
        for (; r + 4 <= r1; r += 4)
            QT(tile)(4, 1, q4, y, ldy, qx, 0, w, r);
    } else {
        for (; r + QT_RM <= r1; r += QT_RM) {
            int i = 0;
            for (; i + QT_NXM <= n; i += QT_NXM)
                QT(tile)(QT_RM, QT_NXM, q4, y, ldy, qx, i, w, r);
            switch (n - i) {
#if QT_NXM > 3
            case 3:
                QT(tile)(QT_RM, 3, q4, y, ldy, qx, i, w, r);
                break;
#endif
            case 2:
                QT(tile)(QT_RM, 2, q4, y, ldy, qx, i, w, r);
                break;
            case 1:
                QT(tile)(QT_RM, 1, q4, y, ldy, qx, i, w, r);
                break;
            default:
                break;
            }
        }
    }
    for (; r < r1; r++)
        for (int i = 0; i < n; i++)
            QT(tile)(1, 1, q4, y, ldy, qx, i, w, r);
}

__attribute__((noinline)) static void QT(rows_q4)(float *y, int64_t ldy, const loom_cpu_qx_t *qx,
                                                  const loom_weight_t *w, int64_t r0, int64_t r1) {
    QT(rows)(1, y, ldy, qx, w, r0, r1);
}

__attribute__((noinline)) static void QT(rows_i8)(float *y, int64_t ldy, const loom_cpu_qx_t *qx,
                                                  const loom_weight_t *w, int64_t r0, int64_t r1) {
    QT(rows)(0, y, ldy, qx, w, r0, r1);
}
