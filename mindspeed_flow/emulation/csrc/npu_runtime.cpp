// The emulated NPU's runtime: device selection, the host-memory allocator with per-device statistics, the
// device guard that autograd and c10 use, the PrivateUse1 hooks torch asks for, and the zero-copy aliases
// between npu and host tensors that the fallback and the HCCL backend run on.
#include "npu_runtime.h"

#include <ATen/core/GeneratorForPrivateuseone.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/alloc_cpu.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>

namespace msf_npu {

// DeviceIndex is int8: at most 127 devices; statistics are kept for every possible index.
constexpr int kMaxDevices = 128;

// ------------------------------------------------------------------ devices
namespace {
thread_local c10::DeviceIndex tls_device = 0;

c10::DeviceIndex read_device_count() noexcept {
  const char* env = std::getenv("LOCAL_WORLD_SIZE");
  if (env == nullptr || *env == '\0') {
    return 1;
  }
  char* end = nullptr;
  long value = std::strtol(env, &end, 10);
  if (end == env || value < 1) {
    return 1;
  }
  return static_cast<c10::DeviceIndex>(value < kMaxDevices ? value : kMaxDevices - 1);
}
}  // namespace

c10::DeviceIndex device_count() noexcept {
  // Read once: torch caches device counts too, and the autograd engine sizes its device threads from it.
  static const c10::DeviceIndex count = read_device_count();
  return count;
}

c10::DeviceIndex current_device() noexcept {
  return tls_device;
}

void set_device(c10::DeviceIndex index) {
  TORCH_CHECK(index >= 0 && index < device_count(), "npu: invalid device ordinal ", static_cast<int>(index),
              " (this emulated host has ", static_cast<int>(device_count()),
              " npu device(s): one per local rank, from LOCAL_WORLD_SIZE)");
  tls_device = index;
}

c10::Device resolve(c10::Device device) {
  TORCH_CHECK(device.type() == kNpu, "expected an npu device, got ", device);
  return device.has_index() ? device : c10::Device(kNpu, current_device());
}

// ------------------------------------------------------------------ memory statistics
namespace {
struct DeviceStats {
  std::atomic<int64_t> allocated{0};
  std::atomic<int64_t> peak{0};
  std::atomic<int64_t> allocations{0};
  std::atomic<int64_t> frees{0};
};
std::array<DeviceStats, kMaxDevices> stats;

DeviceStats& stats_of(c10::DeviceIndex index) {
  return stats[static_cast<size_t>(index < 0 ? 0 : index) % kMaxDevices];
}

void count_alloc(c10::DeviceIndex index, size_t nbytes) {
  DeviceStats& s = stats_of(index);
  int64_t now = s.allocated.fetch_add(static_cast<int64_t>(nbytes)) + static_cast<int64_t>(nbytes);
  s.allocations.fetch_add(1);
  int64_t peak = s.peak.load();
  while (now > peak && !s.peak.compare_exchange_weak(peak, now)) {
  }
}

void count_free(c10::DeviceIndex index, size_t nbytes) {
  DeviceStats& s = stats_of(index);
  s.allocated.fetch_sub(static_cast<int64_t>(nbytes));
  s.frees.fetch_add(1);
}
}  // namespace

MemoryCounters memory_counters(c10::DeviceIndex index) {
  DeviceStats& s = stats_of(index);
  return {s.allocated.load(), s.peak.load(), s.allocations.load(), s.frees.load()};
}

void reset_peak(c10::DeviceIndex index) {
  DeviceStats& s = stats_of(index);
  s.peak.store(s.allocated.load());
}

// ------------------------------------------------------------------ the allocator
namespace {
// Owner of one block: the deleter needs the size and device to keep the statistics right.
struct Block {
  void* data;
  size_t nbytes;
  c10::DeviceIndex index;
};

void free_block(void* ctx) {
  auto* block = static_cast<Block*>(ctx);
  count_free(block->index, block->nbytes);
  c10::free_cpu(block->data);
  delete block;
}

c10::DataPtr allocate_on(c10::DeviceIndex index, size_t nbytes) {
  c10::Device device(kNpu, index);
  if (nbytes == 0) {
    return c10::DataPtr(nullptr, device);
  }
  void* data = c10::alloc_cpu(nbytes);
  count_alloc(index, nbytes);
  return {data, new Block{data, nbytes, index}, &free_block, device};
}

struct NpuAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    return allocate_on(current_device(), nbytes);
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return nullptr;  // the context (a Block) is not the data pointer
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

NpuAllocator npu_allocator;
}  // namespace

// at::GetAllocator(npu): UntypedStorage(n, device="npu") and storage resizes allocate here.
REGISTER_ALLOCATOR(kNpu, &npu_allocator);

c10::Allocator* allocator() {
  return &npu_allocator;
}

void resize_storage_bytes(c10::StorageImpl* storage, size_t new_bytes) {
  TORCH_CHECK(storage->resizable(), "Trying to resize storage that is not resizable");
  c10::DataPtr fresh = allocate_on(storage->device().index() < 0 ? current_device() : storage->device().index(),
                                   new_bytes);
  size_t keep = std::min(storage->nbytes(), new_bytes);
  if (keep > 0) {
    std::memcpy(fresh.get(), storage->data(), keep);
  }
  storage->set_data_ptr_noswap(std::move(fresh));
  storage->set_nbytes(new_bytes);
}

// ------------------------------------------------------------------ aliases
namespace {
// A host view of npu memory holds the npu storage, so the memory outlives every host tensor over it.
struct HostView {
  c10::Storage npu;
};

void release_host_view(void* ctx) {
  delete static_cast<HostView*>(ctx);
}

// npu memory that belongs to a host StorageImpl (a CPU kernel's output, or a device_alias).
struct Adopted {
  c10::intrusive_ptr<c10::StorageImpl> host;
  size_t nbytes;
  c10::DeviceIndex index;
  bool counted;
};

void release_adopted(void* ctx) {
  auto* adopted = static_cast<Adopted*>(ctx);
  if (adopted->counted) {
    count_free(adopted->index, adopted->nbytes);
  }
  delete adopted;
}

c10::DataPtr wrap_host_memory(c10::intrusive_ptr<c10::StorageImpl> host, c10::DeviceIndex index, bool counted) {
  void* data = host->mutable_data();
  size_t nbytes = host->nbytes();
  if (counted) {
    count_alloc(index, nbytes);
  }
  return {data, new Adopted{std::move(host), nbytes, index, counted}, &release_adopted, c10::Device(kNpu, index)};
}
}  // namespace

c10::Storage host_storage_of(const c10::Storage& npu) {
  void* data = npu.unsafeGetStorageImpl()->mutable_data();
  c10::DataPtr ptr(data, new HostView{npu}, &release_host_view, c10::Device(c10::kCPU));
  // Resizable with the CPU allocator: a CPU kernel that grows an out= argument reallocates the host view, and
  // the fallback then hands the new memory to the npu storage.
  return c10::Storage(c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(), npu.nbytes(),
                                                            std::move(ptr), c10::GetCPUAllocator(), true));
}

