// Kernels of the emulated npu: the few that must know the device (allocation, views, resize, set_, copies
// across devices, item()), and one boxed fallback that runs every other aten op with the CPU kernel on
// zero-copy host aliases of its npu arguments, after refusing what a real device refuses: host tensors mixed
// into an npu op, and npu tensors of different device indices.
#include "npu_runtime.h"

#include <unordered_set>

#include <ATen/EmptyTensor.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/view_native.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DeviceGuard.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

#include <array>
#include <cstring>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace msf_npu {
namespace {

bool is_npu(const at::Tensor& t) {
  return t.defined() && t.device().type() == kNpu;
}

// ------------------------------------------------------------------ the device mismatch error (torch's text)
[[noreturn]] void refuse_devices(c10::Device device, c10::Device other, const std::string& arg,
                                 const std::string& op) {
  // The text torch's own device checks use for CUDA (TensorIterator, check_and_update_common_device).
  TORCH_CHECK(false, "Expected all tensors to be on the same device, but found at least two devices, ", device,
              " and ", other, "! (when checking argument for argument ", arg, " in method ", op,
              " on the emulated npu)");
}

std::string op_name(const c10::OperatorHandle& op) {
  return c10::toString(op.schema().operator_name());
}

// Host tensors a real device accepts as arguments of an npu op: index tensors of advanced indexing.
// aten/src/ATen/native/TensorAdvancedIndexing.cpp (check_indices_on_cpu_or_selfdevice, make_info) moves CPU
// indices to the indexed tensor's device; values must still be on the device (or 0-dim).
bool host_argument_allowed(const c10::OperatorHandle& op, const std::string& arg) {
  if (arg != "indices") {
    return false;
  }
  const std::string& name = op.schema().name();
  return name == "aten::index" || name == "aten::index_put_" || name == "aten::index_put" ||
         name == "aten::_index_put_impl_" || name == "aten::_unsafe_index" || name == "aten::_unsafe_index_put";
}

// ------------------------------------------------------------------ the fallback's bookkeeping
// One npu tensor argument and the host alias the CPU kernel sees instead.
struct Aliased {
  at::Tensor npu;
  at::Tensor host;
  c10::StorageImpl* host_storage;  // the alias storage made for it (the kernel may replace it)
  const void* data_before;         // to notice a kernel that reallocated the alias storage
  size_t nbytes_before;
  bool written;                    // an in-place or out= argument (alias annotation with a write)
};

struct Call {
  const c10::OperatorHandle& op;
  std::optional<c10::Device> device;                                 // the op's npu device
  std::vector<std::pair<c10::StorageImpl*, c10::Storage>> storages;  // npu storage -> its host alias storage
  std::vector<Aliased> aliased;
  std::vector<c10::TensorImpl*> host_inputs;                          // host tensors passed in as they are
  std::vector<std::pair<c10::StorageImpl*, c10::Storage>> adopted;   // host output storage -> npu storage

  explicit Call(const c10::OperatorHandle& o) : op(o) {}

  c10::DeviceIndex index() const {
    return device ? device->index() : current_device();
  }

  void note_device(c10::Device d, const std::string& arg) {
    if (!device) {
      device = d;
    } else if (*device != d) {
      refuse_devices(*device, d, arg, op_name(op));
    }
  }

  // First pass: find the op's npu device and refuse mixed devices.
  void scan(const at::Tensor& t, const std::string& arg) {
    if (is_npu(t)) {
      note_device(t.device(), arg);
    }
  }

  void check_host(const at::Tensor& t, const std::string& arg) {
    if (!t.defined() || is_npu(t)) {
      return;
    }
    if (t.device().is_cpu() && (t.dim() == 0 || host_argument_allowed(op, arg))) {
      return;  // CPU scalars are fine on a device, as on CUDA
    }
    refuse_devices(*device, t.device(), arg, op_name(op));
  }

  c10::Storage host_storage(const at::Tensor& t) {
    c10::StorageImpl* key = t.storage().unsafeGetStorageImpl();
    for (auto& entry : storages) {
      if (entry.first == key) {
        return entry.second;
      }
    }
    c10::Storage host = host_storage_of(t.storage());
    storages.emplace_back(key, host);
    return host;
  }

