// bf16 matmul on AVX-512-BF16 CPUs: out = x @ W.T (+ bias), for any number of rows.
//
// A decode step's matmuls are bound by reading the weights, yet oneDNN reads them well
// below the memory bandwidth at decode sizes. Here each thread streams its own slice of the
// packed weight once, and every 64-byte load feeds all the rows' VDPBF16PS accumulators
// held in registers (against oneDNN: docs/benchmarks-history.md, "bf16 CPU kernels by row
// count").
//
// Packed layout (weight_arena.py builds it): [N/16 blocks][K/2 pairs][16 columns][2]: one
// 64-byte vector holds a pair of consecutive k for 16 output columns, as VDPBF16PS takes
// it. Rows are done 8 at a time against 3 column blocks (24 accumulators); further row
// chunks re-read the tile's weights from cache, not memory, while the next tile's stream in.
//
// One row (a batch-1 decode step) is a pure weight stream and runs its own loop: one block
// at a time with four accumulators over alternating k-pairs (one would wait on the
// previous VDPBF16PS). Threads split the work into contiguous shares and take what is left
// of each other's at the end (for_each_item). The weights lie on huge pages
// (weight_arena.WeightArena), which streams them faster.
//
// Which one-row loop is fastest depends on the CPU, so the caller picks it (OneRowMode,
// chosen by measurement in kernel_choice.py): the stream's prefetches non-temporal (NTA:
// the caches kept for the step's Python) or into all levels (T0: where a large L3 holds
// much of the model); or no stream at all, one row through the tile kernel.
//
// One row can also read a lossless exponent-coded copy of the weight (row_block_coded), 12
// bits a weight instead of 16: a trained model's bf16 weights use few exponents, and one
// block's 16 columns rarely more than 16 of them. Decoded in registers to the same bf16
// vectors and summed in the same order, it gives the plain kernel's results bit for bit.
//
// cpu_gemm.cpp registers linear_bf16 as torch.ops.plugserve_gemm.linear_bf16 (built and
// loaded by cpu_features.py); cpu_decoder.cpp calls it inside its fused stretch. Defined
// only where the CPU has AVX512_BF16 (PLUGSERVE_HAS_BF16_GEMM).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define PLUGSERVE_HAS_BF16_GEMM 1
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

#include "row_pool.h"

namespace plugserve {


constexpr int64_t kRowTile = 8;
constexpr int64_t kBlockTile = 3;  // 16-column blocks per tile
constexpr int64_t kPairBytes = 64;  // one k-pair of one block

// 16 fp32 sums into the output, masked: rounded to bf16, or kept in fp32 (the LM head's
// logits, which the sampler reads in fp32 anyway).
inline void store16(uint16_t* out, __mmask16 mask, __m512 sum) {
  _mm256_mask_storeu_epi16(out, mask, (__m256i)_mm512_cvtneps_pbh(sum));
}
inline void store16(float* out, __mmask16 mask, __m512 sum) { _mm512_mask_storeu_ps(out, mask, sum); }

template <int M, int NB, typename Out>
void tile(const uint16_t* x, int64_t x_stride, const uint16_t* w, int64_t block_stride,
          int64_t pairs, const float* bias, Out* out, int64_t out_stride, int64_t n0,
          int64_t n, const char* ahead, int64_t ahead_lines, int64_t ahead_per_pair) {
  __m512 acc[M][NB];
  for (int m = 0; m < M; ++m)
    for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < pairs; ++kp) {
    __m512i wv[NB];
    for (int b = 0; b < NB; ++b) {
      const uint16_t* p = w + b * block_stride + kp * 32;
      wv[b] = _mm512_loadu_si512(p);
      _mm_prefetch(reinterpret_cast<const char*>(p) + 16 * kPairBytes, _MM_HINT_T0);
    }
    // This k-pair's share of the next tile's lines that this chunk streams in.
    const int64_t ahead_stop = std::min(ahead_lines, (kp + 1) * ahead_per_pair);
    for (int64_t line = kp * ahead_per_pair; line < ahead_stop; ++line)
      _mm_prefetch(ahead + line * kPairBytes, _MM_HINT_T0);
    for (int m = 0; m < M; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * x_stride + 2 * kp, sizeof(pair));
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_dpbf16_ps(acc[m][b], xb, (__m512bh)wv[b]);
    }
  }
  for (int b = 0; b < NB; ++b) {
    const int64_t col = n0 + b * 16;
    const int64_t valid = std::min<int64_t>(16, n - col);
    const __mmask16 mask = valid >= 16 ? __mmask16(0xffff) : __mmask16((1u << valid) - 1);
    const __m512 bias_v = bias ? _mm512_maskz_loadu_ps(mask, bias + col) : _mm512_setzero_ps();
    for (int m = 0; m < M; ++m)
      store16(out + m * out_stride + col, mask, _mm512_add_ps(acc[m][b], bias_v));
  }
}

