#include "smp/pytorch/tp_comm.h"

#include <torch/csrc/autograd/custom_function.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "smp/error.h"
#include "smp/pytorch/collective.h"
#include "smp/pytorch/format.h"

namespace smp::pytorch::tp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Note [The group in the autograd graph]
// A backward needs the group of its forward, possibly long after the caller dropped its own
// reference. c10d::ProcessGroup is a TorchScript custom class (registered as c10d.ProcessGroup
// by libtorch's c10d ops library, since the ops take it as an argument), so an IValue can hold
// an intrusive_ptr to it: ctx->saved_data["group"] shares ownership, and the node keeps the group
// alive until the graph is freed (the engine's release after a backward frees saved tensors only,
// not saved_data; so a retain_graph backward can run again). No Python is involved: the engine's
// threads (or the caller's, for CPU) run the backward directly.
constexpr const char* kGroupKey = "group";
constexpr const char* kDimKey = "dim";

void save_group(AutogradContext* ctx, const Group& group) { ctx->saved_data[kGroupKey] = group; }

Group saved_group(AutogradContext* ctx) {
  return ctx->saved_data.at(kGroupKey).toCustomClass<c10d::ProcessGroup>();
}

int64_t saved_dim(AutogradContext* ctx) { return ctx->saved_data.at(kDimKey).toInt(); }

void check_args(const char* fn, const at::Tensor& x, const Group& group) {
  SMP_CHECK(group, "{}: group must not be null", fn);
  SMP_CHECK(x.defined(), "{}: the input tensor is undefined", fn);
}

// Returns `dim` in [0, x.dim()); negative dims count from the end.
int64_t wrap_dim(const char* fn, const at::Tensor& x, int64_t dim) {
  const int64_t ndim = x.dim();
  SMP_CHECK(ndim > 0,
            "{}: cannot split or concatenate a 0-dim tensor along dim {}; reshape it to at least 1 "
            "dim first",
            fn, dim);
  SMP_CHECK(dim >= -ndim && dim < ndim,
            "{}: dim {} is out of range for a tensor of shape {} ({} dims); pass a dim in [{}, {}]",
            fn, dim, shape_str(x.sizes()), ndim, -ndim, ndim - 1);
  return dim < 0 ? dim + ndim : dim;
}

void check_divisible(const char* fn, const at::Tensor& x, int64_t dim, const Group& group) {
  const int64_t size = x.size(dim);
  const int64_t num_ranks = group->getSize();
  SMP_CHECK(size % num_ranks == 0,
            "{}: size {} of dim {} (tensor shape {}) is not divisible by the group size {}; make "
            "that dim a multiple of {}",
            fn, size, dim, shape_str(x.sizes()), num_ranks, num_ranks);
}

// ---- the collectives, on dim 0 of a contiguous buffer ------------------------------------------
// Other dims are moved to the front and back: the backends only concatenate and split along the
// outermost dim (their buffers are flat), so dim d is handled as dim 0 of x.movedim(d, 0).

at::Tensor all_reduce_sum(const at::Tensor& x, const Group& group) {
  // A copy: the all-reduce runs in place, and x belongs to the caller.
  std::vector<at::Tensor> buffers{x.clone(at::MemoryFormat::Contiguous)};
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp::SUM;
  run_collective("tensor-parallel all-reduce", [&] { return group->allreduce(buffers, options); });
  return buffers[0];
}

// out = cat([x_0, ..., x_{n-1}], dim) where x_r is x on group rank r.
at::Tensor all_gather_along(const at::Tensor& x, int64_t dim, const Group& group) {
  at::Tensor input = x.movedim(dim, 0).contiguous();
  std::vector<int64_t> shape = input.sizes().vec();
  shape[0] *= group->getSize();
  at::Tensor output = at::empty(shape, input.options());
  // all_gather_single is ProcessGroup's non-deprecated name for _allgather_base (the same
  // dispatcher op, c10d::_allgather_base_, i.e. all_gather_into_tensor).
  run_collective("tensor-parallel all-gather",
                 [&] { return group->all_gather_single(output, input); });
  return output.movedim(0, dim).contiguous();
}

// out = (x_0 + ... + x_{n-1}).chunk(n, dim)[r] on group rank r. x.size(dim) % n == 0.
at::Tensor reduce_scatter_along(const at::Tensor& x, int64_t dim, const Group& group) {
  at::Tensor input = x.movedim(dim, 0).contiguous();
  std::vector<int64_t> shape = input.sizes().vec();
  shape[0] /= group->getSize();
  at::Tensor output = at::empty(shape, input.options());
  c10d::ReduceScatterOptions options;
  options.reduceOp = c10d::ReduceOp::SUM;
  // reduce_scatter_single is the non-deprecated name for _reduce_scatter_base (the same
  // dispatcher op, c10d::_reduce_scatter_base_, i.e. reduce_scatter_tensor).
  run_collective("tensor-parallel reduce-scatter",
                 [&] { return group->reduce_scatter_single(output, input, options); });
  return output.movedim(0, dim).contiguous();
}