  // Second pass: the host alias of one npu tensor (tensors sharing a storage share one alias storage, so the
  // kernel sees their overlap and outputs that alias an input are recognised).
  at::Tensor to_host(const at::Tensor& t, bool written) {
    if (!is_npu(t)) {
      if (t.defined()) {
        host_inputs.push_back(t.unsafeGetTensorImpl());
      }
      return t;
    }
    c10::Storage storage = host_storage(t);
    c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
    at::Tensor host = tensor_like_on(storage, t, c10::DispatchKey::CPU);
    aliased.push_back({t, host, impl, impl->data(), impl->nbytes(), written});
    return host;
  }

  // The npu storage behind a host storage the kernel returned or switched to: an alias of an argument's
  // storage, else the kernel's own (fresh) memory, adopted once per call.
  c10::Storage npu_storage_for(c10::StorageImpl* host) {
    for (auto& entry : storages) {
      if (entry.second.unsafeGetStorageImpl() == host && host->data() == entry.first->data()) {
        return c10::Storage(c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(entry.first));
      }
    }
    for (auto& entry : adopted) {
      if (entry.first == host) {
        return entry.second;
      }
    }
    c10::Storage npu = adopt_host_storage(c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(host), index());
    adopted.emplace_back(host, npu);
    return npu;
  }

  // After the kernel: carry what it did to an in-place / out= argument's alias over to the npu tensor.
  void write_back(Aliased& a) {
    c10::TensorImpl* host = a.host.unsafeGetTensorImpl();
    c10::TensorImpl* npu = a.npu.unsafeGetTensorImpl();
    c10::StorageImpl* now = host->storage().unsafeGetStorageImpl();
    if (now != a.host_storage) {
      npu->set_storage_keep_dtype(npu_storage_for(now));  // the kernel called set_ on the argument
    } else if (now->data() != a.data_before || now->nbytes() != a.nbytes_before) {
      // The kernel resized the argument: its alias storage now holds CPU memory, which the npu storage takes
      // over (in place, like a CUDA resize, so every npu view of that storage sees the new memory).
      c10::StorageImpl* target = a.npu.storage().unsafeGetStorageImpl();
      if (target->data() != now->data()) {
        target->set_data_ptr_noswap(
            adopt_host_memory(c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(now), index()));
        target->set_nbytes(now->nbytes());
      }
    }
    if (npu->sizes() != host->sizes() || npu->strides() != host->strides() ||
        npu->storage_offset() != host->storage_offset()) {
      npu->set_sizes_and_strides(host->sizes(), host->strides(), host->storage_offset());
    }
  }

  // A tensor the kernel returned, as the npu tensor a device would have returned.
  at::Tensor to_npu(const at::Tensor& out) {
    if (!out.defined() || !out.device().is_cpu()) {
      return out;
    }
    c10::TensorImpl* impl = out.unsafeGetTensorImpl();
    for (auto& a : aliased) {
      if (a.host.unsafeGetTensorImpl() == impl) {
        return a.npu;  // in-place and out= ops return their argument itself
      }
    }
    for (c10::TensorImpl* host : host_inputs) {
      if (host == impl) {
        return out;
      }
    }
    TORCH_CHECK(out.layout() == c10::kStrided, op_name(op),
                ": the emulated npu only supports strided tensors, the CPU kernel returned a ", out.layout(),
                " tensor");
    return tensor_like_on(npu_storage_for(out.storage().unsafeGetStorageImpl()), out, c10::DispatchKey::PrivateUse1);
  }
};

bool writes(const c10::Argument& arg) {
  return arg.alias_info() != nullptr && arg.alias_info()->isWrite();
}

// ------------------------------------------------------------------ the boxed fallback
// Ops whose output size depends on the values of their input: the host reads that size from the device
// (repeat_interleave only with a tensor of repeats and no output_size given).
bool data_dependent_shape(const c10::FunctionSchema& schema, const torch::jit::Stack& stack, size_t first) {
  static const std::unordered_set<std::string> names = {
      "aten::nonzero", "aten::masked_select", "aten::_unique", "aten::_unique2", "aten::unique_dim",
      "aten::unique_consecutive", "aten::unique_dim_consecutive", "aten::argwhere"};
  const std::string& name = schema.name();
  if (name == "aten::repeat_interleave") {
    if (schema.overload_name() == "self_int") {
      return false;
    }
    for (size_t i = 0; i < schema.arguments().size(); ++i) {
      if (schema.arguments()[i].name() == "output_size" && !stack[first + i].isNone()) {
        return false;
      }
    }
    return true;
  }
  return names.count(name) > 0;
}

void npu_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t num_args = schema.arguments().size();
  const size_t first = stack->size() - num_args;
  if (data_dependent_shape(schema, *stack, first)) {
    count_host_sync(HostSync::kDataDependentShape);
  }
  Call call(op);

