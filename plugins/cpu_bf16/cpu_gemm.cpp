// Registers cpu_gemm.h's bf16 matmul as torch.ops.plugserve_gemm.linear_bf16, and the
// exponent coding of its packed weights; built and loaded by cpu_features.py. Only where
// the CPU has AVX512_BF16 (else it registers nothing).
#include <torch/library.h>

#include "cpu_gemm.h"

#ifdef PLUGSERVE_HAS_BF16_GEMM

namespace {

// packed [N/16, K/2, 16, 2] bf16 → out, uint8 [N/16, coded_block_bytes(K/2)]: the
// exponent-coded copy that one-row matmuls read (the layout is in cpu_gemm.h).
void code_exponents(const at::Tensor& packed, at::Tensor out) {
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous() && packed.size(2) == 16 &&
                  packed.size(3) == 2 && packed.scalar_type() == at::kBFloat16,
              "packed must be bfloat16 [N/16, K/2, 16, 2] from weight_arena.pack_k_pairs");
  const int64_t blocks = packed.size(0), pairs = packed.size(1);
  const int64_t record = plugserve::coded_block_bytes(pairs);
  TORCH_CHECK(pairs % 2 == 0, "a coded weight needs K divisible by 4, not ", 2 * pairs);
  TORCH_CHECK(out.scalar_type() == at::kByte && out.is_contiguous() &&
                  out.numel() == blocks * record,
              "out must be contiguous uint8 [N/16, ", record, "]");
  const auto* weights = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  uint8_t* coded = out.data_ptr<uint8_t>();
  at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) {
      const uint16_t* w = weights + b * pairs * 32;
      uint8_t* dst = coded + b * record;
      bool used[256] = {};
      for (int64_t i = 0; i < pairs * 32; ++i) used[(w[i] >> 7) & 0xff] = true;
      uint8_t index[256] = {};
      uint16_t table[32] = {};
      int count = 0;
      for (int e = 0; e < 256; ++e) {
        if (!used[e]) continue;
        if (count < 16) table[count] = static_cast<uint16_t>(e << 7);
        index[e] = static_cast<uint8_t>(count++);
      }
      std::memset(dst, 0, record);
      if (count > 16) {  // its first k-pairs plain, the rest read from the packed weight
        table[0] = plugserve::kUncodedBlock;
        std::memcpy(dst, table, sizeof(uint16_t));
        std::memcpy(dst + plugserve::kCodedTableBytes, w,
                    plugserve::uncoded_pairs_in_record(pairs) * plugserve::kPairBytes);
        continue;
      }
      for (int i = 16; i < 32; ++i) table[i] = table[i - 16];
      std::memcpy(dst, table, sizeof(table));
      uint8_t* group = dst + plugserve::kCodedTableBytes;
      for (int64_t kp = 0; kp < pairs; kp += 2, group += plugserve::kCodedGroupBytes) {
        for (int j = 0; j < 32; ++j) {
          const uint16_t a = w[kp * 32 + j], c = w[(kp + 1) * 32 + j];
          group[j] = static_cast<uint8_t>(index[(a >> 7) & 0xff] | index[(c >> 7) & 0xff] << 4);
          group[32 + j] = static_cast<uint8_t>((a & 0x7f) << 1 | a >> 15);
          group[64 + j] = static_cast<uint8_t>((c & 0x7f) << 1 | c >> 15);
        }
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY(plugserve_gemm, m) {
  m.def(
      "linear_bf16(Tensor x, Tensor packed, int out_features, Tensor? bias, "
      "ScalarType? out_dtype=None, Tensor? coded=None, int one_row_mode=0) -> Tensor");
  m.def("code_exponents(Tensor packed, Tensor(a!) out) -> ()");
  m.def("amx_available() -> bool", &plugserve::amx_available);
}

TORCH_LIBRARY_IMPL(plugserve_gemm, CPU, m) {
  m.impl("linear_bf16", &plugserve::linear_bf16);
  m.impl("code_exponents", &code_exponents);
}

#endif
