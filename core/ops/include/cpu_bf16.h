// bf16 <-> fp32 for plugserve's CPU kernels, written with integer ops so that loops over
// them vectorize (c10::BFloat16's own conversions go through a NaN branch per element).
// Public (plugserve.ops): kernels built by plugserve.ops.load find it on their include path.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

namespace plugserve {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

inline void store(float* p, float v) { *p = v; }
// Round to nearest even, as torch does.
inline void store(c10::BFloat16* p, float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
  bits += 0x7fffu + ((bits >> 16) & 1u);
  p->x = nan ? uint16_t{0x7fc0} : static_cast<uint16_t>(bits >> 16);
}

}  // namespace plugserve
