// Few-query attention over a float32 or bfloat16 KV cache, in float32 for CPU decode steps and verify passes
// (models/cpu_kernels.py, transformer.cached_attention).
//
// PyTorch's CPU SDPA is built for long sequences: a decode step's few queries pay its blocking and
// buffers in every layer (on 2 AVX2 EPYC cores 50-86 us per layer for one query over 200 keys, where
// this kernel takes 20-26), and it sums a query's keys in blocks chosen by the pass's shape, so a
// draft token can get other bits beside the others than alone. Here each (row, query, head) is one task that reads the keys its mask row allows, in slot
// order, and nothing else:
//
//   visible = the slots s with mask[b, t, s], in order
//   score_j = (q . k_visible[j]) * scale          one FMA chain along the head dimension
//   p_j     = exp(score_j - max_j score)          max is exact in any order
//   out     = (sum_j p_j v_visible[j]) / sum_j p_j   both sums in visible order, from zero
//
// So a query's bits depend only on its own query vector and the sequence of keys and values it may
// see: alone (a decode step), beside other draft tokens (a chain or a tree whose siblings sit between
// its ancestors' slots), or beside rows with longer prefixes, it computes the same.
//
// A bfloat16 cache is read as it is stored (half the bytes) and widened to float32 exactly in
// registers; the products and sums stay float32, so the output is rounded to bfloat16 once, by the
// caller, where HF's eager bfloat16 attention rounds each product.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

#include "simd.h"

namespace {

using namespace tlt;

// exp(x) for x <= 0, eight lanes at once (Cephes' expf: x = n ln2 + r, a degree-6 polynomial in r,
// times 2^n; ~1 ulp). Each lane is computed on its own, so a score's exp never depends on its lane.
inline v8 exp8(v8 x) {
  x = x < splat(-87.0f) ? splat(-87.0f) : x;  // exp(-87) ~ 1.6e-38: still a normal float
  const v8 fx = x * splat(1.44269504088896341f) + splat(0.5f);
  v8i n = __builtin_convertvector(fx, v8i);             // truncates toward zero ...
  n -= (v8i)(__builtin_convertvector(n, v8) > fx) & 1;  // ... so subtract 1 where that rounded up: floor
  const v8 nf = __builtin_convertvector(n, v8);
  const v8 r = x - nf * splat(0.693359375f) - nf * splat(-2.12194440e-4f);
  v8 y = splat(1.9875691500e-4f);
  y = y * r + splat(1.3981999507e-3f);
  y = y * r + splat(8.3334519073e-3f);
  y = y * r + splat(4.1665795894e-2f);
  y = y * r + splat(1.6666665459e-1f);
  y = y * r + splat(5.0000001201e-1f);
  y = y * r * r + r + splat(1.0f);
  const v8i scale = (n + 127) << 23;
  v8 two_n;
  std::memcpy(&two_n, &scale, sizeof two_n);
  return y * two_n;
}

#ifdef __clang__
#define TLT_SWAP(v, ...) __builtin_shufflevector(v, v, __VA_ARGS__)
#else
#define TLT_SWAP(v, ...) __builtin_shuffle(v, v8i{__VA_ARGS__})
#endif

inline float hsum(v8 v) {  // a fixed order: ((0+4) + (2+6)) + ((1+5) + (3+7))
  v = v + TLT_SWAP(v, 4, 5, 6, 7, 0, 1, 2, 3);
  v = v + TLT_SWAP(v, 2, 3, 0, 1, 6, 7, 4, 5);
  v = v + TLT_SWAP(v, 1, 0, 3, 2, 5, 4, 7, 6);
  return v[0];
}

}  // namespace

