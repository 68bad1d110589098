#include "smp/pytorch/grad_reduce.h"

#include <algorithm>
#include <cmath>
#include <exception>
#include <map>
#include <tuple>
#include <utility>

#include "smp/error.h"
#include "smp/pytorch/collective.h"
#include "smp/pytorch/format.h"

namespace smp::pytorch {
namespace {

// Rejects, with the tensor's index, shape and dtype, what cannot be reduced through a flat
// buffer (`what` names the caller in the message). Checked for all tensors before the first
// collective, so that a mistake fails every rank the same way instead of leaving peers blocked in
// a collective this rank never issues. In place (`in_place`), a tensor must also be contiguous.
void check_tensor(const at::Tensor& tensor, size_t index, const char* what, bool in_place) {
  SMP_CHECK(tensor.defined(),
            "{}: tensor {} is undefined (a parameter without a gradient?); pass only defined "
            "tensors",
            what, index);
  SMP_CHECK(tensor.layout() == at::kStrided,
            "{}: tensor {} (shape {}, dtype {}) has layout {}; only dense tensors are supported, "
            "call .to_dense() first",
            what, index, shape_str(tensor.sizes()), c10::toString(tensor.scalar_type()),
            layout_name(tensor.layout()));
  SMP_CHECK(!in_place || tensor.is_contiguous(),
            "{}: tensor {} (shape {}, dtype {}, strides {}) is not contiguous; it is reduced in "
            "place, so make it contiguous first",
            what, index, shape_str(tensor.sizes()), c10::toString(tensor.scalar_type()),
            shape_str(tensor.strides()));
  // Integer tensors cannot hold a mean in place (div_ by a double would not type-check).
  SMP_CHECK(at::isFloatingType(tensor.scalar_type()) || at::isComplexType(tensor.scalar_type()),
            "{}: tensor {} (shape {}, dtype {}) must be floating-point or complex to hold a mean",
            what, index, shape_str(tensor.sizes()), c10::toString(tensor.scalar_type()));
}

void check_divisor(double divisor, const char* what) {
  SMP_CHECK(std::isfinite(divisor) && divisor > 0,
            "{}: divisor must be a finite number > 0, got {:g}", what, divisor);
}

// Waits on every Work even if some fail, then rethrows the first failure: returning (or throwing)
// while a collective still runs would let it write into tensors the caller considers done.
void wait_all(const std::vector<c10::intrusive_ptr<c10d::Work>>& works) {
  std::exception_ptr first_error;
  for (const auto& work : works) {
    try {
      work->wait();
    } catch (...) {
      if (!first_error) first_error = std::current_exception();
    }
  }
  if (!first_error) return;
  try {
    std::rethrow_exception(first_error);
  } catch (const std::exception& error) {
    throw CollectiveError(
        fmt::format(FMT_STRING("smp: gradient all-reduce failed: {}"), error.what()));
  }
}

}  // namespace

std::vector<std::vector<size_t>> plan_grad_buckets(const std::vector<at::Tensor>& tensors,
                                                   int64_t bucket_bytes) {
  SMP_CHECK(bucket_bytes > 0, "allreduce_mean_: bucket_bytes must be > 0, got {}", bucket_bytes);
  for (size_t i = 0; i < tensors.size(); ++i) check_tensor(tensors[i], i, "allreduce_mean_", true);

  struct OpenBucket {
    std::vector<size_t> indices;
    int64_t num_bytes = 0;
  };
  // Keyed by (dtype, device type, device index): one flat buffer has one dtype and one device.
  using Key = std::tuple<at::ScalarType, at::DeviceType, at::DeviceIndex>;
  std::map<Key, OpenBucket> open;
  std::vector<std::vector<size_t>> buckets;

  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& tensor = tensors[i];
    // Nothing to reduce; skipping also spares backends a zero-byte collective.
    if (tensor.numel() == 0) continue;
    const auto num_bytes = static_cast<int64_t>(tensor.nbytes());
    if (num_bytes > bucket_bytes) {
      buckets.push_back({i});
      continue;
    }
    OpenBucket& bucket =
        open[Key{tensor.scalar_type(), tensor.device().type(), tensor.device().index()}];
    if (bucket.num_bytes + num_bytes > bucket_bytes) {
      buckets.push_back(std::move(bucket.indices));
      bucket = OpenBucket{};
    }
    bucket.indices.push_back(i);
    bucket.num_bytes += num_bytes;
  }
  for (auto& [key, bucket] : open) {
    if (!bucket.indices.empty()) buckets.push_back(std::move(bucket.indices));
  }
  // Closing order depends on how dtypes interleave; the first index alone is simpler to reason
  // about and equally deterministic across ranks. Indices are unique, so this is a total order.
  std::sort(buckets.begin(), buckets.end(),
            [](const auto& a, const auto& b) { return a.front() < b.front(); });
  return buckets;
}

