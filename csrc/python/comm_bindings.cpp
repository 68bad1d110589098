// Bindings of the communication helpers of the libtorch layer (smp/pytorch/grad_reduce.h).
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
// Declares c10::intrusive_ptr a pybind11 holder type; see Note [ProcessGroup across the pybind11
// boundary]. (torch/extension.h, via bindings.h, includes it too; named here as it is relied on.)
#include <torch/csrc/utils/pybind.h>

#include "python/bindings.h"
#include "smp/pytorch/grad_reduce.h"

namespace py = pybind11;

namespace smp::python {

void init_comm_bindings(py::module_& m) {
  // Note [ProcessGroup across the pybind11 boundary]
  // torch registers torch.distributed.ProcessGroup (torch/csrc/distributed/c10d/init.cpp) as
  // py::class_<c10d::ProcessGroup, c10::intrusive_ptr<c10d::ProcessGroup>, ...>, and
  // torch/csrc/utils/pybind.h declares c10::intrusive_ptr a pybind11 holder type. smp._C is built
  // with torch's bundled pybind11 and the same compiler ABI id, so both modules share pybind11's
  // internals (type registry): the argument below is cast straight from the Python object to
  // torch's holder, sharing ownership, with no unwrapping helper. The group must be imported by
  // torch first (import torch.distributed), which any caller holding a group has done.
  m.def(
      "allreduce_mean_",
      [](const std::vector<at::Tensor>& tensors,
         const c10::intrusive_ptr<c10d::ProcessGroup>& group, double divisor,
         int64_t bucket_bytes) {
        // Required, not only polite: holding the GIL here deadlocks the first gloo collective
        // (observed with torch 2.13: it times out; gloo's side of the work evidently needs the
        // GIL). Safe: the arguments are C++ values now and nothing below touches Python objects.
        py::gil_scoped_release no_gil;
        return pytorch::allreduce_mean_(tensors, group, divisor, bucket_bytes);
      },
      py::arg("tensors"), py::arg("group"), py::arg("divisor"), py::arg("bucket_bytes"),
      R"doc(All-reduces `tensors` in place over `group` as SUM, then divides by `divisor`.

Tensors are packed per (dtype, device) into buckets of at most `bucket_bytes` bytes (a larger
tensor gets a bucket of its own), one collective per bucket, all issued before any is waited on.
Every rank of `group` must pass tensors of the same shapes, dtypes and devices in the same order.
On a group of size 1 nothing is communicated; the tensors are only divided.

Args:
    tensors: dense, contiguous, floating-point or complex tensors, overwritten in place.
    group: a torch.distributed.ProcessGroup, e.g. from dist.new_group().
    divisor: finite number > 0, e.g. the group size for a mean.
    bucket_bytes: maximum bytes per bucket, > 0.

Returns:
    The number of collectives issued (0 for an empty list or a group of size 1).

Raises:
    ValueError: bad divisor or bucket_bytes, or a sparse, non-contiguous, undefined or integer
        tensor (the message names its index, shape and dtype).
)doc");

  // The destructor waits for what is still in flight: without the GIL, as every wait here.
  py::class_<pytorch::PendingAllreduces>(m, "PendingAllreduces",
                                         py::release_gil_before_calling_cpp_dtor(), R"doc(
Bucket all-reduces issued one at a time, as their tensors become final, and waited together
(smp/pytorch/grad_reduce.h). The collectives of one group are matched by order: every rank must
issue buffers of the same sizes and dtypes in the same order, and as many.
)doc")
      .def(py::init<c10::intrusive_ptr<c10d::ProcessGroup>>(), py::arg("group"))
      .def(
          "issue",
          [](pytorch::PendingAllreduces& self, const std::vector<at::Tensor>& tensors,
             double divisor) {
            py::gil_scoped_release no_gil;  // see allreduce_mean_ above
            return self.issue(tensors, divisor);
          },
          py::arg("tensors"), py::arg("divisor"),
          R"doc(Flattens `tensors` (one dtype and device, any strides) into a new buffer and starts
its SUM all-reduce; returns the buffer's index. The tensors are not changed.)doc")
      .def(
          "wait",
          [](pytorch::PendingAllreduces& self) {
            py::gil_scoped_release no_gil;
            return self.wait();
          },
          R"doc(Waits for every issued all-reduce (all, also after a failure, then raises the first
as CollectiveError) and returns the buffers, each divided by its divisor, in issue order.)doc")
      .def(
          "drain",
          [](pytorch::PendingAllreduces& self) {
            py::gil_scoped_release no_gil;
            self.drain();
          },
          "Waits for every issued all-reduce, ignoring failures, and forgets the buffers.")
      .def("__len__", &pytorch::PendingAllreduces::size);
}

}  // namespace smp::python
