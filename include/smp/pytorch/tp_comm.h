// smp/pytorch/tp_comm.h — the communication primitives of tensor parallelism, as autograd pairs.
//
// A tensor-parallel region is the part of a model whose weights are split over the ranks of a TP
// group. Tensors cross its border through six functions, each the autograd conjugate of another
// (Megatron-LM's observation): what one does forward, its partner does backward.
//
//   function                     forward                         backward
//   copy_to_region(x)            identity                        all-reduce SUM
//   reduce_from_region(x)        all-reduce SUM                  identity
//   scatter_to_region(x, d)      keep this rank's chunk along d  all-gather along d
//   gather_from_region(x, d)     all-gather along d              keep this rank's chunk along d
//   reduce_scatter(x, d)         reduce-scatter SUM along d      all-gather along d
//   all_gather(x, d)             all-gather along d              reduce-scatter SUM along d
//
// "Chunk r along d" is x.chunk(n, d)[r] for group size n and group rank r: the size of d must be
// divisible by n (checked, the message names the size and n). All-gather along d concatenates the
// ranks' tensors along d in group-rank order; every rank must pass the same shape.
//
// Which pair to use:
//   - column-parallel linear: copy_to_region before it (its input is replicated, its input
//     gradient is a sum of the ranks' partial gradients), gather_from_region after it if the full
//     output is needed;
//   - row-parallel linear: reduce_from_region after it (partial sums become the full output);
//   - activations sharded between blocks (sequence / batch parallelism): all_gather on entry and
//     reduce_scatter on exit, whose backwards are each other.
//
// Invariants:
//   - Every rank of the group calls the same functions in the same order with the same shapes;
//     the collectives (forward and backward) are matched by order.
//   - Each function waits for its collective before returning, in forward and in backward.
//   - On a group of size 1 nothing is communicated; every function is the identity (forward and
//     backward), and the chunk of a scatter is the whole tensor.
//   - Outputs are new, contiguous tensors (never views of the input) except for the identity
//     cases (copy_to_region's forward, reduce_from_region's backward, and every function on a
//     group of size 1), where the output is an autograd alias of the input.
//   - Each backward is its partner's forward (the pairs above), applied to the gradient; so the
//     backward is itself differentiable (double backward works) and a size-1 group stays free of
//     communication in both directions.
//   - The autograd graph keeps `group` alive until the graph is freed, so callers may drop
//     their own reference after the forward.
//   - A dim may be negative (counted from the end, as in PyTorch).
//
// Errors: smp::Error (ValueError in Python), thrown before anything is communicated, for a null
// group, an undefined tensor, a dim out of range (or any dim of a 0-dim tensor) and a size that
// is not divisible by the group size. Backend failures propagate as the backend's exception.
//
// Example (column- then row-parallel MLP, Megatron layout):
//   auto h = smp::pytorch::tp::copy_to_region(x, group);            // [b, s, d]   replicated
//   h = at::gelu(at::linear(h, w1_shard, b1_shard));                // [b, s, 4d/n] sharded
//   auto y = smp::pytorch::tp::reduce_from_region(at::linear(h, w2_shard), group) + b2;
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <ATen/ATen.h>

#include <cstdint>

namespace smp::pytorch::tp {

using Group = c10::intrusive_ptr<c10d::ProcessGroup>;

/// Identity forward; backward all-reduces (SUM) the gradient over `group`.
at::Tensor copy_to_region(const at::Tensor& x, const Group& group);

/// Forward all-reduces (SUM) `x` over `group`; identity backward.
at::Tensor reduce_from_region(const at::Tensor& x, const Group& group);

/// Forward keeps this rank's chunk of `x` along `dim`; backward all-gathers along `dim`.
/// Throws smp::Error if x.size(dim) is not divisible by the group size.
at::Tensor scatter_to_region(const at::Tensor& x, int64_t dim, const Group& group);

/// Forward all-gathers `x` along `dim`; backward keeps this rank's chunk along `dim`.
at::Tensor gather_from_region(const at::Tensor& x, int64_t dim, const Group& group);

/// Forward reduce-scatters (SUM) `x` along `dim`: rank r gets chunk r of the sum over ranks;
/// backward all-gathers along `dim`. Throws smp::Error if x.size(dim) is not divisible by the
/// group size.
at::Tensor reduce_scatter(const at::Tensor& x, int64_t dim, const Group& group);

/// Forward all-gathers `x` along `dim`; backward reduce-scatters (SUM) along `dim`.
at::Tensor all_gather(const at::Tensor& x, int64_t dim, const Group& group);

}  // namespace smp::pytorch::tp