// A row's four chains summed (+ bias) into its 16 outputs. Not inlined: under -ffast-math
// the compiler may regroup these sums differently in each caller, and the plain and the
// coded blocks must give the same bits.
template <typename Out>
__attribute__((noinline)) void finish_row(const __m512 (&acc)[4], const float* bias, void* out,
                                          int64_t col, int64_t n) {
  __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
  const int64_t valid = std::min<int64_t>(16, n - col);
  const __mmask16 mask = valid >= 16 ? __mmask16(0xffff) : __mmask16((1u << valid) - 1);
  if (bias) sum = _mm512_add_ps(sum, _mm512_maskz_loadu_ps(mask, bias + col));
  store16(static_cast<Out*>(out) + col, mask, sum);
}

// One row against one 16-column block: out[col:col+16] = x . W_block (+ bias); `out` is
// Out (uint16_t: bf16, or float) behind the pool's untyped pointer.
// How a one-row matmul runs (see the top of this file).
// kAmx is not a one-row mode: every row count runs cpu_gemm_amx.h's tiles.
enum OneRowMode : int64_t { kStreamNonTemporal = 0, kStreamCached = 1, kTiled = 2, kAmx = 3 };

// A one-row stream's prefetch: into every cache level, or non-temporal.
template <bool Cached>
inline void stream_prefetch(const char* p) {
  if constexpr (Cached) {
    _mm_prefetch(p, _MM_HINT_T0);
  } else {
    _mm_prefetch(p, _MM_HINT_NTA);
  }
}

// One k-pair of one row into a chain: x's pair kp broadcast against the 64-byte vector w.
inline __m512 dot_pair(__m512 sum, const uint16_t* x, int64_t kp, __m512i w) {
  int32_t pair;
  std::memcpy(&pair, x + 2 * kp, sizeof(pair));
  return _mm512_dpbf16_ps(sum, (__m512bh)_mm512_set1_epi32(pair), (__m512bh)w);
}

template <typename Out, bool Cached>
void row_block(const uint16_t* x, const uint16_t* w, int64_t pairs, const float* bias,
               void* out, int64_t col, int64_t n) {
  constexpr int kChains = 4;
  constexpr int64_t kPrefetchPairs = 32;  // 2 KB ahead in this block's stream
  __m512 acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm512_setzero_ps();
  int64_t kp = 0;
  for (; kp + kChains <= pairs; kp += kChains) {
    for (int c = 0; c < kChains; ++c) {
      const uint16_t* p = w + (kp + c) * 32;
      // Non-temporal: each weight line is read once a step, and a batch-1 step streams the
      // whole model through the caches. Fetched as T0 they evicted everything the step's
      // Python, numpy and small ops touch between matmuls; with NTA a step is faster where
      // the caches are small. The batched tiles keep T0: each reads its weight tile once
      // per 8 rows.
      stream_prefetch<Cached>(reinterpret_cast<const char*>(p) + kPrefetchPairs * kPairBytes);
      acc[c] = dot_pair(acc[c], x, kp + c, _mm512_loadu_si512(p));
    }
  }
  for (; kp < pairs; ++kp) acc[0] = dot_pair(acc[0], x, kp, _mm512_loadu_si512(w + kp * 32));
  finish_row<Out>(acc, bias, out, col, n);
}

