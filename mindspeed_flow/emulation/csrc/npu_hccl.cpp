// The emulated HCCL backend (see npu_hccl.h): each op checks that its tensors are npu tensors, as
// ProcessGroupHCCL does, and hands gloo their host aliases.
#include "npu_hccl.h"

#include "npu_runtime.h"

#include <ATen/core/ivalue.h>

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <exception>
#include <thread>
#include <utility>

namespace msf_npu {

// One emulated stream: tasks run one at a time, in the order they were pushed, on a detached worker thread (a
// thread blocked in a gloo wait that never ends must not keep the process from exiting).
class StreamQueue {
 public:
  StreamQueue() : state_(std::make_shared<State>()) {
    std::thread([state = state_] { run(state); }).detach();
  }

  ~StreamQueue() {
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      state_->stop = true;
    }
    state_->cv.notify_all();
  }

  void push(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      state_->tasks.push_back(std::move(task));
    }
    state_->cv.notify_one();
  }

 private:
  struct State {
    std::mutex mutex;
    std::condition_variable cv;
    std::deque<std::function<void()>> tasks;
    bool stop = false;
  };

  static void run(const std::shared_ptr<State>& state) {
    while (true) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(state->mutex);
        state->cv.wait(lock, [&] { return state->stop || !state->tasks.empty(); });
        if (state->tasks.empty()) {
          return;  // stopped and drained
        }
        task = std::move(state->tasks.front());
        state->tasks.pop_front();
      }
      task();
    }
  }

  std::shared_ptr<State> state_;
};

namespace {

// The work of an operation issued on an emulated stream: completed by the stream's worker once the gloo work
// behind it has (with its error, if it failed).
class StreamWork final : public c10d::Work {
 public:
  StreamWork(int rank, c10d::OpType type, std::vector<at::Tensor> result)
      : c10d::Work(rank, type), result_(std::move(result)),
        future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))) {}

  void complete(std::exception_ptr error) {
    finish(error);
    if (error) {
      future_->setError(error);
    } else {
      future_->markCompleted(c10::IValue(result_));
    }
  }

  std::vector<at::Tensor> result() override {
    return result_;
  }

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    return future_;
  }

 private:
  std::vector<at::Tensor> result_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

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
    : c10d::Backend(rank, size), gloo_(std::move(gloo)), group_name_(std::move(group_name)) {
  // torch_npu: per-pair p2p communicators unless P2P_HCCL_BUFFSIZE is 0 (OptionsManager::GetP2PBufferSize,
  // default 20 MB; ProcessGroupHCCL::pointToPoint picks the pair's key when it is not 0).
  const char* p2p_buffer = std::getenv("P2P_HCCL_BUFFSIZE");
  p2p_on_group_stream_ = p2p_buffer != nullptr && std::strtol(p2p_buffer, nullptr, 10) == 0;
}

std::string HcclBackend::p2p_stream(int peer) const {
  if (p2p_on_group_stream_) {
    return "group";
  }
  int me = getRank();
  return "p2p:" + std::to_string(std::min(me, peer)) + ":" + std::to_string(std::max(me, peer));
}

c10::intrusive_ptr<c10d::Work> HcclBackend::on_stream(const std::string& key, c10d::OpType type,
                                                      std::vector<at::Tensor> result,
                                                      std::function<c10::intrusive_ptr<c10d::Work>()> op) {
  std::shared_ptr<StreamQueue> stream;
  {
    std::lock_guard<std::mutex> lock(streams_mutex_);
    auto& slot = streams_[key];
    if (!slot) {
      slot = std::make_shared<StreamQueue>();
    }
    stream = slot;
  }
  auto work = c10::make_intrusive<StreamWork>(getRank(), type, std::move(result));
  stream->push([op = std::move(op), work]() {
    std::exception_ptr error;
    try {
      op()->wait();
    } catch (...) {
      error = std::current_exception();
    }
    work->complete(error);
  });
  return work;
}

