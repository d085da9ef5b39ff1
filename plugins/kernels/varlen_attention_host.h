// The host side of the fp32 bidirectional varlen attention kernels (an encoder's step: whole
// prompts side by side, each query attending to every key of its own prompt), shared by
// the AVX-512F build (cpu_varlen_attention_f32.cpp) and the AVX2 one
// (cpu_varlen_attention_f32_avx2.cpp): the checks, each prompt's place in the step, the
// packed keys' buffer, and the work items handed to the threads. Each kernel brings its
// own key packing and its own chunk of queries, in its own vector width.
//
// q [T, H, D], k/v [T, KVH, D] (fp32, H a multiple of KVH, D 32, 64 or 128); the tokens
// [cu_seqlens[b], cu_seqlens[b + 1]) are prompt b's. Scores are scaled, then soft-capped
// (cap * tanh(s / cap)) when softcap > 0.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace plugserve::varlen {

constexpr int64_t kQueryChunk = 64;  // query tokens per work item

struct Prompt {
  const float* q;  // the prompt's first token, head 0
  const float* k;
  const float* v;
  float* out;
  float* kp;  // its keys packed by the kernel's PackKeys, KV head by KV head
  int64_t len;
};

struct Layout {
  int64_t q_stride, k_stride, v_stride, H, KVH, D;
  float scale, softcap;
};

inline at::Tensor rows_contiguous(const at::Tensor& t) {
  // Heads and head_dim contiguous; tokens may be strided (q, k, v split from one projection).
  return t.stride(2) == 1 && t.stride(1) == t.size(2) ? t : t.contiguous();
}

// Checks the inputs, packs every prompt's keys per KV head (pack_keys(k, stride, L, D, kp),
// padded to whole groups of KeyGroup keys) and runs attend(P, lay, h, t0, n, scores) over
// every (prompt, query head, chunk of queries) on torch's threads; `scores` is the thread's
// own buffer, kept from call to call.
template <int64_t KeyGroup, typename PackKeys, typename Attend>
at::Tensor bidirectional(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                         at::IntArrayRef cu_seqlens, double scale, double softcap,
                         const PackKeys& pack_keys, const Attend& attend) {
  TORCH_CHECK(q_in.dim() == 3 && k_in.dim() == 3 && v_in.dim() == 3,
              "q, k, v must be [tokens, heads, head_dim]");
  TORCH_CHECK(q_in.scalar_type() == at::kFloat && k_in.scalar_type() == at::kFloat &&
                  v_in.scalar_type() == at::kFloat,
              "fp32 varlen attention takes float32 q, k, v");
  TORCH_CHECK(q_in.size(0) == k_in.size(0) && k_in.sizes() == v_in.sizes(),
              "varlen attention: q, k and v must hold the same tokens");
  const at::Tensor q = rows_contiguous(q_in), k = rows_contiguous(k_in),
                   v = rows_contiguous(v_in);
  const int64_t H = q.size(1), D = q.size(2), KVH = k.size(1);
  TORCH_CHECK(D == 32 || D == 64 || D == 128,
              "fp32 varlen attention takes head_dim 32, 64 or 128, got ", D);
  TORCH_CHECK(H % KVH == 0 && k.size(2) == D, "varlen attention: mismatched q, k, v shapes");
  TORCH_CHECK(k.stride(0) < (int64_t{1} << 26), "varlen attention: k's token stride is too large");
  TORCH_CHECK(!cu_seqlens.empty() && cu_seqlens.front() == 0 && cu_seqlens.back() == q.size(0),
              "varlen attention: cu_seqlens must run from 0 to the number of tokens");
  at::Tensor out = at::empty({q.size(0), H, D}, q.options());
  const Layout lay{q.stride(0), k.stride(0), v.stride(0), H, KVH, D, static_cast<float>(scale),
                   static_cast<float>(softcap)};
  const auto padded_len = [](int64_t len) { return (len + KeyGroup - 1) / KeyGroup * KeyGroup; };

  // Each prompt's keys packed per KV head, padded to whole groups. Reused from call to
  // call: fresh pages at every layer would be faulted in and zeroed.
  const int64_t num_prompts = static_cast<int64_t>(cu_seqlens.size()) - 1;
  std::vector<int64_t> packed_at(num_prompts + 1, 0);
  for (int64_t b = 0; b < num_prompts; ++b) {
    const int64_t len = cu_seqlens[b + 1] - cu_seqlens[b];
    TORCH_CHECK(len >= 0, "varlen attention: cu_seqlens must not decrease");
    packed_at[b + 1] = packed_at[b] + KVH * padded_len(len) * D;
  }
  thread_local std::vector<float> packed;
  if (packed.size() < static_cast<size_t>(packed_at[num_prompts]))
    packed.resize(packed_at[num_prompts]);
  std::vector<Prompt> prompts;
  for (int64_t b = 0; b < num_prompts; ++b) {
    const int64_t start = cu_seqlens[b];
    prompts.push_back(Prompt{q.data_ptr<float>() + start * q.stride(0),
                             k.data_ptr<float>() + start * k.stride(0),
                             v.data_ptr<float>() + start * v.stride(0),
                             out.data_ptr<float>() + start * H * D,
                             packed.data() + packed_at[b], cu_seqlens[b + 1] - start});
  }
  at::parallel_for(0, num_prompts * KVH, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Prompt& P = prompts[i / KVH];
      const int64_t h = i % KVH;
      pack_keys(P.k + h * D, k.stride(0), P.len, D, P.kp + h * padded_len(P.len) * D);
    }
  });
  // Work items handed out costliest first (queries times keys) through a shared counter,
  // so prompts of mixed lengths balance over the threads.
  struct Item {
    int64_t prompt, h, t0, n, cost;
  };
  std::vector<Item> items;
  for (int64_t b = 0; b < static_cast<int64_t>(prompts.size()); ++b)
    for (int64_t t0 = 0; t0 < prompts[b].len; t0 += kQueryChunk) {
      const int64_t n = std::min(kQueryChunk, prompts[b].len - t0);
      for (int64_t h = 0; h < H; ++h) items.push_back(Item{b, h, t0, n, n * prompts[b].len});
    }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const int64_t num_items = static_cast<int64_t>(items.size());
  if (num_items == 0) return out;
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), num_items);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    thread_local std::vector<float> scores;  // kept from call to call, as `packed` is
    for (int64_t index; (index = next.fetch_add(1)) < num_items;) {
      const Item& it = items[index];
      attend(prompts[it.prompt], lay, it.h, it.t0, it.n, scores);
    }
  });
  return out;
}

}  // namespace plugserve::varlen
