// Internal: the pieces of the smp._C module, one init function per area (TransformerEngine style).
#pragma once

#include <torch/extension.h>

namespace smp::python {

void init_topology_bindings(pybind11::module_& m);
void init_partition_bindings(pybind11::module_& m);
void init_comm_bindings(pybind11::module_& m);
void init_transport_bindings(pybind11::module_& m);
void init_policy_bindings(pybind11::module_& m);
void init_tp_bindings(pybind11::module_& m);
void init_schedule_bindings(pybind11::module_& m);

}  // namespace smp::python