// torch_npu runs ReduceOp::AVG as a sum and divides by the group size afterwards (ProcessGroupHCCL.cpp
// getHcclReduceOp: "HCCL does not support ReduceOp::AVG yet, PTA supports it by summing first, then dividing");
// gloo refuses AVG ("Cannot use ReduceOp.AVG with Gloo"), so the emulated backend does as torch_npu does:
// MindSpeed-MM's pretrain_transformers.py averages its logged loss with an AVG all-reduce.
namespace {
template <typename Options>
bool sum_for_average(Options& opts) {
  if (opts.reduceOp == c10d::ReduceOp::AVG) {
    opts.reduceOp = c10d::ReduceOp::SUM;
    return true;
  }
  return false;
}

// A work that already completed: gloo's reduce-scatter work copies its results into the outputs on each wait(),
// so after dividing them the original work must not be waited on again.
class CompletedWork : public c10d::Work {
 public:
  bool isCompleted() override { return true; }
  bool wait(std::chrono::milliseconds /*timeout*/) override { return true; }
};

c10::intrusive_ptr<c10d::Work> divided(c10::intrusive_ptr<c10d::Work> work, bool average,
                                       const std::vector<at::Tensor>& outputs, int group_size) {
  if (average) {
    work->wait();
    for (const auto& t : outputs) {
      if (at::isFloatingType(t.scalar_type()) || at::isComplexType(t.scalar_type())) {
        t.div_(group_size);
      } else {
        t.div_(group_size, "trunc");
      }
    }
    return c10::make_intrusive<CompletedWork>();
  }
  return work;
}
}  // namespace

// Every collective runs on the group's stream; `G` is the gloo backend, captured by each queued operation.
c10::intrusive_ptr<c10d::Work> HcclBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                      const c10d::BroadcastOptions& opts) {
  return on_stream("group", c10d::OpType::BROADCAST, tensors,
                   [G = gloo_, h = hosts_of(tensors), opts]() mutable { return G->broadcast(h, opts); });
}

c10::intrusive_ptr<c10d::Work> HcclBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                      const c10d::AllreduceOptions& opts) {
  return on_stream("group", c10d::OpType::ALLREDUCE, tensors,
                   [G = gloo_, h = hosts_of(tensors), opts]() mutable {
                     auto o = opts;  // the capture is const
                     bool avg = sum_for_average(o);
                     return divided(G->allreduce(h, o), avg, h, G->getSize());
                   });
}

c10::intrusive_ptr<c10d::Work> HcclBackend::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                const c10d::AllreduceCoalescedOptions& opts) {
  return on_stream("group", c10d::OpType::ALLREDUCE_COALESCED, tensors,
                   [G = gloo_, h = hosts_of(tensors), opts]() mutable {
                     auto o = opts;  // the capture is const
                     bool avg = sum_for_average(o);
                     return divided(G->allreduce_coalesced(h, o), avg, h, G->getSize());
                   });
}

c10::intrusive_ptr<c10d::Work> HcclBackend::reduce(std::vector<at::Tensor>& tensors,
                                                   const c10d::ReduceOptions& opts) {
  return on_stream("group", c10d::OpType::REDUCE, tensors,
                   [G = gloo_, h = hosts_of(tensors), opts]() mutable { return G->reduce(h, opts); });
}

c10::intrusive_ptr<c10d::Work> HcclBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                      std::vector<at::Tensor>& inputs,
                                                      const c10d::AllgatherOptions& opts) {
  std::vector<at::Tensor> result = outputs.empty() ? std::vector<at::Tensor>{} : outputs[0];
  return on_stream("group", c10d::OpType::ALLGATHER, result,
                   [G = gloo_, out = hosts_of(outputs), in = hosts_of(inputs), opts]() mutable {
                     return G->allgather(out, in, opts);
                   });
}

// HCCL's single-tensor all-gather and reduce-scatter check dtypes and element counts only (torch_npu
// ProcessGroupHCCL::_allgather_base / _reduce_scatter_base, v2.7.1-7.3.0: "output tensor size must be equal to
// world_size times input tensor size", "input tensor must be the same size as output size times world size"), so
// callers pass any shapes with those counts: MindSpeed-MM's expert-parallel dispatcher gathers a [experts] vector
// into an [ep, experts] tensor (fsdp/distributed/expert_parallel/ep_dispatcher.py, dispatch_preprocess). Gloo
// compares shapes, so it gets flat views of the same memory.
namespace {
at::Tensor flat(const at::Tensor& t) {
  return t.is_contiguous() ? t.view({-1}) : t;
}
}  // namespace

