// Prefill attention for CPUs with AVX-512 BF16, flash-attention style: for each
// (sequence, KV head, block of query tokens) the query rows of the head's whole GQA group
// attend together, key block by key block up to the causal limit (from the sliding
// window's start) or over all the sequence's keys, with an online softmax in fp32. Both
// products (Q·Kᵀ and P·V) run on _mm512_dpbf16_ps, which multiplies pairs of bf16 and
// accumulates in fp32; K and V are packed once per call into the pair-interleaved
// layouts it reads.
//
// Registered as torch.ops.plugserve_prefill:
// - attention(q, k, v, scale, softcap, window): one causal sequence. q [Tq, H, D], k/v
//   [Tk, KVH, D] (bf16, H a multiple of KVH, D 32, 64 or 128); query i sits at position
//   Tk - Tq + i (the keys before the chunk are its context) and attends to the keys up to
//   its own position, the last `window` of them when window > 0.
// - varlen_bidirectional(q, k, v, cu_seqlens, scale, softcap): many whole prompts
//   (an encoder's), tokens [cu_seqlens[b], cu_seqlens[b + 1]) of q, k and v, each query
//   attending to every key of its own prompt.
// Scores are scaled, then soft-capped (cap * tanh(s / cap)) when softcap > 0. Built and
// loaded by cpu_prefill_attention.py, which checks the CPU has avx512_bf16 first.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include "cpu_vec_math.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

#if defined(__AVX512BF16__) && defined(__AVX512BW__)

using plugserve::soft_cap16;

constexpr int64_t kKeyBlock = 64;      // keys per step of the online softmax (4 vectors)
constexpr int64_t kQueryTokens = 32;   // query tokens per work item (times G heads)
// A masked score: finite, as the library is built with -ffast-math.
constexpr float kMasked = -1e30f;

inline __m512bh pair(const uint16_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  return (__m512bh)_mm512_set1_epi32(static_cast<int>(bits));
}

