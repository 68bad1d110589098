// smp._C bindings of the automatic partitioner (include/smp/partition.h).
#include <pybind11/stl.h>

#include <sstream>

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
        std::ostringstream out;
        out << "PartitionNode(name='" << n.name << "', parent=" << n.parent
            << ", compute=" << n.compute << ", param_bytes=" << n.param_bytes
            << ", activation_bytes=" << n.activation_bytes << ", pin=" << n.pin
            << ", chain=" << (n.chain ? "True" : "False") << ")";
        return out.str();
      });

  py::class_<PartitionOptions>(m, "PartitionOptions", "Knobs of partition().")
      .def(py::init([](int num_stages, double memory_weight) {
             PartitionOptions options;
             options.num_stages = num_stages;
             options.memory_weight = memory_weight;
             return options;
           }),
           py::kw_only(), py::arg("num_stages") = 1, py::arg("memory_weight") = 0.2)
      .def_readwrite("num_stages", &PartitionOptions::num_stages)
      .def_readwrite("memory_weight", &PartitionOptions::memory_weight)
      .def("__repr__", [](const PartitionOptions& o) {
        std::ostringstream out;
        out << "PartitionOptions(num_stages=" << o.num_stages
            << ", memory_weight=" << o.memory_weight << ")";
        return out.str();
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
      .def("__repr__", [](const PartitionPlan& p) {
        std::ostringstream out;
        out << "PartitionPlan(num_stages=" << p.stage_cost.size()
            << ", max_stage_cost=" << p.max_stage_cost << ", imbalance=" << p.imbalance << ")";
        return out.str();
      });

  // Arguments are converted before the GIL is released; the plan is converted after it is back.
  m.def("partition", &partition, py::arg("nodes"), py::arg("options"),
        py::call_guard<py::gil_scoped_release>(),
        "Assigns every node of the module tree to a pipeline stage (smp/partition.h).");
  m.def("optimal_contiguous_partition", &optimal_contiguous_partition, py::arg("costs"),
        py::arg("num_parts"),
        "Exact min-max split of costs (in order) into num_parts contiguous parts; the part of "
        "each item.");
}

}  // namespace smp::python