c10::intrusive_ptr<c10d::Work> HcclBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                            const c10d::AllgatherOptions& opts) {
  TORCH_CHECK(input.dtype() == output.dtype(), "output tensor must have the same type as input tensor");
  TORCH_CHECK(input.numel() * gloo_->getSize() == output.numel(),
              "output tensor size must be equal to world_size times input tensor size");
  return on_stream("group", c10d::OpType::_ALLGATHER_BASE, {output},
                   [G = gloo_, out = flat(host_of(output)), in = flat(host_of(input)), opts]() mutable {
                     return G->_allgather_base(out, in, opts);
                   });
}

c10::intrusive_ptr<c10d::Work> HcclBackend::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                                std::vector<at::Tensor>& inputs,
                                                                const c10d::AllgatherOptions& opts) {
  return on_stream("group", c10d::OpType::ALLGATHER_COALESCED, inputs,
                   [G = gloo_, out = hosts_of(outputs), in = hosts_of(inputs), opts]() mutable {
                     return G->allgather_coalesced(out, in, opts);
                   });
}

c10::intrusive_ptr<c10d::Work> HcclBackend::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                            std::vector<at::Tensor>& inputs,
                                                                            const c10d::AllgatherOptions& opts) {
  return on_stream("group", c10d::OpType::COALESCED, outputs,
                   [G = gloo_, out = hosts_of(outputs), in = hosts_of(inputs), opts]() mutable {
                     return G->allgather_into_tensor_coalesced(out, in, opts);
                   });
}

c10::intrusive_ptr<c10d::Work> HcclBackend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                   std::vector<at::Tensor>& inputs,
                                                   const c10d::GatherOptions& opts) {
  std::vector<at::Tensor> result = outputs.empty() ? std::vector<at::Tensor>{} : outputs[0];
  return on_stream("group", c10d::OpType::GATHER, result,
                   [G = gloo_, out = hosts_of(outputs), in = hosts_of(inputs), opts]() mutable {
                     return G->gather(out, in, opts);
                   });
}

c10::intrusive_ptr<c10d::Work> HcclBackend::scatter(std::vector<at::Tensor>& outputs,
                                                    std::vector<std::vector<at::Tensor>>& inputs,
                                                    const c10d::ScatterOptions& opts) {
  return on_stream("group", c10d::OpType::SCATTER, outputs,
                   [G = gloo_, out = hosts_of(outputs), in = hosts_of(inputs), opts]() mutable {
                     return G->scatter(out, in, opts);
                   });
}

c10::intrusive_ptr<c10d::Work> HcclBackend::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                           std::vector<std::vector<at::Tensor>>& inputs,
                                                           const c10d::ReduceScatterOptions& opts) {
  return on_stream("group", c10d::OpType::REDUCE_SCATTER, outputs,
                   [G = gloo_, out = hosts_of(outputs), in = hosts_of(inputs), opts]() mutable {
                     auto o = opts;  // the capture is const
                     bool avg = sum_for_average(o);
                     return divided(G->reduce_scatter(out, in, o), avg, out, G->getSize());
                   });
}

c10::intrusive_ptr<c10d::Work> HcclBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                 const c10d::ReduceScatterOptions& opts) {
  TORCH_CHECK(input.dtype() == output.dtype(), "input tensor must be the same type as the output tensor.");
  TORCH_CHECK(input.numel() == output.numel() * gloo_->getSize(),
              "input tensor must be the same size as output size times world size");
  return on_stream("group", c10d::OpType::_REDUCE_SCATTER_BASE, {output},
                   [G = gloo_, out = flat(host_of(output)), in = flat(host_of(input)), opts]() mutable {
                     auto o = opts;  // the capture is const
                     bool avg = sum_for_average(o);
                     return divided(G->_reduce_scatter_base(out, in, o), avg, {out}, G->getSize());
                   });
}