// q [B, T, h, hd] float32, keys/values [B, S, kv, hd] float32 or bfloat16 (the cache's layout; any
// strides, hd contiguous), mask [B, T, S] bool (any strides) -> out [B, T, h, hd] float32. hd a
// multiple of 8; kv divides h; every query sees at least one key.
template <typename KV>
void attend(const torch::Tensor& q, const KV* kp, const KV* vp, const torch::Tensor& keys, const torch::Tensor& values,
            const torch::Tensor& mask, float sc, torch::Tensor& out) {
  const int64_t B = q.size(0), T = q.size(1), h = q.size(2), hd = q.size(3);
  const int64_t S = keys.size(1), kv = keys.size(2);
  const float* qp = q.data_ptr<float>();
  const bool* mp = mask.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  const int64_t group = h / kv, vecs = hd / 8;
  const auto qs = q.strides(), ks = keys.strides(), vs = values.strides(), ms = mask.strides();
  at::parallel_for(0, B * T * h, 1, [&](int64_t i0, int64_t i1) {
    std::vector<int64_t> slots;
    std::vector<float> p;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / (T * h), t = i / h % T, head = i % h, kvh = head / group;
      if (i == i0 || head == 0) {  // the visible slots of row b's query t (its heads come in a run)
        slots.clear();
        const bool* m = mp + b * ms[0] + t * ms[1];
        for (int64_t s = 0; s < S; ++s)
          if (m[s * ms[2]]) slots.push_back(s);
      }
      const int64_t n = static_cast<int64_t>(slots.size());
      TORCH_CHECK(n > 0, "attention: a query that sees no key");
      const float* qv = qp + b * qs[0] + t * qs[1] + head * qs[2];
      const KV* kb = kp + b * ks[0] + kvh * ks[2];
      const KV* vb = vp + b * vs[0] + kvh * vs[2];
      p.assign((n + 7) / 8 * 8, 0.0f);
      float top = -INFINITY;
      int64_t j = 0;
      for (; j + 4 <= n; j += 4) {  // four keys' chains interleaved; each key's arithmetic is the same
        const KV *k0 = kb + slots[j] * ks[1], *k1 = kb + slots[j + 1] * ks[1];
        const KV *k2 = kb + slots[j + 2] * ks[1], *k3 = kb + slots[j + 3] * ks[1];
        v8 a0 = v8{}, a1 = v8{}, a2 = v8{}, a3 = v8{};
        for (int64_t d = 0; d < vecs; ++d) {
          const v8 x = load8(qv + 8 * d);
          a0 = madd(a0, x, load8(k0 + 8 * d));
          a1 = madd(a1, x, load8(k1 + 8 * d));
          a2 = madd(a2, x, load8(k2 + 8 * d));
          a3 = madd(a3, x, load8(k3 + 8 * d));
        }
        p[j] = hsum(a0) * sc, p[j + 1] = hsum(a1) * sc, p[j + 2] = hsum(a2) * sc, p[j + 3] = hsum(a3) * sc;
      }
      for (; j < n; ++j) {
        const KV* k = kb + slots[j] * ks[1];
        v8 acc = v8{};
        for (int64_t d = 0; d < vecs; ++d) acc = madd(acc, load8(qv + 8 * d), load8(k + 8 * d));
        p[j] = hsum(acc) * sc;
      }
      for (j = 0; j < n; ++j) top = std::max(top, p[j]);
      float total = 0.0f;
      for (int64_t j = 0; j < n; j += 8) store8(&p[j], exp8(load8(&p[j]) - splat(top)));
      for (int64_t j = 0; j < n; ++j) total += p[j];
      v8 acc[16];
      float* o = op + ((b * T + t) * h + head) * hd;
      for (int64_t d0 = 0; d0 < vecs; d0 += 16) {  // 16 vectors (128 values of hd) at a time
        const int64_t w = std::min<int64_t>(16, vecs - d0);
        for (int64_t d = 0; d < w; ++d) acc[d] = v8{};
        for (int64_t j = 0; j < n; ++j) {
          const KV* v = vb + slots[j] * vs[1] + 8 * d0;
          const v8 pj = splat(p[j]);
          for (int64_t d = 0; d < w; ++d) acc[d] = madd(acc[d], pj, load8(v + 8 * d));
        }
        for (int64_t d = 0; d < w; ++d) store8(o + 8 * (d0 + d), acc[d] / splat(total));
      }
    }
  });
}

torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                        const torch::Tensor& mask, double scale) {
  TORCH_CHECK(q.dim() == 4 && keys.dim() == 4 && values.dim() == 4 && mask.dim() == 3, "attention: q [B, T, h, hd], "
              "keys/values [B, S, kv, hd], mask [B, T, S]");
  const auto kv_type = keys.scalar_type();
  TORCH_CHECK(q.scalar_type() == at::kFloat && (kv_type == at::kFloat || kv_type == at::kBFloat16) &&
              values.scalar_type() == kv_type, "attention: float32 queries, float32 or bfloat16 keys and values");
  for (const auto* t : {&q, &keys, &values})
    TORCH_CHECK(t->device().is_cpu() && t->stride(3) == 1, "attention: CPU tensors, the head dimension contiguous");
  TORCH_CHECK(mask.scalar_type() == at::kBool, "attention: a bool mask");
  const int64_t B = q.size(0), T = q.size(1), h = q.size(2), hd = q.size(3);
  const int64_t S = keys.size(1), kv = keys.size(2);
  TORCH_CHECK(hd % 8 == 0 && keys.size(3) == hd && values.sizes() == keys.sizes() && keys.size(0) == B &&
              h % kv == 0 && mask.size(0) == B && mask.size(1) == T && mask.size(2) == S, "attention: shapes");
  auto out = torch::empty({B, T, h, hd}, q.options());
  const float sc = static_cast<float>(scale);
  if (kv_type == at::kFloat)
    attend(q, keys.data_ptr<float>(), values.data_ptr<float>(), keys, values, mask, sc, out);
  else  // bfloat16's bits, widened by load8
    attend(q, reinterpret_cast<const uint16_t*>(keys.data_ptr<at::BFloat16>()),
           reinterpret_cast<const uint16_t*>(values.data_ptr<at::BFloat16>()), keys, values, mask, sc, out);
  return out;
}
