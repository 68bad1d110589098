#include "smp/pytorch/counting_group.h"

#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <utility>

#include "smp/error.h"

namespace smp::pytorch {
namespace {

int64_t bytes_of(const at::Tensor& tensor) {
  return tensor.defined() ? static_cast<int64_t>(tensor.nbytes()) : 0;
}

int64_t bytes_of(const std::vector<at::Tensor>& tensors) {
  int64_t total = 0;
  for (const auto& tensor : tensors) total += bytes_of(tensor);
  return total;
}

int64_t bytes_of(const std::vector<std::vector<at::Tensor>>& lists) {
  int64_t total = 0;
  for (const auto& list : lists) total += bytes_of(list);
  return total;
}

}  // namespace

// ---- CountingBackend ---------------------------------------------------------------------------

CountingBackend::CountingBackend(c10::intrusive_ptr<c10d::Backend> inner)
    : c10d::Backend(inner ? inner->getRank() : 0, inner ? inner->getSize() : 1),
      inner_(std::move(inner)) {
  SMP_CHECK(inner_, "CountingBackend: the inner backend must not be null");
}

const std::string CountingBackend::getBackendName() const { return "smp_counting"; }

std::map<std::string, OpCount> CountingBackend::counts() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return counts_;
}

void CountingBackend::reset() {
  std::lock_guard<std::mutex> lock(mutex_);
  counts_.clear();
}

void CountingBackend::count(const char* op, int64_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  OpCount& entry = counts_[op];
  entry.calls += 1;
  entry.bytes += bytes;
}

// Each op: count (see counting_group.h for the bytes of each), then forward unchanged.

c10::intrusive_ptr<c10d::Work> CountingBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                          const c10d::BroadcastOptions& opts) {
  count("broadcast", bytes_of(tensors));
  return inner_->broadcast(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> CountingBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                          const c10d::AllreduceOptions& opts) {
  count("allreduce", bytes_of(tensors));
  return inner_->allreduce(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> CountingBackend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  count("allreduce_coalesced", bytes_of(tensors));
  return inner_->allreduce_coalesced(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> CountingBackend::reduce(std::vector<at::Tensor>& tensors,
                                                       const c10d::ReduceOptions& opts) {
  count("reduce", bytes_of(tensors));
  return inner_->reduce(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> CountingBackend::allgather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  count("allgather", bytes_of(inputs));
  return inner_->allgather(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> CountingBackend::_allgather_base(
    at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) {
  count("_allgather_base", bytes_of(input));
  return inner_->_allgather_base(output, input, opts);
}

c10::intrusive_ptr<c10d::Work> CountingBackend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  count("allgather_into_tensor_coalesced", bytes_of(inputs));
  return inner_->allgather_into_tensor_coalesced(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> CountingBackend::gather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  count("gather", bytes_of(inputs));
  return inner_->gather(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> CountingBackend::scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  count("scatter", bytes_of(inputs));
  return inner_->scatter(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> CountingBackend::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  count("reduce_scatter", bytes_of(inputs));
  return inner_->reduce_scatter(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> CountingBackend::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  count("_reduce_scatter_base", bytes_of(input));
  return inner_->_reduce_scatter_base(output, input, opts);
}

c10::intrusive_ptr<c10d::Work> CountingBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  count("reduce_scatter_tensor_coalesced", bytes_of(inputs));
  return inner_->reduce_scatter_tensor_coalesced(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> CountingBackend::alltoall_base(
    at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_split_sizes,
    std::vector<int64_t>& input_split_sizes, const c10d::AllToAllOptions& opts) {
  count("alltoall_base", bytes_of(input));
  return inner_->alltoall_base(output, input, output_split_sizes, input_split_sizes, opts);
}

c10::intrusive_ptr<c10d::Work> CountingBackend::alltoall(std::vector<at::Tensor>& outputs,
                                                         std::vector<at::Tensor>& inputs,
                                                         const c10d::AllToAllOptions& opts) {
  count("alltoall", bytes_of(inputs));
  return inner_->alltoall(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> CountingBackend::barrier(const c10d::BarrierOptions& opts) {
  count("barrier", 0);
  return inner_->barrier(opts);
}

c10::intrusive_ptr<c10d::Work> CountingBackend::send(std::vector<at::Tensor>& tensors, int dst_rank,
                                                     int tag) {
  count("send", bytes_of(tensors));
  return inner_->send(tensors, dst_rank, tag);
}

c10::intrusive_ptr<c10d::Work> CountingBackend::recv(std::vector<at::Tensor>& tensors, int src_rank,
                                                     int tag) {
  count("recv", bytes_of(tensors));
  return inner_->recv(tensors, src_rank, tag);
}

c10::intrusive_ptr<c10d::Work> CountingBackend::recvAnysource(std::vector<at::Tensor>& tensors,
                                                              int tag) {
  count("recvAnysource", bytes_of(tensors));
  return inner_->recvAnysource(tensors, tag);
}

// ---- CountingGroup -----------------------------------------------------------------------------

namespace {

c10::intrusive_ptr<c10d::Backend> cpu_backend_of(const c10::intrusive_ptr<c10d::ProcessGroup>& g) {
  SMP_CHECK(g, "CountingGroup: the group to wrap must not be null");
  SMP_CHECK(g->hasBackendForDeviceType(c10::DeviceType::CPU),
            "CountingGroup: the group to wrap (backend {}) has no CPU backend; only CPU groups "
            "(e.g. gloo) can be counted",
            g->getBackendName());
  return g->getBackend(c10::DeviceType::CPU);
}

}  // namespace

CountingGroup::CountingGroup(const c10::intrusive_ptr<c10d::ProcessGroup>& inner)
    : backend_(c10::make_intrusive<CountingBackend>(cpu_backend_of(inner))) {
  // The store is only needed by c10d's own bookkeeping (the backend never uses it): share the
  // wrapped group's when it has one.
  c10::intrusive_ptr<c10d::Store> store = inner->getStore();
  if (!store) store = c10::make_intrusive<c10d::HashStore>();
  group_ = c10::make_intrusive<c10d::ProcessGroup>(store, inner->getRank(), inner->getSize());
  group_->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::CUSTOM, backend_);
  group_->setDefaultBackend(c10d::ProcessGroup::BackendType::CUSTOM);
}

}  // namespace smp::pytorch
