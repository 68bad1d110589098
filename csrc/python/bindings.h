// Internal: the pieces of the smp._C module, one init function per area (TransformerEngine style).
#pragma once

#include <torch/extension.h>

#include <optional>
#include <string>
#include <vector>

#include "smp/schedule.h"

namespace smp::python {

void init_topology_bindings(pybind11::module_& m);
void init_partition_bindings(pybind11::module_& m);
void init_comm_bindings(pybind11::module_& m);
void init_transport_bindings(pybind11::module_& m);
void init_policy_bindings(pybind11::module_& m);
void init_tp_bindings(pybind11::module_& m);
void init_schedule_bindings(pybind11::module_& m);
void init_thread_state_bindings(pybind11::module_& m);
void init_checksum_bindings(pybind11::module_& m);
void init_kernel_bindings(pybind11::module_& m);

/// A program from action strings ("1F0", "1W3"), as the static pipeline takes it from Python.
/// Throws smp::Error naming a string that is not an action.
std::vector<std::optional<schedule::Action>> parse_program(const std::vector<std::string>& actions);

}  // namespace smp::python
