"""A compiled CPU kernel for the gated delta rule of a prefill chunk (``paths.CPU``, fp32 math).

The chunked form (``cpu_ops.chunk_delta_rule``) spends a chunk's time in a few dozen elementwise
passes, small batched products and a block loop — dispatch and memory traffic, not arithmetic:
~3-5 ms a layer at 700 tokens for the tiny model's ~0.15 GFLOP. The recurrence itself, one token
after another with a value head's state S [Dk, Dv] in L1, is one pass over S a token::

    kv = S^T k_t,  sq = S^T q_t                         (read S, both sums in one pass)
    delta = beta_t (v_t - e kv),  o_t = e sq + (k_t . q_t) delta        (e = exp(g_t))
    S <- e S + k_t delta^T                              (written during the next token's read)

— the same recurrence as ``gdn.recurrent_gated_delta_rule`` rearranged (o_t = S_t^T q_t with S_t
expanded), equal to rounding — which C loops the compiler vectorises run ~3x faster than the
chunked form at 256-2,000 tokens and ~10x at a few (q and k are L2-normalised inside, read in place
from the conv output's rows). This module holds that loop as C source, compiles it once per
machine with the system's C compiler (``cc -O3 -march=native``; under a second, no torch headers)
into a cache directory keyed by the source, the flags and the CPU, and calls it through ``ctypes``
(which releases the GIL for the call). Without a compiler, or with ``NINFER_CPU_KERNEL=0``,
``available()`` is False and the CPU path keeps the chunked form — the same results to rounding.
float64 math (the oracle's) never comes here, nor a value head width that is not a multiple of 16
(``fits``).

The loop runs in 16-float vectors (the compiler's vector extensions, whatever the target's
width), its three sums of D products in a fixed lane order, and a chunk of ``SPLIT_TOKENS`` or
more splits its value heads over the forward's threads — torch's own OpenMP team, which the
build joins where torch runs on libgomp (``_shares_torchs_openmp``): a thread of its own would
wait for the core that torch's idle workers spin on after each op (measured: no gain at all, the
same split 1.5-1.65x at 256-2,000 tokens inside the team). Heads are independent, so the split
changes no bit.

A token's arithmetic here depends only on the state before it, never on where a chunk starts or
how long it is: a prompt computed in one chunk or in several gives the same outputs and states bit
for bit (the chunked form's blocks make it equal only to rounding). The states after inner cuts
are copies of the running state at those tokens.

The same library holds the CPU path's other fp32 passes, each where torch made several calls or
passes over memory: a GDN chunk's conv + SiLU and its decode step, its gated norm, an attention
layer's q / k norms and RoPE, a MoE layer's routed experts (``moe_routed``: the pairs sorted by
expert, 8-row blocks through both products, ~2.4x torch's grouped form) and a chunk's causal
attention (``chunk_attention``: an online softmax over 256-key steps, ~1.3x torch's fused op). The
last two share one register-blocked product (``gemm_block``) in which every output is one running
sum, so a row's result never depends on which rows share its block, its chunk or its thread.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

ENV = "NINFER_CPU_KERNEL"          # "0": never build or use the kernel
CFLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-fPIC", "-shared", "-fno-math-errno")

SOURCE = r"""
#include <math.h>
#include <string.h>
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define SPLIT_TOKENS 32      /* a chunk this long or longer splits its heads over the threads */

/* The gated delta rule of every value head over T tokens, one pass over a head's state a
   token. With S the state before token t (decay e = exp(g_t), rate b = beta_t):
       kv = S^T k_t,  sq = S^T q_t                  (read S)
       delta = b (v_t - e kv),  o_t = e sq + (k_t . q_t) delta
       S <- e S + k_t delta^T                        (written during token t+1's read)
   q, k: [T, Hk, D] as they come (L2-normalised here, q then scaled by D^-1/2, as ops.l2norm);
   v: [T, Hv, E]; the three with a token's row ``qs``, ``ks``, ``vs`` elements after the last,
   heads contiguous within it; g, beta: [T, Hv]; state: [Hv, D, E] (read, then overwritten with
   the final state); out: [T, Hv, E]; cuts: ncut ascending token counts in (0, T];
   cut_states: [ncut, Hv, D, E]. Value head h reads key head h / (Hv / Hk). */

/* sum_i a[i] b[i] in a fixed order: LANES running sums (one vector register), then a fixed
   tree. A one-accumulator loop is a chain of D dependent adds the compiler may not reorder (no
   -ffast-math): at D = 64 three of them (|k|, |q|, k.q) cost more than the token's pass over S.
   Both a chunk and a decode step come through here, so they still agree bit for bit. */
#define LANES 16
static inline float dot(const float *restrict a, const float *restrict b, int64_t D)
{
    float acc[LANES];
    for (int l = 0; l < LANES; l++) acc[l] = 0.0f;
    int64_t i = 0;
    for (; i + LANES <= D; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += a[i + l] * b[i + l];
    for (int l = 0; i < D; i++, l++) acc[l] += a[i] * b[i];
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++) acc[l] += acc[l + w];
    return acc[0];
}

static void unit(const float *restrict x, float *restrict y, int64_t D, float scale)
{
    const float r = 1.0f / sqrtf(dot(x, x, D) + 1e-6f);
    for (int64_t i = 0; i < D; i++) y[i] = (x[i] * r) * scale;
}

/* A value head's T tokens in 16-float vectors (GCC / Clang vector extensions: zmm registers
   with AVX-512, pairs of ymm with AVX2, whatever the target has), E = 16 NV. A token's sums kv,
   sq and its update's dp are NV vectors each, kept in registers over the whole pass over S where
   NV is a constant (64 and 128 wide; float arrays went back to memory on every row of S: with the
   fixed-order sums, 1.16-1.27x at 256-2,000 tokens on one thread); another multiple of 16 takes
   NV at run time. */
typedef float v16 __attribute__((vector_size(64), aligned(4), may_alias));

