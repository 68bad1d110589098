// smp/pytorch/counting_group.h — a process group that counts the communication issued through it.
//
// Tests of tensor-parallel layers want to assert what a layer communicates ("one all-reduce of
// the output in forward, one of the input gradient in backward"), on the real backend. A
// CountingGroup wraps an existing c10d::ProcessGroup (e.g. smp's gloo TP group): its group() is
// a new c10d::ProcessGroup with the same rank and size whose CPU backend is a CountingBackend,
// which counts each op and forwards it, unchanged, to the CPU backend of the wrapped group. So
// the ops still reach the real peers (the wrapped group's ranks must all issue them, wrapped or
// not) and the counts are what this rank asked for, per op kind.
//
// What is counted, per op kind (the key is the c10d::Backend method's name):
//   calls  the number of times the op was issued on this rank. An op is counted when it is
//          issued, before it is forwarded: a call that the inner backend rejects, or whose Work
//          later fails, still counts.
//   bytes  the sum of nbytes() over the tensors this rank passes as the op's input:
//            allreduce, allreduce_coalesced, reduce, broadcast   the tensors (in place)
//            allgather, gather, alltoall                         the input tensors
//            _allgather_base, _reduce_scatter_base,
//            alltoall_base                                       the input buffer
//            allgather_into_tensor_coalesced,
//            reduce_scatter_tensor_coalesced                     the inputs
//            reduce_scatter, scatter                             the input lists (scatter: the
//                                                                root's; 0 on other ranks)
//            send                                                the tensors sent
//            recv, recvAnysource                                 the receive buffers
//            barrier                                             0
//          Input, not output: an all-gather of a 1 KiB shard counts 1 KiB, a reduce-scatter of
//          a 1 KiB tensor counts 1 KiB (its output is 1 KiB / group size).
// Only ops that were issued appear in counts(), so a test can compare the whole map.
//
// How torch names reach these keys (torch 2.13, through the c10d dispatcher ops):
//   dist.all_reduce -> allreduce, dist.broadcast -> broadcast, dist.all_gather -> allgather,
//   dist.all_gather_into_tensor -> _allgather_base, dist.reduce_scatter -> reduce_scatter,
//   dist.reduce_scatter_tensor -> _reduce_scatter_base, dist.barrier -> barrier,
//   dist.send / dist.recv -> send / recv; smp::pytorch::tp functions -> allreduce,
//   _allgather_base, _reduce_scatter_base (see tp_comm.h).
//
// Limits: CPU tensors only (the wrapper sets the CPU backend only; a CUDA tensor fails as "no
// backend for cuda"). Ops not listed above (coalescing, splitting, timeouts, sequence numbers)
// are not forwarded and fail with c10d's "does not support" error; abort() and shutdown() are
// not forwarded either, so dropping the wrapper never shuts the wrapped group down. In Python the
// wrapper's group is not registered with torch.distributed (it was not made by new_group), so
// functions that look a group up by name or in the world's maps (get_process_group_ranks,
// get_backend, functional collectives) do not know it; the plain collectives do.
//
// Example:
//   smp::pytorch::CountingGroup counting(tp_group);
//   at::Tensor y = smp::pytorch::tp::reduce_from_region(x, counting.group());  // x: 4 floats
//   // counting.counts() == {{"allreduce", {1, 16}}}
//   counting.reset();
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace smp::pytorch {

/// Calls and input bytes of one kind of op (see the file comment for what is counted).
struct OpCount {
  int64_t calls = 0;
  int64_t bytes = 0;

  friend bool operator==(const OpCount& a, const OpCount& b) {
    return a.calls == b.calls && a.bytes == b.bytes;
  }
  friend bool operator!=(const OpCount& a, const OpCount& b) { return !(a == b); }
};

/// A c10d::Backend that counts each op and forwards it to `inner`. Thread-safe: ops may be
/// issued from several threads at once (e.g. the autograd engine's and the caller's).
class CountingBackend : public c10d::Backend {
 public:
  /// Forwards to `inner`, taking its rank and size. Throws smp::Error if `inner` is null.
  explicit CountingBackend(c10::intrusive_ptr<c10d::Backend> inner);

  /// "smp_counting".
  const std::string getBackendName() const override;

  /// The counts per op kind since construction or the last reset(); only issued kinds appear.
  std::map<std::string, OpCount> counts() const;

  /// Forgets every count.
  void reset();

  /// The backend the ops are forwarded to.
  const c10::intrusive_ptr<c10d::Backend>& inner() const { return inner_; }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_split_sizes,
                                               std::vector<int64_t>& input_split_sizes,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst_rank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src_rank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;

 private:
  void count(const char* op, int64_t bytes);

  const c10::intrusive_ptr<c10d::Backend> inner_;
  mutable std::mutex mutex_;
  std::map<std::string, OpCount> counts_;  // guarded by mutex_
};

/// Wraps a process group so that what is issued through group() is counted (see the file
/// comment). The wrapper and the wrapped group share the wrapped group's CPU backend.
class CountingGroup {
 public:
  /// Throws smp::Error if `inner` is null or has no CPU backend.
  explicit CountingGroup(const c10::intrusive_ptr<c10d::ProcessGroup>& inner);

  /// The counting process group: same rank and size as the wrapped one; use it wherever the
  /// wrapped group would be used. It stays usable (and counting) after the CountingGroup is gone.
  const c10::intrusive_ptr<c10d::ProcessGroup>& group() const { return group_; }

  /// The counts per op kind since construction or the last reset(); only issued kinds appear.
  std::map<std::string, OpCount> counts() const { return backend_->counts(); }

  /// Forgets every count.
  void reset() { backend_->reset(); }

  /// The counting backend behind group().
  const c10::intrusive_ptr<CountingBackend>& backend() const { return backend_; }

 private:
  c10::intrusive_ptr<CountingBackend> backend_;
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
};

}  // namespace smp::pytorch
