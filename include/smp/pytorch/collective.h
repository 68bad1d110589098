// smp/pytorch/collective.h — a failure of the collective layer, as a type of its own.
//
// A collective that fails (a peer died, the backend timed out, the group was aborted) reports a
// failure elsewhere, not a mistake in the code that called it. smp tells the two apart by type
// (smp.step names the rank whose own code failed, design.md §4.7), so every collective smp
// issues in C++ goes through run_collective, which turns whatever the backend throws into
// CollectiveError (smp._C.CollectiveError in Python, a RuntimeError).
//
// Example:
//   run_collective("all-reduce", [&] { return group->allreduce(buffers, options); });
#pragma once

#include <c10/util/intrusive_ptr.h>
#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <exception>
#include <stdexcept>
#include <string>

namespace smp::pytorch {

class CollectiveError : public std::runtime_error {
 public:
  explicit CollectiveError(const std::string& message) : std::runtime_error(message) {}
};

/// Issues a collective (`issue()` returns its Work) and waits for it. Throws CollectiveError
/// naming `what` if issuing or waiting throws, or if the Work reports that it was aborted.
template <typename Issue>
void run_collective(const char* what, Issue&& issue) {
  bool completed = false;
  try {
    c10::intrusive_ptr<c10d::Work> work = issue();
    completed = work->wait();
  } catch (const CollectiveError&) {
    throw;
  } catch (const std::exception& error) {
    throw CollectiveError(fmt::format(FMT_STRING("smp: {} failed: {}"), what, error.what()));
  }
  if (!completed) throw CollectiveError(fmt::format(FMT_STRING("smp: {} was aborted"), what));
}

}  // namespace smp::pytorch