c10::DataPtr adopt_host_memory(c10::intrusive_ptr<c10::StorageImpl> host, c10::DeviceIndex index) {
  return wrap_host_memory(std::move(host), index, true);
}

c10::Storage adopt_host_storage(c10::intrusive_ptr<c10::StorageImpl> host, c10::DeviceIndex index) {
  size_t nbytes = host->nbytes();
  return c10::Storage(c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(), nbytes,
                                                            adopt_host_memory(std::move(host), index),
                                                            allocator(), true));
}

at::Tensor tensor_like_on(c10::Storage storage, const at::Tensor& like, c10::DispatchKey key) {
  // A plain (non-VIEW) impl gets its autograd keys and a version counter; autograd replaces the counter with
  // its base's when the tensor is a view.
  auto impl = c10::make_intrusive<c10::TensorImpl>(std::move(storage), c10::DispatchKeySet(key), like.dtype());
  impl->set_sizes_and_strides(like.sizes(), like.strides(), like.storage_offset());
  impl->_set_conj(like.is_conj());
  impl->_set_neg(like.is_neg());
  return at::Tensor(std::move(impl));
}

at::Tensor host_alias(const at::Tensor& npu) {
  TORCH_CHECK(npu.device().type() == kNpu, "host_alias expects an npu tensor, got one on ", npu.device());
  return tensor_like_on(host_storage_of(npu.storage()), npu, c10::DispatchKey::CPU);
}

at::Tensor device_alias(const at::Tensor& host, c10::DeviceIndex index) {
  TORCH_CHECK(host.is_cpu(), "device_alias expects a CPU tensor, got one on ", host.device());
  TORCH_CHECK(index >= 0 && index < device_count(), "npu: invalid device ordinal ", static_cast<int>(index));
  c10::intrusive_ptr<c10::StorageImpl> impl =
      c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(host.storage().unsafeGetStorageImpl());
  size_t nbytes = impl->nbytes();
  c10::Storage storage(c10::make_intrusive<c10::StorageImpl>(
      c10::StorageImpl::use_byte_size_t(), nbytes, wrap_host_memory(std::move(impl), index, false), allocator(),
      false));
  return tensor_like_on(std::move(storage), host, c10::DispatchKey::PrivateUse1);
}

// ------------------------------------------------------------------ the device guard
namespace {
// Events only carry a timestamp: all npu work is synchronous, so an event is complete once recorded.
struct EventRecord {
  std::chrono::steady_clock::time_point when;
};

thread_local c10::StreamId tls_stream = 0;
std::atomic<int64_t> host_sync_counts[3] = {{0}, {0}, {0}};

std::atomic<c10::StreamId> next_stream{1};

struct NpuGuardImpl final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override {
    return kNpu;
  }

  c10::Device exchangeDevice(c10::Device device) const override {
    c10::Device old = getDevice();
    if (device.index() != old.index()) {
      setDevice(device);
    }
    return old;
  }

  c10::Device getDevice() const override {
    return c10::Device(kNpu, current_device());
  }