#define HEAD(NAME, NVDECL, NV)                                                                    \
static void NAME(int64_t T, int64_t Hk, int64_t Hv, int64_t D, NVDECL, int64_t h, int64_t kh,       \
                 const float *q, const float *k, const float *v, int64_t qs, int64_t ks, int64_t vs, \
                 const float *g, const float *beta, float *restrict S, float *out, int64_t ncut,       \
                 const int64_t *cuts, float *cut_states)                                          \
{                                                                                                 \
    const int64_t E = 16 * NV;                                                                    \
    const float scale = 1.0f / sqrtf((float)D);                                                   \
    const v16 zero = {0.0f};                                                                      \
    float kbuf[2][D], qbuf[D];                                                                    \
    v16 dp[NV];                                                                                   \
    const float *kp = 0;                   /* the pending update: S <- ep S + kp dp^T */          \
    float ep = 1.0f;                                                                              \
    int64_t c = 0;                                                                                \
    for (int l = 0; l < NV; l++) dp[l] = zero;                                                    \
    for (int64_t t = 0; t < T; t++) {                                                             \
        float *restrict kt = kbuf[t & 1], *restrict qt = qbuf;   /* kp: the other buffer */      \
        unit(k + t * ks + kh * D, kt, D, 1.0f);                                                   \
        unit(q + t * qs + kh * D, qt, D, scale);                                                  \
        const v16 *vt = (const v16 *)(v + t * vs + h * E);                                        \
        v16 kv[NV], sq[NV];                                                                       \
        for (int l = 0; l < NV; l++) { kv[l] = zero; sq[l] = zero; }                              \
        if (kp) {                                                                                 \
            for (int64_t i = 0; i < D; i++) {                                                     \
                v16 *row = (v16 *)(S + i * E);                                                    \
                const float ki = kt[i], qi = qt[i], pi = kp[i];                                   \
                for (int l = 0; l < NV; l++) {                                                    \
                    const v16 r = ep * row[l] + pi * dp[l];                                       \
                    row[l] = r;                                                                   \
                    kv[l] += r * ki;                                                              \
                    sq[l] += r * qi;                                                              \
                }                                                                                 \
            }                                                                                     \
        } else {                                                                                  \
            for (int64_t i = 0; i < D; i++) {                                                     \
                const v16 *row = (const v16 *)(S + i * E);                                        \
                const float ki = kt[i], qi = qt[i];                                               \
                for (int l = 0; l < NV; l++) { kv[l] += row[l] * ki; sq[l] += row[l] * qi; }      \
            }                                                                                     \
        }                                                                                         \
        const float kq = dot(kt, qt, D);                                                          \
        const float e = expf(g[t * Hv + h]), b = beta[t * Hv + h];                                \
        v16 *o = (v16 *)(out + (t * Hv + h) * E);                                                 \
        for (int l = 0; l < NV; l++) {                                                            \
            const v16 d = b * (vt[l] - e * kv[l]);                                                \
            dp[l] = d;                                                                            \
            o[l] = e * sq[l] + kq * d;                                                            \
        }                                                                                         \
        kp = kt; ep = e;                                                                          \
        if (c < ncut && cuts[c] == t + 1) {   /* the state after this token, materialised */      \
            for (int64_t i = 0; i < D; i++) {                                                     \
                v16 *row = (v16 *)(S + i * E);                                                    \
                const float pi = kp[i];                                                           \
                for (int l = 0; l < NV; l++) row[l] = ep * row[l] + pi * dp[l];                   \
            }                                                                                     \
            kp = 0;                                                                               \
            for (; c < ncut && cuts[c] == t + 1; c++)                                             \
                memcpy(cut_states + (c * Hv + h) * D * E, S, (size_t)(D * E) * sizeof(float));    \
        }                                                                                         \
    }                                                                                             \
    if (kp) {                                                                                     \
        for (int64_t i = 0; i < D; i++) {                                                         \
            v16 *row = (v16 *)(S + i * E);                                                        \
            const float pi = kp[i];                                                               \
            for (int l = 0; l < NV; l++) row[l] = ep * row[l] + pi * dp[l];                       \
        }                                                                                         \
    }                                                                                             \
}

HEAD(head_64, int64_t unused, 4)
HEAD(head_128, int64_t unused, 8)
HEAD(head_any, int64_t nv_arg, nv_arg)

struct heads_job {
    int64_t T, Hk, Hv, D, E, lo, hi;
    const float *q, *k, *v;
    int64_t qs, ks, vs;
    const float *g, *beta;
    float *state, *out;
    int64_t ncut;
    const int64_t *cuts;
    float *cut_states;
};

static void *run_heads(void *arg)
{
    const struct heads_job *j = arg;
    const int64_t rep = j->Hv / j->Hk, D = j->D, E = j->E;
    for (int64_t h = j->lo; h < j->hi; h++) {
        float *S = j->state + h * D * E;
        if (E == 64)
            head_64(j->T, j->Hk, j->Hv, D, 4, h, h / rep, j->q, j->k, j->v, j->qs, j->ks, j->vs, j->g, j->beta,
                    S, j->out, j->ncut, j->cuts, j->cut_states);
        else if (E == 128)
            head_128(j->T, j->Hk, j->Hv, D, 8, h, h / rep, j->q, j->k, j->v, j->qs, j->ks, j->vs, j->g, j->beta,
                     S, j->out, j->ncut, j->cuts, j->cut_states);
        else
            head_any(j->T, j->Hk, j->Hv, D, E / 16, h, h / rep, j->q, j->k, j->v, j->qs, j->ks, j->vs, j->g,
                     j->beta, S, j->out, j->ncut, j->cuts, j->cut_states);
    }
    return 0;
}

int gdn_rule_f32(int64_t T, int64_t Hk, int64_t Hv, int64_t D, int64_t E,
                 const float *q, const float *k, const float *v, int64_t qs, int64_t ks, int64_t vs,
                 const float *g, const float *beta, float *state, float *out, int64_t ncut,
                 const int64_t *cuts, float *cut_states, int64_t threads)
{
    if (E < 16 || E > 4096 || E % 16 || D < 1 || D > 4096 || Hk < 1 || Hv % Hk) return -1;
    struct heads_job a = {T, Hk, Hv, D, E, 0, Hv, q, k, v, qs, ks, vs, g, beta, state, out, ncut, cuts, cut_states};
#ifdef _OPENMP
    /* the value heads split over the caller's OpenMP team: torch's own (this library resolves
       libgomp.so.1 to the copy torch loaded), whose workers spin for a while after torch's last
       parallel op and would hold a core a thread of our own needs. Heads are independent, so
       the split changes no bit. */
    const int64_t n = threads < Hv ? threads : Hv;
    if (n > 1 && T >= SPLIT_TOKENS) {
        #pragma omp parallel num_threads((int)n)
        {
            struct heads_job j = a;
            const int64_t w = omp_get_thread_num(), m = omp_get_num_threads();
            j.lo = Hv * w / m;
            j.hi = Hv * (w + 1) / m;
            run_heads(&j);
        }
        return 0;
    }
#endif
    run_heads(&a);
    return 0;
}

/* One decode step of N rows, each on its own state in place: row n's q, k: [Hk, D] at n * qs,
   n * ks; v: [Hv, E] at n * vs; g, beta: [N, Hv]; its state states + slots[n] * Hv * D * E
   (stepped in place); its output out + n * Hv * E. The same arithmetic as a one-token chunk. */
int gdn_step_f32(int64_t N, int64_t Hk, int64_t Hv, int64_t D, int64_t E,
                 const float *q, const float *k, const float *v, int64_t qs, int64_t ks, int64_t vs,
                 const float *g, const float *beta, float *states, const int64_t *slots, float *out)
{
    for (int64_t n = 0; n < N; n++) {
        int rc = gdn_rule_f32(1, Hk, Hv, D, E, q + n * qs, k + n * ks, v + n * vs, qs, ks, vs, g + n * Hv,
                              beta + n * Hv, states + slots[n] * Hv * D * E, out + n * Hv * E, 0, 0, 0, 1);
        if (rc) return rc;
    }
    return 0;
}

/* ---- the GDN layer's elementwise passes around the rule (fp32): its conv + SiLU and its
   gated norm, each one pass over rows where torch makes four or five. */

typedef int32_t i16v __attribute__((vector_size(64), aligned(4), may_alias));

