// smp/error.h — the error type and checking macros of the smp core.
//
// User mistakes (a bad degree, an unknown placement string) throw smp::Error with a message that
// names the offending value and the fix; the Python bindings turn it into ValueError. Broken
// invariants inside smp use SMP_INTERNAL_ASSERT, which says "this is a bug in smp".
//
// Example:
//   SMP_CHECK(degree >= 1, "pipeline_parallel_degree must be >= 1, got ", degree);
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace smp {

/// An error caused by input the user can fix; the message says what and how.
class Error : public std::invalid_argument {
 public:
  explicit Error(const std::string& message) : std::invalid_argument(message) {}
};

namespace internal {

template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}

[[noreturn]] void throw_internal_error(const char* file, int line, const char* condition,
                                       const std::string& message);

}  // namespace internal
}  // namespace smp

/// Throws smp::Error built from the streamed arguments unless `cond` holds.
#define SMP_CHECK(cond, ...)                                    \
  do {                                                          \
    if (!(cond)) {                                              \
      throw ::smp::Error(::smp::internal::concat(__VA_ARGS__)); \
    }                                                           \
  } while (false)

/// Checks an invariant of smp itself (not of user input); failure means a bug in smp.
#define SMP_INTERNAL_ASSERT(cond, ...)                                                   \
  do {                                                                                   \
    if (!(cond)) {                                                                       \
      ::smp::internal::throw_internal_error(__FILE__, __LINE__, #cond,                   \
                                            ::smp::internal::concat("", ##__VA_ARGS__)); \
    }                                                                                    \
  } while (false)
