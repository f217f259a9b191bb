/* Per-example weight-gradient norms of a Conv2d (groups = 1) on the CPU, in float32, for
 * dpml.train.clipping_layers (loaded by dpml.train.kernels, which compiles it on first use).
 *
 *   dpml_conv_norms(x, d, B, shape, squared, grads):
 *   x (B, C, H, W) the layer's input, d (B, O, OH, OW) its output gradient, float32 in any layout their
 *   strides describe (NCHW, channels last, a permuted view: read in place, no copy first),
 *   shape = (C, H, W, O, OH, OW, kh, kw, sh, sw, ph, pw, dh, dw, direct, G, xb, xg, xc, xh, xw, db, dg, dout, dt):
 *   example i's input starts at x + (i / G) xb + (i % G) xg, element (c, h, w) at c xc + h xh + w xw from there,
 *   and its output gradient at d + (i / G) db + (i % G) dg, element (o, t) at o dout + t dt for position
 *   t = oh OW + ow (G = 1: one batch stride; G > 1: the (example, group) pairs of a grouped layer, each group
 *   a run of channels); for each example i: A_i (T x K) its
 *   patches, T = OH OW positions, K = C kh kw, zero where the kernel reaches into the padding; G_i = d_i A_i
 *   (O x K) = the example's weight gradient (Goodfellow 2015); squared[i] = ||G_i||_F^2, and when
 *   grads is not NULL, grads[i] = G_i (B x O x K). Two ways, the caller's choice (direct):
 *   - direct = 0, columns in the weight's (c, u, v) order: the patches of one example are built in a buffer
 *     of T K numbers and multiplied there, so they stay in the cache (a batch's patches would not); they
 *     are copied, row by row, from a copy of the example inside its zero padding, so that no copy tests
 *     the image's bounds (that test per position and row made the patches cost more than the product);
 *   - direct = 1 (C a multiple of 16), columns in the channels-last (u, v, c) order: no patches at all. The
 *     example is copied channels last inside its zero padding, xl (HP x WP x C), where the 16 channels
 *     c..c+15 of the patch of position t at kernel offset (u, v) are 16 contiguous numbers at
 *     xl + ((oh sh + u dh) WP + ow sw + v dw) C + c: each vector of the product is loaded from there.
 *   Returns 0, or -1 when a buffer cannot be allocated.
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

#define LANES 16 /* a vector of 16 floats: the direct way's unit, one (u, v) and 16 channels */
#define UNITS (KB / LANES)

#define CACHE_LINE 64 /* the buffers start on a cache line: a vector load then spans one line, not two (the
                       * direct way's product took 25% longer from malloc's 16-byte-aligned buffers, ad hoc) */

typedef struct {
    int64_t C, H, W, O, OH, OW, kh, kw, sh, sw, ph, pw, dh, dw, direct;
    int64_t G, xb, xg, xc, xh, xw, db, dg, dout, dt; /* where each example's numbers are (the header) */
} geometry;

_Static_assert(sizeof(geometry) == 25 * sizeof(int64_t), "geometry: the 25 numbers of shape");

static size_t cache_lines(size_t bytes) { return (bytes + CACHE_LINE - 1) / CACHE_LINE * CACHE_LINE; }

/* xp (C x HP x WP, HP = H + 2 ph, WP = W + 2 pw): the example's input inside its zero padding; the buffer
 * is zeroed once and its border stays zero, each example copies its rows into the interior. */
static void pad(const float *x, const geometry *g, float *xp) {
    const int64_t HP = g->H + 2 * g->ph, WP = g->W + 2 * g->pw;
    for (int64_t c = 0; c < g->C; c++) {
        for (int64_t h = 0; h < g->H; h++) {
            float *out = xp + (c * HP + h + g->ph) * WP + g->pw;
            const float *in = x + c * g->xc + h * g->xh;
            if (g->xw == 1) {
                memcpy(out, in, (size_t)g->W * sizeof(float));
            } else {
                for (int64_t w = 0; w < g->W; w++) out[w] = in[w * g->xw];
            }
        }
    }
}