/* exp of 16 floats: n = round(x log2 e), r = x - n ln 2 (two-part ln 2), Cephes' expf
   polynomial, 2^n from the exponent bits; x clamped to [-87, 88] (results stay normal floats:
   silu(x) for x < -87 comes out ~1e-36 x instead of smaller still). ~1 ulp; the same bits on
   every call (no library, no fast-math). */
static inline v16 vexp(v16 x)
{
    const v16 hi = x * 0.0f + 88.0f, lo = x * 0.0f - 87.0f;
    i16v m = x > hi;
    x = (v16)(((i16v)x & ~m) | ((i16v)hi & m));
    m = x < lo;
    x = (v16)(((i16v)x & ~m) | ((i16v)lo & m));
    const v16 fx = x * 1.44269504088896341f + 0.5f;
    i16v n = __builtin_convertvector(fx, i16v);                 /* toward zero */
    n += (__builtin_convertvector(n, v16) > fx);                /* -1 where that was above: floor */
    const v16 fn = __builtin_convertvector(n, v16);
    const v16 r = (x - fn * 0.693359375f) + fn * 2.12194440e-4f;
    v16 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    return p * (v16)((n + 127) << 23);
}

static inline v16 vsilu(v16 x) { return x / (1.0f + vexp(-x)); }

/* One row of the conv + SiLU: out[c] = silu(sum_j wt[j][c] rows[j][c]), j ascending (rows[j]: K
   pointers to C floats; wt: [K][C]). Not inlined, on purpose: a chunk's rows and a decode step's
   come through this one piece of machine code, so the compiler cannot fuse or order their
   multiply-adds differently in the two callers — the same token gives the same bits either way. */
static __attribute__((noinline)) void conv_row(const float *const *rows, const float *wt, int64_t C, int64_t K,
                                               float *out)
{
    for (int64_t l = 0; l < C / 16; l++) {
        v16 acc = ((const v16 *)rows[0])[l] * ((const v16 *)wt)[l];
        for (int64_t j = 1; j < K; j++) acc += ((const v16 *)rows[j])[l] * ((const v16 *)(wt + j * C))[l];
        ((v16 *)out)[l] = vsilu(acc);
    }
}

/* The depthwise causal conv and its SiLU over T rows of C channels (C a multiple of 16):
   y[t, c] = silu(sum_j w[c, j] r[t + j, c]), j ascending, where rows r are the K-1 state
   columns (state: [C, K-1]) and then x's rows (x: [T, C] at row stride xs); y: [T, C]
   contiguous. Rows split over the caller's threads (each row computed whole by one). */
int conv_silu_f32(int64_t T, int64_t C, int64_t K, const float *x, int64_t xs, const float *state,
                  const float *w, float *y, int64_t threads)
{
    if (C < 16 || C % 16 || K < 1 || K > 16 || T < 0) return -1;
    const int64_t k1 = K - 1;
    float wt[K][C], pre[k1 > 0 ? k1 : 1][C];                   /* w by tap; the state as rows */
    for (int64_t c = 0; c < C; c++) {
        for (int64_t j = 0; j < K; j++) wt[j][c] = w[c * K + j];
        for (int64_t j = 0; j < k1; j++) pre[j][c] = state[c * k1 + j];
    }
#ifdef _OPENMP
    #pragma omp parallel for schedule(static) num_threads((int)threads) if (threads > 1 && T * C >= 65536)
#endif
    for (int64_t t = 0; t < T; t++) {
        const float *rows[16];
        for (int64_t j = 0; j < K; j++)
            rows[j] = t + j < k1 ? pre[t + j] : x + (t + j - k1) * xs;
        conv_row(rows, &wt[0][0], C, K, y + t * C);
    }
    return 0;
}

/* One decode step of the conv + SiLU for N rows, each on its own state in place (states:
   [S, C, K-1], row n's at slots[n]; x: [N, C] at row stride xs; y: [N, C] contiguous): conv_row
   over the row's K-1 state columns and x — the bits a chunk gives the same token — then the
   state shifted by one with x appended. */
int conv_step_f32(int64_t N, int64_t C, int64_t K, const float *x, int64_t xs, float *states,
                  const int64_t *slots, const float *w, float *y)
{
    if (C < 16 || C % 16 || K < 2 || K > 16) return -1;
    const int64_t k1 = K - 1;
    float wt[K][C], win[k1][C];
    const float *rows[16];
    for (int64_t c = 0; c < C; c++)
        for (int64_t j = 0; j < K; j++) wt[j][c] = w[c * K + j];
    for (int64_t j = 0; j < k1; j++) rows[j] = win[j];
    for (int64_t n = 0; n < N; n++) {
        float *st = states + slots[n] * C * k1;
        const float *xr = x + n * xs;
        for (int64_t c = 0; c < C; c++)
            for (int64_t j = 0; j < k1; j++) win[j][c] = st[c * k1 + j];
        rows[k1] = xr;
        conv_row(rows, &wt[0][0], C, K, y + n * C);
        for (int64_t c = 0; c < C; c++) {
            for (int64_t j = 0; j + 1 < k1; j++) st[c * k1 + j] = win[j + 1][c];
            st[c * k1 + k1 - 1] = xr[c];
        }
    }
    return 0;
}

/* An attention layer's q and k heads, RMS-normalised and rotated, into one [T, Hq + Hk, D]
   buffer (fp32): each head's row y = (x r) s, r = 1 / sqrt(|x|^2 / D + eps), s the q or the k norm's
   scale [D]; then RoPE on its first R values (R even, half = R / 2): y'[e] = y[e] cos[e] -
   y[e + half] sin[e] below half, y[e] cos[e] + y[e - half] sin[e] from half to R. q at token
   stride qt and head stride qh, k at (kt, kh); cos, sin: [T, R] at token stride ct. */
int qk_norm_rope_f32(int64_t T, int64_t Hq, int64_t Hk, int64_t D, int64_t R, const float *q, int64_t qt,
                     int64_t qh, const float *k, int64_t kt, int64_t kh, const float *qs, const float *ks,
                     float eps, const float *cosv, const float *sinv, int64_t ct, float *out, int64_t threads)
{
    if (D < 1 || R < 0 || R > D || R % 2 || R > 1024) return -1;
    const int64_t H = Hq + Hk, half = R / 2;
#ifdef _OPENMP
    #pragma omp parallel for schedule(static) num_threads((int)threads) if (threads > 1 && T * H * D >= 65536)
#endif
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < H; h++) {
            const float *x = h < Hq ? q + t * qt + h * qh : k + t * kt + (h - Hq) * kh;
            const float *s = h < Hq ? qs : ks;
            float *y = out + (t * H + h) * D;
            const float r = 1.0f / sqrtf(dot(x, x, D) / (float)D + eps);
            for (int64_t e = 0; e < D; e++) y[e] = (x[e] * r) * s[e];
            const float *c = cosv + t * ct, *sn = sinv + t * ct;
            float rot[1024];
            for (int64_t e = 0; e < R; e++) rot[e] = y[e];
            for (int64_t e = 0; e < half; e++) y[e] = rot[e] * c[e] + (-rot[e + half]) * sn[e];
            for (int64_t e = half; e < R; e++) y[e] = rot[e] * c[e] + rot[e - half] * sn[e];
        }
    return 0;
}

