// Paged attention for CPUs, one query token per row: each row attends to the first
// seq_len tokens of its request, read straight from the block-paged KV cache (no gathered
// copy of the context), GQA by KV head. A decode step has one row per request; a prefill
// chunk has one row per token, whose seq_len is its position + 1 (causal). Per layer: the
// softmax scale, a sliding window (a row then reads only its last `window` tokens, itself
// included) and logit soft-capping (scores -> cap * tanh(scores / cap), after scaling).
//
// Registered as torch.classes.plugserve_cpu.PagedAttentionStep, which holds a step's plan
// and the layers' caches, attends one layer from Python (forward) and offers the kernel as
// a plugserve::LayerAttentionFn, which the core's fused CPU decoder calls for every layer
// without going back to Python; built and loaded by cpu_paged_attention.py. Work is split
// over rows (or row and KV head, when rows are few) with ATen's thread pool, so it shares
// the threads torch already runs on; each thread streams its next row's K/V into cache
// while it computes the current one. A single row (a decode step at batch 1) is split over
// its context instead, with the one-row matmuls' helper thread (core's row_pool.h).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "cpu_bf16.h"  // plugserve.ops' public headers, on the include path
#include "cpu_vec_math.h"
#include "layer_attention.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#if defined(__AVX512F__) && defined(__linux__)
#define PLUGSERVE_SPLIT_DECODE 1
#include "row_pool.h"  // core's: the one-row matmuls' helper thread
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using plugserve::to_float;

#ifdef __AVX512F__
using plugserve::load16;  // 16 consecutive elements as fp32 lanes
#endif

constexpr int64_t kPrefetchTokens = 16;
// The kernels' unit of work between two calls of their run hook: the tokens
// scores_in_registers reduces together.
constexpr int64_t kRunTokens = 16;
// How much of the next work item's context a thread streams in ahead, in tokens.
constexpr int64_t kAheadTokens = 512;

// Prefetches `bytes` from p, a line at a time, into every cache level (Locality 3, T0),
// or with 1 (T2, the outer caches) for what is read a work item later: with T0 there,
// the next item's context competed with the current item's own loads for L1 and its fill
// buffers, and a step's attention ran slower (docs/benchmarks-history.md, "Decode
// attention's read-ahead").
template <int Locality = 3>
inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, Locality);
}

// s[t] = cap * tanh(s[t] / cap) over n scores, in place (Gemma 2's logit soft-capping);
// nothing where cap is 0.
inline void soft_cap(float* s, int64_t n, float cap) {
  if (cap <= 0.0f) return;
  const float inv = 1.0f / cap;
  for (int64_t t = 0; t < n; ++t) s[t] = cap * std::tanh(s[t] * inv);
}

// s[t] = exp(s[t] - max s) over n scores, in place: the unnormalized softmax. Returns its
// sum and writes the maximum to *peak (-inf where n is 0).
inline float exp_from_peak(float* s, int64_t n, float* peak) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < n; ++t) m = std::max(m, s[t]);
  float sum = 0.0f;
  for (int64_t t = 0; t < n; ++t) {
    s[t] = std::exp(s[t] - m);
    sum += s[t];
  }
  *peak = m;
  return sum;
}

// q_g . k over head_dim for each of `group` queries (qf holds them in fp32).
template <typename T>
inline void dots(const float* qf, const T* k, int64_t group, int64_t head_dim, float* out,
                 int64_t out_stride) {
#ifdef __AVX512F__
  if (head_dim % 16 == 0 && head_dim <= 256) {
    __m512 kv[16];
    const int64_t chunks = head_dim / 16;
    for (int64_t c = 0; c < chunks; ++c) kv[c] = load16(k + c * 16);
    for (int64_t g = 0; g < group; ++g) {
      __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qf + g * head_dim), kv[0]);
      for (int64_t c = 1; c < chunks; ++c)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(qf + g * head_dim + c * 16), kv[c], acc);
      out[g * out_stride] = _mm512_reduce_add_ps(acc);
    }
    return;
  }
#endif
  for (int64_t g = 0; g < group; ++g) {
    float dot = 0.0f;
    for (int64_t d = 0; d < head_dim; ++d) dot += qf[g * head_dim + d] * to_float(k[d]);
    out[g * out_stride] = dot;
  }
}

// acc_g += p[g] * v over head_dim for each of `group` queries.
template <typename T>
inline void axpys(const float* p, int64_t p_stride, const T* v, int64_t group, int64_t head_dim,
                  float* acc) {
#ifdef __AVX512F__
  if (head_dim % 16 == 0) {
    for (int64_t c = 0; c < head_dim; c += 16) {
      const __m512 vv = load16(v + c);
      for (int64_t g = 0; g < group; ++g) {
        float* a = acc + g * head_dim + c;
        _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_set1_ps(p[g * p_stride]), vv, _mm512_loadu_ps(a)));
      }
    }
    return;
  }