/* xl (HP x WP x C): the example's input inside its zero padding, channels last (the border stays zero). */
static void pad_channels_last(const float *x, const geometry *g, float *xl) {
    const int64_t WP = g->W + 2 * g->pw, C = g->C;
    for (int64_t h = 0; h < g->H; h++) {
        for (int64_t w = 0; w < g->W; w++) {
            float *out = xl + ((h + g->ph) * WP + w + g->pw) * C;
            const float *in = x + h * g->xh + w * g->xw;
            if (g->xc == 1) {
                memcpy(out, in, (size_t)C * sizeof(float));
            } else {
                for (int64_t c = 0; c < C; c++) out[c] = in[c * g->xc];
            }
        }
    }
}

/* The kw numbers of one patch row, KW a constant where the call passes one (a few vector moves). */
static inline __attribute__((always_inline)) void patch_row(const float *line, int64_t dw, int64_t KW, float *out) {
    if (dw == 1) {
        for (int64_t v = 0; v < KW; v++) out[v] = line[v];
    } else {
        for (int64_t v = 0; v < KW; v++) out[v] = line[v * dw];
    }
}

/* A (T x K): A[t][(c, u, v)] = xp[c][oh sh + u dh][ow sw + v dw], the padded input (so 0 in the padding). */
static inline __attribute__((always_inline)) void patches_kw(const float *xp, const geometry *g, int64_t KW, float *a) {
    const int64_t K = g->C * g->kh * KW, HP = g->H + 2 * g->ph, WP = g->W + 2 * g->pw;
    for (int64_t oh = 0; oh < g->OH; oh++) {
        for (int64_t ow = 0; ow < g->OW; ow++) {
            const float *corner = xp + oh * g->sh * WP + ow * g->sw;
            float *row = a + (oh * g->OW + ow) * K;
            for (int64_t c = 0; c < g->C; c++) {
                for (int64_t u = 0; u < g->kh; u++) {
                    patch_row(corner + (c * HP + u * g->dh) * WP, g->dw, KW, row + (c * g->kh + u) * KW);
                }
            }
        }
    }
}

static void patches(const float *xp, const geometry *g, float *a) {
    switch (g->kw) {  /* the common widths as constants */
        case 1: patches_kw(xp, g, 1, a); break;
        case 2: patches_kw(xp, g, 2, a); break;
        case 3: patches_kw(xp, g, 3, a); break;
        case 4: patches_kw(xp, g, 4, a); break;
        case 5: patches_kw(xp, g, 5, a); break;
        case 7: patches_kw(xp, g, 7, a); break;
        case 8: patches_kw(xp, g, 8, a); break;
        default: patches_kw(xp, g, g->kw, a);
    }
}

/* acc = rows x cols of G_i = d_i A, from output channel o0 and patch column k0. */
static inline __attribute__((always_inline)) void accumulate(const float *di, const float *a, const geometry *g, int64_t T,
                                                             int64_t K, int64_t o0, int64_t rows, int64_t k0,
                                                             int64_t cols, float acc[OB][KB]) {
    for (int64_t t = 0; t < T; t++) {
        const float *p = a + t * K + k0;
        for (int64_t r = 0; r < rows; r++) {
            const float w = di[(o0 + r) * g->dout + t * g->dt];
#pragma omp simd
            for (int64_t k = 0; k < cols; k++) acc[r][k] += w * p[k];
        }
    }
}

/* The same block from xl without patches (direct way): column k0 + LANES j + l of position t is
 * base_t[off[j] + l], base_t = xl + (oh sh WP + ow sw) C. */
static inline __attribute__((always_inline)) void accumulate_direct(const float *di, const float *xl, const geometry *g,
                                                                    int64_t o0, int64_t rows, const int64_t off[UNITS],
                                                                    int64_t units, float acc[OB][KB]) {
    const int64_t WP = g->W + 2 * g->pw;
    for (int64_t oh = 0; oh < g->OH; oh++) {
        for (int64_t ow = 0; ow < g->OW; ow++) {
            const int64_t t = oh * g->OW + ow;
            const float *base = xl + (oh * g->sh * WP + ow * g->sw) * g->C;
            for (int64_t r = 0; r < rows; r++) {
                const float w = di[(o0 + r) * g->dout + t * g->dt];
                for (int64_t j = 0; j < units; j++) {
                    const float *p = base + off[j];
#pragma omp simd
                    for (int64_t l = 0; l < LANES; l++) acc[r][j * LANES + l] += w * p[l];
                }
            }
        }
    }
}