  void setDevice(c10::Device device) const override {
    TORCH_CHECK(device.type() == kNpu, "npu device guard got a ", device.type(), " device");
    set_device(device.index());
  }

  void uncheckedSetDevice(c10::Device device) const noexcept override {
    if (device.index() >= 0 && device.index() < device_count()) {
      tls_device = device.index();
    }
  }

  // Streams are names only: every kernel runs synchronously on the calling thread.
  c10::Stream getStream(c10::Device device) const override {
    return c10::Stream(c10::Stream::UNSAFE, resolve(device), tls_stream);
  }

  c10::Stream getDefaultStream(c10::Device device) const override {
    return c10::Stream(c10::Stream::DEFAULT, resolve(device));
  }

  c10::Stream getStreamFromGlobalPool(c10::Device device, bool /*isHighPriority*/) const override {
    return c10::Stream(c10::Stream::UNSAFE, resolve(device), next_stream.fetch_add(1));
  }

  c10::Stream getNewStream(c10::Device device, int /*priority*/) const override {
    return c10::Stream(c10::Stream::UNSAFE, resolve(device), next_stream.fetch_add(1));
  }

  c10::Stream exchangeStream(c10::Stream stream) const override {
    c10::Stream old = getStream(stream.device());
    tls_stream = stream.id();
    return old;
  }

  void destroyEvent(void* event, const c10::DeviceIndex /*device_index*/) const noexcept override {
    delete static_cast<EventRecord*>(event);
  }

  void record(void** event, const c10::Stream& /*stream*/, const c10::DeviceIndex /*device_index*/,
              const c10::EventFlag /*flag*/) const override {
    if (*event == nullptr) {
      *event = new EventRecord{};
    }
    static_cast<EventRecord*>(*event)->when = std::chrono::steady_clock::now();
  }

  void block(void* /*event*/, const c10::Stream& /*stream*/) const override {}

  bool queryEvent(void* /*event*/) const override {
    return true;
  }

  c10::DeviceIndex deviceCount() const noexcept override {
    return device_count();
  }

  bool queryStream(const c10::Stream& /*stream*/) const override {
    return true;
  }

  void synchronizeStream(const c10::Stream& /*stream*/) const override {}

  void synchronizeEvent(void* /*event*/) const override {}

  void synchronizeDevice(const c10::DeviceIndex /*device_index*/) const override {}

  void recordDataPtrOnStream(const c10::DataPtr& /*data_ptr*/, const c10::Stream& /*stream*/) const override {}

  double elapsedTime(void* start, void* end, const c10::DeviceIndex /*device_index*/) const override {
    TORCH_CHECK(start != nullptr && end != nullptr, "elapsed_time: both events must have been recorded");
    auto span = static_cast<EventRecord*>(end)->when - static_cast<EventRecord*>(start)->when;
    return std::chrono::duration<double, std::milli>(span).count();
  }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, NpuGuardImpl);

// ------------------------------------------------------------------ PrivateUse1 hooks
// What torch asks the accelerator: availability (barrier, torch.accelerator), device selection, the generator
// (npu random ops draw from the CPU default generator), storage resize (UntypedStorage.resize_).
struct NpuHooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override {
    return true;
  }

  bool isAvailable() const override {
    return true;
  }

  bool hasPrimaryContext(c10::DeviceIndex /*device_index*/) const override {
    return true;
  }

  c10::DeviceIndex deviceCount() const override {
    return device_count();
  }

  void setCurrentDevice(c10::DeviceIndex device) const override {
    set_device(device);
  }

  c10::DeviceIndex getCurrentDevice() const override {
    return current_device();
  }

  c10::DeviceIndex exchangeDevice(c10::DeviceIndex device) const override {
    c10::DeviceIndex old = current_device();
    set_device(device);
    return old;
  }

  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex device) const override {
    return exchangeDevice(device);
  }

  const at::Generator& getDefaultGenerator(c10::DeviceIndex /*device_index*/) const override {
    return at::detail::getDefaultCPUGenerator();
  }

  at::Generator getNewGenerator(c10::DeviceIndex /*device_index*/) const override {
    return at::detail::createCPUGenerator();
  }

  at::Device getDeviceFromPtr(void* /*data*/) const override {
    return c10::Device(kNpu, current_device());
  }

  bool isPinnedPtr(const void* /*data*/) const override {
    return false;
  }

  // Host memory is the device memory: "pinning" is a plain host copy.
  at::Allocator* getPinnedMemoryAllocator() const override {
    return c10::GetCPUAllocator();
  }

  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    resize_storage_bytes(storage.unsafeGetStorageImpl(), newsize);
  }
};

struct RegisterHooks {
  RegisterHooks() {
    static NpuHooks hooks;
    at::RegisterPrivateUse1HooksInterface(&hooks);
  }
};
RegisterHooks register_hooks;
}  // namespace

void count_host_sync(HostSync kind) {
  host_sync_counts[static_cast<int>(kind)].fetch_add(1, std::memory_order_relaxed);
}

std::vector<int64_t> host_syncs() {
  return {host_sync_counts[0].load(), host_sync_counts[1].load(), host_sync_counts[2].load()};
}

}  // namespace msf_npu
