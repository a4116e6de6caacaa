// The emulated HCCL process-group backend: a c10d::Backend for npu tensors that runs every collective and
// point-to-point op on a gloo backend, over host aliases of the npu tensors (zero copy: gloo reads and writes
// the npu memory). Registered from Python for device type npu only, as torch_npu registers ProcessGroupHCCL,
// so a host tensor given to a collective of an hccl group is refused by torch's ProcessGroup itself.
//
// Stream order. ProcessGroupHCCL runs each communicator's operations on one stream, in the order they were
// issued: the group's collectives (and torch_npu's batch_isend_irecv) on the group communicator's stream, and
// point-to-point operations on a communicator of their own per pair of ranks (key "low:high", both directions on
// one stream; with P2P_HCCL_BUFFSIZE=0 they use the group communicator instead). An operation does not start
// before the one ahead of it on its stream has completed, and a send completes only when the peer's stream has
// reached the matching receive. gloo runs every operation as soon as it is posted, so a program whose operations
// wait on each other in a cycle (a receive posted ahead of the send its peer waits for) would pass here and hang
// on a device. Each stream is therefore a queue with a worker thread that issues one gloo operation at a time
// and waits for it before the next (`StreamQueue`); the caller gets a work that completes when its operation has.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace msf_npu {

class StreamQueue;

class HcclBackend final : public c10d::Backend {
 public:
  HcclBackend(int rank, int size, c10::intrusive_ptr<c10d::Backend> gloo, std::string group_name);

  const std::string getBackendName() const override {
    return "hccl";
  }

  // The group's name (its key in torch.distributed's registry): the fake HCCL communicator names resolve it.
  const std::string& group_name() const {
    return group_name_;
  }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_split_sizes,
                                               std::vector<int64_t>& input_split_sizes,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst_rank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src_rank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override;
  void setSequenceNumberForGroup() override;
  uint64_t getSequenceNumberForGroup() override;

  // ProcessGroupHCCL::batch_isend_irecv: every op of a batch ("isend"/"irecv", tensors, group ranks) behind ONE
  // work, which torch_npu's batch_isend_irecv returns as a one-element list.
  c10::intrusive_ptr<c10d::Work> batch_isend_irecv(const std::vector<std::string>& op_type,
                                                   std::vector<at::Tensor>& tensors,
                                                   const std::vector<int64_t>& remote_rank_list);

 private:
  // Issue `op` (which posts one gloo operation and returns its work) on stream `key`, after every operation
  // issued on that stream before it; the returned work completes when the gloo work has.
  c10::intrusive_ptr<c10d::Work> on_stream(const std::string& key, c10d::OpType type,
                                           std::vector<at::Tensor> result,
                                           std::function<c10::intrusive_ptr<c10d::Work>()> op);
  std::string p2p_stream(int peer) const;

  c10::intrusive_ptr<c10d::Backend> gloo_;
  std::string group_name_;
  bool p2p_on_group_stream_;  // P2P_HCCL_BUFFSIZE=0: no per-pair communicators
  std::mutex streams_mutex_;
  std::unordered_map<std::string, std::shared_ptr<StreamQueue>> streams_;
};

}  // namespace msf_npu
