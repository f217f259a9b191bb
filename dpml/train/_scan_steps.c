/* One step of an LSTM's or a GRU's scan on the CPU, fused, for dpml.train.rules.recurrent_scan (loaded by
 * dpml.train.kernels, which compiles it on first use): the elementwise work of a step in one pass over its rows,
 * where torch's operations make eight passes forward and six backward, each a dispatch of its own (at a batch of
 * 64 and 128 units a step's rows are 32 K numbers: the passes, not the arithmetic, were the step's cost).
 *
 *   dpml_lstm_forward_<t>(acts, rows, width, c_prev, c_stride, g, c, tanh_c, h)
 *   acts (rows x 4 width): on entry each row's pre-activations a = (a_i, a_f, 2 a_g, a_o) (the g columns doubled),
 *   on exit σ(a) (the g columns hold σ(2 a_g)); then, rows x width each, contiguous:
 *     g = 2 σ(2 a_g) − 1 = tanh(a_g),  c = f c_prev + i g,  tanh_c = 2 σ(2 c) − 1,  h = o tanh_c,
 *   c_prev's rows c_stride apart. tanh as 2 σ(2x) − 1, as the g columns: one exponential, whose SIMD variant glibc's
 *   libmvec has (a tanh of its own it has only in recent versions).
 *
 *   dpml_lstm_backward_<t>(rows, width, dh_own, dh_next, dc_next, dc_own, acts, g, c_prev, tanh_c, delta, dc_prev)
 *   with the forward's σ(a) (acts), g, the entering c_prev and tanh_c of the step's rows, σ' = σ − σ²:
 *     dh = dh_own + dh_next (dh_next NULL: dh_own alone),  dc = dc_next + dc_own (NULL: none) + dh (o − o tanh_c²),
 *     delta = (σ'_i g dc, σ'_f c_prev dc, (1 − g²) i dc, σ'_o tanh_c dh),  dc_prev = dc f,
 *   every operand rows x (its width) contiguous; dc_prev may be dc_next (each number read before it is written).
 *   The factors are formed here from what the forward kept, not read from a pass of their own (a step's rows of
 *   them streamed from memory cost more than forming them).
 *
 *   dpml_gru_forward_<t>(x, q, rows, width, h_prev, h_stride, gates, h)
 *   with each row's input terms x = (x_r, x_z, x_n) and recurrent product q = W_hh h_prev + b_hh = (q_r, q_z, q_n)
 *   (rows x 3 width each, contiguous) and the entering states h_prev (rows h_stride apart):
 *     r = σ(x_r + q_r),  z = σ(x_z + q_z),  n = 2 σ(2 (x_n + r q_n)) − 1 = tanh(x_n + r q_n),  h = n + z (h_prev − n),
 *   gates = (r, z, n) (rows x 3 width) and h (rows x width) written.
 *
 *   dpml_gru_backward_<t>(rows, width, dh_own, dh_next, gates, q_n, q_stride, h_prev, delta, delta_hh)
 *   with the forward's gates, q_n (rows q_stride apart) and h_prev of the step's rows, dh = dh_own + dh_next,
 *   n' = (1 − z)(1 − n²):
 *     delta = (σ'_r q_n n' dh, σ'_z (h_prev − n) dh, n' dh),  delta_hh = (delta_r, delta_z, r delta_n),
 *   and dh z written over dh_next (the state gradient's part that skips the product; the caller adds delta_hh W_hh).
 *
 * <t> is f32 or f64. No -ffast-math: each number is the operations above in this order.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

/* glibc's libmvec has SIMD variants of these; declaring them lets GCC vectorise the loops (with -fno-math-errno). */
#pragma omp declare simd notinbranch
extern float expf(float);
#pragma omp declare simd notinbranch
extern double exp(double);

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONES
#endif

