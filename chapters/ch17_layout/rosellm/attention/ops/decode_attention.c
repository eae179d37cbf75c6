/* Decode attention on the CPU, by hand: one new token per sequence attends to every key and value of its
 * sequence, read in place from the paged pool. `decode_attention` in cpu_attention.py is the same function in
 * tensor algebra, and the test this kernel must pass.
 *
 * The model's shapes are constants, set when the kernel is compiled (-D): HEAD_DIM (a multiple of 16), GROUP
 * (query heads per KV head), KV_HEADS, BLOCK_SIZE, and SCALAR, the element type of the pool: float, or
 * uint16_t holding bf16 when BF16 is 1. Arithmetic is in fp32.
 *
 * One sequence at a time (OpenMP shares the batch between threads); for each:
 *   1. scores = q . k for every key, block by block: a block holds every KV head of BLOCK_SIZE slots, one
 *      contiguous piece of memory, read front to back while the next block is prefetched;
 *   2. a softmax over each head's scores;
 *   3. out = sum of weight * v, block by block again.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float vec __attribute__((vector_size(64)));         /* 16 floats: one AVX-512 register, two AVX2 */
typedef uint16_t bits16 __attribute__((vector_size(32)));   /* 16 bf16, as their bits */
typedef uint32_t bits32 __attribute__((vector_size(64)));

#define CHUNKS (HEAD_DIM / 16)               /* vectors per head */
#define HEADS (KV_HEADS * GROUP)             /* query heads */
#define SLOT (KV_HEADS * HEAD_DIM)           /* elements of one slot: every KV head's vector */
#define BLOCK (BLOCK_SIZE * SLOT)            /* elements of one block */

/* 16 elements from p, as floats. bf16 is the upper half of an fp32: widen, then shift. */
static inline vec load16(const SCALAR *p) {
  vec v;
#if BF16
  bits16 narrow;
  memcpy(&narrow, p, sizeof narrow);
  bits32 wide = __builtin_convertvector(narrow, bits32) << 16;
  memcpy(&v, &wide, sizeof v);
#else
  memcpy(&v, p, sizeof v);
#endif
  return v;
}

/* 16 floats to p, rounded to the nearest bf16 (ties to even) when the pool holds bf16. */
static inline void store16(SCALAR *p, vec v) {
#if BF16
  bits32 wide;
  memcpy(&wide, &v, sizeof wide);
  wide += 0x7fff + ((wide >> 16) & 1);
  bits16 narrow = __builtin_convertvector(wide >> 16, bits16);
  memcpy(p, &narrow, sizeof narrow);
#else
  memcpy(p, &v, sizeof v);
#endif
}

static inline float sum16(vec v) {
  float total = 0.f;
  for (int i = 0; i < 16; i++) total += v[i];
  return total;
}

/* The slots of block j that hold keys of a sequence of len tokens: the last block's end is never read. */
static inline int filled(int64_t len, int64_t j) {
  return len - j * BLOCK_SIZE < BLOCK_SIZE ? (int)(len - j * BLOCK_SIZE) : BLOCK_SIZE;
}

/* Ask for slot s of the next block while this block's slot s is worked on: a block's memory is on its way
 * a little at a time, ahead of its use, and never all at once (the CPU drops what it has no room to fetch). */
static inline void prefetch_slot(const SCALAR *block, int s) {
  const char *slot = (const char *)(block + s * SLOT);
  for (size_t byte = 0; byte < SLOT * sizeof(SCALAR); byte += 64) __builtin_prefetch(slot + byte, 0, 1);
}

/* query [batch, HEADS, HEAD_DIM]; key_cache, value_cache [num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM];
 * block_tables [batch, table_width] (every entry a block of the pool); seq_lens [batch], each at least 1 and
 * at most table_width * BLOCK_SIZE; out [batch, HEADS, HEAD_DIM]. Every array contiguous. Nothing past a
 * sequence's last key is read. Returns the number of sequences for which no memory was found for their
 * scores (their rows of out are not written): 0 when all went well. */
