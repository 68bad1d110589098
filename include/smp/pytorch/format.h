// smp/pytorch/format.h — torch values in smp's messages, written as c10's operator<< writes them.
//
// Messages are built with fmt (smp/error.h), which formats no type through its operator<<, and
// torch defines no fmt formatters for its types: shapes and layouts go through these helpers,
// dtypes through c10::toString, devices through Device::str().
//
// Example:
//   SMP_CHECK(ok, "tensor (shape {}, dtype {}) has layout {}", shape_str(t.sizes()),
//             c10::toString(t.scalar_type()), layout_name(t.layout()));
#pragma once

#include <c10/core/Layout.h>
#include <c10/util/ArrayRef.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdint>
#include <string>

namespace smp::pytorch {

/// "[2, 3]": sizes or strides as c10 prints an IntArrayRef.
inline std::string shape_str(c10::IntArrayRef sizes) {
  return fmt::format(FMT_STRING("[{}]"), fmt::join(sizes, ", "));
}

/// "Strided", "Sparse", ...: the name c10 prints for a layout.
inline std::string layout_name(c10::Layout layout) {
  switch (layout) {
    case c10::kStrided:
      return "Strided";
    case c10::kSparse:
      return "Sparse";
    case c10::kSparseCsr:
      return "SparseCsr";
    case c10::kSparseCsc:
      return "SparseCsc";
    case c10::kSparseBsr:
      return "SparseBsr";
    case c10::kSparseBsc:
      return "SparseBsc";
    case c10::kMkldnn:
      return "Mkldnn";
    case c10::kJagged:
      return "Jagged";
    default:
      return fmt::format(FMT_STRING("Layout({})"), static_cast<int8_t>(layout));
  }
}

}  // namespace smp::pytorch
