// smp._C bindings of the pipeline server's task queue and policy (include/smp/server_policy.h).
#include <fmt/format.h>
#include <pybind11/stl.h>

#include "python/bindings.h"
#include "smp/server_policy.h"

namespace py = pybind11;

namespace smp::python {

schedule::Program parse_program(const std::vector<std::string>& actions) {
  schedule::Program program;
  program.reserve(actions.size());
  for (const std::string& text : actions) program.emplace_back(schedule::parse_action(text));
  return program;
}

void init_policy_bindings(py::module_& m) {
  py::enum_<PipelineKind>(m, "PipelineKind", "The `pipeline` config value.")
      .value("SIMPLE", PipelineKind::kSimple)
      .value("INTERLEAVED", PipelineKind::kInterleaved)
      .value("STATIC", PipelineKind::kStatic);
  m.def("parse_pipeline_kind", &parse_pipeline_kind, py::arg("name"));
  m.def("pipeline_kind_name", &pipeline_kind_name, py::arg("kind"));

  py::enum_<TaskKind>(m, "TaskKind", "What a server task does.")
      .value("START_MICROBATCH", TaskKind::kStartMicrobatch)
      .value("SERVE_REQUEST", TaskKind::kServeRequest)
      .value("RESUME", TaskKind::kResume)
      .value("BACKWARD", TaskKind::kBackward)
      .value("WEIGHT", TaskKind::kWeight);
  m.def("task_kind_name", &task_kind_name, py::arg("kind"));

  py::class_<Task>(m, "Task", "One runnable task of the pipeline server; read-only.")
      .def_readonly("kind", &Task::kind)
      .def_readonly("microbatch", &Task::microbatch)
      .def_readonly("id", &Task::id)
      .def_readonly("sequence", &Task::sequence)
      .def(
          "__eq__", [](const Task& a, const Task& b) { return a == b; }, py::is_operator())
      .def("__hash__",
           [](const Task& t) {
             return py::hash(
                 py::make_tuple(static_cast<int>(t.kind), t.microbatch, t.id, t.sequence));
           })
      .def("__repr__",
           [](const Task& t) { return fmt::format(FMT_STRING("Task({})"), t.to_string()); });

  py::class_<ServerPolicy>(m, "ServerPolicy",
                           "Task queue and scheduling policy of one rank's pipeline server "
                           "(smp/server_policy.h).")
      .def(py::init([](PipelineKind kind, int num_microbatches, int active_microbatches,
                       bool is_leader, int deferred_weight_microbatches,
                       const std::vector<std::string>& program) {
             return ServerPolicy(kind, num_microbatches, active_microbatches, is_leader,
                                 deferred_weight_microbatches, parse_program(program));
           }),
           py::arg("kind"), py::arg("num_microbatches"), py::arg("active_microbatches"),
           py::arg("is_leader"), py::arg("deferred_weight_microbatches") = 0,
           py::arg("program") = std::vector<std::string>{})
      .def(py::init([](const std::string& kind, int num_microbatches, int active_microbatches,
                       bool is_leader, int deferred_weight_microbatches,
                       const std::vector<std::string>& program) {
             return ServerPolicy(parse_pipeline_kind(kind), num_microbatches, active_microbatches,
                                 is_leader, deferred_weight_microbatches, parse_program(program));
           }),
           py::arg("kind"), py::arg("num_microbatches"), py::arg("active_microbatches"),
           py::arg("is_leader"), py::arg("deferred_weight_microbatches") = 0,
           py::arg("program") = std::vector<std::string>{})
      .def("push", &ServerPolicy::push, py::arg("kind"), py::arg("microbatch"), py::arg("id"))
      .def("next", &ServerPolicy::next)
      .def("on_forward_done", &ServerPolicy::on_forward_done, py::arg("microbatch"))
      .def("on_microbatch_finished", &ServerPolicy::on_microbatch_finished, py::arg("microbatch"))
      .def_property_readonly("kind", &ServerPolicy::kind)
      .def_property_readonly("num_microbatches", &ServerPolicy::num_microbatches)
      .def_property_readonly("active_microbatches", &ServerPolicy::active_microbatches)
      .def_property_readonly("is_leader", &ServerPolicy::is_leader)
      .def_property_readonly("deferred_weight_microbatches",
                             &ServerPolicy::deferred_weight_microbatches)
      .def("num_queued", &ServerPolicy::num_queued)
      .def("num_in_flight", &ServerPolicy::num_in_flight)
      .def("num_started", &ServerPolicy::num_started)
      .def("all_finished", &ServerPolicy::all_finished)
      .def("describe", &ServerPolicy::describe)
      .def("__repr__", &ServerPolicy::describe);
}

}  // namespace smp::python