c10::intrusive_ptr<c10d::Work> HcclBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::ReduceScatterOptions& opts) {
  return on_stream("group", c10d::OpType::COALESCED, outputs,
                   [G = gloo_, out = hosts_of(outputs), in = hosts_of(inputs), opts]() mutable {
                     auto o = opts;  // the capture is const
                     bool avg = sum_for_average(o);
                     return divided(G->reduce_scatter_tensor_coalesced(out, in, o), avg, out, G->getSize());
                   });
}

c10::intrusive_ptr<c10d::Work> HcclBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                          std::vector<int64_t>& output_split_sizes,
                                                          std::vector<int64_t>& input_split_sizes,
                                                          const c10d::AllToAllOptions& opts) {
  return on_stream("group", c10d::OpType::ALLTOALL_BASE, {output},
                   [G = gloo_, out = host_of(output), in = host_of(input), os = output_split_sizes,
                    is = input_split_sizes, opts]() mutable { return G->alltoall_base(out, in, os, is, opts); });
}

c10::intrusive_ptr<c10d::Work> HcclBackend::alltoall(std::vector<at::Tensor>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllToAllOptions& opts) {
  return on_stream("group", c10d::OpType::ALLTOALL, outputs,
                   [G = gloo_, out = hosts_of(outputs), in = hosts_of(inputs), opts]() mutable {
                     return G->alltoall(out, in, opts);
                   });
}

// HCCL has no message tags: ProcessGroupHCCL::send/recv take one and drop it (HcclSend/HcclRecv match a pair's
// messages in the order they were posted). Every p2p message here rides gloo tag 0 for the same matching, on the
// pair's stream.
constexpr int kHcclTag = 0;

c10::intrusive_ptr<c10d::Work> HcclBackend::send(std::vector<at::Tensor>& tensors, int dst_rank, int /*tag*/) {
  return on_stream(p2p_stream(dst_rank), c10d::OpType::SEND, tensors,
                   [G = gloo_, h = hosts_of(tensors), dst_rank]() mutable { return G->send(h, dst_rank, kHcclTag); });
}

c10::intrusive_ptr<c10d::Work> HcclBackend::recv(std::vector<at::Tensor>& tensors, int src_rank, int /*tag*/) {
  return on_stream(p2p_stream(src_rank), c10d::OpType::RECV, tensors,
                   [G = gloo_, h = hosts_of(tensors), src_rank]() mutable { return G->recv(h, src_rank, kHcclTag); });
}

c10::intrusive_ptr<c10d::Work> HcclBackend::recvAnysource(std::vector<at::Tensor>& tensors, int /*tag*/) {
  return on_stream("group", c10d::OpType::RECVANYSOURCE, tensors,
                   [G = gloo_, h = hosts_of(tensors)]() mutable { return G->recvAnysource(h, kHcclTag); });
}

c10::intrusive_ptr<c10d::Work> HcclBackend::barrier(const c10d::BarrierOptions& opts) {
  return on_stream("group", c10d::OpType::BARRIER, {},
                   [G = gloo_, opts]() mutable { return G->barrier(opts); });
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
  std::vector<at::Tensor> hosts;
  hosts.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    TORCH_CHECK(op_type[i] == "isend" || op_type[i] == "irecv",
                "batch_isend_irecv: op type must be isend or irecv, got ", op_type[i]);
    hosts.push_back(host_of(tensors[i]));
  }
  // ProcessGroupHCCL runs a batch as one grouped operation on the group communicator's stream: its sends and
  // receives progress together (no order among them), and the batch is one work.
  return on_stream("group", c10d::OpType::UNKNOWN, tensors,
                   [G = gloo_, rank = getRank(), ops = op_type, hosts, peers = remote_rank_list]() mutable {
                     std::vector<c10::intrusive_ptr<c10d::Work>> works;
                     works.reserve(hosts.size());
                     for (size_t i = 0; i < hosts.size(); ++i) {
                       std::vector<at::Tensor> one{hosts[i]};
                       int peer = static_cast<int>(peers[i]);
                       works.push_back(ops[i] == "isend" ? G->send(one, peer, kHcclTag)
                                                         : G->recv(one, peer, kHcclTag));
                     }
                     return c10::intrusive_ptr<c10d::Work>(
                         c10::make_intrusive<BatchWork>(rank, std::move(works), hosts));
                   });
}

}  // namespace msf_npu