// The exponent-coded copy of a packed weight (exponent_coding.code_exponents builds it), one
// record of coded_block_bytes(pairs) per 16-column block:
//   table: 32 uint16, each an exponent already shifted into place (e << 7); entries 16-31
//          repeat 0-15, so an index's fifth bit (the next nibble's low bit) is ignored.
//          A first entry of kUncodedBlock marks a block whose columns use more than 16
//          exponents: it is read from the plain packed weight instead.
//   then per two k-pairs, 96 bytes: 32 codes (byte j: lane j's exponent index for the
//          first pair in its low nibble, for the second in its high), and for each pair
//          the 32 lanes' (mantissa << 1 | sign) bytes.
// Lane j is word j of the plain layout's 64-byte vector, so decoding gives that vector.
// An uncoded block's record holds, after its marked table, the block's first
// uncoded_pairs_in_record(pairs) plain 64-byte k-pair vectors, and the kernel reads only the
// rest from the plain packed weight: with an empty record the one-row stream would prefetch
// nothing useful ahead of the block and read all of it cold from elsewhere, and the few
// uncoded blocks would take far more than their share of the time.
constexpr int64_t kCodedTableBytes = 64;
constexpr int64_t kCodedGroupBytes = 96;  // two k-pairs
constexpr uint16_t kUncodedBlock = 0xffff;  // no shifted exponent has bit 15 set

constexpr int64_t coded_block_bytes(int64_t pairs) {
  return kCodedTableBytes + pairs / 2 * kCodedGroupBytes;
}

// A multiple of 4, so that row_block's chains see the same k-pairs in the same order.
constexpr int64_t uncoded_pairs_in_record(int64_t pairs) {
  return pairs / 2 * kCodedGroupBytes / kPairBytes / 4 * 4;
}

// 32 lanes' (mantissa << 1 | sign) bytes and their shifted exponents → the bf16 vector.
inline __m512i decode_lanes(const uint8_t* sign_mantissa, __m512i exponent) {
  const __m512i sm = _mm512_cvtepu8_epi16(_mm256_loadu_si256(
      reinterpret_cast<const __m256i*>(sign_mantissa)));
  // mantissa | sign << 15 | exponent (0xfe: a | b | c)
  return _mm512_ternarylogic_epi32(_mm512_srli_epi16(sm, 1), _mm512_slli_epi16(sm, 15),
                                   exponent, 0xfe);
}

// row_block over a coded block (pairs even), the same k-pairs to the same chains.
template <typename Out, bool Cached>
void row_block_coded(const uint16_t* x, const uint8_t* block, int64_t pairs, const float* bias,
                     void* out, int64_t col, int64_t n) {
  // Further ahead than row_block's 2 KB: the distance that read the coded stream fastest
  // (docs/benchmarks-history.md, "bf16 CPU kernels by row count").
  constexpr int64_t kPrefetchBytes = 6144;
  const __m512i table = _mm512_loadu_si512(block);
  const uint8_t* groups = block + kCodedTableBytes;
  __m512 acc[4];
  for (auto& a : acc) a = _mm512_setzero_ps();
  // Two k-pairs a group, to chains (c, c + 1); row_block's tail (pairs % 4) goes to chain 0.
  const auto group = [&](int64_t kp, int c0, int c1) {
    const uint8_t* g = groups + kp / 2 * kCodedGroupBytes;
    stream_prefetch<Cached>(reinterpret_cast<const char*>(g) + kPrefetchBytes);
    stream_prefetch<Cached>(reinterpret_cast<const char*>(g) + kPrefetchBytes + 64);
    const __m512i codes =
        _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g)));
    const __m512i first = _mm512_permutexvar_epi16(codes, table);
    const __m512i second = _mm512_permutexvar_epi16(_mm512_srli_epi16(codes, 4), table);
    acc[c0] = dot_pair(acc[c0], x, kp, decode_lanes(g + 32, first));
    acc[c1] = dot_pair(acc[c1], x, kp + 1, decode_lanes(g + 64, second));
  };
  int64_t kp = 0;
  for (; kp + 4 <= pairs; kp += 4) {
    group(kp, 0, 1);
    group(kp + 2, 2, 3);
  }
  for (; kp < pairs; kp += 2) group(kp, 0, 0);
  finish_row<Out>(acc, bias, out, col, n);
}

