// Bindings of the pipeline schedule IR (include/smp/schedule.h) as the submodule smp._C.schedule.
// A schedule is a list (one per rank) of lists of Action or None (an idle step).
#include <fmt/format.h>
#include <pybind11/stl.h>

#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "python/bindings.h"
#include "smp/schedule.h"

namespace py = pybind11;

namespace smp::python {
namespace {

namespace sch = ::smp::schedule;

void init_action(py::module_& m) {
  py::class_<sch::Action>(m, "Action", R"doc(
One action of a pipeline schedule: `type` of `stage` for `microbatch`; immutable.

Its string form is torch.distributed.pipelining's: stage, type, microbatch, e.g. ``1F0``,
``0B3``, ``2I1``, ``2W1``, ``1SEND_F2``, ``0RECV_B3``. ``str()`` and ``repr()`` give it, and
``Action.parse`` reads it back.

Types: F (forward), B (full backward), I (backward for inputs), W (backward for weights),
SEND_F, RECV_F, SEND_B, RECV_B.

Example:
    a = smp._C.schedule.Action(1, "F", 0)
    assert str(a) == "1F0" and smp._C.schedule.Action.parse("1F0") == a
)doc")
      .def(py::init([](int stage, const std::string& type, int microbatch) {
             return sch::Action{stage, sch::parse_action_type(type), microbatch};
           }),
           py::arg("stage"), py::arg("type"), py::arg("microbatch"),
           R"doc(Raises:
    ValueError: `type` is not one of F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B.
)doc")
      .def_readonly("stage", &sch::Action::stage)
      .def_property_readonly(
          "type", [](const sch::Action& a) { return std::string(sch::action_type_name(a.type)); },
          "The type's string form: F, B, I, W, SEND_F, RECV_F, SEND_B or RECV_B.")
      .def_readonly("microbatch", &sch::Action::microbatch)
      .def_property_readonly(
          "is_compute", [](const sch::Action& a) { return sch::is_compute(a.type); },
          "True for F, B, I, W.")
      .def_static("parse", &sch::parse_action, py::arg("text"),
                  R"doc(Parses the string form, e.g. ``"1F0"``.

Raises:
    ValueError: naming the text, when it is not <stage><type><microbatch>.
)doc")
      .def("__str__", &sch::to_string)
      .def("__repr__", &sch::to_string)
      .def(
          "__eq__", [](const sch::Action& a, const sch::Action& b) { return a == b; },
          py::is_operator())
      .def("__hash__",
           [](const sch::Action& a) {
             return py::hash(py::make_tuple(a.stage, static_cast<int>(a.type), a.microbatch));
           })
      .def(py::pickle([](const sch::Action& a) { return sch::to_string(a); },
                      [](const std::string& text) { return sch::parse_action(text); }));
  m.def("parse_action", &sch::parse_action, py::arg("text"),
        "Parses an action's string form, e.g. \"1F0\" (same as Action.parse).");
}

void init_costs_and_timeline(py::module_& m) {
  py::class_<sch::ActionCosts>(m, "ActionCosts",
                               "Duration of each action type for simulate() and "
                               "add_communication(); all >= 0 (compute > 0 for lowering).")
      .def(py::init([](double forward, double full_backward, double backward_input,
                       double backward_weight, double send, double recv, double latency) {
             return sch::ActionCosts{forward, full_backward, backward_input, backward_weight,
                                     send,    recv,          latency};
           }),
           py::kw_only(), py::arg("forward") = 1.0, py::arg("full_backward") = 2.0,
           py::arg("backward_input") = 1.0, py::arg("backward_weight") = 1.0, py::arg("send") = 0.0,
           py::arg("recv") = 0.0, py::arg("latency") = 0.0)
      .def_readwrite("forward", &sch::ActionCosts::forward, "F")
      .def_readwrite("full_backward", &sch::ActionCosts::full_backward, "B")
      .def_readwrite("backward_input", &sch::ActionCosts::backward_input, "I")
      .def_readwrite("backward_weight", &sch::ActionCosts::backward_weight, "W")
      .def_readwrite("send", &sch::ActionCosts::send, "SEND_F, SEND_B: time the sender is busy")
      .def_readwrite("recv", &sch::ActionCosts::recv,
                     "RECV_F, RECV_B: time the receiver is busy once the data is there")
      .def_readwrite("latency", &sch::ActionCosts::latency,
                     "time from a SEND's end (or a producer's end, compute-only) until the data "
                     "is usable on the other rank")
      .def("__repr__", [](const sch::ActionCosts& c) {
        return fmt::format(FMT_STRING("ActionCosts(forward={:g}, full_backward={:g}, "
                                      "backward_input={:g}, backward_weight={:g}, send={:g}, "
                                      "recv={:g}, latency={:g})"),
                           c.forward, c.full_backward, c.backward_input, c.backward_weight, c.send,
                           c.recv, c.latency);
      });

  py::class_<sch::Timeline>(m, "Timeline", "The result of simulate(); read-only.")
      .def_readonly("makespan", &sch::Timeline::makespan, "Largest end time.")
      .def_readonly("bubble_fraction", &sch::Timeline::bubble_fraction,
                    "1 - compute time / (ranks x makespan).")
      .def_readonly("peak_in_flight", &sch::Timeline::peak_in_flight,
                    "Per rank, the most (stage, microbatch) pairs with F done and B/I not done.")
      .def_property_readonly(
          "actions",
          [](const sch::Timeline& t) {
            std::vector<std::tuple<int, std::string, double, double>> actions;
            actions.reserve(t.actions.size());
            for (const sch::TimedAction& a : t.actions) {
              actions.emplace_back(a.rank, sch::to_string(a.action), a.start, a.end);
            }
            return actions;
          },
          "Every action as (rank, action string, start, end), rank by rank in program order.")
      .def("__repr__", [](const sch::Timeline& t) {
        return fmt::format(FMT_STRING("Timeline(makespan={:g}, bubble_fraction={:g}, actions={})"),
                           t.makespan, t.bubble_fraction, t.actions.size());
      });
}

void init_functions(py::module_& m) {
  // Arguments are converted before the GIL is released, results after it is back.
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  m.def("round_robin_stage_to_rank", &sch::round_robin_stage_to_rank, py::arg("num_stages"),
        py::arg("num_ranks"), "stage_to_rank with stage s on rank s % num_ranks.");
  m.def("gpipe", &sch::gpipe, py::arg("num_stages"), py::arg("num_microbatches"), no_gil,
        "GPipe on the unit-time grid: all forwards, then all backwards (stage s on rank s).");
  m.def("one_f_one_b", &sch::one_f_one_b, py::arg("num_stages"), py::arg("num_microbatches"),
        no_gil, "1F1B on the unit-time grid: warm-up, one forward one backward, cool-down.");
  m.def("interleaved_1f1b", &sch::interleaved_1f1b, py::arg("num_ranks"),
        py::arg("virtual_stages_per_rank"), py::arg("num_microbatches"), no_gil,
        R"doc(Megatron's interleaved 1F1B on the unit-time grid; stage s on rank s % num_ranks.

Raises:
    ValueError: num_microbatches is not a multiple of num_ranks, or a count is < 1.
)doc");
  m.def("zero_bubble_h1", &sch::zero_bubble_h1, py::arg("num_stages"), py::arg("num_microbatches"),
        no_gil,
        "ZB-H1 on the unit-time grid: 1F1B with B split into I and W, W deferred into the "
        "bubbles.");
  m.def("add_communication", &sch::add_communication, py::arg("schedule"), py::arg("stage_to_rank"),
        py::arg("costs") = sch::ActionCosts{}, no_gil,
        R"doc(Lowers a compute-only schedule: adds SEND/RECV between stages on different ranks.

The order cannot deadlock, even under rendezvous sends; with `costs` and free communication the
result runs as fast as the compute-only schedule. Idle steps are dropped.

Raises:
    ValueError: the schedule holds communication already or is not valid (the message holds the
        grid), or a compute cost is not > 0.
)doc");
  m.def("validate_schedule", &sch::validate_schedule, py::arg("schedule"), py::arg("num_stages"),
        py::arg("num_microbatches"), py::arg("stage_to_rank"), no_gil,
        R"doc(Checks counts, placement, dependencies, send/recv matching and deadlock freedom.

Raises:
    ValueError: naming the rank, step, action and rule, followed by the rank x step grid with
        the failing step marked >like this<.
)doc");
  m.def(
      "format_grid",
      [](const sch::Schedule& schedule, const std::vector<std::pair<int, int>>& marked) {
        std::vector<sch::Cell> cells;
        for (const auto& [rank, step] : marked) cells.push_back(sch::Cell{rank, step});
        return sch::format_grid(schedule, cells);
      },
      py::arg("schedule"), py::arg("marked") = std::vector<std::pair<int, int>>{},
      "The schedule as a rank x step grid; cells (rank, step) in `marked` print >like this<.");
  m.def("to_csv", &sch::to_csv, py::arg("schedule"),
        "The schedule in torch.distributed.pipelining's _dump_csv format (rows end in \\r\\n).");
  m.def("from_csv", &sch::from_csv, py::arg("text"),
        "Reads to_csv() / torch's _dump_csv output; raises ValueError naming the row and cell.");
  m.def("simulate",
        py::overload_cast<const sch::Schedule&, const sch::ActionCosts&, bool>(&sch::simulate),
        py::arg("schedule"), py::arg("costs") = sch::ActionCosts{}, py::arg("rendezvous") = false,
        no_gil,
        R"doc(Event-driven simulation of a compute-only or lowered schedule.

Each rank runs its program in order; an action waits for its rank and its dependencies (a RECV
for its SEND; with `rendezvous`, a SEND also for its RECV to be reached).

Returns:
    A Timeline: makespan, bubble_fraction, peak_in_flight (per rank) and actions
    (rank, action string, start, end).

Raises:
    ValueError: a cost is negative, the schedule is malformed, or it deadlocks (the message
        holds the grid with the blocked steps marked).
)doc");
  m.def("simulate",
        py::overload_cast<const sch::Schedule&, const std::vector<sch::ActionCosts>&, bool>(
            &sch::simulate),
        py::arg("schedule"), py::arg("costs"), py::arg("rendezvous") = false, no_gil,
        R"doc(simulate() with costs per stage: a list with stage s's ActionCosts at index s.

Raises:
    ValueError: the list does not hold exactly one ActionCosts per stage, or as simulate().
)doc");
}

}  // namespace

void init_schedule_bindings(py::module_& m) {
  py::module_ schedule =
      m.def_submodule("schedule", R"doc(The pipeline schedule IR (smp/schedule.h).

A schedule is a list with one program per rank; a program is a list of Action or None (an idle
step). Generators (gpipe, one_f_one_b, interleaved_1f1b, zero_bubble_h1) return compute-only
schedules on a unit-time grid; add_communication lowers them; validate_schedule checks them;
simulate times them; to_csv / from_csv exchange them with torch.distributed.pipelining.

Example:
    from smp._C import schedule as S
    compute = S.one_f_one_b(4, 8)
    lowered = S.add_communication(compute, S.round_robin_stage_to_rank(4, 4))
    S.validate_schedule(lowered, 4, 8, [0, 1, 2, 3])
    print(S.format_grid(compute), S.simulate(lowered).bubble_fraction)
)doc");
  init_action(schedule);
  init_costs_and_timeline(schedule);
  init_functions(schedule);
}

}  // namespace smp::python