// Scores of R query rows against the first C groups of 16 keys of one key block:
// s[r][0..16 C) = q[r] · k[0..16 C) (the rest of the block lies past the last key).
// kp: the block's keys packed as 4 groups of 16 keys, each [D/2 pairs][16 keys][2].
template <int R, int C>
inline void scores_tile(const uint16_t* q, int64_t D, const uint16_t* kp, float* s) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const int64_t group = 16 * D;  // bf16 per 16-key group
  for (int64_t j = 0; j < D / 2; ++j) {
    __m512bh kv[C];
    for (int c = 0; c < C; ++c)
      kv[c] = (__m512bh)_mm512_loadu_si512(kp + c * group + j * 32);
    for (int r = 0; r < R; ++r) {
      __m512bh qq = pair(q + r * D + 2 * j);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], qq, kv[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(s + r * kKeyBlock + c * 16, acc[r][c]);
}

// o[r][0..D) += p[r] · v over the first `pairs` key pairs of one key block, D = 16 * ND.
// vp: the block's values packed as [32 key pairs][D][2]; p: R rows of 64 bf16
// probabilities.
template <int R, int ND>
inline void values_tile(const uint16_t* p, const uint16_t* vp, float* o, int64_t D,
                        int64_t pairs) {
  __m512 acc[R][ND];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < ND; ++c) acc[r][c] = _mm512_loadu_ps(o + r * D + c * 16);
  for (int64_t t = 0; t < pairs; ++t) {
    __m512bh vv[ND];
    for (int c = 0; c < ND; ++c)
      vv[c] = (__m512bh)_mm512_loadu_si512(vp + t * 2 * D + c * 32);
    for (int r = 0; r < R; ++r) {
      __m512bh pp = pair(p + r * kKeyBlock + 2 * t);
      for (int c = 0; c < ND; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pp, vv[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < ND; ++c) _mm512_storeu_ps(o + r * D + c * 16, acc[r][c]);
}

// Rows in tiles of kRows (the last tile shorter): R * 4 score accumulators, R * ND output
// ones, within the 32 vector registers.
template <int ND>
constexpr int kRows = ND <= 4 ? 6 : 3;

template <int R, int C>
void scores_rows(int rows, const uint16_t* q, int64_t D, const uint16_t* kp, float* s) {
  if constexpr (R > 0) {
    for (; rows >= R; rows -= R, q += R * D, s += R * kKeyBlock) scores_tile<R, C>(q, D, kp, s);
    if (rows) scores_rows<R - 1, C>(rows, q, D, kp, s);
  }
}

// The scores of a block whose keys end `keys` into it: only its groups of 16 that hold
// keys, so a short prompt does not pay for a whole 64-key block.
template <int R>
void scores_rows_upto(int64_t keys, int rows, const uint16_t* q, int64_t D, const uint16_t* kp,
                      float* s) {
  switch (std::min<int64_t>((keys + 15) / 16, 4)) {
    case 1: return scores_rows<R, 1>(rows, q, D, kp, s);
    case 2: return scores_rows<R, 2>(rows, q, D, kp, s);
    case 3: return scores_rows<R, 3>(rows, q, D, kp, s);
    default: return scores_rows<R, 4>(rows, q, D, kp, s);
  }
}

template <int R, int ND>
void values_rows(int rows, const uint16_t* p, const uint16_t* vp, float* o, int64_t D,
                 int64_t pairs) {
  if constexpr (R > 0) {
    for (; rows >= R; rows -= R, p += R * kKeyBlock, o += R * D)
      values_tile<R, ND>(p, vp, o, D, pairs);
    if (rows) values_rows<R - 1, ND>(rows, p, vp, o, D, pairs);
  }
}

struct Problem {
  const uint16_t* q;  // [Tq, H, D], token stride q_stride
  int64_t q_stride;
  uint16_t* out;  // [Tq, H, D] contiguous
  const uint16_t* kp;  // per KV head: keys packed by 16 (see scores_tile), padded to 16
  const uint16_t* vp;  // per KV head: values packed by key pair (see values_tile)
  int64_t head_packed;  // bf16 per KV head in kp / vp
  int64_t Tq, Tk, H, KVH, D;
  float scale, softcap;
  int64_t window;
  bool causal;
};

// 2^x for 16 lanes where x <= 0 (a score less the row's running max, in base-2 units):
// 2^n * poly(r), n = round(x), r = x - n in [-1/2, 1/2], with a degree-5 minimax
// polynomial (relative error ~2e-7; the probabilities are rounded to bf16 after it). A
// masked score (~ -1e30) gives n = x, r = 0 and 2^n = 0: no clamp needed.
inline __m512 exp2_nonpositive16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.3276455e-3f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.67554003e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.55071346e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.240221202f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.693146944f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.00000012f));
  return _mm512_scalef_ps(p, n);
}

constexpr float kLog2e = 1.44269504f;