  // 1. The op's device: its npu tensors (all on one index), else an npu `device=` argument (factories).
  for (size_t i = 0; i < num_args; ++i) {
    const c10::IValue& v = (*stack)[first + i];
    const std::string& arg = schema.arguments()[i].name();
    if (v.isTensor()) {
      call.scan(v.toTensor(), arg);
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList()) {
        call.scan(t, arg);
      }
    } else if (v.isOptionalTensorList()) {
      for (const auto& t : v.toOptionalTensorList()) {
        std::optional<at::Tensor> opt = t;
        if (opt.has_value()) {
          call.scan(*opt, arg);
        }
      }
    } else if (v.isDevice() && v.toDevice().type() == kNpu) {
      call.note_device(resolve(v.toDevice()), arg);
    }
  }
  if (!call.device) {
    call.device = c10::Device(kNpu, current_device());
  }

  // 2. Refuse host tensors the device would refuse; replace npu tensors by host aliases, npu devices by cpu.
  for (size_t i = 0; i < num_args; ++i) {
    c10::IValue& v = (*stack)[first + i];
    const c10::Argument& argument = schema.arguments()[i];
    const std::string& arg = argument.name();
    const bool written = writes(argument);
    if (v.isTensor()) {
      call.check_host(v.toTensor(), arg);
      v = call.to_host(v.toTensor(), written);
    } else if (v.isTensorList()) {
      c10::List<at::Tensor> hosts;
      for (const at::Tensor& t : v.toTensorList()) {
        call.check_host(t, arg);
        hosts.push_back(call.to_host(t, written));
      }
      v = std::move(hosts);
    } else if (v.isOptionalTensorList()) {
      c10::List<std::optional<at::Tensor>> hosts;
      for (const auto& t : v.toOptionalTensorList()) {
        std::optional<at::Tensor> opt = t;
        if (opt.has_value()) {
          call.check_host(*opt, arg);
          hosts.push_back(call.to_host(*opt, written));
        } else {
          hosts.push_back(std::nullopt);
        }
      }
      v = std::move(hosts);
    } else if (v.isDevice() && v.toDevice().type() == kNpu) {
      v = c10::Device(c10::kCPU);
    }
  }

  // 3. The CPU kernel, with the op's device current (allocations made on the way land there).
  {
    c10::DeviceGuard guard(*call.device);
    op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
  }

  // 4. In-place / out= arguments first (a returned argument must already carry the kernel's changes).
  for (Aliased& a : call.aliased) {
    if (a.written) {
      call.write_back(a);
    }
  }
  const auto& returns = schema.returns();
  const size_t first_out = stack->size() - returns.size();
  for (size_t i = 0; i < returns.size(); ++i) {
    c10::IValue& v = (*stack)[first_out + i];
    if (v.isTensor()) {
      v = call.to_npu(v.toTensor());
    } else if (v.isTensorList()) {
      c10::List<at::Tensor> outs;
      for (const at::Tensor& t : v.toTensorList()) {
        outs.push_back(call.to_npu(t));
      }
      v = std::move(outs);
    }
  }
}

