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

// Rejects, with the tensor's index, shape and dtype, what cannot be reduced in place through a
// flat buffer. Checked for all tensors before the first collective, so that a mistake fails every
// rank the same way instead of leaving peers blocked in a collective this rank never issues.
void check_tensor(const at::Tensor& tensor, size_t index) {
  SMP_CHECK(tensor.defined(),
            "allreduce_mean_: tensor {} is undefined (a parameter without a gradient?); pass only "
            "defined tensors",
            index);
  SMP_CHECK(tensor.layout() == at::kStrided,
            "allreduce_mean_: tensor {} (shape {}, dtype {}) has layout {}; only dense tensors are "
            "supported, call .to_dense() first",
            index, shape_str(tensor.sizes()), c10::toString(tensor.scalar_type()),
            layout_name(tensor.layout()));
  SMP_CHECK(tensor.is_contiguous(),
            "allreduce_mean_: tensor {} (shape {}, dtype {}, strides {}) is not contiguous; it is "
            "reduced in place, so make it contiguous first",
            index, shape_str(tensor.sizes()), c10::toString(tensor.scalar_type()),
            shape_str(tensor.strides()));
  // Integer tensors cannot hold a mean in place (div_ by a double would not type-check).
  SMP_CHECK(at::isFloatingType(tensor.scalar_type()) || at::isComplexType(tensor.scalar_type()),
            "allreduce_mean_: tensor {} (shape {}, dtype {}) must be floating-point or complex to "
            "hold a mean in place",
            index, shape_str(tensor.sizes()), c10::toString(tensor.scalar_type()));
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
  for (size_t i = 0; i < tensors.size(); ++i) check_tensor(tensors[i], i);

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
  SMP_CHECK(std::isfinite(divisor) && divisor > 0,
            "allreduce_mean_: divisor must be a finite number > 0, got {:g}", divisor);
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

}  // namespace smp::pytorch