// One key block's online-softmax step for each of `rows` rows: scores s → bf16
// probabilities pb, the running max m and the 16-lane partial sums l, and o rescaled where
// the max grew. Scores are kept in base-2 units (scaled by log2 e), so the exponentials
// are powers of two; the row's max is reduced across lanes only when some lane passes the
// running one, and the sums only once, at the end. C: the block's vectors of 16 keys that
// hold any (a short prompt's last block has fewer).
template <int C>
void softmax_block(const Problem& P, int64_t rows, int64_t k0, int64_t first_pos, bool whole,
                   const float* s, uint16_t* pb, float* o, float* m, float* l) {
  const int64_t D = P.D, G = P.H / P.KVH;
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const bool capped = P.softcap > 0;
  const __m512 scale = _mm512_set1_ps(capped ? P.scale : P.scale * kLog2e);
  for (int64_t r = 0; r < rows; ++r) {
    const float* sr = s + r * kKeyBlock;
    const int64_t pos = P.causal ? first_pos + r / G : first_pos;
    __m512 v[C];
    for (int c = 0; c < C; ++c) {
      v[c] = _mm512_mul_ps(_mm512_loadu_ps(sr + c * 16), scale);
      if (capped)
        v[c] = _mm512_mul_ps(soft_cap16(v[c], P.softcap), _mm512_set1_ps(kLog2e));
      if (!whole) {
        __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(k0 + c * 16)));
        __mmask16 seen = _mm512_cmp_epi32_mask(key, _mm512_set1_epi32(static_cast<int>(pos)),
                                               _MM_CMPINT_LE);
        if (P.window > 0)
          seen &= _mm512_cmp_epi32_mask(
              key, _mm512_set1_epi32(static_cast<int>(pos - P.window)), _MM_CMPINT_GT);
        v[c] = _mm512_mask_blend_ps(seen, _mm512_set1_ps(kMasked), v[c]);
      }
    }
    __m512 peak = v[0];
    for (int c = 1; c < C; ++c) peak = _mm512_max_ps(peak, v[c]);
    const float m_old = m[r];
    const bool grew = _mm512_cmp_ps_mask(peak, _mm512_set1_ps(m_old), _CMP_GT_OQ) != 0;
    const float m_new = grew ? _mm512_reduce_max_ps(peak) : m_old;
    uint16_t* pr = pb + r * kKeyBlock;
    if (m_new <= kMasked * 0.5f) {  // nothing seen yet: no probabilities
      std::memset(pr, 0, kKeyBlock * 2);
      continue;
    }
    float* lr = l + r * 16;
    __m512 sum = _mm512_loadu_ps(lr);
    if (grew) {  // rescale what the earlier blocks summed
      const float alpha = m_old <= kMasked * 0.5f ? 0.0f : std::exp2(m_old - m_new);
      const __m512 alphas = _mm512_set1_ps(alpha);
      sum = _mm512_mul_ps(sum, alphas);
      float* orow = o + r * D;
      for (int64_t d = 0; d < D; d += 16)
        _mm512_storeu_ps(orow + d, _mm512_mul_ps(_mm512_loadu_ps(orow + d), alphas));
      m[r] = m_new;
    }
    const __m512 mv = _mm512_set1_ps(m_new);
    for (int c = 0; c < C; ++c) {
      __m512 e = exp2_nonpositive16(_mm512_sub_ps(v[c], mv));
      sum = _mm512_add_ps(sum, e);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + c * 16),
                          (__m256i)_mm512_cvtneps_pbh(e));
    }
    _mm512_storeu_ps(lr, sum);
  }
}

// How many of a block's first `keys` keys (from k0) row r of a work item sees: those up to
// its position (every key of its prompt when not causal).
inline int64_t keys_seen(const Problem& P, int64_t first_pos, int64_t r, int64_t k0,
                         int64_t keys) {
  const int64_t pos = P.causal ? first_pos + r / (P.H / P.KVH) : first_pos;
  return std::clamp<int64_t>(pos - k0 + 1, 0, keys);
}

