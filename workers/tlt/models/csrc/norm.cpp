// RMSNorm for CPU inference, as transformer.RMSNorm._norm computes it: the same ATen ops in the same
// order, so the same bits, issued from C++. A SmolLM2 decode step runs 61 norms of one row, and
// from Python each of a norm's nine ops pays the interpreter's dispatch on top of a ~1 us kernel.
#include <torch/extension.h>

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  auto xf = x.to(at::kFloat);
  xf = xf * at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return weight * xf.to(x.scalar_type());
}
