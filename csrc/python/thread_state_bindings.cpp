// smp._C.ThreadState / ThreadStateGuard: torch's thread-local state carried to worker threads.
//
// The pipeline runtime runs a step's forwards in pool threads (smp/pipeline/runtime.py). What a
// module's forward would see on the step's own thread must be what it sees there: grad and
// inference mode, the autocast dispatch keys, saved-tensor hooks, torch function / dispatch
// modes, functorch levels. at::ThreadLocalState is torch's own record of exactly that set (the
// autograd engine and at::launch carry it across threads the same way); the autocast dtypes and
// cache flag, which it leaves out, are carried by the runtime in Python.
//
// Also two probes of autograd's state for the pipeline's backward (smp/pipeline/segments.py):
// the calling thread's next node sequence number, and whether a gradient the engine returned is
// held by nothing else.
#include <ATen/SequenceNumber.h>
#include <ATen/ThreadLocalState.h>
#include <torch/csrc/autograd/python_variable.h>

#include <memory>
#include <optional>

#include "python/bindings.h"
#include "smp/error.h"

namespace smp::python {

namespace py = pybind11;

namespace {

// A guard entered and exited from Python (a context manager), once.
class ThreadStateGuard {
 public:
  explicit ThreadStateGuard(std::shared_ptr<const at::ThreadLocalState> state)
      : state_(std::move(state)) {}

  void enter() {
    SMP_CHECK(!guard_ && !used_, "ThreadStateGuard: entered twice");
    used_ = true;
    guard_.emplace(*state_);
  }
  void exit() { guard_.reset(); }

 private:
  std::shared_ptr<const at::ThreadLocalState> state_;
  std::optional<at::ThreadLocalStateGuard> guard_;
  bool used_ = false;
};

}  // namespace

void init_thread_state_bindings(py::module_& m) {
  m.def(
      "next_sequence_nr", [] { return at::sequence_number::peek(); },
      R"doc(The sequence number the next autograd node created by the calling thread will get
(at::sequence_number::peek: a thread-local counter that only node construction advances).)doc");

  m.def(
      "sole_gradient",
      [](const py::tuple& grads, size_t index) {
        SMP_CHECK(index < grads.size(), "sole_gradient: index {} of a tuple of {}", index,
                  grads.size());
        // Borrowed: reading the item from the tuple adds no reference of ours.
        PyObject* item = PyTuple_GET_ITEM(grads.ptr(), static_cast<Py_ssize_t>(index));
        if (Py_REFCNT(item) != 1 || !THPVariable_CheckExact(item)) return false;
        const at::Tensor& grad = THPVariable_Unpack(item);
        if (!grad.defined() || grad.layout() != at::kStrided || grad.requires_grad() ||
            !grad.is_contiguous() || grad.use_count() != 1) {
          return false;
        }
        // The engine often returns a view (a Linear's weight gradient is the transpose of a
        // product): its memory is free when the view alone holds its base.
        if (!grad.is_view()) return grad.storage().use_count() == 1;
        const at::TensorBase& base = grad._base();
        return base.use_count() == 1 && grad.storage().use_count() == 2;
      },
      py::arg("grads"), py::arg("index"),
      R"doc(Whether ``grads[index]`` is a plain, contiguous tensor that nothing but the tuple
holds: no other Python reference to it, no other C++ owner of it or of its storage (a view's
base held by the view alone), and no gradient of its own. autograd's accumulator takes such a
gradient as the parameter's ``.grad`` without copying it; smp's does too (segments.accumulate).)doc");

  py::class_<at::ThreadLocalState, std::shared_ptr<at::ThreadLocalState>>(
      m, "ThreadState",
      R"doc(torch's thread-local state of the calling thread, captured when constructed
(at::ThreadLocalState: grad and inference mode, autocast on/off, saved-tensor hooks, torch
function and dispatch modes). ``ThreadStateGuard(state)`` applies it in another thread.)doc")
      .def(py::init<>());

  py::class_<ThreadStateGuard>(
      m, "ThreadStateGuard",
      "Context manager: the thread runs with ``state`` inside, and with its own state again after.")
      .def(py::init<std::shared_ptr<at::ThreadLocalState>>(), py::arg("state"))
      .def("__enter__",
           [](ThreadStateGuard& self) {
             self.enter();
             return py::none();
           })
      .def("__exit__", [](ThreadStateGuard& self, const py::args&) {
        self.exit();
        return false;
      });
}

}  // namespace smp::python
