// The CPU kernels' one translation unit (torch's headers are parsed once per build) and bindings.
#include "gemv.cpp"
#include "dot_bf16.cpp"
#include "attention.cpp"
#include "norm.cpp"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "a float32 or bfloat16 [out, in] weight in gemv's blocked layout");
  m.def("gemv", &gemv, "few-row float32 x @ w.T from the packed (float32 or bfloat16) weight, row-invariant (csrc/gemv.cpp)");
  m.def("has_bf16_dot", [] { return kHasBf16Dot; }, "built for a CPU with AVX-512 BF16 (csrc/dot_bf16.cpp)");
  m.def("pack_bf16_pairs", &pack_bf16_pairs, "a bfloat16 [out, in] weight in gemv_bf16_pairs' blocked layout");
  m.def("gemv_bf16_pairs", &gemv_bf16_pairs, "few-row bfloat16 x @ w.T + b, float32 sums, row-invariant "
        "(csrc/dot_bf16.cpp)");
  m.def("attention", &attention, "few-query float32 attention over a KV cache, query-invariant (csrc/attention.cpp)");
  m.def("attention_step", &attention_step, "a decode step's or verify pass's attention block from its q/k/v product: "
        "rope, cache writes, attention (csrc/attention.cpp)");
  m.def("rms_norm", &rms_norm, "RMSNorm for CPU inference, transformer.RMSNorm's ops issued from C++ (csrc/norm.cpp)");
}
