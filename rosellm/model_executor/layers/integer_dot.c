/* Integer dot products for GGUF's 4- and 8-bit weights at few rows, llama.cpp's way. `integer_dot.py` is
 * the same arithmetic in tensor algebra, and the test this kernel must pass.
 *
 * 1. quantize_q8_1: each block of 32 activations becomes 32 int8 codes q (-127..127), a scale d = max|x| / 127
 *    and s = d * sum(q) (GGUF's Q8_1, with d and s in fp32): x ~ d * q.
 * 2. dot_q4 / dot_q8: each weight block meets its activation block in integers, and the scales come after:
 *        4 bits, w = dw * c + mw (c 0..15):  sum(w * x) = dw * d * sum(c * q) + mw * s
 *        8 bits, w = dw * c (c -128..127):   sum(w * x) = dw * d * sum(c * q)
 *    (Q4_0's w = dw * (c - 8) is the first with mw = -8 dw.)
 * 3. linear: the two in one call, as a layer runs them (integer_dot_kernel.py, and integer_dot_op.cpp for graphs).
 *
 * The weights' layout, made once at load: a 4-bit block is 16 bytes, byte j holding code j (low nibble) and
 * code j + 16 (high): masking gives codes 0..15 and shifting codes 16..31, each in the order of the activation
 * codes. An 8-bit block is its 32 codes. Scales and minimums are fp32 arrays [out, in / 32].
 *
 * The products multiply unsigned bytes by signed ones (as the instructions do): a 4-bit code is unsigned
 * already; an 8-bit code c is not, so |c| meets sign(c) * q instead, as in llama.cpp (q is never -128, so
 * its sign can move). One path per CPU level, chosen by the compiler's own macros (the level's flags set them):
 *   AVX-512 VNNI (+VL)  _mm256_dpbusd_epi32: 32 products summed by fours into int32, in one instruction
 *   AVX2                _mm256_maddubs_epi16 (pairs into int16, saturating: 2 x 128 x 127 = 32512 still fits)
 *                       then _mm256_madd_epi16 (pairs of those into int32)
 *   plain C             the sums in int32, one code at a time
 * OpenMP shares tiles of 4 outputs between `threads` threads; a tile reads each weight block once for up to 4
 * activation rows.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define BLOCK 32

void quantize_q8_1(const float *x, int64_t rows, int64_t in, int8_t *codes, float *scales, float *sums) {
  for (int64_t b = 0; b < rows * (in / BLOCK); b++) { /* rows are contiguous: block b of all rows' blocks */
    const float *v = x + b * BLOCK;
    float amax = 0.f;
    for (int i = 0; i < BLOCK; i++) amax = fmaxf(amax, fabsf(v[i]));
    const float d = amax * (1.0f / 127.0f);
    const float inverse = d > 0.f ? 1.0f / d : 0.f;
    int sum = 0;
    for (int i = 0; i < BLOCK; i++) {
      int q = (int)nearbyintf(v[i] * inverse); /* to nearest, ties to even: torch.round */
      q = q > 127 ? 127 : q < -127 ? -127 : q;
      codes[b * BLOCK + i] = (int8_t)q;
      sum += q;
    }
    scales[b] = d;
    sums[b] = d * (float)sum;
  }
}

#if defined(__AVX2__)
typedef __m256 partial; /* 8 fp32 partial sums of one output, added up at the end */

