// The only PYBIND11_MODULE of smp: smp._C. Each area registers itself in its own file.
#include "python/bindings.h"

#include "smp/error.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "smp's C++ core and libtorch layer";
  // A user mistake detected in C++ surfaces in Python as ValueError with the same message.
  pybind11::register_exception<smp::Error>(m, "Error", PyExc_ValueError);
  smp::python::init_topology_bindings(m);
  smp::python::init_partition_bindings(m);
  smp::python::init_comm_bindings(m);
  smp::python::init_transport_bindings(m);
  smp::python::init_policy_bindings(m);
  smp::python::init_tp_bindings(m);
  smp::python::init_schedule_bindings(m);
  smp::python::init_thread_state_bindings(m);
  smp::python::init_checksum_bindings(m);
  smp::python::init_kernel_bindings(m);
}
