// The emulated HCCL backend (see npu_hccl.h): each op checks that its tensors are npu tensors, as
// ProcessGroupHCCL does, and hands gloo their host aliases.
#include "npu_hccl.h"

#include "npu_runtime.h"

#include <exception>
#include <utility>

namespace msf_npu {
namespace {

// The host alias of one tensor of a collective; a host tensor that reached the backend (mixed into a list whose
// first tensor is on the npu) is refused with ProcessGroup's own wording for a device without a backend.
at::Tensor host_of(const at::Tensor& t) {
  TORCH_CHECK(t.device().type() == kNpu, "No backend type associated with device type ", t.device().type(),
              " (the hccl backend only takes npu tensors)");
  return host_alias(t);
}

std::vector<at::Tensor> hosts_of(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> out;
  out.reserve(tensors.size());
  for (const at::Tensor& t : tensors) {
    out.push_back(host_of(t));
  }
  return out;
}

std::vector<std::vector<at::Tensor>> hosts_of(const std::vector<std::vector<at::Tensor>>& lists) {
  std::vector<std::vector<at::Tensor>> out;
  out.reserve(lists.size());
  for (const auto& list : lists) {
    out.push_back(hosts_of(list));
  }
  return out;
}

// One work over several: complete when every one is; waiting waits on each.
class BatchWork final : public c10d::Work {
 public:
  BatchWork(int rank, std::vector<c10::intrusive_ptr<c10d::Work>> works, std::vector<at::Tensor> tensors)
      : c10d::Work(rank, c10d::OpType::UNKNOWN), works_(std::move(works)), tensors_(std::move(tensors)) {}

  bool isCompleted() override {
    for (auto& w : works_) {
      if (!w->isCompleted()) {
        return false;
      }
    }
    return true;
  }

  bool isSuccess() const override {
    for (const auto& w : works_) {
      if (!w->isSuccess()) {
        return false;
      }
    }
    return true;
  }

  std::exception_ptr exception() const override {
    for (const auto& w : works_) {
      if (std::exception_ptr e = w->exception()) {
        return e;
      }
    }
    return nullptr;
  }

  bool wait(std::chrono::milliseconds timeout) override {
    for (auto& w : works_) {
      w->wait(timeout);
    }
    return true;
  }

  std::vector<at::Tensor> result() override {
    return tensors_;
  }

  void abort() override {
    for (auto& w : works_) {
      w->abort();
    }
  }

 private:
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
  std::vector<at::Tensor> tensors_;  // the npu tensors of the batch
};

}  // namespace

HcclBackend::HcclBackend(int rank, int size, c10::intrusive_ptr<c10d::Backend> gloo, std::string group_name)
    : c10d::Backend(rank, size), gloo_(std::move(gloo)), group_name_(std::move(group_name)) {}

c10::intrusive_ptr<c10d::Work> HcclBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                      const c10d::BroadcastOptions& opts) {
  auto h = hosts_of(tensors);
  return gloo_->broadcast(h, opts);
}

c10::intrusive_ptr<c10d::Work> HcclBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                      const c10d::AllreduceOptions& opts) {
  auto h = hosts_of(tensors);
  return gloo_->allreduce(h, opts);
}

c10::intrusive_ptr<c10d::Work> HcclBackend::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                const c10d::AllreduceCoalescedOptions& opts) {
  auto h = hosts_of(tensors);
  return gloo_->allreduce_coalesced(h, opts);
}

c10::intrusive_ptr<c10d::Work> HcclBackend::reduce(std::vector<at::Tensor>& tensors,
                                                   const c10d::ReduceOptions& opts) {
  auto h = hosts_of(tensors);
  return gloo_->reduce(h, opts);
}

c10::intrusive_ptr<c10d::Work> HcclBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                      std::vector<at::Tensor>& inputs,
                                                      const c10d::AllgatherOptions& opts) {
  auto out = hosts_of(outputs);
  auto in = hosts_of(inputs);
  return gloo_->allgather(out, in, opts);
}

c10::intrusive_ptr<c10d::Work> HcclBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                            const c10d::AllgatherOptions& opts) {
  at::Tensor out = host_of(output);
  at::Tensor in = host_of(input);
  return gloo_->_allgather_base(out, in, opts);
}

c10::intrusive_ptr<c10d::Work> HcclBackend::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                                std::vector<at::Tensor>& inputs,
                                                                const c10d::AllgatherOptions& opts) {
  auto out = hosts_of(outputs);
  auto in = hosts_of(inputs);
  return gloo_->allgather_coalesced(out, in, opts);
}

c10::intrusive_ptr<c10d::Work> HcclBackend::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                            std::vector<at::Tensor>& inputs,
                                                                            const c10d::AllgatherOptions& opts) {
  auto out = hosts_of(outputs);
  auto in = hosts_of(inputs);
  return gloo_->allgather_into_tensor_coalesced(out, in, opts);
}

