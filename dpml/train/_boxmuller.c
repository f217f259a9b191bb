/* The CPU draw of dpml.train.noise's Box-Muller normals in float32, in one pass of compiled code:
 * exactly the uniforms of NumPy's SFC64 streams, the same float32 arithmetic (glibc's vector math
 * for log / sin / cos, within a few ulp of NumPy's), loaded with ctypes by noise.py, which falls back
 * to NumPy when this file was not compiled. The construction and why it is safe: noise.py.
 *
 *   dpml_box_muller_f32(states, q, std, out, threads): STREAMS SFC64 streams (states: STREAMS x 4 words, as
 *   NumPy's SFC64 state array a, b, c, counter), stream k covers pairs k*q ... k*q + q - 1 of the
 *   P = STREAMS*q pairs: first its q uniforms U (one 64-bit output each, U = (x >> 11) 2^-53), then
 *   its q uniforms V (32-bit halves of 64-bit outputs, low half first, V = (h >> 8) 2^-24), as
 *   NumPy's Generator.random(q) and random(q, dtype=float32) draw them. Pair p = k*q + j gives
 *       R = sqrt(-2 std^2 ln(float32(1 - U))),  out[p] = R cos(2 pi V),  out[P + p] = R sin(2 pi V).
 *   The streams run on `threads` OpenMP threads, those of each thread in lockstep: their outputs do
 *   not depend on each other, so the processor overlaps them (one stream alone is one long chain of
 *   dependent additions).
 *
 *   dpml_sfc64_stream_states(key, states): the states of the draw's streams from its key, as NumPy seeds them
 *   (below).
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "V is read from the 32-bit halves of the outputs, low half first: little-endian only (NumPy draws instead)"
#endif

#define STREAMS 4
#define BLOCK 1024 /* pairs per stream per block: the block's numbers stay in the first-level cache */

/* glibc's libmvec has SIMD variants of these; declaring them so lets GCC vectorise the loops without
 * -ffast-math (compiled with -fno-math-errno, which they need). */
#pragma omp declare simd notinbranch
extern float logf(float);
#pragma omp declare simd notinbranch
extern float sinf(float);
#pragma omp declare simd notinbranch
extern float cosf(float);
extern float sqrtf(float); /* an instruction, with -fno-math-errno */

typedef struct { uint64_t a, b, c, counter; } sfc64;