/* The offsets in xl of the units of columns k0 ... (channels-last order k = (u kw + v) C + c). */
static void unit_offsets(const geometry *g, int64_t k0, int64_t units, int64_t off[UNITS]) {
    const int64_t WP = g->W + 2 * g->pw;
    for (int64_t j = 0; j < units; j++) {
        const int64_t k = k0 + j * LANES, uv = k / g->C, c = k % g->C;
        off[j] = ((uv / g->kw) * g->dh * WP + (uv % g->kw) * g->dw) * g->C + c;
    }
}

/* One block of G_i, zeroed first. A full block (rows = OB, cols = KB) passes its bounds as constants,
 * so that the inlined loops keep the accumulators in vector registers. */
static inline __attribute__((always_inline)) void block(const float *di, const float *a, const geometry *g, int64_t T,
                                                        int64_t K, int64_t o0, int64_t rows, int64_t k0, int64_t cols,
                                                        float acc[OB][KB]) {
    memset(acc, 0, sizeof(float) * OB * KB);
    if (rows == OB && cols == KB) {
        accumulate(di, a, g, T, K, o0, OB, k0, KB, acc);
    } else {
        accumulate(di, a, g, T, K, o0, rows, k0, cols, acc);
    }
}

static inline __attribute__((always_inline)) void block_direct(const float *di, const float *xl, const geometry *g,
                                                               int64_t o0, int64_t rows, int64_t k0, int64_t cols,
                                                               float acc[OB][KB]) {
    int64_t off[UNITS];
    const int64_t units = cols / LANES;
    unit_offsets(g, k0, units, off);
    memset(acc, 0, sizeof(float) * OB * KB);
    if (rows == OB && units == UNITS) {
        accumulate_direct(di, xl, g, o0, OB, off, UNITS, acc);
    } else {
        accumulate_direct(di, xl, g, o0, rows, off, units, acc);
    }
}

/* Examples first ... last - 1, one patch (or padded-copy) buffer per thread; returns 0, or -1 if a buffer could not be had.
 * Cloned for the instruction sets itself: the OpenMP region that calls it is a function of its own. */
CLONES int dpml_conv_examples(const float *x, const float *d, int64_t first, int64_t last, const geometry *g, float *squared,
                    float *grads) {
    const int64_t T = g->OH * g->OW, K = g->C * g->kh * g->kw;
    const size_t patch_bytes = cache_lines((size_t)(T * K) * sizeof(float));
    const size_t padded_bytes = cache_lines((size_t)(g->C * (g->H + 2 * g->ph) * (g->W + 2 * g->pw)) * sizeof(float));
    float *a = g->direct ? NULL : aligned_alloc(CACHE_LINE, patch_bytes);
    float *xp = aligned_alloc(CACHE_LINE, padded_bytes);
    if ((a == NULL && !g->direct) || xp == NULL) {
        free(a);
        free(xp);
        return -1;
    }
    memset(xp, 0, padded_bytes);
    float acc[OB][KB];
    for (int64_t i = first; i < last; i++) {
        const float *di = d + (i / g->G) * g->db + (i % g->G) * g->dg;
        const float *xi = x + (i / g->G) * g->xb + (i % g->G) * g->xg;
        if (g->direct) {
            pad_channels_last(xi, g, xp);
        } else {
            pad(xi, g, xp);
            patches(xp, g, a);
        }
        double total = 0.0;
        for (int64_t o0 = 0; o0 < g->O; o0 += OB) {
            const int64_t rows = g->O - o0 < OB ? g->O - o0 : OB;
            for (int64_t k0 = 0; k0 < K; k0 += KB) {
                const int64_t cols = K - k0 < KB ? K - k0 : KB;
                if (g->direct) {
                    block_direct(di, xp, g, o0, rows, k0, cols, acc);
                } else {
                    block(di, a, g, T, K, o0, rows, k0, cols, acc);
                }
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
    free(xp);
    return 0;
}

/* The examples split over the OpenMP threads: linked by soname, this library shares the libgomp that
 * torch has already loaded, so these are torch's own intra-op threads (torch.set_num_threads sets their
 * count), not a second pool competing with them. */
int dpml_conv_norms(const float *x, const float *d, int64_t batch, const int64_t *shape, float *squared, float *grads) {
    geometry g;
    memcpy(&g, shape, sizeof g); /* the fields in the header's order */
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        const int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();
        failed |= dpml_conv_examples(x, d, batch * me / threads, batch * (me + 1) / threads, &g, squared, grads);
    }
    return failed ? -1 : 0;
}