/* The GDN output's gated RMSNorm, fp32: out[t, h] = (w (x r)) silu(z), r = 1 / sqrt(|x|^2 / E +
   eps) over each head's E values (E a multiple of 16). x: [T, H, E] at strides (xt, E); z at
   (zt, zh); out: [T, H, E] contiguous. */
int gated_norm_f32(int64_t T, int64_t H, int64_t E, const float *x, int64_t xt, const float *z, int64_t zt,
                   int64_t zh, const float *w, float eps, float *out, int64_t threads)
{
    if (E < 16 || E % 16) return -1;
    const int64_t nv = E / 16;
#ifdef _OPENMP
    #pragma omp parallel for schedule(static) num_threads((int)threads) if (threads > 1 && T * H * E >= 65536)
#endif
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < H; h++) {
            const float *xr = x + t * xt + h * E;
            const v16 *xv = (const v16 *)xr, *zv = (const v16 *)(z + t * zt + h * zh), *wv = (const v16 *)w;
            const float r = 1.0f / sqrtf(dot(xr, xr, E) / (float)E + eps);
            v16 *o = (v16 *)(out + (t * H + h) * E);
            for (int64_t l = 0; l < nv; l++) o[l] = (wv[l] * (xv[l] * r)) * vsilu(zv[l]);
        }
    return 0;
}

/* ---- a register-blocked product, and a MoE's routed experts over a chunk's tokens (fp32) ---- */

#define MR 8       /* a block's rows (token, expert) pairs */

/* c[r][0..N) = sum_j a[r][j] b[j][0..N), j ascending, for the MR rows of a (a: [MR][Kd] at row
   stride lda; b: [Kd][N] at row stride ldb; c at row stride ldc; N a multiple of 16): each output
   one running sum, so a row's result does not depend on the other rows of its block. Two 16-float
   columns at a time: 16 sums in registers, each b vector read once for the MR rows. */
static void gemm_block(int64_t Kd, int64_t N, const float *restrict a, int64_t lda, const float *restrict b,
                       int64_t ldb, float *restrict c, int64_t ldc)
{
    const v16 zero = {0.0f};
    int64_t col = 0;
    for (; col + 32 <= N; col += 32) {
        v16 acc[MR][2];
        for (int r = 0; r < MR; r++) { acc[r][0] = zero; acc[r][1] = zero; }
        for (int64_t j = 0; j < Kd; j++) {
            const v16 b0 = *(const v16 *)(b + j * ldb + col), b1 = *(const v16 *)(b + j * ldb + col + 16);
            for (int r = 0; r < MR; r++) {
                const float ar = a[r * lda + j];
                acc[r][0] += ar * b0;
                acc[r][1] += ar * b1;
            }
        }
        for (int r = 0; r < MR; r++) {
            *(v16 *)(c + r * ldc + col) = acc[r][0];
            *(v16 *)(c + r * ldc + col + 16) = acc[r][1];
        }
    }
    for (; col < N; col += 16) {
        v16 acc[MR];
        for (int r = 0; r < MR; r++) acc[r] = zero;
        for (int64_t j = 0; j < Kd; j++) {
            const v16 b0 = *(const v16 *)(b + j * ldb + col);
            for (int r = 0; r < MR; r++) acc[r] += a[r * lda + j] * b0;
        }
        for (int r = 0; r < MR; r++) *(v16 *)(c + r * ldc + col) = acc[r];
    }
}

/* The routed experts of a MoE layer over T tokens, added into out [T, H] (the shared expert's
   output): token t's slot j goes to expert top_i[t, j] with weight top_w[t, j]. The (token, slot)
   pairs are ordered by expert, stably (a counting sort: torch.argsort(top_i.view(-1), stable=True));
   each expert's pairs in blocks of MR rows:
       gu = x_t W_gu^T        (gu_t: [E][H][2I], expert e's gate_up transposed: gate then up)
       h  = silu(gu[:I]) * gu[I:]
       y  = (h W_d^T) w       (d_t: [E][I][H], its down transposed)
   into y [T k, H] at the pair's sorted place; then out[t] += y of t's pairs in sorted order
   (ascending expert), as index_add_ adds them. H and I multiples of 16, at most 4096 (a block's
   rows live on the stack); work: 4 T k + 3 E + 1 int64. Blocks split over the caller's threads;
   a row's sums never depend on its block. */
int moe_routed_f32(int64_t T, int64_t H, int64_t I, int64_t E, int64_t K, const float *x, int64_t xs,
                   const int64_t *top_i, const float *top_w, const float *gu_t, const float *d_t,
                   float *out, float *y, int64_t *work, int64_t threads)
{
    if (H < 16 || H % 16 || H > 4096 || I < 16 || I % 16 || I > 4096 || E < 1 || E > 4096 || K < 1 || K > 64
        || T < 0) return -1;
    const int64_t P = T * K;
    int64_t *order = work, *pos = work + P, *first = work + 2 * P;    /* first: E + 1 */
    for (int64_t e = 0; e <= E; e++) first[e] = 0;
    for (int64_t p = 0; p < P; p++) {
        const int64_t e = top_i[p];
        if (e < 0 || e >= E) return -2;
        first[e + 1]++;
    }
    for (int64_t e = 0; e < E; e++) first[e + 1] += first[e];
    {
        int64_t fill[E];
        for (int64_t e = 0; e < E; e++) fill[e] = first[e];
        for (int64_t p = 0; p < P; p++) {
            const int64_t s = fill[top_i[p]]++;
            order[s] = p;
            pos[p] = s;
        }
    }
    int64_t nblk = 0;
    for (int64_t e = 0; e < E; e++) nblk += (first[e + 1] - first[e] + MR - 1) / MR;
    int64_t *blk_e = first + E + 1, *blk_s = blk_e + P + E;           /* nblk <= P + E each */
    nblk = 0;
    for (int64_t e = 0; e < E; e++)
        for (int64_t s = first[e]; s < first[e + 1]; s += MR) { blk_e[nblk] = e; blk_s[nblk] = s; nblk++; }
#ifdef _OPENMP
    #pragma omp parallel for schedule(static) num_threads((int)threads) if (threads > 1 && nblk >= 8)
#endif
    for (int64_t b = 0; b < nblk; b++) {
        const int64_t e = blk_e[b], s0 = blk_s[b];
        const int64_t n = first[e + 1] - s0 < MR ? first[e + 1] - s0 : MR;
        float xb[MR * H], gu[MR * 2 * I], hb[MR * I], yb[MR * H];
        for (int64_t r = 0; r < MR; r++)
            if (r < n) memcpy(xb + r * H, x + (order[s0 + r] / K) * xs, (size_t)H * sizeof(float));
            else memset(xb + r * H, 0, (size_t)H * sizeof(float));
        gemm_block(H, 2 * I, xb, H, gu_t + e * H * 2 * I, 2 * I, gu, 2 * I);
        for (int64_t r = 0; r < MR; r++)
            for (int64_t l = 0; l < I / 16; l++) {
                const v16 g = *(const v16 *)(gu + r * 2 * I + 16 * l), u = *(const v16 *)(gu + r * 2 * I + I + 16 * l);
                *(v16 *)(hb + r * I + 16 * l) = vsilu(g) * u;
            }
        gemm_block(I, H, hb, I, d_t + e * I * H, H, yb, H);
        for (int64_t r = 0; r < n; r++) {
            const float w = top_w[order[s0 + r]];
            v16 *dst = (v16 *)(y + (s0 + r) * H);
            const v16 *src = (const v16 *)(yb + r * H);
            for (int64_t l = 0; l < H / 16; l++) dst[l] = src[l] * w;
        }
    }
#ifdef _OPENMP
    #pragma omp parallel for schedule(static) num_threads((int)threads) if (threads > 1 && T * H >= 65536)
#endif
    for (int64_t t = 0; t < T; t++) {
        int64_t ps[64];
        for (int64_t j = 0; j < K; j++) {             /* t's places, ascending (insertion sort) */
            int64_t v = pos[t * K + j], i = j;
            for (; i > 0 && ps[i - 1] > v; i--) ps[i] = ps[i - 1];
            ps[i] = v;
        }
        v16 *o = (v16 *)(out + t * H);
        for (int64_t j = 0; j < K; j++) {
            const v16 *src = (const v16 *)(y + ps[j] * H);
            for (int64_t l = 0; l < H / 16; l++) o[l] += src[l];
        }
    }
    return 0;
}