int64_t decode_attention(const SCALAR *query, const SCALAR *key_cache, const SCALAR *value_cache,
                         const int64_t *block_tables, const int64_t *seq_lens, SCALAR *out, int64_t batch,
                         int64_t table_width, float scale, int threads) {
  const int64_t keys = table_width * BLOCK_SIZE; /* a row of scores */
  int64_t without_memory = 0;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) reduction(+ : without_memory)
  for (int64_t b = 0; b < batch; b++) {
    const int64_t len = seq_lens[b], blocks = (len + BLOCK_SIZE - 1) / BLOCK_SIZE;
    const int64_t *table = block_tables + b * table_width;
    float *scores = malloc(sizeof(float) * HEADS * keys); /* [HEADS, keys] */
    if (scores == NULL) {
      without_memory++;
      continue;
    }
    vec q[HEADS][CHUNKS], acc[HEADS][CHUNKS];
    for (int h = 0; h < HEADS; h++)
      for (int c = 0; c < CHUNKS; c++) {
        q[h][c] = load16(query + (b * HEADS + h) * HEAD_DIM + c * 16) * scale;
        acc[h][c] = (vec){0};
      }

    for (int64_t j = 0; j < blocks; j++) { /* 1. scores */
      const SCALAR *block = key_cache + table[j] * BLOCK;
      const SCALAR *next = key_cache + table[j + 1 < blocks ? j + 1 : j] * BLOCK;
      for (int s = 0; s < filled(len, j); s++) {
        prefetch_slot(next, s);
        for (int kv = 0; kv < KV_HEADS; kv++) {
          vec k[CHUNKS];
          for (int c = 0; c < CHUNKS; c++) k[c] = load16(block + s * SLOT + kv * HEAD_DIM + c * 16);
          for (int h = kv * GROUP; h < (kv + 1) * GROUP; h++) { /* the query heads that read KV head kv */
            vec dot = q[h][0] * k[0];
            for (int c = 1; c < CHUNKS; c++) dot += q[h][c] * k[c];
            scores[h * keys + j * BLOCK_SIZE + s] = sum16(dot);
          }
        }
      }
    }

    for (int h = 0; h < HEADS; h++) { /* 2. softmax */
      float *row = scores + h * keys, top = row[0], total = 0.f; /* no infinity: compiled with -ffast-math */
      for (int64_t t = 1; t < len; t++) top = row[t] > top ? row[t] : top;
      for (int64_t t = 0; t < len; t++) {
        row[t] = expf(row[t] - top);
        total += row[t];
      }
      for (int64_t t = 0; t < len; t++) row[t] /= total;
    }

    for (int64_t j = 0; j < blocks; j++) { /* 3. weighted sum of the values */
      const SCALAR *block = value_cache + table[j] * BLOCK;
      const SCALAR *next = value_cache + table[j + 1 < blocks ? j + 1 : j] * BLOCK;
      for (int s = 0; s < filled(len, j); s++) {
        prefetch_slot(next, s);
        for (int kv = 0; kv < KV_HEADS; kv++) {
          vec v[CHUNKS];
          for (int c = 0; c < CHUNKS; c++) v[c] = load16(block + s * SLOT + kv * HEAD_DIM + c * 16);
          for (int h = kv * GROUP; h < (kv + 1) * GROUP; h++) {
            float weight = scores[h * keys + j * BLOCK_SIZE + s];
            for (int c = 0; c < CHUNKS; c++) acc[h][c] += weight * v[c];
          }
        }
      }
    }

    for (int h = 0; h < HEADS; h++)
      for (int c = 0; c < CHUNKS; c++) store16(out + (b * HEADS + h) * HEAD_DIM + c * 16, acc[h][c]);
    free(scores);
  }
  return without_memory;
}