#endif
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < head_dim; ++d) acc[g * head_dim + d] += p[g * p_stride] * to_float(v[d]);
}

#ifdef __AVX512F__
// out[g] = sum_t p[g, t] * v_t for one KV head, the G x CH accumulators held in registers
// across the whole context (GQA groups and head sizes of common models).
template <int G, int CH, typename T, typename TokenFn, typename RunFn>
void weighted_sum_in_registers(const float* p, int64_t len, TokenFn token, RunFn on_run,
                               float* out) {
  __m512 acc[G][CH];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < CH; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t t0 = 0; t0 < len; t0 += kRunTokens) {
    on_run();
    const int64_t run_end = std::min(len, t0 + kRunTokens);
    for (int64_t t = t0; t < run_end; ++t) {
      const T* v = token(t);
      __m512 vv[CH];
      for (int c = 0; c < CH; ++c) vv[c] = load16(v + c * 16);
      for (int g = 0; g < G; ++g) {
        const __m512 pg = _mm512_set1_ps(p[g * len + t]);
        for (int c = 0; c < CH; ++c) acc[g][c] = _mm512_fmadd_ps(pg, vv[c], acc[g][c]);
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < CH; ++c) _mm512_storeu_ps(out + (g * CH + c) * 16, acc[g][c]);
}
#endif

#ifdef __AVX512F__
// The horizontal sums of 16 vectors, as one vector: r[i] = sum(v[i]). A transposing
// reduction tree costs about two instructions per vector instead of eight.
inline __m512 sum16(const __m512* v) {
  __m512 x[8], z[4];
  for (int i = 0; i < 8; ++i)
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(x[2 * i]), b = _mm512_castps_pd(x[2 * i + 1]);
    z[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 w01 = _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], 0x88),
                                   _mm512_shuffle_f32x4(z[0], z[1], 0xDD));
  const __m512 w23 = _mm512_add_ps(_mm512_shuffle_f32x4(z[2], z[3], 0x88),
                                   _mm512_shuffle_f32x4(z[2], z[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w01, w23, 0x88), _mm512_shuffle_f32x4(w01, w23, 0xDD));
}

// s[g, t] = q_g . k_t for one KV head over the whole context, q held in registers and
// the products of 16 tokens reduced together.
template <int G, int CH, typename T, typename TokenFn, typename RunFn>
void scores_in_registers(const float* qf, int64_t len, TokenFn token, RunFn on_run, float* s) {
  __m512 qv[G][CH];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < CH; ++c) qv[g][c] = _mm512_loadu_ps(qf + (g * CH + c) * 16);
  __m512 products[G][16];
  for (int64_t t0 = 0; t0 < len; t0 += kRunTokens) {
    on_run();
    const int n = static_cast<int>(std::min<int64_t>(kRunTokens, len - t0));
    for (int i = 0; i < 16; ++i) {
      if (i >= n) {
        for (int g = 0; g < G; ++g) products[g][i] = _mm512_setzero_ps();
        continue;
      }
      const T* k = token(t0 + i);
      __m512 kv[CH];
      for (int c = 0; c < CH; ++c) kv[c] = load16(k + c * 16);
      for (int g = 0; g < G; ++g) {
        __m512 acc = _mm512_mul_ps(qv[g][0], kv[0]);
        for (int c = 1; c < CH; ++c) acc = _mm512_fmadd_ps(qv[g][c], kv[c], acc);
        products[g][i] = acc;
      }
    }
    const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
    for (int g = 0; g < G; ++g) _mm512_mask_storeu_ps(s + g * len + t0, mask, sum16(products[g]));
  }
}

template <typename T, typename TokenFn, typename RunFn>
bool scores_fast(int64_t group, int64_t head_dim, const float* qf, int64_t len, TokenFn token,
                 RunFn on_run, float* s) {
  if (head_dim == 64) {
    switch (group) {
      case 1: scores_in_registers<1, 4, T>(qf, len, token, on_run, s); return true;
      case 2: scores_in_registers<2, 4, T>(qf, len, token, on_run, s); return true;
      case 3: scores_in_registers<3, 4, T>(qf, len, token, on_run, s); return true;
      case 4: scores_in_registers<4, 4, T>(qf, len, token, on_run, s); return true;
      default: return false;
    }
  }
  if (head_dim == 128) {
    switch (group) {
      case 1: scores_in_registers<1, 8, T>(qf, len, token, on_run, s); return true;
      case 2: scores_in_registers<2, 8, T>(qf, len, token, on_run, s); return true;
      default: return false;
    }
  }
  return false;
}
#endif

