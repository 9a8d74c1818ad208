// Few-query attention over a float32 or bfloat16 KV cache, in float32 for CPU decode steps and verify passes
// (models/cpu_kernels.py, transformer.cached_attention).
//
// PyTorch's CPU SDPA is built for long sequences: a decode step's few queries pay its blocking and
// buffers in every layer (on 2 AVX2 EPYC cores 50-86 us per layer for one query over 200 keys, where
// this kernel takes 20-26), and it sums a query's keys in blocks chosen by the pass's shape, so a
// draft token can get other bits beside the others than alone. Here each query head is computed
// from the keys its mask row allows, in slot order, and nothing else:
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
// What is shared is only the reading. One task takes a row's key head for all the pass's queries
// and the query heads that share that key head (GQA): a verify pass of T tokens reads each key
// once, not T * group times (a 4-row, 9-token tree pass over 800 bfloat16 keys on 2 AMX Xeon
// cores: 1.29 ms per layer, 1.66 when each query head read its own; the bits are the same). Where
// that leaves a thread fewer than two tasks (one row: SmolLM2's 3 key heads on 2 threads), the
// pass's tokens are split into runs, a task each, and a key is read once per run. Scores
// are computed for every slot up to the row's last visible one; the slots a query may not see are
// left out of its maximum and its sums, so those run over exactly its visible keys, in order, from
// zero.
//
// A bfloat16 cache is read as it is stored (half the bytes) and widened to float32 exactly (a block
// of keys once for all its query heads, values in registers); the products and sums stay float32,
// so the output is rounded to bfloat16 once, by the caller, where HF's eager bfloat16 attention
// rounds each product.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <type_traits>
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
#define TLT_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define TLT_SHUFFLE(a, b, ...) __builtin_shuffle(a, b, v8i{__VA_ARGS__})
#endif

constexpr int64_t MAX_GROUP = 16;  // query heads per key head (GQA): SmolLM2 3, Qwen2.5-7B 7
constexpr int64_t VB = 4;          // value vectors accumulated per pass over the keys, per query head