// row_block over an uncoded block of a coded weight: its first k-pairs from its record (the
// coded stream, whose prefetch runs on into the next record), the rest from the plain
// packed weight `w`, prefetched while the first part is summed. The same k-pairs go to the
// same chains in the same order as in row_block, so the sums are its bits.
template <typename Out, bool Cached>
void row_block_uncoded(const uint16_t* x, const uint8_t* record, const uint16_t* w,
                       int64_t pairs, const float* bias, void* out, int64_t col, int64_t n) {
  constexpr int kChains = 4;
  constexpr int64_t kPrefetchBytes = 6144;  // row_block_coded's distance in the same stream
  const int64_t in_record = uncoded_pairs_in_record(pairs);
  const auto* head = reinterpret_cast<const uint16_t*>(record + kCodedTableBytes);
  const char* rest = reinterpret_cast<const char*>(w + in_record * 32);
  const int64_t rest_lines = pairs - in_record;  // a line a k-pair
  int64_t rest_fetched = 0;
  __m512 acc[kChains];
  for (auto& a : acc) a = _mm512_setzero_ps();
  const auto dot = [&](int c, int64_t kp, const uint16_t* p) {
    acc[c] = dot_pair(acc[c], x, kp, _mm512_loadu_si512(p));
  };
  // The record's stream runs on at a line a k-pair, from first to last, into the next record.
  const char* ahead = reinterpret_cast<const char*>(head) + kPrefetchBytes;
  int64_t kp = 0;
  for (; kp + kChains <= in_record; kp += kChains) {
    for (int c = 0; c < kChains; ++c) {
      stream_prefetch<Cached>(ahead + (kp + c) * kPairBytes);
      if (rest_fetched < rest_lines) stream_prefetch<Cached>(rest + rest_fetched++ * kPairBytes);
      dot(c, kp + c, head + (kp + c) * 32);
    }
  }
  for (; kp + kChains <= pairs; kp += kChains) {
    for (int c = 0; c < kChains; ++c) {
      stream_prefetch<Cached>(ahead + (kp + c) * kPairBytes);
      dot(c, kp + c, w + (kp + c) * 32);
    }
  }
  for (; kp < pairs; ++kp) dot(0, kp, w + kp * 32);
  finish_row<Out>(acc, bias, out, col, n);
}

// A one-row matmul as a RowPool job: item b is block b's 16 outputs (fewer in the last).
struct RowArgs {
  const uint16_t* x;
  const uint16_t* w;
  int64_t block_stride, pairs;
  const float* bias;
  int64_t n;
  const uint8_t* coded;  // the weight's exponent-coded copy, or nullptr
};

