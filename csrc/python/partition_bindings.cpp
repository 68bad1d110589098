// smp._C bindings of the automatic partitioner (include/smp/partition.h).
#include <fmt/format.h>
#include <pybind11/stl.h>

#include "python/bindings.h"
#include "smp/partition.h"

namespace py = pybind11;

namespace smp::python {

void init_partition_bindings(py::module_& m) {
  py::class_<PartitionNode>(m, "PartitionNode", "One module of the traced tree (smp/partition.h).")
      .def(py::init([](std::string name, int parent, double compute, double param_bytes,
                       double activation_bytes, int pin, bool chain) {
             return PartitionNode{std::move(name),  parent, compute, param_bytes,
                                  activation_bytes, pin,    chain};
           }),
           py::kw_only(), py::arg("name") = "", py::arg("parent") = -1, py::arg("compute") = 0.0,
           py::arg("param_bytes") = 0.0, py::arg("activation_bytes") = 0.0, py::arg("pin") = -1,
           py::arg("chain") = false)
      .def_readwrite("name", &PartitionNode::name)
      .def_readwrite("parent", &PartitionNode::parent)
      .def_readwrite("compute", &PartitionNode::compute)
      .def_readwrite("param_bytes", &PartitionNode::param_bytes)
      .def_readwrite("activation_bytes", &PartitionNode::activation_bytes)
      .def_readwrite("pin", &PartitionNode::pin)
      .def_readwrite("chain", &PartitionNode::chain)
      .def("__repr__", [](const PartitionNode& n) {
        return fmt::format(FMT_STRING("PartitionNode(name='{}', parent={}, compute={:g}, "
                                      "param_bytes={:g}, activation_bytes={:g}, pin={}, chain={})"),
                           n.name, n.parent, n.compute, n.param_bytes, n.activation_bytes, n.pin,
                           n.chain ? "True" : "False");
      });

  py::class_<PartitionCall>(m, "PartitionCall",
                            "Calls one node's forward makes to another per microbatch "
                            "(smp/partition.h).")
      .def(py::init([](int caller, int callee, double calls, double forward_bytes,
                       double backward_bytes) {
             return PartitionCall{caller, callee, calls, forward_bytes, backward_bytes};
           }),
           py::kw_only(), py::arg("caller") = -1, py::arg("callee") = 0, py::arg("calls") = 0.0,
           py::arg("forward_bytes") = 0.0, py::arg("backward_bytes") = 0.0)
      .def_readwrite("caller", &PartitionCall::caller)
      .def_readwrite("callee", &PartitionCall::callee)
      .def_readwrite("calls", &PartitionCall::calls)
      .def_readwrite("forward_bytes", &PartitionCall::forward_bytes)
      .def_readwrite("backward_bytes", &PartitionCall::backward_bytes)
      .def("__repr__", [](const PartitionCall& c) {
        return fmt::format(FMT_STRING("PartitionCall(caller={}, callee={}, calls={:g}, "
                                      "forward_bytes={:g}, backward_bytes={:g})"),
                           c.caller, c.callee, c.calls, c.forward_bytes, c.backward_bytes);
      });

  py::class_<PartitionLink>(m, "PartitionLink",
                            "Crossings between two stages per microbatch; read-only.")
      .def_readonly("first_stage", &PartitionLink::first_stage)
      .def_readonly("second_stage", &PartitionLink::second_stage)
      .def_readonly("calls", &PartitionLink::calls)
      .def_readonly("forward_bytes", &PartitionLink::forward_bytes)
      .def_readonly("backward_bytes", &PartitionLink::backward_bytes)
      .def_readonly("seconds", &PartitionLink::seconds)
      .def("__repr__", [](const PartitionLink& l) {
        return fmt::format(FMT_STRING("PartitionLink(stages={}-{}, calls={:g}, forward_bytes={:g}, "
                                      "backward_bytes={:g}, seconds={:g})"),
                           l.first_stage, l.second_stage, l.calls, l.forward_bytes,
                           l.backward_bytes, l.seconds);
      });

  py::class_<PartitionOptions>(m, "PartitionOptions", "Knobs of partition().")
      .def(py::init([](int num_stages, double memory_weight, double seconds_per_compute,
                       double crossing_latency, double bandwidth, double balance_tolerance) {
             PartitionOptions options;
             options.num_stages = num_stages;
             options.memory_weight = memory_weight;
             options.seconds_per_compute = seconds_per_compute;
             options.crossing_latency = crossing_latency;
             options.bandwidth = bandwidth;
             options.balance_tolerance = balance_tolerance;
             return options;
           }),
           py::kw_only(), py::arg("num_stages") = 1, py::arg("memory_weight") = 0.2,
           py::arg("seconds_per_compute") = PartitionOptions{}.seconds_per_compute,
           py::arg("crossing_latency") = PartitionOptions{}.crossing_latency,
           py::arg("bandwidth") = PartitionOptions{}.bandwidth,
           py::arg("balance_tolerance") = PartitionOptions{}.balance_tolerance)
      .def_readwrite("num_stages", &PartitionOptions::num_stages)
      .def_readwrite("memory_weight", &PartitionOptions::memory_weight)
      .def_readwrite("seconds_per_compute", &PartitionOptions::seconds_per_compute)
      .def_readwrite("crossing_latency", &PartitionOptions::crossing_latency)
      .def_readwrite("bandwidth", &PartitionOptions::bandwidth)
      .def_readwrite("balance_tolerance", &PartitionOptions::balance_tolerance)
      .def("__repr__", [](const PartitionOptions& o) {
        return fmt::format(FMT_STRING("PartitionOptions(num_stages={}, memory_weight={:g}, "
                                      "seconds_per_compute={:g}, crossing_latency={:g}, "
                                      "bandwidth={:g}, balance_tolerance={:g})"),
                           o.num_stages, o.memory_weight, o.seconds_per_compute, o.crossing_latency,
                           o.bandwidth, o.balance_tolerance);
      });

  py::class_<PartitionPlan>(m, "PartitionPlan", "The result of partition(); read-only.")
      .def_readonly("stage", &PartitionPlan::stage)
      .def_readonly("node_cost", &PartitionPlan::node_cost)
      .def_readonly("stage_cost", &PartitionPlan::stage_cost)
      .def_readonly("stage_param_bytes", &PartitionPlan::stage_param_bytes)
      .def_readonly("stage_activation_bytes", &PartitionPlan::stage_activation_bytes)
      .def_readonly("stage_compute", &PartitionPlan::stage_compute)
      .def_readonly("max_stage_cost", &PartitionPlan::max_stage_cost)
      .def_readonly("imbalance", &PartitionPlan::imbalance)
      .def_readonly("stage_crossing_cost", &PartitionPlan::stage_crossing_cost)
      .def_readonly("max_stage_load", &PartitionPlan::max_stage_load)
      .def_readonly("links", &PartitionPlan::links)
      .def("__repr__", [](const PartitionPlan& p) {
        return fmt::format(FMT_STRING("PartitionPlan(num_stages={}, max_stage_cost={:g}, "
                                      "imbalance={:g}, max_stage_load={:g})"),
                           p.stage_cost.size(), p.max_stage_cost, p.imbalance, p.max_stage_load);
      });

  // Arguments are converted before the GIL is released; the plan is converted after it is back.
  m.def("partition", &partition, py::arg("nodes"), py::arg("options"),
        py::arg("calls") = std::vector<PartitionCall>{}, py::call_guard<py::gil_scoped_release>(),
        "Assigns every node of the module tree to a pipeline stage (smp/partition.h).");
  m.def("optimal_contiguous_partition", &optimal_contiguous_partition, py::arg("costs"),
        py::arg("num_parts"),
        "Exact min-max split of costs (in order) into num_parts contiguous parts; the part of "
        "each item.");
}

}  // namespace smp::python