/* ---- one sequence's chunk of causal attention over its keys (fp32) ---- */

#define KB 256     /* keys a step */

/* Tq queries at positions L - Tq .. L - 1 over the sequence's L keys, query row r seeing keys
   0 .. L - Tq + r (lower-right causal): out = softmax(scale q k^T) v per query head, key / value
   head h / (Hq / Hkv). q: [Tq, Hq, D] at token stride qt and head stride qh (each head's D
   floats contiguous); kt: [Hkv][D][ldk], the keys transposed; v: [Hkv][ldk][D]; keys past L up
   to ldk (a multiple of 16, >= L) must be finite (they are weighted by exact zeros); out: [Tq,
   Hq, D] contiguous. Blocks of MR queries of one head, KB keys a step, a running max and sum
   (the online softmax): S = q kt (gemm_block), p = exp(S scale - max) with the keys a row does
   not see set to exact zeros, o = o c + p v. A block stops at the last key its last row sees;
   its blocks split over the caller's threads, and a row's arithmetic never depends on its
   block or thread. */
int attn_chunk_f32(int64_t Tq, int64_t L, int64_t Hq, int64_t Hkv, int64_t D, const float *q, int64_t qt,
                   int64_t qh, const float *kt, int64_t ldk, const float *v, float scale, float *out,
                   int64_t threads)
{
    if (D < 16 || D % 16 || D > 512 || Hkv < 1 || Hq % Hkv || Tq < 0 || Tq > L || ldk < L || ldk % 16) return -1;
    const int64_t start = L - Tq, rep = Hq / Hkv, nqb = (Tq + MR - 1) / MR, items = nqb * Hq;
#ifdef _OPENMP
    #pragma omp parallel for schedule(static, 1) num_threads((int)threads) if (threads > 1 && Tq * L >= 16384)
#endif
    for (int64_t it = 0; it < items; it++) {
        const int64_t h = it % Hq, r0 = (it / Hq) * MR, g = h / rep;
        const int64_t n = Tq - r0 < MR ? Tq - r0 : MR;
        float qb[MR * D], sb[MR * KB], o[MR * D], tmp[MR * D], m[MR], l[MR];
        for (int64_t r = 0; r < MR; r++) {
            if (r < n) memcpy(qb + r * D, q + (r0 + r) * qt + h * qh, (size_t)D * sizeof(float));
            else memset(qb + r * D, 0, (size_t)D * sizeof(float));
            m[r] = -INFINITY;
            l[r] = 0.0f;
        }
        memset(o, 0, sizeof(o));
        const int64_t last = start + r0 + n;                  /* keys [0, last): what the block's rows see */
        const float *ktg = kt + g * D * ldk, *vg = v + g * ldk * D;
        for (int64_t k0 = 0; k0 < last; k0 += KB) {
            const int64_t nk = last - k0 < KB ? last - k0 : KB, nv = (nk + 15) / 16;
            gemm_block(D, 16 * nv, qb, D, ktg + k0, ldk, sb, KB);
            for (int64_t r = 0; r < MR; r++) {
                v16 *row = (v16 *)(sb + r * KB);
                int64_t seen = start + r0 + r + 1 - k0;       /* the row's keys in this step */
                if (r >= n || seen < 0) seen = 0;
                if (seen > nk) seen = nk;
                const v16 zero = {0.0f};
                if (seen == 0) {
                    for (int64_t c = 0; c < nv; c++) row[c] = zero;
                    continue;
                }
                /* whole vectors the row sees, then one partial (lanes at or past ``seen`` cut off
                   with a lane mask), then nothing */
                const int64_t full = seen / 16, rem = seen % 16;
                const i16v lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
                const i16v keep = lane < (i16v){0} + (int32_t)rem;
                const v16 ninf = zero - INFINITY;
                v16 mv = ninf;
                for (int64_t c = 0; c < nv; c++) {
                    v16 x = row[c] * scale;
                    if (c == full) x = (v16)(((i16v)x & keep) | ((i16v)ninf & ~keep));
                    else if (c > full) x = ninf;
                    row[c] = x;
                    const i16v gt = x > mv;
                    mv = (v16)(((i16v)x & gt) | ((i16v)mv & ~gt));
                }
                float mx = mv[0];
                for (int x = 1; x < 16; x++) mx = mv[x] > mx ? mv[x] : mx;
                const float mnew = mx > m[r] ? mx : m[r], corr = expf(m[r] - mnew);
                v16 sum = zero;
                for (int64_t c = 0; c < nv; c++) {
                    v16 p = vexp(row[c] - mnew);
                    if (c == full) p = (v16)((i16v)p & keep);
                    else if (c > full) p = zero;
                    row[c] = p;
                    sum += p;
                }
                float ps = 0.0f;
                for (int x = 0; x < 16; x++) ps += sum[x];
                l[r] = l[r] * corr + ps;
                m[r] = mnew;
                v16 *orow = (v16 *)(o + r * D);
                for (int64_t c = 0; c < D / 16; c++) orow[c] = orow[c] * corr;
            }
            gemm_block(16 * nv, D, sb, KB, vg + k0 * D, D, tmp, D);
            for (int64_t x = 0; x < MR * D / 16; x++) ((v16 *)o)[x] += ((const v16 *)tmp)[x];
        }
        for (int64_t r = 0; r < n; r++) {
            const float inv = 1.0f / l[r];
            v16 *dst = (v16 *)(out + ((r0 + r) * Hq + h) * D);
            const v16 *src = (const v16 *)(o + r * D);
            for (int64_t c = 0; c < D / 16; c++) dst[c] = src[c] * inv;
        }
    }
    return 0;
}
"""

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_why: str | None = None


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ninfer" / "kernels"


def _cpu_key() -> str:
    """The CPU the build targets (``-march=native``): its model and flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "|".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))}))
    except OSError:
        return platform.processor() or platform.machine()