template <typename Out, bool Cached>
void row_item(const void* args, int64_t b, void* out) {
  const auto& a = *static_cast<const RowArgs*>(args);
  const float* bias = a.bias ? a.bias + b * 16 : nullptr;
  const int64_t n = std::min<int64_t>(16, a.n - b * 16);
  if (a.coded != nullptr) {
    const uint8_t* block = a.coded + b * coded_block_bytes(a.pairs);
    uint16_t first_entry;
    std::memcpy(&first_entry, block, sizeof(first_entry));
    if (first_entry != kUncodedBlock) {
      row_block_coded<Out, Cached>(a.x, block, a.pairs, bias, out, 0, n);
    } else {
      row_block_uncoded<Out, Cached>(a.x, block, a.w + b * a.block_stride, a.pairs, bias, out,
                                     0, n);
    }
    return;
  }
  row_block<Out, Cached>(a.x, a.w + b * a.block_stride, a.pairs, bias, out, 0, n);
}

template <typename Out>
using TileFn = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, int64_t,
                        const float*, Out*, int64_t, int64_t, int64_t, const char*, int64_t,
                        int64_t);

template <int M, typename Out>
constexpr TileFn<Out> pick(int64_t nb) {
  return nb == 1 ? tile<M, 1, Out> : nb == 2 ? tile<M, 2, Out> : tile<M, 3, Out>;
}

template <typename Out>
TileFn<Out> tile_for(int64_t rows, int64_t blocks) {
  switch (rows) {
    case 1: return pick<1, Out>(blocks);
    case 2: return pick<2, Out>(blocks);
    case 3: return pick<3, Out>(blocks);
    case 4: return pick<4, Out>(blocks);
    case 5: return pick<5, Out>(blocks);
    case 6: return pick<6, Out>(blocks);
    case 7: return pick<7, Out>(blocks);
    default: return pick<8, Out>(blocks);
  }
}

// Runs work(i) for every i in [0, items) on torch's threads. Each thread works its own
// contiguous share front to back, so that its weight reads form one sequential stream (runs
// taken from a shared counter interleave the threads' streams, slower at one row).
// A thread done with its share then takes items one at a time from the back of a share
// still being worked: when the API server or the client takes one of two cores for a
// moment, the other thread finishes the matmul instead of waiting for it at the barrier.
// A share's unclaimed items [front, end) are one 64-bit word, so owner and thief claim
// through one compare-and-swap and never take the same item.
class ItemShares {
 public:
  static constexpr int64_t kMaxThreads = 256;

  ItemShares(int64_t items, int64_t threads) {
    for (int64_t t = 0; t < threads; ++t)
      shares_[t].range.store(pack(items * t / threads, items * (t + 1) / threads),
                             std::memory_order_relaxed);
  }

  // The next item of share t from its front (the owner) or its back (a thief); -1 when
  // none is left.
  int64_t claim(int64_t t, bool from_front) {
    std::atomic<uint64_t>& range = shares_[t].range;
    uint64_t current = range.load(std::memory_order_relaxed);
    while (true) {
      const uint64_t front = current & 0xffffffffu, end = current >> 32;
      if (front >= end) return -1;
      const uint64_t next = from_front ? pack(front + 1, end) : pack(front, end - 1);
      if (range.compare_exchange_weak(current, next, std::memory_order_relaxed))
        return static_cast<int64_t>(from_front ? front : end - 1);
    }
  }

 private:
  static uint64_t pack(uint64_t front, uint64_t end) { return front | (end << 32); }

  struct alignas(64) Share {
    std::atomic<uint64_t> range;
  };
  Share shares_[kMaxThreads];
};

template <typename Work>
void for_each_item(int64_t items, const Work& work) {
  const int64_t threads = std::clamp<int64_t>(
      std::min<int64_t>(at::get_num_threads(), items), 1, ItemShares::kMaxThreads);
  if (threads == 1) {
    for (int64_t i = 0; i < items; ++i) work(i);
    return;
  }
  ItemShares shares(items, threads);
  at::parallel_for(0, threads, 1, [&](int64_t first_thread, int64_t end_thread) {
    for (int64_t t = first_thread; t < end_thread; ++t) {
      for (int64_t i = shares.claim(t, true); i >= 0; i = shares.claim(t, true)) work(i);
      for (int64_t k = 1; k < threads; ++k) {
        const int64_t victim = (t + k) % threads;
        for (int64_t i = shares.claim(victim, false); i >= 0; i = shares.claim(victim, false))
          work(i);
      }
    }
  });
}

