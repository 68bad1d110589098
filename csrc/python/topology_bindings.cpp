#include <fmt/format.h>

#include "python/bindings.h"
#include "smp/topology.h"

namespace py = pybind11;

namespace smp::python {

void init_topology_bindings(py::module_& m) {
  py::enum_<Axis>(m, "Axis")
      .value("PP", Axis::kPp)
      .value("TP", Axis::kTp)
      .value("DP", Axis::kDp)
      .value("RDP", Axis::kRdp)
      .value("MP", Axis::kMp);
  m.def("axis_name", &axis_name, py::arg("axis"));
  m.def("canonical_placement", &canonical_placement, py::arg("placement_strategy"));

  py::class_<Coordinates>(m, "Coordinates")
      .def(py::init<>())
      .def(py::init([](int pp, int tp, int rdp) {
             return Coordinates{pp, tp, rdp};
           }),
           py::arg("pp"), py::arg("tp"), py::arg("rdp"))
      .def_readwrite("pp", &Coordinates::pp)
      .def_readwrite("tp", &Coordinates::tp)
      .def_readwrite("rdp", &Coordinates::rdp)
      .def("__eq__", &Coordinates::operator==)
      .def("__repr__", [](const Coordinates& c) {
        return fmt::format(FMT_STRING("Coordinates(pp={}, tp={}, rdp={})"), c.pp, c.tp, c.rdp);
      });

  py::class_<Topology>(m, "Topology")
      .def(py::init<int, int, int, const std::string&>(), py::arg("world_size"),
           py::arg("pipeline_parallel_degree"), py::arg("tensor_parallel_degree"),
           py::arg("placement_strategy") = "cluster")
      .def_property_readonly("world_size", &Topology::world_size)
      .def_property_readonly("pp_size", &Topology::pp_size)
      .def_property_readonly("tp_size", &Topology::tp_size)
      .def_property_readonly("dp_size", &Topology::dp_size)
      .def_property_readonly("rdp_size", &Topology::rdp_size)
      .def_property_readonly("mp_size", &Topology::mp_size)
      .def_property_readonly("placement", &Topology::placement)
      .def("size", &Topology::size, py::arg("axis"))
      .def("coordinates", &Topology::coordinates, py::arg("rank"))
      .def("rank_of", &Topology::rank_of, py::arg("coordinates"))
      .def("group_of", &Topology::group_of, py::arg("axis"), py::arg("rank"))
      .def("rank_in", &Topology::rank_in, py::arg("axis"), py::arg("rank"))
      .def("groups", &Topology::groups, py::arg("axis"));
}

}  // namespace smp::python