def _shares_torchs_openmp() -> bool:
    """Whether a ``-fopenmp`` build joins torch's own thread team: torch's parallel backend is
    OpenMP and a libgomp.so.1 is loaded in this process (the build's ``libgomp.so.1`` then
    resolves to that copy by its soname). Elsewhere (another OpenMP runtime, no /proc) the
    kernel is built without OpenMP and runs its heads one after another."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return False
    return "libgomp" in maps and "parallel backend: OpenMP" in torch.__config__.parallel_info()


def _compile(cc: str, flags: tuple[str, ...]) -> Path:
    key = hashlib.sha256("\0".join((SOURCE, cc, *flags, _cpu_key())).encode()).hexdigest()[:20]
    out = _cache_dir() / f"gdn_rule-{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            src, lib = Path(tmp) / "gdn_rule.c", Path(tmp) / "gdn_rule.so"
            src.write_text(SOURCE)
            got = subprocess.run([cc, *flags, "-o", str(lib), str(src), "-lm"], capture_output=True, text=True,
                                 timeout=120)
            if got.returncode != 0:
                raise RuntimeError(f"{cc} failed: {got.stderr.strip()[-400:]}")
            os.replace(lib, out)          # atomic: a concurrent build's file is as good as this one
    return out


def _build() -> ctypes.CDLL:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc, clang) on PATH")
    out = None
    if _shares_torchs_openmp():
        try:
            out = _compile(cc, (*CFLAGS, "-fopenmp"))
        except (RuntimeError, subprocess.SubprocessError):
            out = None                    # no OpenMP in this compiler: the serial build below
    if out is None:
        out = _compile(cc, CFLAGS)
    lib = ctypes.CDLL(str(out))
    f = lib.gdn_rule_f32
    i64, fp = ctypes.c_int64, ctypes.c_void_p
    f.argtypes = [i64, i64, i64, i64, i64, fp, fp, fp, i64, i64, i64, fp, fp, fp, fp, i64, fp, fp, i64]
    f.restype = ctypes.c_int
    f = lib.conv_silu_f32
    f.argtypes = [i64, i64, i64, fp, i64, fp, fp, fp, i64]
    f.restype = ctypes.c_int
    f = lib.conv_step_f32
    f.argtypes = [i64, i64, i64, fp, i64, fp, fp, fp, fp]
    f.restype = ctypes.c_int
    f = lib.qk_norm_rope_f32
    f.argtypes = [i64, i64, i64, i64, i64, fp, i64, i64, fp, i64, i64, fp, fp, ctypes.c_float, fp, fp, i64, fp, i64]
    f.restype = ctypes.c_int
    f = lib.gated_norm_f32
    f.argtypes = [i64, i64, i64, fp, i64, fp, i64, i64, fp, ctypes.c_float, fp, i64]
    f.restype = ctypes.c_int
    f = lib.moe_routed_f32
    f.argtypes = [i64, i64, i64, i64, i64, fp, i64, fp, fp, fp, fp, fp, fp, fp, i64]
    f.restype = ctypes.c_int
    f = lib.attn_chunk_f32
    f.argtypes = [i64, i64, i64, i64, i64, fp, i64, i64, fp, i64, fp, ctypes.c_float, fp, i64]
    f.restype = ctypes.c_int
    f = lib.gdn_step_f32
    f.argtypes = [i64, i64, i64, i64, i64, fp, fp, fp, i64, i64, i64, fp, fp, fp, fp, fp]
    f.restype = ctypes.c_int
    return lib


def load() -> ctypes.CDLL | None:
    """The compiled kernel, built on first use; None when disabled or it cannot be built
    (``why()`` says why)."""
    global _lib, _tried, _why
    if _tried:
        return _lib
    with _lock:
        if not _tried:
            if os.environ.get(ENV, "1") == "0":
                _why = f"{ENV}=0"
            else:
                try:
                    _lib = _build()
                except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                    _why = str(e)
            _tried = True
    return _lib


def available() -> bool:
    return load() is not None


def why() -> str | None:
    """Why the kernel is not in use (None when it is)."""
    load()
    return _why


def _reset_for_tests() -> None:
    """Forget the loaded kernel, so the next ``load`` reads the environment again."""
    global _lib, _tried, _why
    with _lock:
        _lib, _tried, _why = None, False, None


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] in fp32 with each token's heads contiguous (the conv output's views are, at
    their row's stride): as it is when it already is, else a contiguous copy."""
    if x.dtype != torch.float32:
        return x.to(torch.float32).contiguous()
    if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        return x.contiguous()
    return x


def fits(dv: int) -> bool:
    """Whether the loop takes value heads ``dv`` wide: whole 16-float vectors (64 and 128 with
    the width a constant, other multiples of 16 at run time); a caller keeps the chunked form for
    any other width."""
    return 16 <= dv <= 4096 and dv % 16 == 0


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> None:
    """The shapes the C loop indexes by, on the CPU: a mismatch is an error here, not a stray read."""
    t, hk, dk = k.shape
    hv = v.shape[1]
    if any(x.device.type != "cpu" for x in (q, k, v, g, beta)):
        raise ValueError("the CPU kernel takes CPU tensors")
    if not fits(v.shape[2]):
        raise ValueError(f"the CPU kernel takes value heads a multiple of 16 wide, not {v.shape[2]}")
    if q.shape != k.shape or v.shape[0] != t or g.shape != (t, hv) or beta.shape != (t, hv):
        raise ValueError(f"the CPU kernel's shapes disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}, g {tuple(g.shape)}, beta {tuple(beta.shape)}")