/* Doty-Humphrey's SFC64, step for step as NumPy's (numpy/random/src/sfc64/sfc64.h). */
static inline uint64_t sfc64_next(sfc64 *s) {
    const uint64_t out = s->a + s->b + s->counter++;
    s->a = s->b ^ (s->b >> 11);
    s->b = s->c + (s->c << 3);
    s->c = ((s->c << 24) | (s->c >> 40)) + out;
    return out;
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONES
#endif

/* Streams first ... first + COUNT - 1 of the draw, in lockstep (COUNT a constant at each call, so the
 * loops over the streams unroll). */
static inline __attribute__((always_inline)) void draw_streams(const uint64_t *states, size_t q, double std,
                                                               float *out, const int first, const int COUNT) {
    sfc64 s[STREAMS];
    uint64_t bits[STREAMS][BLOCK];
    uint32_t halves[BLOCK];
    float angle[BLOCK];
    const size_t pairs = STREAMS * q;
    const float scale = (float)(-2.0 * std * std), two_pi = (float)(2.0 * 3.14159265358979323846);
    for (int k = 0; k < COUNT; k++) {
        const uint64_t *state = states + 4 * (first + k);
        s[k] = (sfc64){state[0], state[1], state[2], state[3]};
    }
    /* every U of each stream: R, parked in the cosine half of out */
    for (size_t start = 0; start < q; start += BLOCK) {
        const size_t n = q - start < BLOCK ? q - start : BLOCK;
        for (size_t j = 0; j < n; j++) {
            for (int k = 0; k < COUNT; k++) bits[k][j] = sfc64_next(&s[k]);
        }
        for (int k = 0; k < COUNT; k++) {
            float *radius = out + (first + k) * q + start;
            for (size_t j = 0; j < n; j++) {  /* float32(1 - U), U = x 2^-53: (2^53 - x) 2^-53, rounded once */
                radius[j] = (float)(int64_t)((UINT64_C(1) << 53) - (bits[k][j] >> 11)) * 0x1p-53f;
            }
#pragma omp simd
            for (size_t j = 0; j < n; j++) radius[j] = sqrtf(scale * logf(radius[j]));
        }
    }
    /* then every V of each stream: the pair */
    for (size_t start = 0; start < q; start += BLOCK) {  /* BLOCK is even: a block starts on a low half */
        const size_t n = q - start < BLOCK ? q - start : BLOCK;
        for (size_t j = 0; j < (n + 1) / 2; j++) {
            for (int k = 0; k < COUNT; k++) bits[k][j] = sfc64_next(&s[k]);
        }
        for (int k = 0; k < COUNT; k++) {
            float *cosine = out + (first + k) * q + start, *sine = out + pairs + (first + k) * q + start;
            memcpy(halves, bits[k], (n + 1) / 2 * sizeof(uint64_t));  /* V_j: low (j even) or high half of output j/2 */
            for (size_t j = 0; j < n; j++) angle[j] = (float)(int32_t)(halves[j] >> 8) * 0x1p-24f * two_pi;
#pragma omp simd
            for (size_t j = 0; j < n; j++) sine[j] = cosine[j] * sinf(angle[j]);
#pragma omp simd
            for (size_t j = 0; j < n; j++) cosine[j] = cosine[j] * cosf(angle[j]);
        }
    }
}

/* The draw's STREAMS SFC64 states from its key (four integers in [0, 2^62), int64): those of NumPy's
 * SFC64(child) for child in SeedSequence(key).spawn(STREAMS), written as the kernel reads them (a, b, c, counter
 * per stream), bit for bit (numpy/random/bit_generator.pyx and _sfc64.pyx):
 *   the entropy: each key integer as 32-bit words, least significant first (0 is one word 0), then the child's
 *   spawn key k (one word); hashmix(v) = ((v ^ h) * (h *= MULT_A)) ^ >> 16 with h starting at INIT_A; the pool of
 *   4 words: hashmix of the first 4 words, each word then mixed with hashmix of every other, then with hashmix of
 *   each further entropy word (mix(x, y) = (L x - R y) ^ >> 16); generate_state(3, uint64): 6 words, pool word
 *   i mod 4 hashed with a second constant (INIT_B, MULT_B), paired low word first; SFC64 seeded (a, b, c, 1)
 *   with them and stepped 12 times. Every key integer gives at least one word, so the run entropy fills the
 *   pool and needs none of NumPy's padding. Done here rather than through NumPy's objects, which cost more per
 *   step than the draw's arithmetic in a small model's step (the noise module's docstring). */
#define POOL 4
static uint32_t hashmix(uint32_t value, uint32_t *hash) {
    value ^= *hash;
    *hash *= 0x931e8875u;
    value *= *hash;
    return value ^ (value >> 16);
}

static uint32_t mix(uint32_t x, uint32_t y) {
    const uint32_t result = 0xca01f9ddu * x - 0x4973f715u * y;
    return result ^ (result >> 16);
}

void dpml_sfc64_stream_states(const int64_t *key, uint64_t *states) {
    uint32_t entropy[4 * 2 + 1];
    size_t words = 0;
    for (int i = 0; i < 4; i++) {
        uint64_t value = (uint64_t)key[i];
        do {
            entropy[words++] = (uint32_t)value;
            value >>= 32;
        } while (value != 0);
    }
    for (int k = 0; k < STREAMS; k++) {
        uint32_t pool[POOL], hash = 0x43b0d7e5u, seed[6];
        entropy[words] = (uint32_t)k; /* the child's spawn key */
        for (int i = 0; i < POOL; i++) pool[i] = hashmix(entropy[i], &hash);
        for (int source = 0; source < POOL; source++) {
            for (int target = 0; target < POOL; target++) {
                if (source != target) pool[target] = mix(pool[target], hashmix(pool[source], &hash));
            }
        }
        for (size_t source = POOL; source < words + 1; source++) {
            for (int target = 0; target < POOL; target++) pool[target] = mix(pool[target], hashmix(entropy[source], &hash));
        }
        uint32_t generate = 0x8b51f9ddu;
        for (int i = 0; i < 6; i++) {
            uint32_t value = pool[i % POOL] ^ generate;
            generate *= 0x58f38dedu;
            value *= generate;
            seed[i] = value ^ (value >> 16);
        }
        sfc64 s = {seed[0] | (uint64_t)seed[1] << 32, seed[2] | (uint64_t)seed[3] << 32, seed[4] | (uint64_t)seed[5] << 32, 1};
        for (int i = 0; i < 12; i++) (void)sfc64_next(&s);
        states[4 * k] = s.a, states[4 * k + 1] = s.b, states[4 * k + 2] = s.c, states[4 * k + 3] = s.counter;
    }
}

/* The exported draw: the STREAMS streams on `threads` OpenMP threads (1, 2 or 4; those of the libgomp torch
 * has loaded), STREAMS / threads streams each; a team of another size (a thread limit) leaves them all to its
 * first thread. Each stream writes its own pairs only, so the numbers do not depend on the threads. */
CLONES void dpml_box_muller_f32(const uint64_t *states, size_t q, double std, float *out, int threads) {
    threads = threads >= 4 ? 4 : threads >= 2 ? 2 : 1;
#pragma omp parallel num_threads(threads)
    {
        const int team = omp_get_num_threads(), thread = omp_get_thread_num();
        if (team == 4) draw_streams(states, q, std, out, thread, 1);
        else if (team == 2) draw_streams(states, q, std, out, 2 * thread, 2);
        else if (thread == 0) draw_streams(states, q, std, out, 0, 4);
    }
}
