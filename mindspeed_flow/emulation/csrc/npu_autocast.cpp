// Autocast on the emulated npu. torch registers autocast kernels for CPU, CUDA, XPU, MPS... and leaves the
// AutocastPrivateUse1 key to the backend (torch_npu registers its own); without them any op under
// `torch.autocast("npu")` fails to dispatch. Here: the per-policy op lists torch publishes in ATen/autocast_mode.h
// for backends to reuse, with the same policies CUDA gets (lower precision for matmul-like ops, fp32 for the
// numerically sensitive ones, promotion for mixed-dtype ops), and a fallthrough for every other op.
#include <ATen/Operators.h>
#include <ATen/autocast_mode.h>
#include <torch/library.h>

namespace {

struct AutocastFallthrough {
  AutocastFallthrough() {
    if (!c10::Dispatcher::singleton().hasBackendFallbackForDispatchKey(c10::DispatchKey::AutocastPrivateUse1)) {
      static torch::Library library(torch::Library::IMPL, "_", c10::DispatchKey::AutocastPrivateUse1, __FILE__,
                                    __LINE__);
      library.fallback(torch::CppFunction::makeFallthrough());
    }
  }
};
AutocastFallthrough autocast_fallthrough;

}  // namespace

// Inside namespace at (anonymous, so nothing leaks): the lists name their signatures' types unqualified, and which
// types they name differs between torch releases.
namespace at {
namespace {

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
#define MSF_NPU_LOWER_PRECISION_FP(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
#define MSF_NPU_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
#define MSF_NPU_FP32_SET_OPT_DTYPE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)
#define MSF_NPU_PROMOTE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, promote)
  AT_FORALL_LOWER_PRECISION_FP(MSF_NPU_LOWER_PRECISION_FP)
  AT_FORALL_FP32(MSF_NPU_FP32)
  AT_FORALL_FP32_SET_OPT_DTYPE(MSF_NPU_FP32_SET_OPT_DTYPE)
  AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(KERNEL_DIFFERENT_REDISPATCH_SIGNATURE_PRIVATEUSEONE)
  AT_FORALL_PROMOTE(MSF_NPU_PROMOTE)
#undef MSF_NPU_LOWER_PRECISION_FP
#undef MSF_NPU_FP32
#undef MSF_NPU_FP32_SET_OPT_DTYPE
#undef MSF_NPU_PROMOTE
}

}  // namespace
}  // namespace at