// out[g] = sum_t p[g, t] * v_t for one KV head; false if no register-held variant fits.
template <typename T, typename TokenFn, typename RunFn>
bool weighted_sum_fast(int64_t group, int64_t head_dim, const float* p, int64_t len,
                       TokenFn token, RunFn on_run, float* out) {
#ifdef __AVX512F__
  if (head_dim == 64) {
    switch (group) {
      case 1: weighted_sum_in_registers<1, 4, T>(p, len, token, on_run, out); return true;
      case 2: weighted_sum_in_registers<2, 4, T>(p, len, token, on_run, out); return true;
      case 3: weighted_sum_in_registers<3, 4, T>(p, len, token, on_run, out); return true;
      case 4: weighted_sum_in_registers<4, 4, T>(p, len, token, on_run, out); return true;
      default: return false;
    }
  }
  if (head_dim == 128) {
    switch (group) {
      case 1: weighted_sum_in_registers<1, 8, T>(p, len, token, on_run, out); return true;
      case 2: weighted_sum_in_registers<2, 8, T>(p, len, token, on_run, out); return true;
      default: return false;
    }
  }
#endif
  return false;
}

#ifdef PLUGSERVE_SPLIT_DECODE
// A batch-1 decode row's attention as a RowPool job (row_pool.h), so that the matmuls'
// helper thread, idle while the caller attends, reads half of the context: one item per KV
// head and half of the context, each the unnormalized softmax of its slice
// (flash-decoding), merged by the caller. One thread alone reads the context mostly from
// memory (docs/benchmarks-history.md, "Figures from code comments").
constexpr int64_t kSplitMinTokens = 64;  // below this the hand-over costs more than it saves
constexpr int64_t kSlices = 2;

struct SliceArgs {
  const float* q;  // [heads, head_dim] in fp32, scaled
  const void* k;   // the layer's cache, [blocks, block_size, kv_heads, head_dim]
  const void* v;
  const int64_t* blocks;  // the row's block table
  // The row reads tokens first .. first + len - 1 of its context (first > 0: a window).
  int64_t first, len, slice_tokens, kv_heads, group, head_dim, block_size, token_stride,
      block_stride;
  float softcap;  // 0: none
};

// What an item writes: the group's weighted sums of V [group, head_dim], then each query
// head's score maximum [group] and sum of exp(score - maximum) [group].
inline int64_t slice_floats(int64_t group, int64_t head_dim) { return group * (head_dim + 2); }

template <typename T, int BS>
void attend_slice(const void* args, int64_t item, void* out) {
  const auto& a = *static_cast<const SliceArgs*>(args);
  const int64_t group = a.group, head_dim = a.head_dim;
  const int64_t j = item % a.kv_heads, t0 = (item / a.kv_heads) * a.slice_tokens;
  const int64_t n = std::max<int64_t>(0, std::min(a.len, t0 + a.slice_tokens) - t0);
  float* acc = static_cast<float*>(out);
  float* peak = acc + group * head_dim;
  float* total = peak + group;
  const int64_t block_size = BS != 0 ? BS : a.block_size;
  const T* k_base = static_cast<const T*>(a.k) + j * head_dim;
  const T* v_base = static_cast<const T*>(a.v) + j * head_dim;
  auto token_of = [&](const T* base, int64_t t) {
    const int64_t p = a.first + t0 + t;
    return base + a.blocks[p / block_size] * a.block_stride + (p % block_size) * a.token_stride;
  };
  const int64_t head_bytes = head_dim * static_cast<int64_t>(sizeof(T));
  for (int64_t t = 0; t < std::min(n, kPrefetchTokens); ++t) {
    prefetch(token_of(k_base, t), head_bytes);
    prefetch(token_of(v_base, t), head_bytes);
  }
  auto k_of = [&](int64_t t) {
    if (t + kPrefetchTokens < n) {  // V too, which the second pass then finds in cache
      prefetch(token_of(k_base, t + kPrefetchTokens), head_bytes);
      prefetch(token_of(v_base, t + kPrefetchTokens), head_bytes);
    }
    return token_of(k_base, t);
  };
  auto v_of = [&](int64_t t) { return token_of(v_base, t); };
  auto no_run = [] {};
  thread_local std::vector<float> scores;
  if (scores.size() < static_cast<size_t>(group * n)) scores.resize(group * n);
  float* s = scores.data();
  const float* q = a.q + j * group * head_dim;
  if (!scores_fast<T>(group, head_dim, q, n, k_of, no_run, s))
    for (int64_t t = 0; t < n; ++t) dots(q, k_of(t), group, head_dim, s + t, n);
  soft_cap(s, group * n, a.softcap);
  for (int64_t g = 0; g < group; ++g) total[g] = exp_from_peak(s + g * n, n, peak + g);
  if (!weighted_sum_fast<T>(group, head_dim, s, n, v_of, no_run, acc)) {
    std::fill(acc, acc + group * head_dim, 0.0f);
    for (int64_t t = 0; t < n; ++t) axpys(s + t, n, v_of(t), group, head_dim, acc);
  }
}

