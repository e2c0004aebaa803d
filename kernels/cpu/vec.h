/* Single-threaded vector kernels of the CPU backend: the inner loops of the
 * element-wise ops, RoPE and attention. AVX2/FMA when the build targets it,
 * plain C otherwise; both give the same results to float rounding. */
#ifndef LOOM_CPU_VEC_H
#define LOOM_CPU_VEC_H

#include <stdint.h>

#include "kernels/backend.h"

float loom_vec_dot(const float *a, const float *b, int n);
/* y += a * x */
void loom_vec_axpy(float *y, float a, const float *x, int n);
/* y = a * x */
void loom_vec_scale(float *y, float a, const float *x, int n);
/* y += a */
void loom_vec_add(float *y, const float *a, int64_t n);
float loom_vec_max(const float *x, int n);
/* x[i] = exp(x[i] - sub); returns the sum of the new values. */
float loom_vec_exp_sub_sum(float *x, int n, float sub);

/* x[i] = cap * tanh(x[i] / cap) (logit soft-capping; cap > 0). The SIMD
 * path computes tanh(y) = sign(y) (1 - e) / (1 + e), e = exp(-2|y|): within
 * a few float32 ulps of cap (absolute) of tanhf's result. */
void loom_vec_softcap(float *x, int n, float cap);

/* out[j] = dot(q, k + j*k_stride) for j in 0..3: four keys against one query. */
void loom_vec_dot4(const float *q, const float *k, int64_t k_stride, int n, float out[4]);
/* y[d] += sum_p w[p] * v[p*v_stride + d] for p in [0, np), d in [0, n). */
void loom_vec_wsum_rows(float *y, const float *w, const float *v, int64_t v_stride, int np, int n);

/* y = float32(x): bf16 widened by a 16-bit shift. */
void loom_vec_bf16_to_f32(float *y, const uint16_t *x, int n);
/* y = scale * x for int8 codes x. */
void loom_vec_i8_to_f32(float *y, const int8_t *x, float scale, int n);

/* The narrowing the KV cache stores: y = bf16(x), round to nearest even. */
void loom_vec_f32_to_bf16(uint16_t *y, const float *x, int n);
/* Symmetric int8 of one row: y = round(x / s) with s = max|x| / 127
 * (0 for an all-zero row); returns s. */
float loom_vec_f32_to_i8(int8_t *y, const float *x, int n);

/* One row of each op (see backend.h for the semantics). */
void loom_vec_rmsnorm(float *y, const float *x, const float *g, int dim, float eps);
void loom_vec_silu_mul(float *out, const float *gate, const float *up, int hidden);
/* out = act(gate) * up for any loom_act_t (kernels/backend.h). */
void loom_vec_act_mul(loom_act_t act, float *out, const float *gate, const float *up, int hidden);
/* Rotates n_heads heads of hd at x (head h at x + h*hd) by angles
 * pos * inv_freq[j], computed in double. hd is even and at most
 * LOOM_VEC_ROPE_MAX_HD. */
#define LOOM_VEC_ROPE_MAX_HD 2048
void loom_vec_rope(float *x, int n_heads, int hd, int32_t pos, const float *inv_freq);

#endif