static inline __m256i unsigned_times_signed(__m256i u, __m256i s) { /* 8 int32 sums of 4 products each */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

static inline __m256i q4_codes(const uint8_t *w) { /* 32 codes 0..15 in order */
  const __m128i packed = _mm_loadu_si128((const __m128i *)w);
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

static inline __m256i q4_products(const uint8_t *w, const int8_t *q) {
  return unsigned_times_signed(q4_codes(w), _mm256_loadu_si256((const __m256i *)q));
}

static inline __m256i q8_products(const int8_t *w, const int8_t *q) {
  const __m256i c = _mm256_loadu_si256((const __m256i *)w);
  const __m256i x = _mm256_loadu_si256((const __m256i *)q);
  return unsigned_times_signed(_mm256_sign_epi8(c, c), _mm256_sign_epi8(x, c));
}

static inline partial partial_zero(void) { return _mm256_setzero_ps(); }

static inline partial partial_add(partial acc, float scale, __m256i products) {
  return _mm256_fmadd_ps(_mm256_set1_ps(scale), _mm256_cvtepi32_ps(products), acc);
}

static inline float partial_total(partial acc) {
  const __m128 four = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}
#else
typedef float partial;

static inline int32_t q4_products(const uint8_t *w, const int8_t *q) {
  int32_t sum = 0;
  for (int j = 0; j < BLOCK / 2; j++) sum += (w[j] & 15) * q[j] + (w[j] >> 4) * q[j + BLOCK / 2];
  return sum;
}

static inline int32_t q8_products(const int8_t *w, const int8_t *q) {
  int32_t sum = 0;
  for (int j = 0; j < BLOCK; j++) sum += w[j] * q[j];
  return sum;
}

static inline partial partial_zero(void) { return 0.f; }
static inline partial partial_add(partial acc, float scale, int32_t products) { return acc + scale * products; }
static inline float partial_total(partial acc) { return acc; }
#endif

/* The weights and activations of one product, as the functions below pass them on. */
typedef struct {
  const void *w;            /* 4 bits: uint8_t [out, blocks, 16]; 8 bits: int8_t [out, blocks, 32] */
  const float *w_scales;    /* [out, blocks] */
  const float *w_minimums;  /* [out, blocks], 4 bits only */
  const int8_t *codes;      /* [rows, blocks, 32] */
  const float *scales;      /* [rows, blocks] */
  const float *sums;        /* [rows, blocks], 4 bits only */
  const float *bias;        /* [out] or NULL */
  float *out;               /* [rows, out] */
  int64_t out_features, blocks;
} product;

#define TILE 4 /* most outputs, and activation rows, of one tile */
/* How far ahead an 8-bit tile asks for its weights. Measured on a 2-core AMD EPYC with AVX2 (SmolLM2's
 * 49152x576 Q8_0 LM head, 2 threads, ms): 3.4 without, 1.7 / 1.5 / 1.3 at 4 / 8 / 16 rows ahead; 4-bit rows
 * (half as long) read as fast without it. A prefetch past the end of the weights is harmless: it never faults. */
#define PREFETCH_ROWS 16

/* A tile of OUTPUTS outputs o.. for ROWS activation rows first.. (BITS, OUTPUTS and ROWS are constants where
 * it is inlined, so the compiler keeps the OUTPUTS x ROWS sums in registers). Each weight block is read once for
 * every row, each activation block once for every output, and the tile's sums are independent chains that the
 * CPU overlaps. */
static inline __attribute__((always_inline)) void tile(const int BITS, const int OUTPUTS, const int ROWS,
                                                       const product *p, int64_t o, int64_t first) {
  partial acc[TILE][TILE];
  float minimums[TILE][TILE];
  for (int j = 0; j < OUTPUTS; j++)
    for (int r = 0; r < ROWS; r++) acc[j][r] = partial_zero(), minimums[j][r] = 0.f;
  for (int64_t k = 0; k < p->blocks; k++) {
    for (int j = 0; j < OUTPUTS; j++) {
      const int64_t wb = (o + j) * p->blocks + k;
      const float dw = p->w_scales[wb];
      if (BITS == 8) /* the same block PREFETCH_ROWS rows on: 8-bit rows stream at half the speed without it */
        __builtin_prefetch((const int8_t *)p->w + (wb + PREFETCH_ROWS * p->blocks) * 32);
      for (int r = 0; r < ROWS; r++) {
        const int64_t xb = (first + r) * p->blocks + k;
        const int8_t *q = p->codes + xb * BLOCK;
        if (BITS == 4) {
          acc[j][r] = partial_add(acc[j][r], dw * p->scales[xb], q4_products((const uint8_t *)p->w + wb * 16, q));
          minimums[j][r] += p->w_minimums[wb] * p->sums[xb];
        } else {
          acc[j][r] = partial_add(acc[j][r], dw * p->scales[xb], q8_products((const int8_t *)p->w + wb * 32, q));
        }
      }
    }
  }
  for (int j = 0; j < OUTPUTS; j++)
    for (int r = 0; r < ROWS; r++)
      p->out[(first + r) * p->out_features + o + j] =
          partial_total(acc[j][r]) + minimums[j][r] + (p->bias ? p->bias[o + j] : 0.f);
}

/* Every tile of out [rows, out_features]: TILE outputs at a time, the last few one by one; TILE rows at a time,
 * the last fewer. Each case names its constants, so each gets code of its own. */
static inline __attribute__((always_inline)) void every_tile(const int BITS, const product *p, int64_t rows,
                                                             int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t o = 0; o < p->out_features; o += TILE) {
    for (int64_t first = 0; first < rows; first += TILE) {
      const int count = rows - first < TILE ? (int)(rows - first) : TILE;
      if (o + TILE > p->out_features) {
        for (int64_t one = o; one < p->out_features; one++)
          for (int r = 0; r < count; r++) tile(BITS, 1, 1, p, one, first + r);
      } else if (count == 1) {
        tile(BITS, TILE, 1, p, o, first);
      } else if (count == 2) {
        tile(BITS, TILE, 2, p, o, first);
      } else if (count == 3) {
        tile(BITS, TILE, 3, p, o, first);
      } else {
        tile(BITS, TILE, TILE, p, o, first);
      }
    }
  }
}

/* out [rows, out_features] = x @ w.T + bias for 4-bit blocks w [out_features, in / 32, 16 bytes], with
 * w_scales, w_minimums [out_features, in / 32], and x as quantize_q8_1 made it; bias may be NULL. */
void dot_q4(const uint8_t *w, const float *w_scales, const float *w_minimums, const int8_t *codes,
            const float *scales, const float *sums, const float *bias, float *out, int64_t rows,
            int64_t out_features, int64_t in, int threads) {
  const product p = {w, w_scales, w_minimums, codes, scales, sums, bias, out, out_features, in / BLOCK};
  every_tile(4, &p, rows, threads);
}

/* The same for 8-bit blocks w [out_features, in] int8 with w_scales [out_features, in / 32]. */
void dot_q8(const int8_t *w, const float *w_scales, const int8_t *codes, const float *scales, const float *bias,
            float *out, int64_t rows, int64_t out_features, int64_t in, int threads) {
  const product p = {w, w_scales, NULL, codes, scales, NULL, bias, out, out_features, in / BLOCK};
  every_tile(8, &p, rows, threads);
}

/* quantize_q8_1 and then dot_q4 (bits 4: w_minimums given) or dot_q8 (bits 8: w_minimums NULL) in one call, x
 * [rows, in] fp32 quantized into memory of its own: a layer's whole product for one crossing from Python.
 * Returns 0, or -1 where that memory cannot be had (nothing written). */
int linear(int bits, const float *x, const void *w, const float *w_scales, const float *w_minimums,
           const float *bias, float *out, int64_t rows, int64_t out_features, int64_t in, int threads) {
  const int64_t blocks = rows * (in / BLOCK);
  int8_t *codes = malloc((size_t)rows * (size_t)in);
  float *scales = malloc((size_t)blocks * 2 * sizeof(float)), *sums = scales + blocks;
  if (codes == NULL || scales == NULL) {
    free(codes), free(scales);
    return -1;
  }
  quantize_q8_1(x, rows, in, codes, scales, sums);
  if (bits == 4)
    dot_q4(w, w_scales, w_minimums, codes, scales, sums, bias, out, rows, out_features, in, threads);
  else
    dot_q8(w, w_scales, codes, scales, bias, out, rows, out_features, in, threads);
  free(codes), free(scales);
  return 0;
}
