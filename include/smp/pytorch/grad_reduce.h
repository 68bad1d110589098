// smp/pytorch/grad_reduce.h — bucketed gradient averaging over a c10d process group.
//
// allreduce_mean_ replaces every tensor t of a list, on every rank of a group, by
//   t := (t_0 + t_1 + ... + t_{n-1}) / divisor
// where t_r is that tensor on group rank r. It always reduces with ReduceOp::SUM and divides
// afterwards: ReduceOp::AVG is not supported by every backend (gloo lacks it), and the divisor a
// caller wants is often not the group size (e.g. data-parallel size times gradient accumulation).
//
// Bucketing: one collective per tensor would pay the collective's latency once per parameter, so
// tensors are packed into buckets, each flattened into one contiguous buffer and reduced with one
// collective. Buckets never mix dtypes or devices (one flat buffer has one dtype and one device).
// See plan_grad_buckets for the exact rule.
//
// Invariants the caller must keep:
//   - Collective order. The buckets, hence the collectives, follow the order of `tensors`, so every
//     rank of `group` must pass tensors with the same shapes, dtypes and devices in the same order;
//     otherwise ranks pair up different buckets and hang or reduce garbage.
//   - The tensors are dense (strided), contiguous, floating-point or complex, and do not alias
//     each other; they are overwritten in place. Zero-element tensors are skipped.
//   - Every collective is waited on before the function returns, also when it throws, so no
//     communication is still writing into the caller's tensors afterwards.
//
// Example:
//   std::vector<at::Tensor> grads;
//   for (const auto& p : module->parameters()) grads.push_back(p.grad());
//   // Average over the data-parallel group, 25 MiB buckets.
//   int64_t num_collectives = smp::pytorch::allreduce_mean_(
//       grads, dp_group, /*divisor=*/dp_group->getSize(), /*bucket_bytes=*/25 << 20);
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <ATen/ATen.h>

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace smp::pytorch {

/// Splits `tensors` into the buckets allreduce_mean_ reduces, each a list of indices into
/// `tensors`, in the order their collectives are issued.
///
/// Rule: walking `tensors` in order and skipping zero-element tensors, each (dtype, device) pair
/// has one open bucket. A tensor is appended to its pair's open bucket while the bucket's bytes
/// stay <= `bucket_bytes`; otherwise that bucket is closed and a new one opened with the tensor. A
/// tensor of more than `bucket_bytes` bytes gets a bucket of its own (the pair's open bucket stays
/// open). Buckets are then ordered by their first index, which is what makes the collective order
/// a function of the tensors' order, shapes and dtypes only.
///
/// Example (bucket_bytes = 100; f = float32, d = float64; sizes in bytes):
///   tensors  0:f40  1:d80  2:f40  3:f40  4:f400  5:d16
///   buckets  {0, 2}  {1, 5}  {3}  {4}
///
/// Throws smp::Error if bucket_bytes <= 0 or a tensor is undefined, sparse, non-contiguous or not
/// floating-point/complex (the message names its index, shape and dtype).
std::vector<std::vector<size_t>> plan_grad_buckets(const std::vector<at::Tensor>& tensors,
                                                   int64_t bucket_bytes);

/// All-reduces `tensors` in place over `group` as SUM, then divides them by `divisor` (never
/// ReduceOp::AVG), so that each becomes the sum over the group's ranks divided by `divisor`.
///
/// Tensors are packed into buckets of at most `bucket_bytes` bytes per (dtype, device) as
/// plan_grad_buckets describes. A bucket of several tensors is flattened into one contiguous
/// buffer, reduced with one collective, divided and copied back; a bucket of one tensor is reduced
/// in place, without the copies. All buckets' collectives are issued first and then waited on, so
/// that the backend overlaps them (gloo runs them on its worker threads); the price is that every
/// multi-tensor bucket's buffer is alive at once, i.e. up to one extra copy of the gradients.
///
/// Every rank of `group` must call this with tensors of the same shapes, dtypes and devices in the
/// same order (the collectives are matched by order). On a group of size 1 nothing is
/// communicated: the tensors are only divided and 0 is returned. Runs under at::NoGradGuard, so
/// tensors that require grad (e.g. parameters) may be passed as well as gradients.
///
/// Returns the number of collectives issued (0 for an empty list or a group of size 1).
/// Throws smp::Error for a null group, a divisor that is not a finite number > 0,
/// bucket_bytes <= 0, or a tensor plan_grad_buckets rejects; all are checked before anything is
/// communicated. A backend error is rethrown after every issued collective has been waited on.
int64_t allreduce_mean_(const std::vector<at::Tensor>& tensors,
                        const c10::intrusive_ptr<c10d::ProcessGroup>& group, double divisor,
                        int64_t bucket_bytes);

/// Bucket all-reduces issued one at a time, as their tensors become final, and waited together:
/// the overlapped gradient reduction (smp/dp/reduction.py, design.md §2). Each `issue` flattens its
/// tensors into a new buffer (a copy: the tensors may still be read or written by the caller
/// while the collective runs) and starts one SUM all-reduce of it; `wait` waits for all of them
/// and returns each buffer divided by the divisor given with it.
///
/// The collectives of one group are matched by order: every rank must issue buffers of the same
/// sizes and dtypes in the same order, and as many. A caller that gives up on a reduction still
/// issues the rest of its sequence (e.g. zeros) before `drain`, or peers stay blocked.
///
/// Example:
///   PendingAllreduces pending(dp_group);
///   pending.issue({grad_a, grad_b}, /*divisor=*/2.0);   // from a gradient hook
///   pending.issue({grad_c}, 2.0);
///   std::vector<at::Tensor> means = pending.wait();     // [a|b flattened, c], means over dp
class PendingAllreduces {
 public:
  explicit PendingAllreduces(c10::intrusive_ptr<c10d::ProcessGroup> group);
  PendingAllreduces(const PendingAllreduces&) = delete;
  PendingAllreduces& operator=(const PendingAllreduces&) = delete;
  /// Waits for what is still in flight (errors ignored): no collective outlives its buffer.
  ~PendingAllreduces();

  /// Flattens `tensors` (dense, floating-point or complex, one dtype and device, any strides)
  /// into one buffer and starts its SUM all-reduce; returns the buffer's index. Nothing is
  /// communicated on a group of size 1. Throws smp::Error for an empty list, a bad divisor or a
  /// tensor allreduce_mean_ would reject (except for contiguity), before communicating.
  size_t issue(const std::vector<at::Tensor>& tensors, double divisor);

  /// Waits for every issued collective (all of them, also after a failure, then rethrows the
  /// first as CollectiveError), divides each buffer by its divisor and returns the buffers in
  /// issue order. Afterwards nothing is pending and the object can be reused.
  std::vector<at::Tensor> wait();

  /// Waits for every issued collective, ignoring failures, and forgets the buffers.
  void drain() noexcept;

  /// How many buffers were issued since the last wait or drain.
  size_t size() const { return buffers_.size(); }

 private:
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  std::vector<at::Tensor> buffers_;
  std::vector<double> divisors_;
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
};

}  // namespace smp::pytorch
