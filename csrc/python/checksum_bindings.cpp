// smp._C bindings of the checkpoint checksum (include/smp/checksum.h).
#include "python/bindings.h"
#include "smp/checksum.h"

namespace py = pybind11;

namespace smp::python {

void init_checksum_bindings(py::module_& m) {
  m.def(
      "crc32c",
      [](py::buffer data, uint32_t crc) {
        py::buffer_info info = data.request();
        const auto size = static_cast<size_t>(info.size * info.itemsize);
        py::gil_scoped_release release;  // other threads read the next block meanwhile
        return crc32c(info.ptr, size, crc);
      },
      py::arg("data"), py::arg("crc") = 0,
      "The CRC-32C of the bytes of `data` (any contiguous buffer), continuing `crc`.");
  m.def("crc32c_is_hardware", &crc32c_is_hardware,
        "Whether crc32c runs on the CPU's CRC instruction here.");
}

}  // namespace smp::python