// ------------------------------------------------------------------ kernels that must know the device
at::Tensor npu_empty(c10::IntArrayRef size, std::optional<at::ScalarType> dtype, std::optional<at::Layout> layout,
                     std::optional<at::Device> device, std::optional<bool> /*pin_memory*/,
                     std::optional<at::MemoryFormat> memory_format) {
  TORCH_CHECK(layout.value_or(c10::kStrided) == c10::kStrided, "the emulated npu only supports strided tensors");
  c10::DeviceGuard guard(resolve(device.value_or(c10::Device(kNpu))));
  return at::detail::empty_generic(size, allocator(), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   c10::dtype_or_default(dtype), memory_format);
}

at::Tensor npu_empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<at::ScalarType> dtype,
                             std::optional<at::Layout> layout, std::optional<at::Device> device,
                             std::optional<bool> /*pin_memory*/) {
  TORCH_CHECK(layout.value_or(c10::kStrided) == c10::kStrided, "the emulated npu only supports strided tensors");
  c10::DeviceGuard guard(resolve(device.value_or(c10::Device(kNpu))));
  return at::detail::empty_strided_generic(size, stride, allocator(),
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype));
}

// Make `self`'s storage hold at least `nbytes` (never shrinks, as CPU and CUDA resize_).
void ensure_storage_bytes(const at::Tensor& self, size_t nbytes) {
  c10::StorageImpl* storage = self.storage().unsafeGetStorageImpl();
  if (nbytes > storage->nbytes()) {
    c10::DeviceGuard guard(self.device());
    resize_storage_bytes(storage, nbytes);
  }
}

const at::Tensor& npu_resize_(const at::Tensor& self, c10::IntArrayRef size,
                              std::optional<at::MemoryFormat> memory_format) {
  c10::TensorImpl* impl = self.unsafeGetTensorImpl();
  if (self.sizes() != size || memory_format.has_value()) {
    impl->set_sizes_contiguous(size);
    if (impl->numel() > 0) {
      ensure_storage_bytes(self, at::detail::computeStorageNbytesContiguous(size, self.dtype().itemsize(),
                                                                            self.storage_offset()));
    }
    if (memory_format.has_value()) {
      TORCH_CHECK(*memory_format != at::MemoryFormat::Preserve, "unsupported memory format ", *memory_format);
      impl->empty_tensor_restride(*memory_format);
    }
  }
  return self;
}

at::Tensor& npu_set_storage(at::Tensor& self, at::Storage source, int64_t storage_offset, c10::IntArrayRef size,
                            c10::IntArrayRef stride) {
  TORCH_CHECK(source.device().type() == kNpu, "set_: expected an npu storage for an npu tensor, got a ",
              source.device().type(), " storage");
  TORCH_CHECK(storage_offset >= 0, "set_: storage_offset must be non-negative, got ", storage_offset);
  c10::TensorImpl* impl = self.unsafeGetTensorImpl();
  if (self.storage().unsafeGetStorageImpl() != source.unsafeGetStorageImpl()) {
    impl->set_storage_keep_dtype(std::move(source));
  }
  impl->set_storage_offset(storage_offset);
  if (stride.empty()) {
    impl->set_sizes_contiguous(size);
  } else {
    TORCH_CHECK(stride.size() == size.size(), "set_: ", size.size(), " sizes but ", stride.size(), " strides");
    impl->set_sizes_and_strides(size, stride);
  }
  if (impl->numel() > 0) {
    ensure_storage_bytes(self, at::detail::computeStorageNbytes(size, impl->strides(), self.dtype().itemsize(),
                                                                storage_offset));
  }
  return self;
}

at::Tensor& npu_set_source_storage(at::Tensor& self, at::Storage source) {
  int64_t numel = static_cast<int64_t>(source.nbytes() / self.dtype().itemsize());
  return npu_set_storage(self, std::move(source), 0, {numel}, {});
}

at::Tensor& npu_set_source_tensor(at::Tensor& self, const at::Tensor& source) {
  TORCH_CHECK(is_npu(source), "Expected all tensors to be on the same device, but found at least two devices, ",
              self.device(), " and ", source.device(), "! (set_)");
  if (self.unsafeGetTensorImpl() == source.unsafeGetTensorImpl()) {
    return self;
  }
  return npu_set_storage(self, source.storage(), source.storage_offset(), source.sizes(), source.strides());
}