// One row (a decode step at batch 1) over the caller and the pool's helper; false where
// the pool is not there or the row is too short to be worth splitting.
template <typename T, int BS>
bool attend_row_split(T* out, const T* q_row, int64_t q_head, int64_t heads, int64_t kv_heads,
                      int64_t head_dim, int64_t first, int64_t len, int64_t block_size,
                      const int64_t* row_blocks, const at::Tensor& k_blocks,
                      const at::Tensor& v_blocks, const at::Tensor& block_table, float scale,
                      float softcap) {
  const int64_t group = heads / kv_heads;
  const int64_t item_floats = slice_floats(group, head_dim);
  const int64_t item_bytes = item_floats * static_cast<int64_t>(sizeof(float));
  if (len < kSplitMinTokens || item_bytes > plugserve::RowPool::kScratchBytes ||
      at::get_num_threads() < 2)
    return false;
  plugserve::RowPool* pool = plugserve::lookup_row_pool();
  if (pool == nullptr || !pool->enabled()) return false;
  at::Tensor qf = at::empty({heads * head_dim}, at::kFloat);
  float* qp = qf.data_ptr<float>();
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t d = 0; d < head_dim; ++d)
      qp[h * head_dim + d] = to_float(q_row[h * q_head + d]) * scale;
  // Slices of whole runs of kRunTokens, the unit the score kernel reduces together.
  const int64_t half = (len + kSlices - 1) / kSlices;
  const int64_t slice_tokens = (half + kRunTokens - 1) / kRunTokens * kRunTokens;
  const int64_t token_stride = kv_heads * head_dim;
  const SliceArgs args{qp,         k_blocks.data_ptr(), v_blocks.data_ptr(), row_blocks,
                       first,      len,                 slice_tokens,        kv_heads,
                       group,      head_dim,            block_size,          token_stride,
                       block_size * token_stride,       softcap};
  const int64_t items = kv_heads * kSlices;  // item i: KV head i % kv_heads, slice i / kv_heads
  thread_local std::vector<float> parts;
  if (parts.size() < static_cast<size_t>(items * item_floats)) parts.resize(items * item_floats);
  pool->run(plugserve::RowPool::make_job(&attend_slice<T, BS>, args, items, parts.data(),
                                         item_bytes, item_bytes,
                                         {qf, k_blocks, v_blocks, block_table}));
  // out_h = sum over slices of exp(m_s - m) * acc_s / sum over slices of exp(m_s - m) * l_s
  for (int64_t j = 0; j < kv_heads; ++j) {
    for (int64_t g = 0; g < group; ++g) {
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t sl = 0; sl < kSlices; ++sl) {
        const float* part = parts.data() + (sl * kv_heads + j) * item_floats;
        m = std::max(m, part[group * head_dim + g]);
      }
      float weights[kSlices], denominator = 0.0f;
      for (int64_t sl = 0; sl < kSlices; ++sl) {
        const float* part = parts.data() + (sl * kv_heads + j) * item_floats;
        weights[sl] = std::exp(part[group * head_dim + g] - m);
        denominator += weights[sl] * part[group * head_dim + group + g];
      }
      const float inv = 1.0f / denominator;
      T* dst = out + (j * group + g) * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) {
        float sum = 0.0f;
        for (int64_t sl = 0; sl < kSlices; ++sl)
          sum += weights[sl] * parts[(sl * kv_heads + j) * item_floats + g * head_dim + d];
        dst[d] = static_cast<T>(sum * inv);
      }
    }
  }
  return true;
}
#endif