int64_t allreduce_mean_(const std::vector<at::Tensor>& tensors,
                        const c10::intrusive_ptr<c10d::ProcessGroup>& group, double divisor,
                        int64_t bucket_bytes) {
  SMP_CHECK(group, "allreduce_mean_: group must not be null");
  check_divisor(divisor, "allreduce_mean_");
  const std::vector<std::vector<size_t>> buckets = plan_grad_buckets(tensors, bucket_bytes);
  // A communication op, not part of any graph: lets callers pass tensors that require grad.
  at::NoGradGuard no_grad;

  if (group->getSize() == 1) {
    // The sum over one rank is the tensor itself: skip the copies and the collectives.
    for (const auto& bucket : buckets) {
      for (size_t i : bucket) tensors[i].div_(divisor);
    }
    return 0;
  }

  // 1. Issue every bucket's collective. `buffers[b]` is the flat copy of bucket b, or the tensor
  //    itself when b holds one tensor (already contiguous: reduce it in place, no copy).
  std::vector<at::Tensor> buffers;
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  buffers.reserve(buckets.size());
  works.reserve(buckets.size());
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp::SUM;
  try {
    for (const auto& bucket : buckets) {
      if (bucket.size() == 1) {
        buffers.push_back(tensors[bucket.front()]);
      } else {
        std::vector<at::Tensor> flat;
        flat.reserve(bucket.size());
        for (size_t i : bucket) flat.push_back(tensors[i].view({-1}));
        buffers.push_back(at::cat(flat));
      }
      std::vector<at::Tensor> io{buffers.back()};
      works.push_back(group->allreduce(io, options));
    }
  } catch (...) {
    // Do not leave already-issued collectives writing into the caller's tensors; their own errors
    // are secondary to the one that stopped us.
    try {
      wait_all(works);
    } catch (...) {
    }
    throw;
  }

  // 2. Wait for all of them (see wait_all for why all, even after a failure).
  wait_all(works);

  // 3. Divide, and copy multi-tensor buckets back into their tensors.
  for (size_t b = 0; b < buckets.size(); ++b) {
    buffers[b].div_(divisor);
    if (buckets[b].size() == 1) continue;
    int64_t offset = 0;
    for (size_t i : buckets[b]) {
      const at::Tensor& tensor = tensors[i];
      tensor.copy_(buffers[b].narrow(0, offset, tensor.numel()).view(tensor.sizes()));
      offset += tensor.numel();
    }
  }
  return static_cast<int64_t>(works.size());
}

PendingAllreduces::PendingAllreduces(c10::intrusive_ptr<c10d::ProcessGroup> group)
    : group_(std::move(group)) {
  SMP_CHECK(group_, "PendingAllreduces: group must not be null");
}

PendingAllreduces::~PendingAllreduces() { drain(); }

size_t PendingAllreduces::issue(const std::vector<at::Tensor>& tensors, double divisor) {
  constexpr const char* what = "PendingAllreduces.issue";
  SMP_CHECK(!tensors.empty(), "{}: no tensors to reduce", what);
  check_divisor(divisor, what);
  for (size_t i = 0; i < tensors.size(); ++i) {
    check_tensor(tensors[i], i, what, false);
    SMP_CHECK(tensors[i].scalar_type() == tensors[0].scalar_type() &&
                  tensors[i].device() == tensors[0].device(),
              "{}: tensor {} ({} on {}) differs in dtype or device from tensor 0 ({} on {}); one "
              "buffer holds one dtype on one device",
              what, i, c10::toString(tensors[i].scalar_type()), tensors[i].device().str(),
              c10::toString(tensors[0].scalar_type()), tensors[0].device().str());
  }
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> flat;
  flat.reserve(tensors.size());
  for (const auto& tensor : tensors) flat.push_back(tensor.reshape({-1}));
  // Always a new buffer, also for one contiguous tensor: the caller's tensor may be read or
  // accumulated into while the collective writes the buffer.
  at::Tensor buffer = flat.size() == 1 ? flat.front().clone() : at::cat(flat);
  c10::intrusive_ptr<c10d::Work> work;
  if (group_->getSize() > 1) {
    c10d::AllreduceOptions options;
    options.reduceOp = c10d::ReduceOp::SUM;
    std::vector<at::Tensor> io{buffer};
    work = group_->allreduce(io, options);
  }
  buffers_.push_back(std::move(buffer));
  divisors_.push_back(divisor);
  works_.push_back(std::move(work));
  return buffers_.size() - 1;
}

std::vector<at::Tensor> PendingAllreduces::wait() {
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  for (auto& work : works_) {
    if (work) works.push_back(std::move(work));
  }
  std::vector<at::Tensor> buffers = std::move(buffers_);
  std::vector<double> divisors = std::move(divisors_);
  buffers_.clear();
  divisors_.clear();
  works_.clear();
  wait_all(works);
  at::NoGradGuard no_grad;
  for (size_t b = 0; b < buffers.size(); ++b) buffers[b].div_(divisors[b]);
  return buffers;
}

void PendingAllreduces::drain() noexcept {
  for (auto& work : works_) {
    if (!work) continue;
    try {
      work->wait();
    } catch (...) {  // a reduction given up on: its failure says nothing the caller needs
    }
  }
  buffers_.clear();
  divisors_.clear();
  works_.clear();
}

}  // namespace smp::pytorch