template <typename Out>
void linear_rows(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                 const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& coded,
                 int64_t one_row_mode, at::Tensor& out) {
  const int64_t rows = x.size(0), pairs = packed.size(1), blocks = packed.size(0);
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  auto* op = reinterpret_cast<Out*>(out.data_ptr());
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const int64_t block_stride = pairs * 32, x_stride = x.stride(0);
  if (rows == 1 && one_row_mode != kTiled) {
    const RowArgs args{xp, wp, block_stride, pairs, bp, out_features,
                       coded.has_value() ? coded->data_ptr<uint8_t>() : nullptr};
    const auto item =
        one_row_mode == kStreamCached ? &row_item<Out, true> : &row_item<Out, false>;
    RowPool* pool = at::get_num_threads() > 1 ? lookup_row_pool() : nullptr;
    if (pool != nullptr && pool->enabled()) {
      const int64_t last = out_features - (blocks - 1) * 16;
      pool->run(RowPool::make_job(item, args, blocks, op, 16 * sizeof(Out),
                                  last * sizeof(Out),
                                  {x, packed, bias.has_value() ? *bias : at::Tensor(),
                                   coded.has_value() ? *coded : at::Tensor()}));
    } else {
      for_each_item(blocks, [&](int64_t b) { item(&args, b, op + b * 16); });
    }
    return;
  }
  const int64_t tiles = (blocks + kBlockTile - 1) / kBlockTile;
  const int64_t chunks = (rows + kRowTile - 1) / kRowTile;
  for_each_item(tiles, [&](int64_t t) {
    const int64_t b0 = t * kBlockTile, nb = std::min(kBlockTile, blocks - b0);
    // While this tile's rows compute, the next tile's weights (contiguous after this one's,
    // a line per block and k-pair) stream in, spread over the row chunks: a thread's
    // memory reads then overlap the chunks that compute from cache instead of alternating
    // with them. One chunk (up to 8 rows) is a stream of its own tile only.
    const char* next = reinterpret_cast<const char*>(wp + (b0 + nb) * block_stride);
    const int64_t next_lines = chunks > 1 ? std::min(kBlockTile, blocks - b0 - nb) * pairs : 0;
    const int64_t per_pair = (next_lines + chunks * pairs - 1) / (chunks * pairs);
    for (int64_t r = 0, c = 0; r < rows; r += kRowTile, ++c) {
      const int64_t m = std::min(kRowTile, rows - r);
      const int64_t first = std::min(next_lines, c * per_pair * pairs);  // this chunk's lines
      tile_for<Out>(m, nb)(xp + r * x_stride, x_stride, wp + b0 * block_stride, block_stride,
                           pairs, bp, op + r * out_features, out_features, b0 * 16,
                           out_features, next + first * kPairBytes,
                           std::min(next_lines - first, per_pair * pairs), per_pair);
    }
  });
}

}  // namespace plugserve

#include "cpu_gemm_amx.h"

