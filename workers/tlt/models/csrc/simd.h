// Eight-float vectors for the CPU kernels (GCC/Clang vector extensions; FMA where the CPU has it).
#pragma once

#include <cstdint>
#include <cstring>
#ifdef __FMA__
#include <immintrin.h>
#endif

namespace tlt {

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

inline v8 load8(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// eight bfloat16 values (their bits) widened to float32 exactly: bfloat16 is float32's top half
inline v8 load8(const uint16_t* p) {
  typedef uint16_t v8h __attribute__((vector_size(16)));
  v8h h;
  std::memcpy(&h, p, sizeof h);
  const v8i bits = __builtin_convertvector(h, v8i) << 16;
  v8 v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

inline void store8(float* p, v8 v) { std::memcpy(p, &v, sizeof v); }

inline v8 splat(float x) { return v8{x, x, x, x, x, x, x, x}; }

inline v8 madd(v8 acc, v8 a, v8 b) {
#ifdef __FMA__
  return (v8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)acc);
#else
  return acc + a * b;  // compiled the same way at every call site
#endif
}

}  // namespace tlt