def delta_rule_cuts(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor, cuts: tuple[int, ...] | list[int] = (),
                    ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """``cpu_ops.chunk_delta_rule_cuts``'s contract (q, k: [T, Hk, Dk]; v: [T, Hv, Dv]; g, beta:
    [T, Hv]; state: [Hv, Dk, Dv] -> o in v's dtype, the final state and the states after
    ``cuts`` tokens in fp32) by the compiled recurrence; ``load()`` must not be None."""
    lib = load()
    f32 = torch.float32
    _check(q, k, v, g, beta)
    t, hk, dk = k.shape
    hv, dv, out_dtype = v.shape[1], v.shape[2], v.dtype
    cuts = [int(r) for r in cuts]
    if state.shape != (hv, dk, dv) or state.device.type != "cpu":
        raise ValueError(f"the CPU kernel's state is {tuple(state.shape)}, not ({hv}, {dk}, {dv}) on the CPU")
    if any(not 0 < r <= t for r in cuts) or cuts != sorted(cuts):
        raise ValueError(f"cuts must ascend within (0, {t}]: {cuts}")
    q, k, v = _rows(q), _rows(k), _rows(v)
    gf, bf = g.to(f32).contiguous(), beta.to(f32).contiguous()
    s = state.to(f32, copy=True).contiguous()
    out = torch.empty(t, hv, dv, dtype=f32)
    kept = torch.empty(len(cuts), hv, dk, dv, dtype=f32)
    at = (ctypes.c_int64 * max(len(cuts), 1))(*cuts)
    rc = lib.gdn_rule_f32(t, hk, hv, dk, dv, q.data_ptr(), k.data_ptr(), v.data_ptr(), q.stride(0), k.stride(0),
                          v.stride(0), gf.data_ptr(), bf.data_ptr(), s.data_ptr(), out.data_ptr(), len(cuts),
                          ctypes.addressof(at), kept.data_ptr(), torch.get_num_threads())
    if rc:
        raise ValueError(f"gdn_rule_f32: unsupported shapes (Hk {hk}, Hv {hv}, Dv {dv})")
    return out if out_dtype == f32 else out.to(out_dtype), s, list(kept.unbind(0))


def delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state: torch.Tensor, chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``gdn.chunk_gated_delta_rule``'s contract by the compiled recurrence (``chunk`` ignored:
    the recurrence has no blocks)."""
    o, s, _ = delta_rule_cuts(q, k, v, g, beta, state)
    return o, s


def delta_rule_step_slots(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          states: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """One decode step of N rows (q, k: [N, Hk, Dk]; v: [N, Hv, Dv]; g, beta: [N, Hv]), each row's
    state stepped in place in its slot of ``states`` [S, Hv, Dk, Dv] (fp32, contiguous; distinct
    slots): the arithmetic of a one-token chunk through ``delta_rule``. Returns o [N, Hv, Dv] in
    v's dtype."""
    lib = load()
    f32 = torch.float32
    _check(q, k, v, g, beta)
    n, hk, dk = k.shape
    hv, dv, out_dtype = v.shape[1], v.shape[2], v.dtype
    if states.dtype != f32 or not states.is_contiguous() or states.device.type != "cpu" \
            or states.shape[1:] != (hv, dk, dv):
        raise ValueError(f"the CPU kernel's states must be contiguous fp32 [S, {hv}, {dk}, {dv}] on the CPU")
    if slots.shape != (n,):
        # (their values are the batch's own slots, not read here: a graph's captured forward reads
        # no tensor back to Python — native/graphs.py)
        raise ValueError(f"the CPU kernel's slots must be {n} indices, not {tuple(slots.shape)}")
    q, k, v = _rows(q), _rows(k), _rows(v)
    gf, bf = g.to(f32).contiguous(), beta.to(f32).contiguous()
    at = slots.to(torch.int64).contiguous()
    out = torch.empty(n, hv, dv, dtype=f32)
    rc = lib.gdn_step_f32(n, hk, hv, dk, dv, q.data_ptr(), k.data_ptr(), v.data_ptr(), q.stride(0), k.stride(0),
                          v.stride(0), gf.data_ptr(), bf.data_ptr(), states.data_ptr(), at.data_ptr(), out.data_ptr())
    if rc:
        raise ValueError(f"gdn_step_f32: unsupported shapes (Hk {hk}, Hv {hv}, Dv {dv})")
    return out if out_dtype == f32 else out.to(out_dtype)


def conv_silu(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``gdn.causal_conv1d``'s contract in fp32 (x: [T, C] with contiguous rows, any row stride;
    state: [C, K-1]; weight: [C, K]; C a multiple of 16): y = silu(conv) [T, C] in one pass over the
    rows, and the new state, the last K-1 inputs [C, K-1]."""
    lib = load()
    f32 = torch.float32
    t, c = x.shape
    k = weight.shape[1]
    if x.dtype != f32 or x.stride(1) != 1 or state.shape != (c, k - 1) or weight.shape != (c, k) or not fits(c) \
            or k > 16:
        raise ValueError(f"conv_silu takes fp32 rows [T, C] (C a multiple of 16), state [C, K-1], weight [C, K]: "
                         f"x {tuple(x.shape)} {x.dtype}, state {tuple(state.shape)}, weight {tuple(weight.shape)}")
    st = state.to(f32).contiguous()
    w = weight.to(f32).contiguous()
    y = torch.empty(t, c, dtype=f32)
    rc = lib.conv_silu_f32(t, c, k, x.data_ptr(), x.stride(0), st.data_ptr(), w.data_ptr(), y.data_ptr(),
                           torch.get_num_threads())
    if rc:
        raise ValueError(f"conv_silu_f32: unsupported shapes (C {c}, K {k})")
    window = torch.cat([st.t(), x[t - min(t, k - 1):]], dim=0)                 # the last inputs, oldest first
    return y, window[window.shape[0] - (k - 1):].t().contiguous()


def conv_step_slots(x: torch.Tensor, conv_states: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor
                    ) -> torch.Tensor:
    """``cpu_ops.conv_step_slots``'s contract in fp32 (x: [N, C] with contiguous rows; conv_states:
    [S, C, K-1] fp32 contiguous, each row's state stepped in its slot in place; slots distinct;
    weight: [C, K], 2 <= K <= 16; C a multiple of 16): y [N, C], the bits ``conv_silu`` gives the
    same token in a chunk."""
    lib = load()
    f32 = torch.float32
    n, c = x.shape
    k = weight.shape[1]
    if x.dtype != f32 or x.stride(1) != 1 or conv_states.dtype != f32 or not conv_states.is_contiguous() \
            or conv_states.shape[1:] != (c, k - 1) or weight.shape != (c, k) or not fits(c) or not 2 <= k <= 16 \
            or slots.shape != (n,):
        raise ValueError(f"conv_step_slots takes fp32 rows [N, C] (C a multiple of 16), contiguous fp32 states "
                         f"[S, C, K-1], weight [C, K] and N slots: x {tuple(x.shape)} {x.dtype}, states "
                         f"{tuple(conv_states.shape)} {conv_states.dtype}, weight {tuple(weight.shape)}, "
                         f"slots {tuple(slots.shape)}")
    at = slots.to(torch.int64).contiguous()
    w = weight.to(f32).contiguous()
    y = torch.empty(n, c, dtype=f32)
    rc = lib.conv_step_f32(n, c, k, x.data_ptr(), x.stride(0), conv_states.data_ptr(), at.data_ptr(), w.data_ptr(),
                           y.data_ptr())
    if rc:
        raise ValueError(f"conv_step_f32: unsupported shapes (C {c}, K {k})")
    return y


def gated_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``ops.gated_rms_norm``'s contract in fp32 (x, gate: [T, H, E], each head's E values
    contiguous, any token stride; gate any head stride; weight: [E]; E a multiple of 16): one pass."""
    lib = load()
    f32 = torch.float32
    t, h, e = x.shape
    if x.dtype != f32 or gate.dtype != f32 or weight.dtype != f32 or gate.shape != x.shape or weight.shape != (e,) \
            or x.stride(2) != 1 or x.stride(1) != e or gate.stride(2) != 1 or not fits(e):
        raise ValueError(f"gated_norm takes fp32 [T, H, E] rows (E a multiple of 16): x {tuple(x.shape)} "
                         f"{x.dtype}, gate {tuple(gate.shape)} {gate.dtype}, weight {tuple(weight.shape)}")
    w = weight.contiguous()
    out = torch.empty(t, h, e, dtype=f32)
    rc = lib.gated_norm_f32(t, h, e, x.data_ptr(), x.stride(0), gate.data_ptr(), gate.stride(0), gate.stride(1),
                            w.data_ptr(), float(eps), out.data_ptr(), torch.get_num_threads())
    if rc:
        raise ValueError(f"gated_norm_f32: unsupported shapes (E {e})")
    return out


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_scale: torch.Tensor, k_scale: torch.Tensor, eps: float,
                 cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """An attention layer's q [T, Hq, D] and k [T, Hk, D] (fp32, each head's D values contiguous,
    any token and head strides) RMS-normalised by their norms' scales [D] — ``cpu_ops.scaled_norm``'s
    (x r) s — and rotated by cos, sin [T, 1, R] (``cpu_layers.rope_``: the first R values, R even),
    in one pass into a new [T, Hq + Hk, D]: the q heads, then the k heads."""
    lib = load()
    f32 = torch.float32
    t, hq, d = q.shape
    hk, r = k.shape[1], cos.shape[-1]
    if any(x.dtype != f32 for x in (q, k, q_scale, k_scale, cos, sin)) or q.stride(2) != 1 or k.stride(2) != 1 \
            or k.shape[0] != t or k.shape[2] != d or q_scale.shape != (d,) or k_scale.shape != (d,) \
            or cos.shape != (t, 1, r) or sin.shape != cos.shape or r % 2 or r > min(d, 1024) \
            or cos.stride(2) != 1 or sin.stride() != cos.stride():
        raise ValueError(f"qk_norm_rope takes fp32 q [T, Hq, D], k [T, Hk, D], scales [D] and cos, sin [T, 1, R] "
                         f"(R even, at most D): q {tuple(q.shape)}, k {tuple(k.shape)}, cos {tuple(cos.shape)}")
    qs, ks = q_scale.contiguous(), k_scale.contiguous()
    out = torch.empty(t, hq + hk, d, dtype=f32)
    rc = lib.qk_norm_rope_f32(t, hq, hk, d, r, q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0),
                              k.stride(1), qs.data_ptr(), ks.data_ptr(), float(eps), cos.data_ptr(), sin.data_ptr(),
                              cos.stride(0), out.data_ptr(), torch.get_num_threads())
    if rc:
        raise ValueError(f"qk_norm_rope_f32: unsupported shapes (D {d}, R {r})")
    return out