namespace plugserve {

// Whether linear_bf16 can run kAmx here: built for AMX-BF16 and allowed by the kernel.
inline bool amx_available() {
#ifdef PLUGSERVE_HAS_AMX_GEMM
  return amx_usable();
#else
  return false;
#endif
}

// Checks a step's one_row_mode (OneRowMode), which its kernel plan gives the step's row
// count, for an op that runs many linears in it (the fused decoder's and encoder's).
inline void check_step_mode(int64_t mode) {
  TORCH_CHECK(mode >= kStreamNonTemporal && mode <= kAmx, "mode must be a plugserve::OneRowMode");
  TORCH_CHECK(mode != kAmx || amx_available(),
              "mode kAmx needs AMX tiles, which this CPU or build lacks");
}

// The mode a packed weight runs a step's mode in: AMX tiles need K divisible by 32, and a
// weight that is not runs the vector kernel, as packed_linear.PackedLinear runs it alone.
inline int64_t mode_for(const at::Tensor& packed, int64_t mode) {
  return mode == kAmx && packed.size(1) % 16 != 0 ? kStreamNonTemporal : mode;
}

// x [rows, K] bf16 @ the packed weight (+ bias) → [rows, out_features], in bf16 or, with
// out_dtype float32, the fp32 sums unrounded. `coded`, the weight's exponent-coded copy
// where it has one, is what a single row reads instead, unless one_row_mode (OneRowMode)
// runs that row through the tile kernel.
inline at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                              const c10::optional<at::Tensor>& bias,
                              c10::optional<at::ScalarType> out_dtype = c10::nullopt,
                              const c10::optional<at::Tensor>& coded = c10::nullopt,
                              int64_t one_row_mode = kStreamNonTemporal) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kBFloat16,
              "x must be bfloat16 [rows, in_features] with a dense last dim");
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous() && packed.size(2) == 16 &&
                  packed.size(3) == 2 && packed.scalar_type() == at::kBFloat16,
              "packed must be bfloat16 [N/16, K/2, 16, 2] from weight_arena.pack_k_pairs");
  const int64_t pairs = packed.size(1), blocks = packed.size(0);
  TORCH_CHECK(x.size(1) == 2 * pairs, "x has ", x.size(1), " features, the weight ",
              2 * pairs);
  TORCH_CHECK(out_features > (blocks - 1) * 16 && out_features <= blocks * 16,
              "out_features does not match the packed weight");
  if (bias.has_value())
    TORCH_CHECK(bias->numel() == out_features && bias->is_contiguous() &&
                    bias->scalar_type() == at::kFloat,
                "bias must be contiguous float32 [out_features]");
  if (coded.has_value())
    TORCH_CHECK(pairs % 2 == 0 && coded->scalar_type() == at::kByte && coded->is_contiguous() &&
                    coded->numel() == blocks * coded_block_bytes(pairs),
                "coded must be uint8 [N/16, coded_block_bytes] from exponent_coding.code_exponents");
  TORCH_CHECK(one_row_mode >= kStreamNonTemporal && one_row_mode <= kAmx,
              "one_row_mode must be 0 (stream, non-temporal), 1 (stream, cached), 2 (tiled) "
              "or 3 (AMX tiles for every row count)");
  TORCH_CHECK(one_row_mode != kAmx || (amx_available() && pairs % 16 == 0),
              "AMX tiles need an AMX-BF16 CPU the kernel lets use them and K divisible by 32");
  const at::ScalarType dtype = out_dtype.value_or(at::kBFloat16);
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat,
              "out_dtype must be bfloat16 or float32");
  at::Tensor out = at::empty({x.size(0), out_features}, x.options().dtype(dtype));
#ifdef PLUGSERVE_HAS_AMX_GEMM
  if (one_row_mode == kAmx) {
    const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
    const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
    const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
    if (dtype == at::kFloat) {
      linear_rows_amx<float>(xp, x.stride(0), x.size(0), wp, blocks, pairs, bp,
                             out.data_ptr<float>(), out_features);
    } else {
      linear_rows_amx<uint16_t>(xp, x.stride(0), x.size(0), wp, blocks, pairs, bp,
                                reinterpret_cast<uint16_t*>(out.data_ptr()), out_features);
    }
    return out;
  }
#endif
  if (dtype == at::kFloat) {
    linear_rows<float>(x, packed, out_features, bias, coded, one_row_mode, out);
  } else {
    linear_rows<uint16_t>(x, packed, out_features, bias, coded, one_row_mode, out);
  }
  return out;
}

}  // namespace plugserve

#endif
