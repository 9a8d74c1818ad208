// Few-row bfloat16 products y = x W^T + b for CPU decode steps and verify passes of a bfloat16 model
// where the CPU has AVX-512 BF16 (models/cpu_kernels.py), gemv.cpp's counterpart for bfloat16.
//
// On an AVX-512 BF16 CPU without AMX, oneDNN multiplies few bfloat16 rows slower than float32 (README
// "Verify cost"), while a decode step only needs the weights streamed once: half float32's bytes.
// VDPBF16PS multiplies pairs of bfloat16 values exactly and adds both products to a float32 sum,
// 32 products per instruction, so several rows (a verify pass) also cost little more than one.
//
// The weight is packed once into blocks of DNB consecutive outputs, each [ceil(in / 2), DNB, 2]: the
// pair (input i, input i + 1) of every output of the block side by side, as VDPBF16PS reads them.
// Up to DRB input rows share each loaded weight vector; each row's pair of inputs is broadcast.
//
// Row invariance by construction, as in gemv.cpp: every output is one chain of VDPBF16PS along the
// input pairs, in order, from zero, then its bias and one rounding to bfloat16 (to nearest even, as
// PyTorch rounds). Which rows or outputs share its tile never changes that, nor the thread count
// (each output is one thread's), so a row gets the same bits alone as beside others.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#ifdef __AVX512BF16__
#include <immintrin.h>

namespace {

constexpr int64_t DNB = 32;  // outputs per block: two vectors of 16 float32 sums
constexpr int DRB = 12;      // input rows per tile: DRB * 2 sums + 2 weights + 1 broadcast <= 32 registers

// R rows of x (stride n) by one packed block -> y (row stride ldy), `valid` outputs stored
template <int R>
inline void dot_tile(const uint16_t* x, const uint16_t* wb, int64_t n, const float* bias, at::BFloat16* y,
                     int64_t ldy, int64_t valid) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const auto step = [&](int64_t i, auto pair) {  // inputs i, i + 1 of each row into the sums
    const uint16_t* wp = wb + i * DNB;  // pair i / 2: DNB outputs x 2 inputs
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp), w1 = (__m512bh)_mm512_loadu_si512(wp + DNB);
    for (int r = 0; r < R; ++r) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair(x + r * n + i));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, w1);
    }
  };
  int64_t i = 0;
  for (; i + 1 < n; i += 2) step(i, [](const uint16_t* p) { int32_t v; std::memcpy(&v, p, 4); return v; });
  if (i < n) step(i, [](const uint16_t* p) { return static_cast<int32_t>(*p); });  // odd `in`: (last, 0)
  for (int r = 0; r < R; ++r) {
    float sums[DNB];
    _mm512_storeu_ps(sums, acc[r][0]);
    _mm512_storeu_ps(sums + 16, acc[r][1]);
    for (int64_t o = 0; o < valid; ++o) y[r * ldy + o] = at::BFloat16(bias ? sums[o] + bias[o] : sums[o]);
  }
}

template <int R>
inline void dot_rest(const uint16_t* x, const uint16_t* wb, int64_t n, const float* bias, at::BFloat16* y,
                     int64_t ldy, int64_t valid, int64_t rows) {
  if constexpr (R > 0) {
    if (rows == R) return dot_tile<R>(x, wb, n, bias, y, ldy, valid);
    dot_rest<R - 1>(x, wb, n, bias, y, ldy, valid, rows);
  }
}

}  // namespace

constexpr bool kHasBf16Dot = true;

torch::Tensor pack_bf16_pairs(const torch::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.device().is_cpu(),
              "pack_bf16_pairs: a bfloat16 CPU [out, in]");
  const int64_t out = w.size(0), n = w.size(1), blocks = (out + DNB - 1) / DNB, pairs = (n + 1) / 2;
  auto padded = torch::zeros({blocks * DNB, pairs * 2}, w.options());
  padded.narrow(0, 0, out).narrow(1, 0, n).copy_(w);
  return padded.view({blocks, DNB, pairs, 2}).permute({0, 2, 1, 3}).contiguous();  // [blocks, pairs, DNB, 2]
}

torch::Tensor gemv_bf16_pairs(const torch::Tensor& x, const torch::Tensor& packed, int64_t out,
                              const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.device().is_cpu(),
              "gemv_bf16_pairs: bfloat16 CPU x [rows, in]");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
              packed.size(1) == (x.size(1) + 1) / 2 && packed.size(2) == DNB && packed.size(3) == 2 &&
              (out + DNB - 1) / DNB == packed.size(0), "gemv_bf16_pairs: a packed weight (pack_bf16_pairs)");
  const auto xc = x.contiguous();
  const int64_t rows = xc.size(0), n = xc.size(1), blocks = packed.size(0);
  torch::Tensor b;  // the bias widened once: each output adds it to its float32 sum before rounding
  if (bias && bias->defined()) {
    TORCH_CHECK(bias->numel() == out, "gemv_bf16_pairs: a bias of `out` values");
    b = bias->to(at::kFloat).contiguous();
  }
  auto y = torch::empty({rows, out}, xc.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  const int64_t block_elems = packed.size(1) * DNB * 2;
  at::parallel_for(0, blocks, 2, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) {
      const uint16_t* wb = wp + blk * block_elems;
      const float* bb = bp ? bp + blk * DNB : nullptr;
      const int64_t valid = std::min(DNB, out - blk * DNB);
      int64_t r = 0;
      for (; r + DRB <= rows; r += DRB) dot_tile<DRB>(xp + r * n, wb, n, bb, yp + r * out + blk * DNB, out, valid);
      if (r < rows) dot_rest<DRB - 1>(xp + r * n, wb, n, bb, yp + r * out + blk * DNB, out, valid, rows - r);
    }
  });
  return y;
}

#else  // no AVX-512 BF16: cpu_kernels.bf16_dot() is False and nothing calls these

constexpr bool kHasBf16Dot = false;

torch::Tensor pack_bf16_pairs(const torch::Tensor&) { TORCH_CHECK(false, "this CPU has no AVX-512 BF16"); }

torch::Tensor gemv_bf16_pairs(const torch::Tensor&, const torch::Tensor&, int64_t, const c10::optional<torch::Tensor>&) {
  TORCH_CHECK(false, "this CPU has no AVX-512 BF16");
}

#endif
