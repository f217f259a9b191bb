/* Per-example weight-gradient norms of a Conv2d (groups = 1) on the CPU, in float32, for
 * dpml.train.clipping_layers (loaded by dpml.train.kernels, which compiles it on first use).
 *
 *   dpml_conv_norms(x, d, B, shape, squared, grads):
 *   x (B, C, H, W) the layer's input, d (B, O, OH, OW) its output gradient, both contiguous float32,
 *   shape = (C, H, W, O, OH, OW, kh, kw, sh, sw, ph, pw, dh, dw); for each example i: A_i (T x K) its patches, T = OH OW positions, K = C kh kw in
 *   the weight's (c, u, v) order, zero where the kernel reaches into the padding; G_i = d_i A_i
 *   (O x K) = the example's weight gradient (Goodfellow 2015); squared[i] = ||G_i||_F^2, and when
 *   grads is not NULL, grads[i] = G_i (B x O x K). The patches of one example are built in a buffer of
 *   T K numbers and multiplied there, so they stay in the cache (a batch's patches would not).
 *   Returns 0, or -1 when the buffer cannot be allocated.
 */
#include <omp.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define OB 4  /* output channels per block: their accumulators and one patch row stay in registers */
#define KB 64 /* patch columns per block */

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONES
#endif

typedef struct { int64_t C, H, W, O, OH, OW, kh, kw, sh, sw, ph, pw, dh, dw; } geometry;

/* The first index in [0, n) with 0 <= start + index * step < size, and one past the last (step > 0). */
static void valid_range(int64_t start, int64_t step, int64_t n, int64_t size, int64_t *lo, int64_t *hi) {
    int64_t first = start >= 0 ? 0 : (-start + step - 1) / step;
    int64_t last = start + (n - 1) * step < size ? n : (size - 1 - start) / step + 1;
    if (start > size - 1) last = 0;
    *lo = first < n ? first : n;
    *hi = last > *lo ? last : *lo;
}

/* A (T x K): A[t][(c, u, v)] = x[c][oh sh - ph + u dh][ow sw - pw + v dw], or 0 outside the image. */
static void patches(const float *x, const geometry *g, float *a) {
    const int64_t K = g->C * g->kh * g->kw;
    for (int64_t oh = 0; oh < g->OH; oh++) {
        int64_t u_lo, u_hi;
        valid_range(oh * g->sh - g->ph, g->dh, g->kh, g->H, &u_lo, &u_hi);
        for (int64_t ow = 0; ow < g->OW; ow++) {
            int64_t v_lo, v_hi;
            const int64_t w0 = ow * g->sw - g->pw;
            valid_range(w0, g->dw, g->kw, g->W, &v_lo, &v_hi);
            float *row = a + (oh * g->OW + ow) * K;
            for (int64_t c = 0; c < g->C; c++) {
                for (int64_t u = 0; u < g->kh; u++) {
                    float *out = row + (c * g->kh + u) * g->kw;
                    if (u < u_lo || u >= u_hi) {
                        for (int64_t v = 0; v < g->kw; v++) out[v] = 0.0f;
                        continue;
                    }
                    const float *line = x + (c * g->H + oh * g->sh - g->ph + u * g->dh) * g->W + w0;
                    for (int64_t v = 0; v < v_lo; v++) out[v] = 0.0f;
                    if (g->dw == 1) {
                        for (int64_t v = v_lo; v < v_hi; v++) out[v] = line[v];
                    } else {
                        for (int64_t v = v_lo; v < v_hi; v++) out[v] = line[v * g->dw];
                    }
                    for (int64_t v = v_hi; v < g->kw; v++) out[v] = 0.0f;
                }
            }
        }
    }
}

/* acc = rows x cols of G_i = d_i A, from output channel o0 and patch column k0. */
static inline __attribute__((always_inline)) void accumulate(const float *di, const float *a, int64_t T, int64_t K,
                                                             int64_t o0, int64_t rows, int64_t k0, int64_t cols,
                                                             float acc[OB][KB]) {
    for (int64_t t = 0; t < T; t++) {
        const float *p = a + t * K + k0;
        for (int64_t r = 0; r < rows; r++) {
            const float w = di[(o0 + r) * T + t];
#pragma omp simd
            for (int64_t k = 0; k < cols; k++) acc[r][k] += w * p[k];
        }
    }
}

/* One block of G_i, zeroed first. A full block (rows = OB, cols = KB) passes its bounds as constants,
 * so that the inlined loops keep the accumulators in vector registers. */
static inline __attribute__((always_inline)) void block(const float *di, const float *a, int64_t T, int64_t K, int64_t o0,
                                                        int64_t rows, int64_t k0, int64_t cols, float acc[OB][KB]) {
    memset(acc, 0, sizeof(float) * OB * KB);
    if (rows == OB && cols == KB) {
        accumulate(di, a, T, K, o0, OB, k0, KB, acc);
    } else {
        accumulate(di, a, T, K, o0, rows, k0, cols, acc);
    }
}

/* Examples first ... last - 1, one patch buffer per thread; returns 0, or -1 if a buffer could not be had.
 * Cloned for the instruction sets itself: the OpenMP region that calls it is a function of its own. */
CLONES int dpml_conv_examples(const float *x, const float *d, int64_t first, int64_t last, const geometry *g, float *squared,
                    float *grads) {
    const int64_t T = g->OH * g->OW, K = g->C * g->kh * g->kw;
    float *a = malloc((size_t)(T * K) * sizeof(float));
    if (a == NULL) return -1;
    float acc[OB][KB];
    for (int64_t i = first; i < last; i++) {
        const float *di = d + i * g->O * T;
        patches(x + i * g->C * g->H * g->W, g, a);
        double total = 0.0;
        for (int64_t o0 = 0; o0 < g->O; o0 += OB) {
            const int64_t rows = g->O - o0 < OB ? g->O - o0 : OB;
            for (int64_t k0 = 0; k0 < K; k0 += KB) {
                const int64_t cols = K - k0 < KB ? K - k0 : KB;
                block(di, a, T, K, o0, rows, k0, cols, acc);
                float s = 0.0f;
                for (int64_t r = 0; r < rows; r++) {
#pragma omp simd reduction(+ : s)
                    for (int64_t k = 0; k < cols; k++) s += acc[r][k] * acc[r][k];
                    if (grads != NULL) memcpy(grads + (i * g->O + o0 + r) * K + k0, acc[r], (size_t)cols * sizeof(float));
                }
                total += s;
            }
        }
        squared[i] = (float)total;
    }
    free(a);
    return 0;
}

/* The examples split over the OpenMP threads: linked by soname, this library shares the libgomp that
 * torch has already loaded, so these are torch's own intra-op threads (torch.set_num_threads sets their
 * count), not a second pool competing with them. */
int dpml_conv_norms(const float *x, const float *d, int64_t batch, const int64_t *shape, float *squared, float *grads) {
    const geometry g = {shape[0], shape[1], shape[2], shape[3], shape[4], shape[5], shape[6],
                        shape[7], shape[8], shape[9], shape[10], shape[11], shape[12], shape[13]};
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        const int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();
        failed |= dpml_conv_examples(x, d, batch * me / threads, batch * (me + 1) / threads, &g, squared, grads);
    }
    return failed ? -1 : 0;
}