c10::intrusive_ptr<c10d::Work> HcclBackend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                   std::vector<at::Tensor>& inputs,
                                                   const c10d::GatherOptions& opts) {
  auto out = hosts_of(outputs);
  auto in = hosts_of(inputs);
  return gloo_->gather(out, in, opts);
}

c10::intrusive_ptr<c10d::Work> HcclBackend::scatter(std::vector<at::Tensor>& outputs,
                                                    std::vector<std::vector<at::Tensor>>& inputs,
                                                    const c10d::ScatterOptions& opts) {
  auto out = hosts_of(outputs);
  auto in = hosts_of(inputs);
  return gloo_->scatter(out, in, opts);
}

c10::intrusive_ptr<c10d::Work> HcclBackend::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                           std::vector<std::vector<at::Tensor>>& inputs,
                                                           const c10d::ReduceScatterOptions& opts) {
  auto out = hosts_of(outputs);
  auto in = hosts_of(inputs);
  return gloo_->reduce_scatter(out, in, opts);
}

c10::intrusive_ptr<c10d::Work> HcclBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                 const c10d::ReduceScatterOptions& opts) {
  at::Tensor out = host_of(output);
  at::Tensor in = host_of(input);
  return gloo_->_reduce_scatter_base(out, in, opts);
}

c10::intrusive_ptr<c10d::Work> HcclBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::ReduceScatterOptions& opts) {
  auto out = hosts_of(outputs);
  auto in = hosts_of(inputs);
  return gloo_->reduce_scatter_tensor_coalesced(out, in, opts);
}

c10::intrusive_ptr<c10d::Work> HcclBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                          std::vector<int64_t>& output_split_sizes,
                                                          std::vector<int64_t>& input_split_sizes,
                                                          const c10d::AllToAllOptions& opts) {
  at::Tensor out = host_of(output);
  at::Tensor in = host_of(input);
  return gloo_->alltoall_base(out, in, output_split_sizes, input_split_sizes, opts);
}

c10::intrusive_ptr<c10d::Work> HcclBackend::alltoall(std::vector<at::Tensor>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllToAllOptions& opts) {
  auto out = hosts_of(outputs);
  auto in = hosts_of(inputs);
  return gloo_->alltoall(out, in, opts);
}

// HCCL has no message tags: ProcessGroupHCCL::send/recv take one and drop it (HcclSend/HcclRecv match a pair's
// messages in the order they were posted). Every p2p message here rides gloo tag 0 for the same matching.
constexpr int kHcclTag = 0;

c10::intrusive_ptr<c10d::Work> HcclBackend::send(std::vector<at::Tensor>& tensors, int dst_rank, int /*tag*/) {
  auto h = hosts_of(tensors);
  return gloo_->send(h, dst_rank, kHcclTag);
}

c10::intrusive_ptr<c10d::Work> HcclBackend::recv(std::vector<at::Tensor>& tensors, int src_rank, int /*tag*/) {
  auto h = hosts_of(tensors);
  return gloo_->recv(h, src_rank, kHcclTag);
}

c10::intrusive_ptr<c10d::Work> HcclBackend::recvAnysource(std::vector<at::Tensor>& tensors, int /*tag*/) {
  auto h = hosts_of(tensors);
  return gloo_->recvAnysource(h, kHcclTag);
}

c10::intrusive_ptr<c10d::Work> HcclBackend::barrier(const c10d::BarrierOptions& opts) {
  return gloo_->barrier(opts);
}

void HcclBackend::monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) {
  gloo_->monitoredBarrier(opts, wait_all_ranks);
}

void HcclBackend::setSequenceNumberForGroup() {
  gloo_->setSequenceNumberForGroup();
}

uint64_t HcclBackend::getSequenceNumberForGroup() {
  return gloo_->getSequenceNumberForGroup();
}

c10::intrusive_ptr<c10d::Work> HcclBackend::batch_isend_irecv(const std::vector<std::string>& op_type,
                                                              std::vector<at::Tensor>& tensors,
                                                              const std::vector<int64_t>& remote_rank_list) {
  TORCH_CHECK(op_type.size() == tensors.size() && tensors.size() == remote_rank_list.size(),
              "batch_isend_irecv: ", op_type.size(), " op types, ", tensors.size(), " tensors and ",
              remote_rank_list.size(), " remote ranks");
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  works.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    std::vector<at::Tensor> one{host_of(tensors[i])};
    int peer = static_cast<int>(remote_rank_list[i]);
    if (op_type[i] == "isend") {
      works.push_back(gloo_->send(one, peer, kHcclTag));
    } else if (op_type[i] == "irecv") {
      works.push_back(gloo_->recv(one, peer, kHcclTag));
    } else {
      TORCH_CHECK(false, "batch_isend_irecv: op type must be isend or irecv, got ", op_type[i]);
    }
  }
  return c10::make_intrusive<BatchWork>(getRank(), std::move(works), tensors);
}

}  // namespace msf_npu