// Eight vectors' lane sums, lane k = a[k]'s, each in one fixed order: ((0+4) + (2+6)) + ((1+5) + (3+7)).
// Eight keys' dot products are summed at once (one key's alone would cost as many shuffles), and
// every lane's order is the same, so a key's score does not depend on its place among the eight.
inline v8 hsum8(const v8* a) {
  v8 p[4];  // pairs: lanes 0-3 one vector's (i, i + 4) sums, lanes 4-7 the next one's
  for (int k = 0; k < 4; ++k)
    p[k] = TLT_SHUFFLE(a[2 * k], a[2 * k + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           TLT_SHUFFLE(a[2 * k], a[2 * k + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  // (0+4) + (2+6) and (1+5) + (3+7): lanes of vectors 0, 0, 2, 2, 1, 1, 3, 3 (then 4-7 alike)
  const v8 q0 = TLT_SHUFFLE(p[0], p[1], 0, 1, 8, 9, 4, 5, 12, 13) + TLT_SHUFFLE(p[0], p[1], 2, 3, 10, 11, 6, 7, 14, 15);
  const v8 q1 = TLT_SHUFFLE(p[2], p[3], 0, 1, 8, 9, 4, 5, 12, 13) + TLT_SHUFFLE(p[2], p[3], 2, 3, 10, 11, 6, 7, 14, 15);
  return TLT_SHUFFLE(q0, q1, 0, 4, 2, 6, 8, 12, 10, 14) + TLT_SHUFFLE(q0, q1, 1, 5, 3, 7, 9, 13, 11, 15);
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
  TORCH_CHECK(group <= MAX_GROUP, "attention: at most ", MAX_GROUP, " query heads per key head");
  // a task per (row, key head, run of the pass's tokens): the runs only as short as it takes to give
  // every thread two tasks (one row's 9-token pass has but 3 key heads for 2 threads)
  const int64_t runs = std::max<int64_t>(1, std::min(T, (2 * at::get_num_threads() + B * kv - 1) / (B * kv)));
  const int64_t per_run = (T + runs - 1) / runs;
  at::parallel_for(0, B * kv * runs, 1, [&](int64_t i0, int64_t i1) {
    std::vector<uint8_t> seen;  // [Tr][S]: may the run's query t see slot s
    std::vector<float> score;   // [Tr * group][n8]: each query head's scores, then weights
    std::vector<float> wide;    // [8][hd]: a block of bfloat16 keys widened once for every query head
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / (kv * runs), kvh = i / runs % kv, t0 = i % runs * per_run;
      const int64_t Tr = std::min(per_run, T - t0), Q = Tr * group;
      if (Tr <= 0) continue;  // the last runs of a short pass
      int64_t n = 0;  // slots 0..n-1 hold every key some query of the run sees
      seen.assign(Tr * S, 0);
      for (int64_t t = 0; t < Tr; ++t) {
        const bool* m = mp + b * ms[0] + (t0 + t) * ms[1];
        int64_t count = 0;
        for (int64_t s = 0; s < S; ++s)
          if (m[s * ms[2]]) seen[t * S + s] = 1, n = std::max(n, s + 1), ++count;
        TORCH_CHECK(count > 0, "attention: a query that sees no key");
      }
      const int64_t n8 = (n + 7) / 8 * 8;
      const KV* kb = kp + b * ks[0] + kvh * ks[2];
      const KV* vb = vp + b * vs[0] + kvh * vs[2];
      const float* qb = qp + b * qs[0] + t0 * qs[1] + kvh * group * qs[2];  // query head r = (t, g): + t qs[1] + g qs[2]
      score.assign(Q * n8, 0.0f);
      wide.resize(8 * hd);
      for (int64_t s0 = 0; s0 < n; s0 += 8) {  // eight slots' keys, read once for all the run's query heads
        const float* k[8];
        for (int e = 0; e < 8; ++e) {
          const KV* key = kb + std::min(s0 + e, n - 1) * ks[1];  // past n: unused lanes
          if constexpr (std::is_same_v<KV, float>) {
            k[e] = key;
          } else {
            for (int64_t d = 0; d < vecs; ++d) store8(&wide[e * hd + 8 * d], load8(key + 8 * d));
            k[e] = &wide[e * hd];
          }
        }
        for (int64_t r = 0; r < Q; ++r) {  // eight keys' chains interleaved; each key's arithmetic is the same
          const float* qv = qb + (r / group) * qs[1] + (r % group) * qs[2];
          v8 acc[8] = {};
          for (int64_t d = 0; d < vecs; ++d) {
            const v8 x = load8(qv + 8 * d);
            for (int e = 0; e < 8; ++e) acc[e] = madd(acc[e], x, load8(k[e] + 8 * d));
          }
          store8(&score[r * n8 + s0], hsum8(acc) * splat(sc));
        }
      }
      float total[MAX_GROUP];
      for (int64_t t = 0; t < Tr; ++t) {
        const uint8_t* vis = &seen[t * S];
        for (int64_t g = 0; g < group; ++g) {  // softmax over the slots query t sees; the rest weigh 0
          float* p = &score[(t * group + g) * n8];
          float top = -INFINITY;
          for (int64_t s = 0; s < n; ++s)
            if (vis[s]) top = std::max(top, p[s]);
          for (int64_t s = 0; s < n; s += 8) store8(p + s, exp8(load8(p + s) - splat(top)));
          float sum = 0.0f;
          for (int64_t s = 0; s < n; ++s)
            if (vis[s]) sum += p[s];
          total[g] = sum;
        }
        for (int64_t d0 = 0; d0 < vecs; d0 += VB) {  // VB vectors of hd at a time, for the group's heads
          const int64_t w = std::min<int64_t>(VB, vecs - d0);
          v8 acc[MAX_GROUP][VB] = {};
          for (int64_t s = 0; s < n; ++s) {
            if (!vis[s]) continue;
            const KV* v = vb + s * vs[1] + 8 * d0;
            v8 x[VB];
            for (int64_t d = 0; d < w; ++d) x[d] = load8(v + 8 * d);
            for (int64_t g = 0; g < group; ++g) {
              const v8 pj = splat(score[(t * group + g) * n8 + s]);
              for (int64_t d = 0; d < w; ++d) acc[g][d] = madd(acc[g][d], pj, x[d]);
            }
          }
          for (int64_t g = 0; g < group; ++g) {
            float* o = op + ((b * T + t0 + t) * h + kvh * group + g) * hd + 8 * d0;
            for (int64_t d = 0; d < w; ++d) store8(o + 8 * d, acc[g][d] / splat(total[g]));
          }
        }
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

// --- the attention block of a decode step or verify pass, from its q/k/v product ----------------
//
// In a decode step the ~25 small PyTorch ops around the kernel (rotating q and k, writing k and v
// into the cache, the layout changes and casts) cost more than the kernel itself. attention_step
// does them in one call, with the bits those ops give: the rotation is HF's rotate-half with
// PyTorch's eager rounding (x cos and rotate(x) sin each rounded to the dtype, then their sum), the
// queries are widened to float32 exactly, and the output is rounded to the dtype once.

namespace {

inline float widen(float x) { return x; }
inline float widen(at::BFloat16 x) { return static_cast<float>(x); }
template <typename X>
inline X narrow(float x) { return X(x); }  // bfloat16: round to nearest even, as PyTorch's casts do

// one head's hd values rotated by cos/sin. Each product and the sum are rounded on their own, as the
// eager ops round them: no fused multiply-add may merge them (float32's bits would change)
template <typename X>
__attribute__((optimize("fp-contract=off"))) void rotate(const X* x, const X* c, const X* s, int64_t hd, X* out) {
#ifdef __clang__
#pragma clang fp contract(off)
#endif
  const int64_t half = hd / 2;
  for (int64_t i = 0; i < hd; ++i) {
    const float turned = i < half ? -widen(x[i + half]) : widen(x[i - half]);
    const X a = narrow<X>(widen(x[i]) * widen(c[i])), b = narrow<X>(turned * widen(s[i]));
    out[i] = narrow<X>(widen(a) + widen(b));
  }
}

// q [B, T, h * hd], k/v [B, T, kv * hd] (the product's split columns: any strides but the last),
// cos/sin [B, T, hd]; writes the rotated k and v at cache slots write_pos [B, T] of kcache/vcache
// [B, L, kv, hd] and returns the attention of the rotated q over the slots mask [B, T, S] allows
template <typename X>
torch::Tensor step(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& cos,
                   const torch::Tensor& sin, const torch::Tensor& kcache, const torch::Tensor& vcache,
                   const torch::Tensor& write_pos, const torch::Tensor& mask, float sc) {
  const int64_t B = q.size(0), T = q.size(1), hd = kcache.size(3), kv = kcache.size(2), h = q.size(2) / hd;
  const int64_t L = kcache.size(1);
  auto qf = torch::empty({B, T, h, hd}, q.options().dtype(at::kFloat));
  float* qfp = qf.data_ptr<float>();
  X* kc = kcache.data_ptr<X>();
  X* vc = vcache.data_ptr<X>();
  const auto wp = write_pos.accessor<int64_t, 2>();
  std::vector<X> turned(hd);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const X* c = cos.data_ptr<X>() + b * cos.stride(0) + t * cos.stride(1);
      const X* s = sin.data_ptr<X>() + b * sin.stride(0) + t * sin.stride(1);
      const X* qt = q.data_ptr<X>() + b * q.stride(0) + t * q.stride(1);
      for (int64_t head = 0; head < h; ++head) {
        rotate(qt + head * hd, c, s, hd, turned.data());
        for (int64_t i = 0; i < hd; ++i) qfp[((b * T + t) * h + head) * hd + i] = widen(turned[i]);
      }
      const int64_t slot = wp[b][t];
      TORCH_CHECK(0 <= slot && slot < L, "attention_step: a write position outside the cache");
      const X* kt = k.data_ptr<X>() + b * k.stride(0) + t * k.stride(1);
      const X* vt = v.data_ptr<X>() + b * v.stride(0) + t * v.stride(1);
      X* kdst = kc + (b * L + slot) * kv * hd;
      for (int64_t head = 0; head < kv; ++head) rotate(kt + head * hd, c, s, hd, kdst + head * hd);
      std::memcpy(vc + (b * L + slot) * kv * hd, vt, kv * hd * sizeof(X));
    }
  const int64_t S = mask.size(2);
  const auto keys = kcache.narrow(1, 0, S), values = vcache.narrow(1, 0, S);
  auto out = torch::empty({B, T, h, hd}, qf.options());
  if constexpr (std::is_same_v<X, float>)
    attend(qf, kc, vc, keys, values, mask, sc, out);
  else
    attend(qf, reinterpret_cast<const uint16_t*>(kc), reinterpret_cast<const uint16_t*>(vc), keys, values, mask, sc,
           out);
  return out.view({B, T, h * hd}).to(q.scalar_type());
}

}  // namespace

torch::Tensor attention_step(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& kcache,
                             const torch::Tensor& vcache, const torch::Tensor& write_pos, const torch::Tensor& mask,
                             double scale) {
  const auto dt = q.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "attention_step: float32 or bfloat16");
  for (const auto* t : {&q, &k, &v, &cos, &sin, &kcache, &vcache})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == dt && t->stride(-1) == 1,
                "attention_step: CPU tensors of one dtype, the last dimension contiguous");
  TORCH_CHECK(q.dim() == 3 && k.sizes() == v.sizes() && kcache.dim() == 4 && kcache.sizes() == vcache.sizes() &&
              kcache.is_contiguous() && vcache.is_contiguous(), "attention_step: q/k/v [B, T, heads * hd], "
              "contiguous caches [B, L, kv, hd]");
  const int64_t B = q.size(0), T = q.size(1), kv = kcache.size(2), hd = kcache.size(3);
  TORCH_CHECK(hd % 8 == 0 && q.size(2) % hd == 0 && (q.size(2) / hd) % kv == 0 && k.size(0) == B && k.size(1) == T &&
              k.size(2) == kv * hd && kcache.size(0) == B && cos.sizes() == sin.sizes() && cos.size(0) == B &&
              cos.size(1) == T && cos.size(2) == hd && write_pos.scalar_type() == at::kLong &&
              write_pos.size(0) == B && write_pos.size(1) == T && mask.scalar_type() == at::kBool &&
              mask.dim() == 3 && mask.size(0) == B && mask.size(1) == T && mask.size(2) <= kcache.size(1),
              "attention_step: shapes");
  const float sc = static_cast<float>(scale);
  if (dt == at::kFloat) return step<float>(q, k, v, cos, sin, kcache, vcache, write_pos, mask, sc);
  return step<at::BFloat16>(q, k, v, cos, sin, kcache, vcache, write_pos, mask, sc);
}