// One work item: query tokens [t0, t0 + n) of KV head h, with all G heads of its group.
template <int ND>
void attend_block(const Problem& P, int64_t h, int64_t t0, int64_t n, uint16_t* qt, float* s,
                  uint16_t* pb, float* o, float* m, float* l) {
  const int64_t D = P.D, G = P.H / P.KVH, rows = n * G, offset = P.Tk - P.Tq;
  // The tile's queries, row (token i, head g) at i * G + g.
  for (int64_t i = 0; i < n; ++i)
    std::memcpy(qt + i * G * D, P.q + (t0 + i) * P.q_stride + h * G * D, G * D * 2);
  std::fill(o, o + rows * D, 0.0f);
  std::fill(m, m + rows, kMasked);
  std::fill(l, l + rows * 16, 0.0f);

  // Not causal: every row sits past the last key, so it sees them all.
  const int64_t first_pos = P.causal ? offset + t0 : P.Tk - 1;
  const int64_t last_pos = P.causal ? offset + t0 + n - 1 : P.Tk - 1;
  int64_t k_begin = P.window > 0 ? std::max<int64_t>(0, first_pos - P.window + 1) : 0;
  k_begin -= k_begin % kKeyBlock;
  const int64_t k_end = last_pos + 1;
  const uint16_t* kp = P.kp + h * P.head_packed;
  const uint16_t* vp = P.vp + h * P.head_packed;

  constexpr int R = kRows<ND>;
  for (int64_t k0 = k_begin; k0 < k_end; k0 += kKeyBlock) {
    // Keys past Tk (zero-padded in kp and vp) are masked below; whole groups and pairs
    // of them are skipped.
    const int64_t keys = std::min(kKeyBlock, P.Tk - k0);
    // The vectors of 16 keys that hold any: a short prompt's block is mostly past its end.
    const int vectors = static_cast<int>((keys + 15) / 16);
    // Every row sees every key of the block: no masks to build.
    const bool whole = k0 + kKeyBlock - 1 <= first_pos &&
                       (P.window <= 0 || k0 > last_pos - P.window);
    const uint16_t* kb = kp + k0 * D;
    const uint16_t* vb = vp + k0 * D;
    // Tile by tile, the keys of the block that a tile's last row sees: all of them but
    // where the causal limit cuts the block. The products past them would be masked
    // (scores) or multiply zero probabilities (values).
    for (int64_t r0 = 0; r0 < rows; r0 += R) {
      const int n = static_cast<int>(std::min<int64_t>(R, rows - r0));
      if (const int64_t seen = keys_seen(P, first_pos, r0 + n - 1, k0, keys); seen > 0)
        scores_rows_upto<R>(seen, n, qt + r0 * D, D, kb, s + r0 * kKeyBlock);
    }
    switch (vectors) {  // the count a compile-time constant, as the loops unroll on it
      case 1: softmax_block<1>(P, rows, k0, first_pos, whole, s, pb, o, m, l); break;
      case 2: softmax_block<2>(P, rows, k0, first_pos, whole, s, pb, o, m, l); break;
      case 3: softmax_block<3>(P, rows, k0, first_pos, whole, s, pb, o, m, l); break;
      default: softmax_block<4>(P, rows, k0, first_pos, whole, s, pb, o, m, l);
    }
    for (int64_t r0 = 0; r0 < rows; r0 += R) {
      const int n = static_cast<int>(std::min<int64_t>(R, rows - r0));
      if (const int64_t seen = keys_seen(P, first_pos, r0 + n - 1, k0, keys); seen > 0)
        values_rows<R, ND>(n, pb + r0 * kKeyBlock, vb, o + r0 * D, D, (seen + 1) / 2);
    }
  }

  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = r / G, g = r % G;
    uint16_t* dst = P.out + (t0 + i) * P.H * D + (h * G + g) * D;
    const float sum = _mm512_reduce_add_ps(_mm512_loadu_ps(l + r * 16));
    const __m512 inv = _mm512_set1_ps(sum > 0 ? 1.0f / sum : 0.0f);
    for (int64_t d = 0; d < D; d += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d),
                          (__m256i)_mm512_cvtneps_pbh(
                              _mm512_mul_ps(_mm512_loadu_ps(o + r * D + d), inv)));
  }
}

// Packs KV head h's keys [Tk, D] (token stride) into groups of 16 keys, each
// [D/2 pairs][16 keys][2], and its values into [key pairs][D][2]; zero past Tk up to
// `padded` keys (a multiple of 16). A short prompt's packing is a good share of its
// attention: a key group's pair j is one gather of 16 keys' j-th pair, a value pair two
// rows interleaved by two permutes per 32 dimensions.
void pack_head(const uint16_t* k, const uint16_t* v, int64_t k_stride, int64_t v_stride,
               int64_t Tk, int64_t D, int64_t padded, uint16_t* kp, uint16_t* vp) {
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  // Each lane's key row, in pairs from its group's first key: the same for every group, and
  // small whatever the prompt's length (offsets from k itself could overflow 32 bits).
  const __m512i row = _mm512_mullo_epi32(lane, _mm512_set1_epi32(static_cast<int>(k_stride / 2)));
  for (int64_t g = 0; g < padded / 16; ++g) {
    const __mmask16 live = _mm512_cmp_epi32_mask(
        lane, _mm512_set1_epi32(static_cast<int>(std::min<int64_t>(Tk - g * 16, 16))),
        _MM_CMPINT_LT);
    const uint16_t* group = k + g * 16 * k_stride;
    uint16_t* dst = kp + g * 16 * D;
    for (int64_t j = 0; j < D / 2; ++j) {
      const __m512i index = _mm512_add_epi32(row, _mm512_set1_epi32(static_cast<int>(j)));
      _mm512_storeu_si512(dst + j * 32, _mm512_mask_i32gather_epi32(_mm512_setzero_si512(),
                                                                      live, index, group, 4));
    }
  }
  // Output lanes 0..31 take a[0], b[0], a[1], b[1], ... a[15], b[15]; lanes 32..63 the rest.
  alignas(64) int16_t low[32], high[32];
  for (int i = 0; i < 32; ++i) {
    low[i] = static_cast<int16_t>((i % 2) * 32 + i / 2);
    high[i] = static_cast<int16_t>((i % 2) * 32 + 16 + i / 2);
  }
  const __m512i low_index = _mm512_load_si512(low), high_index = _mm512_load_si512(high);
  for (int64_t t = 0; t < padded / 2; ++t) {
    uint16_t* dst = vp + t * 2 * D;
    const int64_t a_key = 2 * t, b_key = 2 * t + 1;
    for (int64_t d = 0; d < D; d += 32) {
      const __m512i a = a_key < Tk ? _mm512_loadu_si512(v + a_key * v_stride + d)
                                   : _mm512_setzero_si512();
      const __m512i b = b_key < Tk ? _mm512_loadu_si512(v + b_key * v_stride + d)
                                   : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + 2 * d, _mm512_permutex2var_epi16(a, low_index, b));
      _mm512_storeu_si512(dst + 2 * d + 32, _mm512_permutex2var_epi16(a, high_index, b));
    }
  }
}