def moe_fits(hidden: int, inter: int) -> bool:
    """Whether ``moe_routed`` takes a MoE of this hidden size and expert width: whole 16-float
    vectors, at most 4,096 (a block's rows live on the stack); a caller keeps the torch form."""
    return fits(hidden) and fits(inter) and hidden <= 4096 and inter <= 4096


def moe_routed(x: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor, gate_up_t: torch.Tensor,
               down_t: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """A MoE layer's routed experts over x [T, H] (fp32, contiguous rows, any row stride), added into
    ``out`` [T, H] (fp32, contiguous: the shared expert's output) and returned: token t's k experts
    top_i [T, k] with weights top_w [T, k] (fp32); gate_up_t: [E, H, 2I] (each expert's gate_up
    transposed: gate columns, then up), down_t: [E, I, H] (its down transposed), both contiguous
    fp32. ``cpu_ops.grouped_moe``'s contract: the pairs ordered by expert (stably), each expert's
    SwiGLU, its output scaled by the pair's weight and added into its token's row in that order."""
    lib = load()
    f32 = torch.float32
    t, h = x.shape
    e, i = down_t.shape[0], down_t.shape[1]
    k = top_i.shape[1] if top_i.dim() == 2 else -1
    if x.dtype != f32 or x.stride(1) != 1 or top_i.shape != (t, k) or top_w.shape != (t, k) \
            or top_w.dtype != f32 or gate_up_t.shape != (e, h, 2 * i) or down_t.shape != (e, i, h) \
            or gate_up_t.dtype != f32 or down_t.dtype != f32 or not gate_up_t.is_contiguous() \
            or not down_t.is_contiguous() or out.shape != (t, h) or out.dtype != f32 or not out.is_contiguous() \
            or not moe_fits(h, i) or not 1 <= k <= 64:
        raise ValueError(f"moe_routed takes fp32 x [T, H], top_i / top_w [T, k], gate_up_t [E, H, 2I], down_t "
                         f"[E, I, H] and out [T, H] (H, I multiples of 16 up to 4096): x {tuple(x.shape)} {x.dtype}, "
                         f"top_i {tuple(top_i.shape)}, gate_up_t {tuple(gate_up_t.shape)}, down_t "
                         f"{tuple(down_t.shape)}, out {tuple(out.shape)}")
    ids = top_i.to(torch.int64).contiguous()
    w = top_w.contiguous()
    y = torch.empty(t * k, h, dtype=f32)
    work = torch.empty(4 * t * k + 3 * e + 1, dtype=torch.int64)
    rc = lib.moe_routed_f32(t, h, i, e, k, x.data_ptr(), x.stride(0), ids.data_ptr(), w.data_ptr(),
                            gate_up_t.data_ptr(), down_t.data_ptr(), out.data_ptr(), y.data_ptr(), work.data_ptr(),
                            torch.get_num_threads())
    if rc == -2:
        raise ValueError(f"moe_routed_f32: an expert id outside [0, {e})")
    if rc:
        raise ValueError(f"moe_routed_f32: unsupported shapes (H {h}, I {i}, E {e}, k {k})")
    return out


def attention_fits(head_dim: int) -> bool:
    """Whether ``chunk_attention`` takes heads ``head_dim`` wide: whole 16-float vectors, at most 512."""
    return fits(head_dim) and head_dim <= 512


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One sequence's chunk of causal attention (``attention.paged_attention``'s arithmetic with
    its keys gathered): q [Tq, Hq, D] (fp32, each head's D values contiguous, any token and head
    strides) at positions L - Tq .. L - 1 over the sequence's keys and values k, v [L, Hkv, D]
    (any float dtype), query r seeing keys 0 .. L - Tq + r. Returns [Tq, Hq, D] fp32."""
    lib = load()
    f32 = torch.float32
    tq, hq, d = q.shape
    n, hkv = k.shape[0], k.shape[1]
    if q.dtype != f32 or q.stride(2) != 1 or k.shape != (n, hkv, d) or v.shape != k.shape or not tq <= n \
            or hkv < 1 or hq % hkv or not attention_fits(d):
        raise ValueError(f"chunk_attention takes fp32 q [Tq, Hq, D] and k, v [L, Hkv, D] (L >= Tq, Hq a multiple of "
                         f"Hkv, D a multiple of 16 up to 512): q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    ldk = (n + 15) // 16 * 16
    kt = torch.empty(hkv, d, ldk, dtype=f32)
    kt[:, :, :n] = k.permute(1, 2, 0)
    kt[:, :, n:] = 0.0
    vt = torch.empty(hkv, ldk, d, dtype=f32)
    vt[:, :n] = v.transpose(0, 1)
    vt[:, n:] = 0.0
    out = torch.empty(tq, hq, d, dtype=f32)
    rc = lib.attn_chunk_f32(tq, n, hq, hkv, d, q.data_ptr(), q.stride(0), q.stride(1), kt.data_ptr(), ldk,
                            vt.data_ptr(), float(scale), out.data_ptr(), torch.get_num_threads())
    if rc:
        raise ValueError(f"attn_chunk_f32: unsupported shapes (Hq {hq}, Hkv {hkv}, D {d})")
    return out