#define SCAN_STEPS(T, SUFFIX, EXP)                                                                                     \
    static inline T sigmoid_##SUFFIX(T x) { return (T)1 / ((T)1 + EXP(-x)); }                                        \
                                                                                                                       \
    CLONES void dpml_lstm_forward_##SUFFIX(T *acts, int64_t rows, int64_t width, const T *c_prev, int64_t c_stride,   \
                                           T *g, T *c, T *tanh_c, T *h) {                                              \
        for (int64_t r = 0; r < rows; r++) {                                                                           \
            T *a = acts + r * 4 * width;                                                                               \
            const T *cp = c_prev + r * c_stride;                                                                       \
            T *gr = g + r * width, *cr = c + r * width, *tr = tanh_c + r * width, *hr = h + r * width;                 \
            _Pragma("omp simd") for (int64_t j = 0; j < 4 * width; j++) a[j] = sigmoid_##SUFFIX(a[j]);                 \
            _Pragma("omp simd") for (int64_t j = 0; j < width; j++) {                                                  \
                T gj = 2 * a[2 * width + j] - 1;                                                                       \
                T cj = a[width + j] * cp[j] + a[j] * gj;                                                               \
                T tj = 2 * sigmoid_##SUFFIX(2 * cj) - 1;                                                               \
                gr[j] = gj;                                                                                            \
                cr[j] = cj;                                                                                            \
                tr[j] = tj;                                                                                            \
                hr[j] = a[3 * width + j] * tj;                                                                         \
            }                                                                                                          \
        }                                                                                                              \
    }                                                                                                                  \
                                                                                                                       \
    /* One row, the operands' NULL tests as constants (has_next, has_own): a test inside the loop kept GCC from    \
     * vectorising it (12 times slower at 128 units).                                                               \
     */                                                                                                                \
    static inline __attribute__((always_inline)) void lstm_backward_row_##SUFFIX(                                    \
        int64_t width, const T *dh_own, const T *dh_next, const T *dc_next, const T *dc_own, const T *a, const T *g,  \
        const T *c_prev, const T *tanh_c, T *d, T *dc_prev, const int has_next, const int has_own) {                  \
        _Pragma("omp simd") for (int64_t j = 0; j < width; j++) {                                                      \
            T dh = has_next ? dh_own[j] + dh_next[j] : dh_own[j];                                                      \
            T dc = has_own ? dc_next[j] + dc_own[j] : dc_next[j];                                                      \
            T i = a[j], f = a[width + j], o = a[3 * width + j], gj = g[j], tc = tanh_c[j];                             \
            dc = dc + dh * (o - o * tc * tc);                                                                          \
            d[j] = (i - i * i) * gj * dc;                                                                              \
            d[width + j] = (f - f * f) * c_prev[j] * dc;                                                               \
            d[2 * width + j] = (1 - gj * gj) * i * dc;                                                                 \
            d[3 * width + j] = (o - o * o) * tc * dh;                                                                  \
            dc_prev[j] = dc * f;                                                                                       \
        }                                                                                                              \
    }                                                                                                                  \
                                                                                                                       \
    CLONES void dpml_lstm_backward_##SUFFIX(int64_t rows, int64_t width, const T *dh_own, const T *dh_next,           \
                                            const T *dc_next, const T *dc_own, const T *acts, const T *g,              \
                                            const T *c_prev, const T *tanh_c, T *delta, T *dc_prev) {                  \
        for (int64_t r = 0; r < rows; r++) {                                                                           \
            const int64_t at = r * width, wide = r * 4 * width;                                                        \
            const T *next = dh_next ? dh_next + at : NULL, *own = dc_own ? dc_own + at : NULL;                         \
            const T *dh = dh_own + at, *dcn = dc_next + at, *a = acts + wide, *gr = g + at, *cp = c_prev + at;         \
            const T *tc = tanh_c + at;                                                                                 \
            T *d = delta + wide, *dcp = dc_prev + at;                                                                  \
            if (next && own)                                                                                           \
                lstm_backward_row_##SUFFIX(width, dh, next, dcn, own, a, gr, cp, tc, d, dcp, 1, 1);                    \
            else if (next)                                                                                             \
                lstm_backward_row_##SUFFIX(width, dh, next, dcn, own, a, gr, cp, tc, d, dcp, 1, 0);                    \
            else if (own)                                                                                              \
                lstm_backward_row_##SUFFIX(width, dh, next, dcn, own, a, gr, cp, tc, d, dcp, 0, 1);                    \
            else                                                                                                       \
                lstm_backward_row_##SUFFIX(width, dh, next, dcn, own, a, gr, cp, tc, d, dcp, 0, 0);                    \
        }                                                                                                              \
    }

#define GRU_STEPS(T, SUFFIX)                                                                                           \
    CLONES void dpml_gru_forward_##SUFFIX(const T *x, const T *q, int64_t rows, int64_t width, const T *h_prev,       \
                                          int64_t h_stride, T *gates, T *h) {                                          \
        for (int64_t r = 0; r < rows; r++) {                                                                           \
            const T *xr = x + r * 3 * width, *qr = q + r * 3 * width, *hp = h_prev + r * h_stride;                    \
            T *gr = gates + r * 3 * width, *hr = h + r * width;                                                        \
            _Pragma("omp simd") for (int64_t j = 0; j < width; j++) {                                                  \
                T rj = sigmoid_##SUFFIX(xr[j] + qr[j]);                                                                \
                T zj = sigmoid_##SUFFIX(xr[width + j] + qr[width + j]);                                                \
                T nj = 2 * sigmoid_##SUFFIX(2 * (xr[2 * width + j] + rj * qr[2 * width + j])) - 1;                     \
                gr[j] = rj;                                                                                            \
                gr[width + j] = zj;                                                                                    \
                gr[2 * width + j] = nj;                                                                                \
                hr[j] = nj + zj * (hp[j] - nj);                                                                        \
            }                                                                                                          \
        }                                                                                                              \
    }                                                                                                                  \
                                                                                                                       \
    CLONES void dpml_gru_backward_##SUFFIX(int64_t rows, int64_t width, const T *dh_own, T *dh_next, const T *gates,  \
                                           const T *q_n, int64_t q_stride, const T *h_prev, T *delta, T *delta_hh) {   \
        for (int64_t r = 0; r < rows; r++) {                                                                           \
            const int64_t at = r * width, wide = r * 3 * width;                                                        \
            const T *own = dh_own + at, *g = gates + wide, *qn = q_n + r * q_stride, *hp = h_prev + at;                \
            T *next = dh_next + at, *d = delta + wide, *dhh = delta_hh + wide;                                         \
            _Pragma("omp simd") for (int64_t j = 0; j < width; j++) {                                                  \
                T dh = own[j] + next[j];                                                                               \
                T rj = g[j], zj = g[width + j], nj = g[2 * width + j];                                                 \
                T dn = dh * ((1 - zj) * (1 - nj * nj));                                                                \
                T dr = dn * qn[j] * (rj - rj * rj);                                                                    \
                T dz = dh * (hp[j] - nj) * (zj - zj * zj);                                                             \
                d[j] = dr;                                                                                             \
                d[width + j] = dz;                                                                                     \
                d[2 * width + j] = dn;                                                                                 \
                dhh[j] = dr;                                                                                           \
                dhh[width + j] = dz;                                                                                   \
                dhh[2 * width + j] = dn * rj;                                                                          \
                next[j] = dh * zj;                                                                                     \
            }                                                                                                          \
        }                                                                                                              \
    }

SCAN_STEPS(float, f32, expf)
SCAN_STEPS(double, f64, exp)
GRU_STEPS(float, f32)
GRU_STEPS(double, f64)
