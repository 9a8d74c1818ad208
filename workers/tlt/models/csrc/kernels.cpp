// The CPU kernels' one translation unit (torch's headers are parsed once per build) and bindings.
#include "gemv.cpp"
#include "attention.cpp"
#include "norm.cpp"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "a float32 or bfloat16 [out, in] weight in gemv's blocked layout");
  m.def("gemv", &gemv, "few-row float32 x @ w.T from the packed (float32 or bfloat16) weight, row-invariant (csrc/gemv.cpp)");
  m.def("attention", &attention, "few-query float32 attention over a KV cache, query-invariant (csrc/attention.cpp)");
  m.def("attention_step", &attention_step, "a decode step's or verify pass's attention block from its q/k/v product: "
        "rope, cache writes, attention (csrc/attention.cpp)");
  m.def("rms_norm", &rms_norm, "RMSNorm for CPU inference, transformer.RMSNorm's ops issued from C++ (csrc/norm.cpp)");
}
