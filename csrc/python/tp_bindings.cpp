// Bindings of the tensor-parallel communication (smp/pytorch/tp_comm.h) as the submodule
// smp._C.tp, and of smp/pytorch/counting_group.h as smp._C.CountingGroup.
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
// Declares c10::intrusive_ptr a pybind11 holder type; see Note [ProcessGroup across the pybind11
// boundary] in comm_bindings.cpp.
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>

#include "python/bindings.h"
#include "smp/pytorch/counting_group.h"
#include "smp/pytorch/tp_comm.h"

namespace py = pybind11;

namespace smp::python {
namespace {

using Group = c10::intrusive_ptr<c10d::ProcessGroup>;

// Note [No GIL around collectives]
// Each function below may run a collective (in forward), and the autograd graph it builds runs
// one in backward. Both must run without the GIL: holding it deadlocks the first gloo collective
// (see allreduce_mean_ in comm_bindings.cpp). The forward releases it here; the backward is run
// by the autograd engine, which Tensor.backward() and torch.autograd.grad() call without the GIL.
// Safe: the arguments are C++ values once the call starts, and torch re-acquires the GIL itself
// should an op dispatch to Python (a tensor subclass, a dispatch mode).

void init_region_functions(py::module_& tp) {
  tp.def(
      "copy_to_region",
      [](const at::Tensor& x, const Group& group) {
        py::gil_scoped_release no_gil;  // See Note [No GIL around collectives]
        return pytorch::tp::copy_to_region(x, group);
      },
      py::arg("x"), py::arg("group"),
      R"doc(Identity forward; backward all-reduces (SUM) the gradient over `group`.

Put it before a column-parallel linear: its input is replicated, and its input gradient is the
sum of the ranks' partial gradients.

Args:
    x: the replicated input.
    group: the tensor-parallel torch.distributed.ProcessGroup.

Returns:
    An autograd alias of `x`.
)doc");

  tp.def(
      "reduce_from_region",
      [](const at::Tensor& x, const Group& group) {
        py::gil_scoped_release no_gil;  // See Note [No GIL around collectives]
        return pytorch::tp::reduce_from_region(x, group);
      },
      py::arg("x"), py::arg("group"),
      R"doc(Forward all-reduces (SUM) `x` over `group`; identity backward.

Put it after a row-parallel linear: the ranks' partial sums become the full output.

Args:
    x: this rank's partial sum.
    group: the tensor-parallel torch.distributed.ProcessGroup.

Returns:
    A new tensor, the sum of `x` over the ranks of `group` (`x` itself on a group of size 1).
)doc");

  tp.def(
      "scatter_to_region",
      [](const at::Tensor& x, int64_t dim, const Group& group) {
        py::gil_scoped_release no_gil;  // See Note [No GIL around collectives]
        return pytorch::tp::scatter_to_region(x, dim, group);
      },
      py::arg("x"), py::arg("dim"), py::arg("group"),
      R"doc(Forward keeps this rank's chunk of `x` along `dim`; backward all-gathers along `dim`.

Args:
    x: the replicated input.
    dim: the dim to split; negative counts from the end.
    group: the tensor-parallel torch.distributed.ProcessGroup.

Returns:
    A new contiguous tensor, ``x.chunk(group.size(), dim)[group.rank()]``.

Raises:
    ValueError: ``x.size(dim)`` is not divisible by the group size (the message names the dim,
        the size and the group size), or `dim` is out of range.
)doc");

  tp.def(
      "gather_from_region",
      [](const at::Tensor& x, int64_t dim, const Group& group) {
        py::gil_scoped_release no_gil;  // See Note [No GIL around collectives]
        return pytorch::tp::gather_from_region(x, dim, group);
      },
      py::arg("x"), py::arg("dim"), py::arg("group"),
      R"doc(Forward all-gathers `x` along `dim`; backward keeps this rank's chunk along `dim`.

Put it after a column-parallel linear when the full output is needed.

Args:
    x: this rank's shard; every rank passes the same shape.
    dim: the dim to concatenate along; negative counts from the end.
    group: the tensor-parallel torch.distributed.ProcessGroup.

Returns:
    A new contiguous tensor, the ranks' `x` concatenated along `dim` in group-rank order.

Raises:
    ValueError: `dim` is out of range.
)doc");

  tp.def(
      "reduce_scatter",
      [](const at::Tensor& x, int64_t dim, const Group& group) {
        py::gil_scoped_release no_gil;  // See Note [No GIL around collectives]
        return pytorch::tp::reduce_scatter(x, dim, group);
      },
      py::arg("x"), py::arg("dim"), py::arg("group"),
      R"doc(Forward reduce-scatters (SUM) `x` along `dim`; backward all-gathers along `dim`.

Rank r gets chunk r (along `dim`) of the sum of `x` over the ranks. With all_gather, the border
of a block whose activations are sharded (sequence parallelism): each one's backward is the other.

Args:
    x: this rank's partial sum, the same shape on every rank.
    dim: the dim to split; negative counts from the end.
    group: the tensor-parallel torch.distributed.ProcessGroup.

Returns:
    A new contiguous tensor, ``sum_ranks(x).chunk(group.size(), dim)[group.rank()]``.

Raises:
    ValueError: ``x.size(dim)`` is not divisible by the group size (the message names the dim,
        the size and the group size), or `dim` is out of range.
)doc");

  tp.def(
      "all_gather",
      [](const at::Tensor& x, int64_t dim, const Group& group) {
        py::gil_scoped_release no_gil;  // See Note [No GIL around collectives]
        return pytorch::tp::all_gather(x, dim, group);
      },
      py::arg("x"), py::arg("dim"), py::arg("group"),
      R"doc(Forward all-gathers `x` along `dim`; backward reduce-scatters (SUM) along `dim`.

Args:
    x: this rank's shard; every rank passes the same shape.
    dim: the dim to concatenate along; negative counts from the end.
    group: the tensor-parallel torch.distributed.ProcessGroup.

Returns:
    A new contiguous tensor, the ranks' `x` concatenated along `dim` in group-rank order.

Raises:
    ValueError: `dim` is out of range.
)doc");
}

// (calls, bytes) per op kind: plain Python values for tests to compare.
std::map<std::string, std::pair<int64_t, int64_t>> to_python(
    const std::map<std::string, pytorch::OpCount>& counts) {
  std::map<std::string, std::pair<int64_t, int64_t>> result;
  for (const auto& [name, count] : counts)
    result.emplace(name, std::pair{count.calls, count.bytes});
  return result;
}

void init_counting_group(py::module_& m) {
  py::class_<pytorch::CountingGroup>(m, "CountingGroup", R"doc(
A process group that counts the communication issued through it.

``CountingGroup(group).group`` is a new torch.distributed.ProcessGroup with the rank and size of
`group`, whose ops are counted and forwarded unchanged to `group`'s CPU backend (so they reach
the real peers). Use it wherever `group` would be used: smp._C.tp functions, or
torch.distributed collectives such as ``dist.all_reduce(t, group=cg.group)``. It is not
registered with torch.distributed, so functions that look groups up (get_process_group_ranks,
get_backend, functional collectives) do not know it. CPU tensors only.

Counted per op kind, keyed by the c10d::Backend method (dist.all_reduce -> "allreduce",
all_gather_into_tensor -> "_allgather_base", reduce_scatter_tensor -> "_reduce_scatter_base",
broadcast, allgather, reduce_scatter, barrier, send, recv, ...): the calls issued on this rank
(counted when issued, even if they fail later) and the bytes of the tensors this rank passes as
input (an all-gather counts its shard, a reduce-scatter its full input, a recv its buffer, a
barrier 0). Only kinds that were issued appear.

Example:
    cg = smp._C.CountingGroup(tp_group)
    y = smp._C.tp.reduce_from_region(x, cg.group)   # x: 4 float32
    assert cg.counts() == {"allreduce": (1, 16)}
)doc")
      .def(py::init<const Group&>(), py::arg("group"),
           R"doc(Wraps `group` (a torch.distributed.ProcessGroup with a CPU backend, e.g. gloo).

Raises:
    ValueError: `group` has no CPU backend.
)doc")
      .def_property_readonly("group", &pytorch::CountingGroup::group,
                             "The counting torch.distributed.ProcessGroup.")
      .def(
          "counts", [](const pytorch::CountingGroup& self) { return to_python(self.counts()); },
          "Returns {op kind: (calls, bytes)} since construction or the last reset().")
      .def("reset", &pytorch::CountingGroup::reset, "Forgets every count.");
}

}  // namespace

void init_tp_bindings(py::module_& m) {
  py::module_ tp = m.def_submodule(
      "tp", R"doc(Tensor-parallel communication as autograd pairs (smp/pytorch/tp_comm.h).

Each function's backward is its partner's forward:

    copy_to_region       identity                 | all-reduce SUM
    reduce_from_region   all-reduce SUM           | identity
    scatter_to_region    keep chunk r along dim   | all-gather along dim
    gather_from_region   all-gather along dim     | keep chunk r along dim
    reduce_scatter       reduce-scatter SUM       | all-gather along dim
    all_gather           all-gather along dim     | reduce-scatter SUM along dim

Every rank of the group calls the same functions in the same order with the same shapes; on a
group of size 1 nothing is communicated.
)doc");
  init_region_functions(tp);
  init_counting_group(m);
}

}  // namespace smp::python
