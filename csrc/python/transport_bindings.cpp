// Bindings of the pipeline runtime's message transport (smp/pytorch/transport.h).
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
// The ProcessGroup argument crosses as torch's own holder; see Note [ProcessGroup across the
// pybind11 boundary] in comm_bindings.cpp.
#include <torch/csrc/utils/pybind.h>

#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <optional>

#include "python/bindings.h"
#include "smp/error.h"
#include "smp/pytorch/collective.h"
#include "smp/pytorch/sender.h"
#include "smp/pytorch/server.h"
#include "smp/pytorch/transport.h"

namespace py = pybind11;

namespace smp::python {
namespace {

using pytorch::Message;
using pytorch::PipelineServer;
using pytorch::RemoteStageError;
using pytorch::Sender;
using pytorch::Transport;
using pytorch::TransportError;

// Seconds (a Python float) to milliseconds, rounded up so that a small positive timeout never
// becomes 0. Longer than a year is clamped to a year (the waits would overflow otherwise).
std::chrono::milliseconds to_millis(double seconds, const char* name, bool allow_zero) {
  SMP_CHECK(std::isfinite(seconds) && (allow_zero ? seconds >= 0 : seconds > 0),
            "{} must be {} seconds and finite, got {:g}", name, allow_zero ? ">= 0" : "> 0",
            seconds);
  const double millis = std::ceil(std::min(seconds, 365.0 * 24 * 3600) * 1000.0);
  return std::chrono::milliseconds(static_cast<int64_t>(millis));
}

// The destructor may join receiver threads (Transport::abort()): do not hold the GIL meanwhile,
// since the backend's side of a wake-up may need it (see comm_bindings.cpp on gloo and the GIL).
// (A Sender's destructor waits for its threads' sends likewise.)
template <typename T>
struct DeleteWithoutGil {
  void operator()(T* object) const {
    if (PyGILState_Check()) {
      py::gil_scoped_release no_gil;
      delete object;
    } else {
      delete object;
    }
  }
};

}  // namespace

void init_transport_bindings(py::module_& m) {
  // A timeout or backend failure of the transport: RuntimeError, with the peer(s) named in the
  // message. (smp::Error, a user mistake, is ValueError; see bindings.cpp.)
  py::register_exception<TransportError>(m, "TransportError", PyExc_RuntimeError);
  // A failure of a collective smp issued (smp/pytorch/collective.h): a failure elsewhere.
  py::register_exception<pytorch::CollectiveError>(m, "CollectiveError", PyExc_RuntimeError);

  py::class_<Transport, std::unique_ptr<Transport, DeleteWithoutGil<Transport>>>(
      m, "Transport",
      R"doc(Point-to-point messages between this rank and its peers (smp/pytorch/transport.h).

One FIFO channel per peer: messages from one peer arrive in the order they were sent. A message
is a list of ints (the header) plus a list of tensors (CPU or device). Each step: start(), any
number of send()/recv(), then finish() on every rank (it exchanges END with every peer); start()
may then open the next step. The blocking calls release the GIL.

Args:
    group: a torch.distributed.ProcessGroup, e.g. from dist.new_group().
    peers: group ranks this rank talks to (distinct, not itself); symmetric across ranks.
    timeout_s: bounds the waits of send() and finish(), seconds > 0.
    tag: the point-to-point tag, >= 0; one per Transport on a group.
    payload_groups: [] or two groups of the same ranks (ascending, descending direction) that
        carry the tensors their backends support, e.g. NCCL groups for CUDA tensors; headers
        and the other tensors go on `group` (device tensors staged through host memory).
    device: where received device tensors land (this rank's device); None: the CPU.

Raises:
    ValueError: a bad group, peer list, timeout or tag.
)doc")
      .def(py::init([](const c10::intrusive_ptr<c10d::ProcessGroup>& group, std::vector<int> peers,
                       double timeout_s, int tag,
                       std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> payload_groups,
                       std::optional<c10::Device> device) {
             return std::unique_ptr<Transport, DeleteWithoutGil<Transport>>(new Transport(
                 group, std::move(peers), to_millis(timeout_s, "timeout_s", false), tag,
                 std::move(payload_groups), device.value_or(c10::Device(c10::kCPU))));
           }),
           py::arg("group"), py::arg("peers"), py::arg("timeout_s"), py::arg("tag"),
           py::arg("payload_groups") = std::vector<c10::intrusive_ptr<c10d::ProcessGroup>>{},
           py::arg("device") = py::none())
      .def(
          "start",
          [](Transport& self) {
            py::gil_scoped_release no_gil;
            self.start();
          },
          "Opens the step: one receiver thread per peer. Raises ValueError if already started "
          "or after a failure.")
      .def(
          "send",
          [](Transport& self, int peer, const std::vector<int64_t>& header,
             const std::vector<at::Tensor>& tensors) {
            // Safe: the arguments are C++ values now; nothing below touches Python objects.
            py::gil_scoped_release no_gil;
            self.send(peer, header, tensors);
          },
          py::arg("peer"), py::arg("header"), py::arg("tensors"),
          R"doc(Sends one message to `peer`; returns once the peer has taken every part.

Raises:
    ValueError: not started, unknown peer, an undefined/sparse/meta tensor, or a header that
        does not fit (see header_capacity), all before anything is sent.
    TransportError: the backend failed or the peer did not take the message within timeout_s.
)doc")
      .def(
          "send_batch",
          [](Transport& self, int peer, const std::vector<Transport::OutgoingMessage>& messages) {
            py::gil_scoped_release no_gil;
            self.send_batch(peer, messages);
          },
          py::arg("peer"), py::arg("messages"),
          R"doc(Sends `messages`, a list of (header, tensors), to `peer` in order, as that many
send() calls would, packed into as few wire messages as fit; the peer's recv() returns them one
by one. Returns once the peer has taken every part.

Raises:
    ValueError: as send(), for any of the messages, before anything is sent.
    TransportError: as send().
)doc")
      .def(
          "recv",
          [](Transport& self, double timeout_s) -> py::object {
            const auto timeout = to_millis(timeout_s, "timeout_s", true);
            std::optional<Message> message;
            {
              py::gil_scoped_release no_gil;
              message = self.recv(timeout);
              if (message) message->wait_ready();  // the caller uses its tensors from now on
            }
            if (!message) return py::none();
            return py::make_tuple(message->peer, message->header, message->tensors);
          },
          py::arg("timeout_s"),
          R"doc(Returns the next message as (peer, header, tensors), waiting up to timeout_s.

Messages from one peer come in the order they were sent. Returns None once every peer has called
finish() and every message has been returned.

Raises:
    TransportError: nothing arrived within timeout_s (the message names the peers whose channels
        are still open), or receiving from a peer failed (the message names it).
    ValueError: not started.
)doc")
      .def(
          "finish",
          [](Transport& self, bool abort_on_failure) {
            py::gil_scoped_release no_gil;
            self.finish(abort_on_failure);
          },
          py::arg("abort_on_failure") = true,
          R"doc(Ends the step: sends END to every peer and waits for theirs (within timeout_s).

Raises:
    TransportError: a peer did not call finish() in time (named), a receive failed, or received
        messages were never taken by recv(); the transport is then aborted, unless
        abort_on_failure is False: then its receivers stay posted until abort() (for a peer
        that is late, not gone: its sends on this tag still find a receive).
    ValueError: not started.
)doc")
      .def(
          "abort",
          [](Transport& self) {
            py::gil_scoped_release no_gil;
            self.abort();
          },
          "Stops now without END (error paths): wakes and joins the receivers; pending and "
          "later recv() raise TransportError. The group's channels on this tag must not be "
          "reused afterwards.")
      .def_static("header_capacity", &Transport::header_capacity, py::arg("tensors"),
                  "How many header ints fit in one message with these tensors.")
      .def_property_readonly("rank", &Transport::rank)
      .def_property_readonly("peers", &Transport::peers)
      .def_property_readonly("tag", &Transport::tag)
      .def_property_readonly("timeout_s",
                             [](const Transport& self) { return self.timeout().count() / 1000.0; })
      .def_property_readonly("device", &Transport::device)
      .def_property_readonly("started", &Transport::started);

  py::class_<Sender, std::unique_ptr<Sender, DeleteWithoutGil<Sender>>>(
      m, "Sender",
      R"doc(Sends a step's messages on threads of its own, one per peer (smp/pytorch/sender.h).

Messages to one peer go in the order they were given; those that queue up while one is on the
wire go as one batch. Device tensors: the send waits on an event recorded on the calling
thread's current stream when the message is queued, from a stream of its own (design.md §4.8).
The transport must stay started until close() has returned.

Args:
    transport: a started smp._C.Transport (kept alive by the Sender).
    peers: the peers to send to (peers of the transport).
    timeout_s: how long close() waits for the queues to drain, seconds > 0.
)doc")
      .def(py::init([](Transport* transport, const std::vector<int>& peers, double timeout_s) {
             return std::unique_ptr<Sender, DeleteWithoutGil<Sender>>(
                 new Sender(transport, peers, to_millis(timeout_s, "timeout_s", false)));
           }),
           py::arg("transport"), py::arg("peers"), py::arg("timeout_s"), py::keep_alive<1, 2>())
      .def(
          "send",
          [](Sender& self, int peer, std::vector<int64_t> header, std::vector<at::Tensor> tensors,
             bool wait) {
            if (!wait) {  // a lock and a notify: cheaper than giving the GIL away
              self.send(peer, std::move(header), std::move(tensors), false);
              return;
            }
            py::gil_scoped_release no_gil;
            self.send(peer, std::move(header), std::move(tensors), true);
          },
          py::arg("peer"), py::arg("header"), py::arg("tensors"), py::arg("wait") = false,
          R"doc(Queues a message for `peer`; with `wait`, returns once it has been sent.

The tensors must not be modified in place until the message is sent.

Raises:
    The first error of an earlier send (TransportError, ValueError); the transport was aborted.
    TransportError: with `wait`, the message was not sent within timeout_s per queued message.
    ValueError: an unknown peer, or the sender is closed.
)doc")
      .def(
          "close",
          [](Sender& self) {
            py::gil_scoped_release no_gil;
            return self.close();
          },
          "Waits (timeout_s at most) until every queued message is sent or failed and ends the "
          "threads; returns the peers still being sent to then (the transport was aborted to "
          "stop them). Idempotent.")
      .def("check", &Sender::check, "Raises the first send error, if any.")
      .def_property_readonly("sent", &Sender::sent, "Messages sent so far.");

  py::register_exception<RemoteStageError>(m, "RemoteStageError", PyExc_RuntimeError);

  py::class_<PipelineServer>(m, "PipelineServer",
                             R"doc(The module server's loop for one step (smp/pytorch/server.h).

Reads the started transport, turns messages into tasks of its ServerPolicy, and returns them with
the message that made them runnable.
)doc")
      .def(py::init([](Transport* transport, const std::string& kind, int num_microbatches,
                       int active_microbatches, bool is_leader, int deferred_weight_microbatches,
                       const std::vector<std::string>& program) {
             return new PipelineServer(transport, parse_pipeline_kind(kind), num_microbatches,
                                       active_microbatches, is_leader, deferred_weight_microbatches,
                                       parse_program(program));
           }),
           py::arg("transport"), py::arg("kind"), py::arg("num_microbatches"),
           py::arg("active_microbatches"), py::arg("is_leader"),
           py::arg("deferred_weight_microbatches") = 0,
           py::arg("program") = std::vector<std::string>{}, py::keep_alive<1, 2>())
      .def("new_id", &PipelineServer::new_id)
      .def("expect", &PipelineServer::expect, py::arg("call_id"), py::arg("kind"),
           py::arg("microbatch"), py::arg("worker_id"))
      .def(
          "next",
          [](PipelineServer& self, double timeout_s) -> py::object {
            const auto timeout = to_millis(timeout_s, "timeout_s", false);
            std::optional<pytorch::ServerTask> task;
            {
              py::gil_scoped_release no_gil;
              task = self.next(timeout);
            }
            if (!task) return py::none();
            py::object message = py::none();
            if (task->message) {
              message = py::make_tuple(task->message->peer, task->message->header,
                                       task->message->tensors);
            }
            return py::make_tuple(task->task, message, task->target);
          },
          py::arg("timeout_s"),
          "(task, (peer, header, tensors) or None, target worker id or -1), or None when the step "
          "is over on this rank.")
      .def_property_readonly(
          "policy", [](PipelineServer& self) -> ServerPolicy& { return self.policy(); },
          py::return_value_policy::reference_internal)
      .def_property_readonly("announced_backward_calls", &PipelineServer::announced_backward_calls)
      .def_property("hold_open", &PipelineServer::hold_open, &PipelineServer::set_hold_open,
                    "While True, next() does not end the step at STEP_END (non-leaders): quiet "
                    "calls served here have not finished.");
}

}  // namespace smp::python