// Tokens [q0, q0 + Tq) of q attend to tokens [k0, k0 + Tk) of k and v.
struct Sequence {
  int64_t q0, Tq, k0, Tk;
};

at::Tensor rows_contiguous(const at::Tensor& t) {
  // Heads and head_dim contiguous; tokens may be strided (q, k, v split from one projection).
  return t.stride(2) == 1 && t.stride(1) == t.size(2) ? t : t.contiguous();
}

at::Tensor attend(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                  const std::vector<Sequence>& sequences, double scale, double softcap,
                  int64_t window, bool causal) {
  TORCH_CHECK(q_in.dim() == 3 && k_in.dim() == 3 && v_in.dim() == 3,
              "q, k, v must be [tokens, heads, head_dim]");
  TORCH_CHECK(q_in.scalar_type() == at::kBFloat16 && k_in.scalar_type() == at::kBFloat16 &&
                  v_in.scalar_type() == at::kBFloat16,
              "prefill attention takes bfloat16 q, k, v");
  const at::Tensor q = rows_contiguous(q_in), k = rows_contiguous(k_in),
                   v = rows_contiguous(v_in);
  const int64_t H = q.size(1), D = q.size(2), KVH = k.size(1);
  TORCH_CHECK(D == 32 || D == 64 || D == 128,
              "prefill attention takes head_dim 32, 64 or 128, got ", D);
  TORCH_CHECK(H % KVH == 0 && k.size(2) == D && v.sizes() == k.sizes(),
              "prefill attention: mismatched q, k, v shapes");
  at::Tensor out = at::empty({q.size(0), H, D}, q.options());

  // Each sequence's keys and values packed per KV head, padded to whole groups of 16 keys.
  const int64_t num_seqs = static_cast<int64_t>(sequences.size());
  std::vector<int64_t> packed_at(num_seqs + 1, 0);
  for (int64_t b = 0; b < num_seqs; ++b) {
    // Whole groups of 16 keys: the blocks of the online softmax read no group past Tk.
    const int64_t padded = (sequences[b].Tk + 15) / 16 * 16;
    packed_at[b + 1] = packed_at[b] + KVH * padded * D;
  }
  // Reused from call to call (pack_head writes every element, padding included): a
  // fresh allocation this size is fresh pages, faulted in and zeroed at every layer.
  thread_local std::vector<uint16_t> packed;
  if (packed.size() < static_cast<size_t>(2 * packed_at[num_seqs]))
    packed.resize(2 * packed_at[num_seqs]);
  uint16_t* const kp = packed.data();
  uint16_t* const vp = packed.data() + packed_at[num_seqs];
  const auto* qd = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  const auto* kd = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
  const auto* vd = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
  auto* od = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  std::vector<Problem> problems;
  problems.reserve(num_seqs);
  for (int64_t b = 0; b < num_seqs; ++b) {
    const Sequence& seq = sequences[b];
    const int64_t head_packed = (packed_at[b + 1] - packed_at[b]) / KVH;
    problems.push_back(Problem{qd + seq.q0 * q.stride(0), q.stride(0), od + seq.q0 * H * D,
                               kp + packed_at[b], vp + packed_at[b], head_packed,
                               seq.Tq, seq.Tk, H, KVH, D, static_cast<float>(scale),
                               static_cast<float>(softcap), window, causal});
  }
  at::parallel_for(0, num_seqs * KVH, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / KVH, h = i % KVH;
      const Problem& P = problems[b];
      pack_head(kd + sequences[b].k0 * k.stride(0) + h * D,
                vd + sequences[b].k0 * v.stride(0) + h * D, k.stride(0), v.stride(0), P.Tk, D,
                P.head_packed / D, kp + packed_at[b] + h * P.head_packed,
                vp + packed_at[b] + h * P.head_packed);
    }
  });

  // Work items (sequence, query block, KV head), handed out costliest first (the most
  // keys times the most queries) through a shared counter: uneven items (the causal
  // triangle, prompts of mixed lengths) balance over the threads.
  struct Item {
    int64_t seq, t0, n, h, cost;
  };
  std::vector<Item> items;
  for (int64_t b = 0; b < num_seqs; ++b) {
    const Problem& P = problems[b];
    for (int64_t t0 = 0; t0 < P.Tq; t0 += kQueryTokens) {
      const int64_t n = std::min(kQueryTokens, P.Tq - t0);
      const int64_t keys = causal ? P.Tk - P.Tq + t0 + n : P.Tk;
      for (int64_t h = 0; h < KVH; ++h) items.push_back(Item{b, t0, n, h, keys * n});
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const int64_t num_items = static_cast<int64_t>(items.size());
  if (num_items == 0) return out;
  const int64_t G = H / KVH, max_rows = kQueryTokens * G;
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), num_items);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    std::vector<uint16_t> qt(max_rows * D), pb(max_rows * kKeyBlock);
    std::vector<float> s(max_rows * kKeyBlock), o(max_rows * D), m(max_rows),
        l(max_rows * 16);
    for (int64_t index; (index = next.fetch_add(1)) < num_items;) {
      const Item& it = items[index];
      const Problem& P = problems[it.seq];
      if (D == 32)
        attend_block<2>(P, it.h, it.t0, it.n, qt.data(), s.data(), pb.data(), o.data(),
                        m.data(), l.data());
      else if (D == 64)
        attend_block<4>(P, it.h, it.t0, it.n, qt.data(), s.data(), pb.data(), o.data(),
                        m.data(), l.data());
      else
        attend_block<8>(P, it.h, it.t0, it.n, qt.data(), s.data(), pb.data(), o.data(),
                        m.data(), l.data());
    }
  });
  return out;
}

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             double scale, double softcap, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) <= k.size(0),
              "prefill attention: more queries than keys");
  return attend(q, k, v, {Sequence{0, q.size(0), 0, k.size(0)}}, scale, softcap, window, true);
}

