// The emulated Ascend NPU: a real PrivateUse1 ("npu") device whose memory is host memory.
//
// Declarations shared by the runtime (allocator, device guard, hooks: npu_runtime.cpp), the kernels and the
// boxed CPU fallback (npu_kernels.cpp), the HCCL backend over gloo (npu_hccl.cpp) and the Python module
// (npu_module.cpp). Everything compiles against the torch headers of both supported releases (2.7 and 2.13).
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Allocator.h>
#include <c10/core/Storage.h>
#include <c10/core/StorageImpl.h>

#include <cstdint>

namespace msf_npu {

constexpr c10::DeviceType kNpu = c10::DeviceType::PrivateUse1;

// ------------------------------------------------------------------ devices
// Number of emulated devices: $LOCAL_WORLD_SIZE (one per local rank, as on an Ascend node), else 1.
c10::DeviceIndex device_count() noexcept;
// The calling thread's device index (per thread, like CUDA/ACL); 0 until set.
c10::DeviceIndex current_device() noexcept;
// Select the calling thread's device; refuses an index outside [0, device_count()).
void set_device(c10::DeviceIndex index);
// `device` with its index filled in from the calling thread when it has none.
c10::Device resolve(c10::Device device);

// ------------------------------------------------------------------ memory
// The npu allocator: host memory, DataPtr on npu:<current device>, live/peak bytes counted per device.
c10::Allocator* allocator();

struct MemoryCounters {
  int64_t allocated = 0;    // live bytes on the device (allocator blocks and adopted kernel outputs)
  int64_t peak = 0;         // highest `allocated` since start or the last reset_peak
  int64_t allocations = 0;  // number of blocks handed out
  int64_t frees = 0;        // number of blocks returned
};
MemoryCounters memory_counters(c10::DeviceIndex index);
void reset_peak(c10::DeviceIndex index);

// ------------------------------------------------------------------ host synchronisations
// What makes the host wait for the device on a real npu, counted per process: a blocking device-to-host copy
// (`.cpu()`, `.tolist()`, `.item()` and the like), and ops whose output size depends on the data (`nonzero`,
// `masked_select`, `unique`...: the host must read the count before it can allocate). A job's count per
// iteration tells whether code added a synchronisation per microbatch.
enum class HostSync : int { kCopyToHost = 0, kScalar = 1, kDataDependentShape = 2 };
void count_host_sync(HostSync kind);
std::vector<int64_t> host_syncs();  // [copies to host, scalar reads, data-dependent shapes]

// Grow or shrink an npu storage in place (new block from the allocator, old bytes copied), as CUDA does: every
// tensor sharing the StorageImpl sees the new memory.
void resize_storage_bytes(c10::StorageImpl* storage, size_t new_bytes);

// ------------------------------------------------------------------ host <-> device aliases (zero copy)
// A CPU storage over the npu storage's memory (same base pointer, same byte size) that keeps it alive.
c10::Storage host_storage_of(const c10::Storage& npu);
// An npu DataPtr that owns a host StorageImpl's memory (a CPU kernel's output); its bytes are counted on `index`.
c10::DataPtr adopt_host_memory(c10::intrusive_ptr<c10::StorageImpl> host, c10::DeviceIndex index);
// An npu storage made of `adopt_host_memory`.
c10::Storage adopt_host_storage(c10::intrusive_ptr<c10::StorageImpl> host, c10::DeviceIndex index);

// A tensor on `storage` with `like`'s dtype, sizes, strides, offset and conj/neg bits, dispatched as `key`.
at::Tensor tensor_like_on(c10::Storage storage, const at::Tensor& like, c10::DispatchKey key);
// npu tensor -> CPU tensor over the same memory (the inverse of device_alias).
at::Tensor host_alias(const at::Tensor& npu);
// CPU tensor -> npu tensor on device `index` over the same memory; not counted as an allocation.
at::Tensor device_alias(const at::Tensor& host, c10::DeviceIndex index);

}  // namespace msf_npu