at::Tensor& npu_set_empty(at::Tensor& self) {
  c10::DeviceGuard guard(self.device());
  c10::Storage empty(c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(), 0,
                                                           allocator()->allocate(0), allocator(), true));
  return npu_set_storage(self, std::move(empty), 0, {0}, {});
}

// Copies between the npu and the host (or two npu devices): the CPU copy on host aliases.
at::Tensor npu_copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  at::Tensor src_host = is_npu(self) ? host_alias(self) : self;
  at::Tensor dst_host = is_npu(dst) ? host_alias(dst) : dst;
  TORCH_CHECK(src_host.is_cpu() && dst_host.is_cpu(), "the emulated npu cannot copy from ", self.device(), " to ",
              dst.device());
  if (is_npu(self) && !is_npu(dst) && !non_blocking) {
    count_host_sync(HostSync::kCopyToHost);
  }
  dst_host.copy_(src_host, non_blocking);
  return dst;
}

at::Tensor npu_copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  if (is_npu(dst)) {
    npu_resize_(dst, self.sizes(), std::nullopt);
  } else {
    dst.resize_(self.sizes());
  }
  return npu_copy_from(self, dst, false);
}

c10::Scalar npu_local_scalar_dense(const at::Tensor& self) {
  count_host_sync(HostSync::kScalar);
  return at::_local_scalar_dense(host_alias(self));
}

// All work is synchronous: there is no stream for memory to wait on.
void npu_record_stream(at::Tensor& /*self*/, c10::Stream /*stream*/) {}

// ------------------------------------------------------------------ convolution
// For devices other than CPU/CUDA, aten's convolution calls convolution_overrideable, whose only kernel (the
// default) raises: a backend must provide it, as torch_npu does. Here: the CPU convolution on host aliases.
at::Tensor host_operand(const at::Tensor& t, c10::Device device, const char* arg, const char* op) {
  if (!t.defined()) {
    return t;
  }
  if (!is_npu(t) || t.device() != device) {
    refuse_devices(device, t.device(), arg, op);
  }
  return host_alias(t);
}

at::Tensor on_device(const at::Tensor& host, c10::DeviceIndex index) {
  if (!host.defined()) {
    return host;
  }
  auto storage = c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(host.storage().unsafeGetStorageImpl());
  return tensor_like_on(adopt_host_storage(std::move(storage), index), host, c10::DispatchKey::PrivateUse1);
}