at::Tensor varlen_bidirectional(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                at::IntArrayRef cu_seqlens, double scale, double softcap) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0),
              "varlen attention: q and k must hold the same tokens");
  TORCH_CHECK(!cu_seqlens.empty() && cu_seqlens.front() == 0 &&
                  cu_seqlens.back() == q.size(0),
              "varlen attention: cu_seqlens must run from 0 to the number of tokens");
  std::vector<Sequence> sequences;
  for (size_t b = 0; b + 1 < cu_seqlens.size(); ++b) {
    const int64_t start = cu_seqlens[b], len = cu_seqlens[b + 1] - start;
    TORCH_CHECK(len >= 0, "varlen attention: cu_seqlens must not decrease");
    sequences.push_back(Sequence{start, len, start, len});
  }
  return attend(q, k, v, sequences, scale, softcap, 0, false);
}

#else  // no AVX-512 BF16: the Python side never calls this build

at::Tensor prefill_attention(const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                             double, int64_t) {
  TORCH_CHECK(false, "prefill attention was built without AVX-512 BF16");
}

at::Tensor varlen_bidirectional(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                at::IntArrayRef, double, double) {
  TORCH_CHECK(false, "prefill attention was built without AVX-512 BF16");
}

#endif

}  // namespace

TORCH_LIBRARY(plugserve_prefill, m) {
  m.def(
      "attention(Tensor q, Tensor k, Tensor v, float scale, float softcap, int window) -> "
      "Tensor",
      &prefill_attention);
  m.def(
      "varlen_bidirectional(Tensor q, Tensor k, Tensor v, int[] cu_seqlens, float scale, "
      "float softcap) -> Tensor",
      &varlen_bidirectional);
}