// out = x.chunk(n, dim)[r] on group rank r, as a new tensor. x.size(dim) % n == 0.
at::Tensor chunk_along(const at::Tensor& x, int64_t dim, const Group& group) {
  const int64_t chunk_size = x.size(dim) / group->getSize();
  return x.narrow(dim, group->getRank() * chunk_size, chunk_size)
      .clone(at::MemoryFormat::Contiguous);
}

// ---- the autograd pairs ------------------------------------------------------------------------
// Each backward calls its partner's public function (see tp_comm.h): with create_graph the
// gradient gets a graph of its own, which is what makes double backward work. On a group of size
// 1 each forward returns its input, which autograd turns into an alias with this node as grad_fn.
// The non-tensor arguments (dim, group) get undefined gradients.

struct CopyToRegion : torch::autograd::Function<CopyToRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const Group& group) {
    save_group(ctx, group);
    return x;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {reduce_from_region(grads[0], saved_group(ctx)), at::Tensor()};
  }
};

struct ReduceFromRegion : torch::autograd::Function<ReduceFromRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const Group& group) {
    save_group(ctx, group);
    return group->getSize() == 1 ? x : all_reduce_sum(x, group);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {copy_to_region(grads[0], saved_group(ctx)), at::Tensor()};
  }
};

struct ScatterToRegion : torch::autograd::Function<ScatterToRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t dim,
                            const Group& group) {
    save_group(ctx, group);
    ctx->saved_data[kDimKey] = dim;
    return group->getSize() == 1 ? x : chunk_along(x, dim, group);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {gather_from_region(grads[0], saved_dim(ctx), saved_group(ctx)), at::Tensor(),
            at::Tensor()};
  }
};

struct GatherFromRegion : torch::autograd::Function<GatherFromRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t dim,
                            const Group& group) {
    save_group(ctx, group);
    ctx->saved_data[kDimKey] = dim;
    return group->getSize() == 1 ? x : all_gather_along(x, dim, group);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {scatter_to_region(grads[0], saved_dim(ctx), saved_group(ctx)), at::Tensor(),
            at::Tensor()};
  }
};

struct ReduceScatter : torch::autograd::Function<ReduceScatter> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t dim,
                            const Group& group) {
    save_group(ctx, group);
    ctx->saved_data[kDimKey] = dim;
    return group->getSize() == 1 ? x : reduce_scatter_along(x, dim, group);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {all_gather(grads[0], saved_dim(ctx), saved_group(ctx)), at::Tensor(), at::Tensor()};
  }
};

struct AllGather : torch::autograd::Function<AllGather> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t dim,
                            const Group& group) {
    save_group(ctx, group);
    ctx->saved_data[kDimKey] = dim;
    return group->getSize() == 1 ? x : all_gather_along(x, dim, group);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {reduce_scatter(grads[0], saved_dim(ctx), saved_group(ctx)), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor copy_to_region(const at::Tensor& x, const Group& group) {
  check_args("copy_to_region", x, group);
  return CopyToRegion::apply(x, group);
}

at::Tensor reduce_from_region(const at::Tensor& x, const Group& group) {
  check_args("reduce_from_region", x, group);
  return ReduceFromRegion::apply(x, group);
}

at::Tensor scatter_to_region(const at::Tensor& x, int64_t dim, const Group& group) {
  constexpr const char* kFn = "scatter_to_region";
  check_args(kFn, x, group);
  dim = wrap_dim(kFn, x, dim);
  check_divisible(kFn, x, dim, group);
  return ScatterToRegion::apply(x, dim, group);
}

at::Tensor gather_from_region(const at::Tensor& x, int64_t dim, const Group& group) {
  constexpr const char* kFn = "gather_from_region";
  check_args(kFn, x, group);
  dim = wrap_dim(kFn, x, dim);
  return GatherFromRegion::apply(x, dim, group);
}

at::Tensor reduce_scatter(const at::Tensor& x, int64_t dim, const Group& group) {
  constexpr const char* kFn = "reduce_scatter";
  check_args(kFn, x, group);
  dim = wrap_dim(kFn, x, dim);
  check_divisible(kFn, x, dim, group);
  return ReduceScatter::apply(x, dim, group);
}

at::Tensor all_gather(const at::Tensor& x, int64_t dim, const Group& group) {
  constexpr const char* kFn = "all_gather";
  check_args(kFn, x, group);
  dim = wrap_dim(kFn, x, dim);
  return AllGather::apply(x, dim, group);
}

}  // namespace smp::pytorch::tp
