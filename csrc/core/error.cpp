#include "smp/error.h"

#include <stdexcept>

namespace smp::internal {

void throw_internal_error(const char* file, int line, const char* condition,
                          const std::string& message) {
  // std::logic_error, not smp::Error: the user cannot fix this, so it must not look like
  // ValueError.
  throw std::logic_error(
      fmt::format(FMT_STRING("internal error in smp (please report it): {}:{}: expected {}{}{}"),
                  file, line, condition, message.empty() ? "" : ": ", message));
}

}  // namespace smp::internal