// BS is the cache's block size where it is a common one, 0 for any other (read at run
// time): with BS known, finding a token's block and offset is a shift and a mask instead of
// a division per token, a measurable share of the kernel with the context in cache
// (docs/benchmarks-history.md, "Figures from code comments").
// softcap 0: none; window 0: the whole context.
template <typename T, int BS>
void paged_attention_impl(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_blocks,
                          const at::Tensor& v_blocks, const at::Tensor& block_table,
                          const at::Tensor& table_index, const at::Tensor& seq_lens,
                          double scale, double softcap, int64_t window, bool split_one_row) {
  const int64_t rows = q.size(0), heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = BS != 0 ? BS : k_blocks.size(1), kv_heads = k_blocks.size(2);
  const int64_t group = heads / kv_heads;
  const int64_t max_blocks = block_table.size(1);
  const T* q_ptr = q.data_ptr<T>();
  const T* k_ptr = k_blocks.data_ptr<T>();
  const T* v_ptr = v_blocks.data_ptr<T>();
  T* out_ptr = out.data_ptr<T>();
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* table_of = table_index.data_ptr<int64_t>();
  // Strides in elements: q/out [rows, heads, D] contiguous per head; the cache
  // [blocks, block_size, kv_heads, D] contiguous.
  const int64_t q_row = q.stride(0), q_head = q.stride(1);
  const int64_t token_stride = kv_heads * head_dim, block_stride = block_size * token_stride;
  const float fscale = static_cast<float>(scale), fsoftcap = static_cast<float>(softcap);
  // A row whose context ends at token `end` (exclusive) reads from here.
  auto first_of = [&](int64_t end) {
    return window > 0 ? std::max<int64_t>(0, end - window) : int64_t{0};
  };

  // A work item is a row and a range of its KV heads: all of them when there are
  // enough rows to share among the threads (each token's K/V row of every head is then
  // one contiguous read) or only one row (run on this thread, below), one head each when
  // there are a few rows.
  const int64_t split = rows == 1 || rows >= 4 * at::get_num_threads() ? 1 : kv_heads;
  const int64_t heads_per_item = kv_heads / split;
  const int64_t item_bytes = heads_per_item * head_dim * static_cast<int64_t>(sizeof(T));

  struct Item {
    int64_t row, first_kvh;
    int64_t first, len;  // the context tokens it reads: first .. first + len - 1
    const int64_t* blocks;  // the row's block table
  };
  auto item_at = [&](int64_t item) {
    // Rows in zigzag order (first, last, second, second-to-last...): the threads' equal
    // ranges of items then get equal work even when a prefill's rows grow in length.
    const int64_t order = item / split;
    const int64_t row = order % 2 == 0 ? order / 2 : rows - 1 - order / 2;
    const int64_t first = first_of(lens[row]);
    return Item{row, (item % split) * heads_per_item, first, lens[row] - first,
                table + table_of[row] * max_blocks};
  };
  // Token t of an item's context in `base` (the K or V cache), at its first KV head.
  auto token_of = [&](const T* base, const Item& it, int64_t t) {
    const int64_t p = it.first + t;
    return base + it.blocks[p / block_size] * block_stride + (p % block_size) * token_stride +
           it.first_kvh * head_dim;
  };

  auto attend_items = [&](int64_t begin, int64_t end) {
    std::vector<float> qf(heads * head_dim), acc(heads * head_dim), scores;
    int64_t in_cache = 0;  // leading tokens of this item that the item before streamed in
    for (int64_t item = begin; item < end; ++item) {
      const Item it = item_at(item);
      const int64_t first_head = it.first_kvh * group, num_heads = heads_per_item * group;
      const int64_t len = it.len;
      // While this item computes from cache, the next one's K/V streams in, spread evenly
      // over this item's runs of kRunTokens in both passes: a thread's memory reads then
      // overlap its arithmetic instead of alternating with it (docs/benchmarks-history.md,
      // "Figures from code comments"). Not where the next item reads what
      // this one does (a prefill's rows share their context), and only its first
      // kAheadTokens, so that two items' contexts stay within L2.
      const bool has_next = item + 1 < end;
      const Item next = has_next ? item_at(item + 1) : it;
      const bool same_context =
          table_of[next.row] == table_of[it.row] && next.first_kvh == it.first_kvh;
      const int64_t ahead = has_next && !same_context ? std::min(next.len, kAheadTokens) : 0;
      const int64_t runs = 2 * heads_per_item * ((len + kRunTokens - 1) / kRunTokens);
      int64_t runs_done = 0, streamed = 0;
      auto stream_next = [&] {
        ++runs_done;
        for (; streamed < ahead && streamed * runs < runs_done * ahead; ++streamed) {
          prefetch<1>(token_of(k_ptr, next, streamed), item_bytes);
          prefetch<1>(token_of(v_ptr, next, streamed), item_bytes);
        }
      };
      // Grown, never cleared: pass 1 writes every score before anything reads it.
      if (scores.size() < static_cast<size_t>(num_heads * len)) scores.resize(num_heads * len);
      for (int64_t h = 0; h < num_heads; ++h) {
        const T* src = q_ptr + it.row * q_row + (first_head + h) * q_head;
        for (int64_t d = 0; d < head_dim; ++d) qf[h * head_dim + d] = to_float(src[d]) * fscale;
      }
      // Pass 1: scores[h, t] = q_h . k_t over the row's context, one KV head at a time.
      for (int64_t t = in_cache; t < len && t < in_cache + kPrefetchTokens; ++t)
        prefetch(token_of(k_ptr, it, t), item_bytes);
      for (int64_t j = 0; j < heads_per_item; ++j) {
        const float* qj = qf.data() + j * group * head_dim;
        float* sj = scores.data() + j * group * len;
        auto k_of = [&](int64_t t) {
          // Past what the item before streamed in: one block ahead, for K now and for V,
          // which pass 2 then finds in cache.
          if (j == 0 && t >= in_cache && t + kPrefetchTokens < len) {
            prefetch(token_of(k_ptr, it, t + kPrefetchTokens), item_bytes);
            prefetch(token_of(v_ptr, it, t + kPrefetchTokens), item_bytes);
          }
          return token_of(k_ptr, it, t) + j * head_dim;
        };
        bool done = false;
#ifdef __AVX512F__
        done = scores_fast<T>(group, head_dim, qj, len, k_of, stream_next, sj);
#endif
        for (int64_t t = 0; !done && t < len; ++t) {
          if (t % kRunTokens == 0) stream_next();
          dots(qj, k_of(t), group, head_dim, sj + t, len);
        }
      }
      // Softmax per query head, in fp32 (soft-capped first where the layer caps).
      soft_cap(scores.data(), num_heads * len, fsoftcap);
      for (int64_t h = 0; h < num_heads; ++h) {
        float* s = scores.data() + h * len;
        float peak;
        const float inv = 1.0f / exp_from_peak(s, len, &peak);
        for (int64_t t = 0; t < len; ++t) s[t] *= inv;
      }
      // Pass 2: out_h = sum_t p[h, t] * v_t.
      for (int64_t j = 0; j < heads_per_item; ++j) {
        const float* p = scores.data() + j * group * len;
        float* a = acc.data() + j * group * head_dim;
        auto v_of = [&](int64_t t) { return token_of(v_ptr, it, t) + j * head_dim; };
        if (weighted_sum_fast<T>(group, head_dim, p, len, v_of, stream_next, a)) continue;
        std::fill(a, a + group * head_dim, 0.0f);
        for (int64_t t = 0; t < len; ++t) {
          if (t % kRunTokens == 0) stream_next();
          axpys(p + t, len, v_of(t), group, head_dim, a);
        }
      }
      for (int64_t h = 0; h < num_heads; ++h) {
        T* dst = out_ptr + (it.row * heads + first_head + h) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<T>(acc[h * head_dim + d]);
      }
      in_cache = streamed;
    }
  };
  // One row (a batch-1 decode step) is shared with the one-row matmuls' helper thread
  // where there is one, or else runs on this thread: its few microseconds of work would
  // leave OpenMP's other thread spinning for far longer afterwards on the core where that
  // helper runs next.
  if (rows == 1) {
#ifdef PLUGSERVE_SPLIT_DECODE
    const int64_t first = first_of(lens[0]);
    if (split_one_row &&
        attend_row_split<T, BS>(out_ptr, q_ptr, q_head, heads, kv_heads, head_dim, first,
                                lens[0] - first, block_size, table + table_of[0] * max_blocks,
                                k_blocks, v_blocks, block_table, fscale, fsoftcap))
      return;
#endif
    attend_items(0, 1);
  } else {
    at::parallel_for(0, rows * split, 1, attend_items);
  }
}

