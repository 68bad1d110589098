// smp/error.h — the error type and checking macros of the smp core.
//
// User mistakes (a bad degree, an unknown placement string) throw smp::Error with a message that
// names the offending value and the fix; the Python bindings turn it into ValueError. Broken
// invariants inside smp use SMP_INTERNAL_ASSERT, which says "this is a bug in smp".
//
// Messages are fmt format strings, checked at compile time (FMT_STRING), so they must be string
// literals; a literal brace is written {{ or }}. Doubles are formatted with {:g}, which prints
// them as std::ostream does (6 significant digits).
//
// Example:
//   SMP_CHECK(degree >= 1, "pipeline_parallel_degree must be >= 1, got {}", degree);
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace smp {

/// An error caused by input the user can fix; the message says what and how.
class Error : public std::invalid_argument {
 public:
  explicit Error(const std::string& message) : std::invalid_argument(message) {}
};

namespace internal {

[[noreturn]] void throw_internal_error(const char* file, int line, const char* condition,
                                       const std::string& message);

}  // namespace internal
}  // namespace smp

/// Throws smp::Error with the formatted message unless `cond` holds:
/// SMP_CHECK(cond, "format {}", args...).
#define SMP_CHECK(cond, format_string, ...)                                        \
  do {                                                                             \
    if (!(cond)) {                                                                 \
      throw ::smp::Error(::fmt::format(FMT_STRING(format_string), ##__VA_ARGS__)); \
    }                                                                              \
  } while (false)

/// Checks an invariant of smp itself (not of user input); failure means a bug in smp.
/// SMP_INTERNAL_ASSERT(cond) or SMP_INTERNAL_ASSERT(cond, "format {}", args...).
// "" before the arguments makes the format string "" when there is none.
#define SMP_INTERNAL_ASSERT(cond, ...) SMP_INTERNAL_ASSERT_IMPL_(cond, #cond, "" __VA_ARGS__)
#define SMP_INTERNAL_ASSERT_IMPL_(cond, text, format_string, ...)                             \
  do {                                                                                        \
    if (!(cond)) {                                                                            \
      ::smp::internal::throw_internal_error(                                                  \
          __FILE__, __LINE__, text, ::fmt::format(FMT_STRING(format_string), ##__VA_ARGS__)); \
    }                                                                                         \
  } while (false)
