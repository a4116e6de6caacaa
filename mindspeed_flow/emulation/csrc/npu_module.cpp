// Python surface of the emulated npu extension (loaded by mindspeed_flow.emulation.npu_ext): device selection,
// memory statistics, host/device aliases, and the HCCL backend class that torch.distributed registers.
#include "npu_hccl.h"
#include "npu_runtime.h"

#include <torch/extension.h>

#include <Python.h>

#include <string>
#include <utility>
#include <vector>

namespace {

// Holder of the HCCL backend in Python: drops its reference with the GIL released, because destroying a
// backend joins gloo's worker threads, which may be waiting for the GIL. Same layout as torch's own holder of
// c10d objects (one intrusive_ptr), which is what lets torch's ProcessGroup take it as a c10d::Backend.
template <typename T>
class ReleasingHolder {
 public:
  ReleasingHolder() = default;
  ReleasingHolder(const ReleasingHolder&) = default;
  ReleasingHolder(ReleasingHolder&&) noexcept = default;
  ReleasingHolder& operator=(const ReleasingHolder&) = default;
  ReleasingHolder& operator=(ReleasingHolder&&) noexcept = default;
  /* implicit */ ReleasingHolder(c10::intrusive_ptr<T> ptr) : ptr_(std::move(ptr)) {}
  explicit ReleasingHolder(T* raw) : ptr_(c10::intrusive_ptr<T>::unsafe_steal_from_new(raw)) {}
  ~ReleasingHolder() {
    if (ptr_ && PyGILState_Check()) {
      pybind11::gil_scoped_release release;
      ptr_.reset();
    }
  }
  T* get() const noexcept {
    return ptr_.get();
  }

 private:
  c10::intrusive_ptr<T> ptr_;
};

}  // namespace

PYBIND11_DECLARE_HOLDER_TYPE(T, ReleasingHolder<T>, true)

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "mindspeed-flow emulated Ascend npu (PrivateUse1 over host memory)";

  m.def("device_type", []() { return static_cast<int>(msf_npu::kNpu); }, "c10::DeviceType of the npu");
  m.def("device_count", []() { return static_cast<int>(msf_npu::device_count()); });
  m.def("current_device", []() { return static_cast<int>(msf_npu::current_device()); });
  m.def("set_device", [](int index) { msf_npu::set_device(static_cast<c10::DeviceIndex>(index)); });
  m.def(
      "memory_stats",
      [](int index) {
        msf_npu::MemoryCounters c = msf_npu::memory_counters(static_cast<c10::DeviceIndex>(index));
        return std::vector<int64_t>{c.allocated, c.peak, c.allocations, c.frees};
      },
      "[allocated bytes, peak bytes, allocations, frees] of one device");
  m.def("reset_peak", [](int index) { msf_npu::reset_peak(static_cast<c10::DeviceIndex>(index)); });
  m.def("host_syncs", &msf_npu::host_syncs,
        "[blocking device-to-host copies, scalar reads, ops with data-dependent output sizes] of this process");
  m.def("host_alias", &msf_npu::host_alias, "npu tensor -> CPU tensor over the same memory");
  m.def(
      "device_alias",
      [](const at::Tensor& host, int index) {
        return msf_npu::device_alias(host, static_cast<c10::DeviceIndex>(index));
      },
      "CPU tensor -> npu tensor over the same memory");

  // The base class is torch's own Backend type (passed as a Python handle): torch's ProcessGroup then accepts
  // an instance as the backend of a device, and `group._get_backend(npu)` hands this class back.
  pybind11::object backend_base = pybind11::module_::import("torch._C._distributed_c10d").attr("Backend");
  pybind11::class_<msf_npu::HcclBackend, ReleasingHolder<msf_npu::HcclBackend>>(m, "HcclBackend", backend_base)
      .def_property_readonly("group_name", &msf_npu::HcclBackend::group_name)
      .def(
          "batch_isend_irecv",
          [](msf_npu::HcclBackend& self, const std::vector<std::string>& op_type, std::vector<at::Tensor> tensors,
             const std::vector<int64_t>& remote_rank_list) {
            return self.batch_isend_irecv(op_type, tensors, remote_rank_list);
          },
          pybind11::call_guard<pybind11::gil_scoped_release>());

  m.def(
      "make_hccl_backend",
      [](pybind11::object gloo, int rank, int size, std::string group_name) {
        auto* raw = gloo.cast<c10d::Backend*>();
        auto inner = c10::intrusive_ptr<c10d::Backend>::reclaim_copy(raw);
        return ReleasingHolder<msf_npu::HcclBackend>(
            c10::make_intrusive<msf_npu::HcclBackend>(rank, size, std::move(inner), std::move(group_name)));
      },
      "an HCCL backend for npu tensors over `gloo` (a ProcessGroupGloo of the same ranks)");
}