at::Tensor npu_convolution(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                           c10::IntArrayRef stride, c10::IntArrayRef padding, c10::IntArrayRef dilation,
                           bool transposed, c10::IntArrayRef output_padding, int64_t groups) {
  const char* op = "aten::convolution_overrideable";
  c10::Device device = input.device();
  c10::DeviceGuard guard(device);
  std::optional<at::Tensor> host_bias;
  if (bias.has_value() && bias->defined()) {
    host_bias = host_operand(*bias, device, "bias", op);
  }
  at::Tensor out = at::convolution(host_operand(input, device, "input", op), host_operand(weight, device, "weight", op),
                                   host_bias, stride, padding, dilation, transposed, output_padding, groups);
  return on_device(out, device.index());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> npu_convolution_backward(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight, c10::IntArrayRef stride,
    c10::IntArrayRef padding, c10::IntArrayRef dilation, bool transposed, c10::IntArrayRef output_padding,
    int64_t groups, std::array<bool, 3> output_mask) {
  const char* op = "aten::convolution_backward_overrideable";
  c10::Device device = input.device();
  c10::DeviceGuard guard(device);
  std::vector<int64_t> bias_sizes{transposed ? weight.size(1) * groups : weight.size(0)};
  auto grads = at::convolution_backward(host_operand(grad_output, device, "grad_output", op),
                                        host_operand(input, device, "input", op),
                                        host_operand(weight, device, "weight", op), bias_sizes, stride, padding,
                                        dilation, transposed, output_padding, groups, output_mask);
  return {on_device(std::get<0>(grads), device.index()), on_device(std::get<1>(grads), device.index()),
          on_device(std::get<2>(grads), device.index())};
}

at::Tensor npu_as_strided(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride,
                          std::optional<int64_t> storage_offset) {
  return at::native::as_strided_tensorimpl(self, size, stride, storage_offset);
}

at::Tensor npu_view(const at::Tensor& self, c10::IntArrayRef size) {
  return at::native::view(self, size);
}

at::Tensor npu_reshape_alias(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride) {
  return at::native::_reshape_alias(self, size, stride);
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", TORCH_FN(npu_empty));
  m.impl("empty_strided", TORCH_FN(npu_empty_strided));
  m.impl("as_strided", TORCH_FN(npu_as_strided));
  m.impl("view", TORCH_FN(npu_view));
  m.impl("_reshape_alias", TORCH_FN(npu_reshape_alias));
  m.impl("resize_", TORCH_FN(npu_resize_));
  m.impl("set_.source_Storage_storage_offset", TORCH_FN(npu_set_storage));
  m.impl("set_.source_Storage", TORCH_FN(npu_set_source_storage));
  m.impl("set_.source_Tensor", TORCH_FN(npu_set_source_tensor));
  m.impl("set_", TORCH_FN(npu_set_empty));
  m.impl("_copy_from", TORCH_FN(npu_copy_from));
  m.impl("_copy_from_and_resize", TORCH_FN(npu_copy_from_and_resize));
  m.impl("_local_scalar_dense", TORCH_FN(npu_local_scalar_dense));
  m.impl("record_stream", TORCH_FN(npu_record_stream));
  m.impl("convolution_overrideable", TORCH_FN(npu_convolution));
  m.impl("convolution_backward_overrideable", TORCH_FN(npu_convolution_backward));
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&npu_fallback>());
}

namespace {
// aten ops that have a CPU kernel and also a composite one (CompositeExplicitAutograd, its NonFunctional variant for
// structured ops, or CompositeImplicitAutograd): on any backend without its own kernel torch runs the composite,
// which for native_layer_norm / native_group_norm / silu_backward is a different decomposition (other rounding)
// and for the ~380 structured ops allocates the output and calls the .out kernel. A real backend registers its own
// kernels for them, as torch_npu does; here they go to the CPU kernel through the fallback, so npu results are
// bit-identical to the CPU's. Registered at load, after the explicit kernels above (which are left alone).
struct RouteCpuKernels {
  RouteCpuKernels() {
    static torch::Library library(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
    auto& dispatcher = c10::Dispatcher::singleton();
    for (const c10::OperatorName& name : dispatcher.getAllOpNames()) {
      if (name.name.rfind("aten::", 0) != 0) {
        continue;
      }
      auto op = dispatcher.findOp(name);
      if (!op || !op->hasKernelForDispatchKey(c10::DispatchKey::CPU) ||
          op->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1)) {
        continue;
      }
      if (op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd) ||
          op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional) ||
          op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd)) {
        library.impl(c10::toString(name).c_str(), torch::CppFunction::makeFromBoxedFunction<&npu_fallback>());
      }
    }
  }
};
RouteCpuKernels route_cpu_kernels;

// Ops without an autograd formula (c10d collectives, ...) need an autograd fallback on the npu. torch 2.13
// registers its basic one for AutogradPrivateUse1 itself; torch 2.7 leaves it to the backend (torch_npu registers
// one), so it is registered here only where torch has none.
struct AutogradFallback {
  AutogradFallback() {
    if (!c10::Dispatcher::singleton().hasBackendFallbackForDispatchKey(c10::DispatchKey::AutogradPrivateUse1)) {
      static torch::Library library(torch::Library::IMPL, "_", c10::DispatchKey::AutogradPrivateUse1, __FILE__,
                                    __LINE__);
      library.fallback(torch::autograd::basicAutogradNotImplementedFallback());
    }
  }
};
AutogradFallback autograd_fallback;
}  // namespace

}  // namespace msf_npu