template <typename T>
void paged_attention_rows(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_blocks,
                          const at::Tensor& v_blocks, const at::Tensor& block_table,
                          const at::Tensor& table_index, const at::Tensor& seq_lens,
                          double scale, double softcap, int64_t window, bool split_one_row) {
  switch (k_blocks.size(1)) {
    case 16:
      return paged_attention_impl<T, 16>(out, q, k_blocks, v_blocks, block_table, table_index,
                                         seq_lens, scale, softcap, window, split_one_row);
    case 32:
      return paged_attention_impl<T, 32>(out, q, k_blocks, v_blocks, block_table, table_index,
                                         seq_lens, scale, softcap, window, split_one_row);
    default:
      return paged_attention_impl<T, 0>(out, q, k_blocks, v_blocks, block_table, table_index,
                                        seq_lens, scale, softcap, window, split_one_row);
  }
}

// k/v [T, kv_heads, D] (each token's heads contiguous) into cache slots[t] of the blocks.
void write_kv(const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots,
              at::Tensor& k_blocks, at::Tensor& v_blocks) {
  const int64_t tokens = k.size(0);
  const int64_t num_slots = k_blocks.size(0) * k_blocks.size(1);
  const int64_t token_elems = k_blocks.size(2) * k_blocks.size(3);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(1) * k.size(2) == token_elems &&
                  k.scalar_type() == k_blocks.scalar_type() &&
                  v.scalar_type() == k_blocks.scalar_type(),
              "k and v must be [tokens, kv_heads, head_dim] of the cache's dtype");
  for (const at::Tensor* t : {&k, &v})
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == t->size(2),
                "each token's k and v heads must be contiguous");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() &&
                  slots.numel() == tokens,
              "slots must be contiguous int64, one per token");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "slot ", slot[t], " is outside the cache");
  const int64_t bytes = token_elems * k.element_size();
  auto* kd = static_cast<char*>(k_blocks.data_ptr());
  auto* vd = static_cast<char*>(v_blocks.data_ptr());
  const auto* ks = static_cast<const char*>(k.data_ptr());
  const auto* vs = static_cast<const char*>(v.data_ptr());
  const int64_t k_row = k.stride(0) * k.element_size(), v_row = v.stride(0) * v.element_size();
  at::parallel_for(0, tokens, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      std::memcpy(kd + slot[t] * bytes, ks + t * k_row, bytes);
      std::memcpy(vd + slot[t] * bytes, vs + t * v_row, bytes);
    }
  });
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& slots, at::Tensor k_blocks, at::Tensor v_blocks,
                           const at::Tensor& block_table, const at::Tensor& table_index,
                           const at::Tensor& seq_lens, double scale, double softcap,
                           int64_t window, bool split_one_row) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [rows, heads, head_dim], last dim dense");
  TORCH_CHECK(k_blocks.is_contiguous() && v_blocks.is_contiguous(), "KV blocks must be contiguous");
  TORCH_CHECK(k_blocks.scalar_type() == q.scalar_type() && v_blocks.scalar_type() == q.scalar_type(),
              "q and the KV cache must share a dtype");
  for (const at::Tensor* t : {&block_table, &table_index, &seq_lens})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(),
                "block_table, table_index and seq_lens must be contiguous int64");
  TORCH_CHECK(table_index.size(0) == q.size(0) && seq_lens.size(0) == q.size(0),
              "table_index and seq_lens need one entry per row of q");
  TORCH_CHECK(q.size(1) % k_blocks.size(2) == 0, "heads must be a multiple of kv_heads");
  // Every token's K/V goes in before any row reads: a prefill row attends to the tokens
  // the rows before it add in this same step.
  write_kv(k, v, slots, k_blocks, v_blocks);
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  if (q.size(0) == 0) return out;
  if (q.scalar_type() == at::kBFloat16) {
    paged_attention_rows<c10::BFloat16>(out, q, k_blocks, v_blocks, block_table, table_index,
                                        seq_lens, scale, softcap, window, split_one_row);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kFloat, "paged_attention supports float32 and bfloat16");
    paged_attention_rows<float>(out, q, k_blocks, v_blocks, block_table, table_index, seq_lens,
                                scale, softcap, window, split_one_row);
  }
  return out;
}

