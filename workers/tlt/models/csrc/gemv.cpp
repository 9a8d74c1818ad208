// Few-row float32 products y = x W^T for CPU decode steps and verify passes (models/cpu_kernels.py).
//
// A decode step reads every weight once for one row, so it is bound by how fast the weights stream
// from memory; a verify pass multiplies the same weights into a few rows. The weight is packed once
// into blocks of NB consecutive outputs, each block [in, NB] contiguous, so a thread streams its
// blocks front to back. Within a block, up to RB input rows share each loaded weight vector (the
// usual broadcast-x, vector-of-outputs micro-kernel), so a few rows cost little more than one.
//
// Row invariance by construction: every output element is one fused multiply-add chain along the
// input, in input order, from zero. Which rows or outputs share its tile never changes its
// arithmetic, so a row gets the same bits alone (a decode step) as beside others (a verify pass).
//
// The packed weight may also be bfloat16 (a drafter's copy: half the bytes to stream, widened to
// float32 exactly in registers; x, the sums and y stay float32). Only a drafter uses that: its
// weights then differ from its float32 ones by bfloat16's rounding, which changes what it
// proposes, never what verification accepts.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "simd.h"

namespace {

using namespace tlt;

constexpr int64_t NB = 16;  // outputs per block: two vectors
// input rows per tile: RB * 2 accumulators + 2 weights + 1 broadcast fit the vector registers (16;
// 32 with AVX-512, whose ymm16-31 the compiler uses under -march=native). 12 rows in one tile rather
// than 6 + 6 (a 2-row tail verifying 5-token drafts): 8 rows over 553 MB of weights on one AVX-512
// EPYC thread took 38 ms in one tile against 50 in two, 12 rows 48 against 53
#ifdef __AVX512VL__
constexpr int RB = 12;
#else
constexpr int RB = 6;
#endif
// How far ahead of the tile a block's weights are prefetched. The hardware prefetcher alone left a
// tile of several rows waiting on memory, then computing, not both at once: on 2 AVX-512 EPYC cores
// 6 rows through 553 MB of weights took 49 ms on one thread against 28 for one row; prefetching
// 1 KB ahead (16 of a float32 block's 64-byte steps) made it 32 (the bits are the same).
constexpr int64_t PREFETCH_BYTES = 1024;

// R input rows (stride n) by one packed block [n, NB] -> y (row stride ldy), `valid` outputs stored
template <int R, typename W>
inline void tile(const float* x, const W* wb, int64_t n, float* y, int64_t ldy, int64_t valid) {
  v8 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = v8{};
  for (int64_t i = 0; i < n; ++i) {
    __builtin_prefetch(reinterpret_cast<const char*>(wb + i * NB) + PREFETCH_BYTES, 0, 0);  // never faults
    const v8 w0 = load8(wb + i * NB), w1 = load8(wb + i * NB + 8);
    for (int r = 0; r < R; ++r) {
      const float xi = x[r * n + i];
      const v8 xb = splat(xi);
      acc[r][0] = madd(acc[r][0], xb, w0);
      acc[r][1] = madd(acc[r][1], xb, w1);
    }
  }
  for (int r = 0; r < R; ++r) {
    float out[NB];
    std::memcpy(out, &acc[r][0], sizeof acc[r][0]);
    std::memcpy(out + 8, &acc[r][1], sizeof acc[r][1]);
    std::memcpy(y + r * ldy, out, valid * sizeof(float));
  }
}

template <int R, typename W>
inline void rest(const float* x, const W* wb, int64_t n, float* y, int64_t ldy, int64_t valid, int64_t rows) {
  if constexpr (R > 0) {
    if (rows == R) return tile<R>(x, wb, n, y, ldy, valid);
    rest<R - 1>(x, wb, n, y, ldy, valid, rows);
  }
}

// y [rows, out] = x [rows, n] @ W^T from the packed blocks of W
template <typename W>
void product(const float* xp, const W* wp, int64_t rows, int64_t n, int64_t out, int64_t blocks, float* yp) {
  at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const W* wb = wp + b * n * NB;
      const int64_t valid = std::min(NB, out - b * NB);
      int64_t r = 0;
      for (; r + RB <= rows; r += RB) tile<RB>(xp + r * n, wb, n, yp + r * out + b * NB, out, valid);
      if (r < rows) rest<RB - 1>(xp + r * n, wb, n, yp + r * out + b * NB, out, valid, rows - r);
    }
  });
}

}  // namespace

torch::Tensor pack(const torch::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16) &&
              w.device().is_cpu(), "pack: a float32 or bfloat16 CPU [out, in]");
  const int64_t out = w.size(0), n = w.size(1), blocks = (out + NB - 1) / NB;
  auto padded = torch::zeros({blocks * NB, n}, w.options());
  padded.narrow(0, 0, out).copy_(w);
  return padded.view({blocks, NB, n}).transpose(1, 2).contiguous();  // [blocks, in, NB]
}

torch::Tensor gemv(const torch::Tensor& x, const torch::Tensor& packed, int64_t out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(), "gemv: float32 CPU x [rows, in]");
  const bool bf16 = packed.scalar_type() == at::kBFloat16;
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == NB && packed.size(1) == x.size(1) && packed.is_contiguous() &&
              (bf16 || packed.scalar_type() == at::kFloat) && (out + NB - 1) / NB == packed.size(0),
              "gemv: a packed weight (pack)");
  const auto xc = x.contiguous();
  const int64_t rows = xc.size(0), n = xc.size(1), blocks = packed.size(0);
  auto y = torch::empty({rows, out}, xc.options());
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (bf16)
    product(xp, reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), rows, n, out, blocks, yp);
  else
    product(xp, packed.data_ptr<float>(), rows, n, out, blocks, yp);
  return y;
}