// A step's plan and every layer's cache, for calls from C++ (plugserve::LayerAttentionFn).
// Per layer: its softmax scale, soft-cap (0: none) and sliding window (0: none).
// split_one_row: a lone row may split its context with the row pool's helper (faster at
// batch 1, but the slices' partial sums then merge in another order than a row of a larger
// batch, whose context one thread reduces front to back); false keeps every row's sums in
// that one order whatever shares the step (engine.batch_invariant).
struct PagedAttentionStep : torch::CustomClassHolder {
  PagedAttentionStep(std::vector<at::Tensor> k_blocks, std::vector<at::Tensor> v_blocks,
                     std::vector<double> scales, std::vector<double> softcaps,
                     std::vector<int64_t> windows, bool split_one_row)
      : k_blocks(std::move(k_blocks)),
        v_blocks(std::move(v_blocks)),
        scales(std::move(scales)),
        softcaps(std::move(softcaps)),
        windows(std::move(windows)),
        split_one_row(split_one_row) {
    const size_t layers = this->k_blocks.size();
    TORCH_CHECK(this->v_blocks.size() == layers && this->scales.size() == layers &&
                    this->softcaps.size() == layers && this->windows.size() == layers,
                "one K, V, scale, soft-cap and window per layer");
    for (size_t i = 0; i < layers; ++i)
      TORCH_CHECK(this->softcaps[i] >= 0 && this->windows[i] >= 0, "layer ", i,
                  ": soft-cap and window must be 0 (none) or positive");
  }

  // A step as the engine builds it (interfaces.AttentionBatch: query_start [R + 1], seq_lens
  // [R], block_table [R, max_blocks], slot_mapping [T], any integer dtype) → one kernel row
  // per token, which sees its request's context plus the step's tokens up to itself. In C++
  // because in numpy these were ~20 calls a step, each one cold after the weights' stream.
  void plan(const at::Tensor& slot_mapping, const at::Tensor& query_start,
            const at::Tensor& seq_lens, const at::Tensor& block_table) {
    TORCH_CHECK_VALUE(!k_blocks.empty(), "the cache has no layers");
    const int64_t rows = seq_lens.numel();
    TORCH_CHECK_VALUE(query_start.dim() == 1 && query_start.numel() == rows + 1 &&
                    block_table.dim() == 2 && block_table.size(0) == rows,
                "query_start needs one entry more than seq_lens, block_table one row per row");
    const at::Tensor starts = query_start.to(at::kLong).contiguous();
    const at::Tensor lens = seq_lens.to(at::kLong).contiguous();
    at::Tensor table = block_table.to(at::kLong).contiguous();
    at::Tensor step_slots = slot_mapping.to(at::kLong).contiguous();
    const int64_t* qs = starts.data_ptr<int64_t>();
    const int64_t* len = lens.data_ptr<int64_t>();
    const int64_t tokens = qs[rows];
    TORCH_CHECK_VALUE(qs[0] == 0 && step_slots.numel() == tokens,
                "slot_mapping needs one slot per token of query_start");
    const int64_t block_size = k_blocks[0].size(1), num_blocks = k_blocks[0].size(0);
    const int64_t max_blocks = table.size(1);
    const int64_t* ids = table.data_ptr<int64_t>();
    at::Tensor token_table = at::empty({tokens}, at::kLong);
    at::Tensor token_lens = at::empty({tokens}, at::kLong);
    int64_t* table_of = token_table.data_ptr<int64_t>();
    int64_t* sees = token_lens.data_ptr<int64_t>();
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t context = len[r] - (qs[r + 1] - qs[r]);
      TORCH_CHECK_VALUE(qs[r + 1] >= qs[r] && context >= 0, "row ", r,
                  " has more query tokens than its seq_len");
      const int64_t used = (len[r] + block_size - 1) / block_size;
      TORCH_CHECK_VALUE(used <= max_blocks, "row ", r, " needs ", used, " blocks; the table has ",
                  max_blocks);
      for (int64_t b = 0; b < used; ++b)
        TORCH_CHECK_VALUE(ids[r * max_blocks + b] >= 0 && ids[r * max_blocks + b] < num_blocks,
                    "block ", ids[r * max_blocks + b], " is outside the cache");
      for (int64_t t = qs[r]; t < qs[r + 1]; ++t) {
        table_of[t] = r;
        sees[t] = context + (t - qs[r]) + 1;
      }
    }
    slots = std::move(step_slots);
    this->block_table = std::move(table);
    table_index = std::move(token_table);
    this->seq_lens = std::move(token_lens);
  }

  // One layer from Python (the backend's forward), over the planned step.
  at::Tensor forward(int64_t layer, const at::Tensor& q, const at::Tensor& k,
                     const at::Tensor& v) {
    return call(this, layer, q, k, v);
  }

  // [function address, context address]: valid while this object lives and until the next
  // plan(), whose tensors the call reads.
  std::vector<int64_t> layer_call() const {
    plugserve::LayerAttentionFn fn = &call;
    return {reinterpret_cast<int64_t>(fn), reinterpret_cast<int64_t>(this)};
  }

  static at::Tensor call(const void* context, int64_t layer, const at::Tensor& q,
                         const at::Tensor& k, const at::Tensor& v) {
    const auto& step = *static_cast<const PagedAttentionStep*>(context);
    TORCH_CHECK(layer >= 0 && layer < static_cast<int64_t>(step.k_blocks.size()), "layer ",
                layer, " is outside the cache");
    TORCH_CHECK(step.slots.defined(), "plan() must run before the layer call");
    return paged_attention(q, k, v, step.slots, step.k_blocks[layer], step.v_blocks[layer],
                           step.block_table, step.table_index, step.seq_lens, step.scales[layer],
                           step.softcaps[layer], step.windows[layer], step.split_one_row);
  }

  std::vector<at::Tensor> k_blocks, v_blocks;
  std::vector<double> scales, softcaps;
  std::vector<int64_t> windows;
  bool split_one_row;
  at::Tensor slots, block_table, table_index, seq_lens;
};

}  // namespace

TORCH_LIBRARY(plugserve_cpu, m) {
  m.class_<PagedAttentionStep>("PagedAttentionStep")
      .def(torch::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<double>,
                       std::vector<double>, std::vector<int64_t>, bool>())
      .def("plan", &PagedAttentionStep::plan)
      .def("forward", &PagedAttentionStep::forward)
      .def("layer_call", &PagedAttentionStep::layer_call);
}

