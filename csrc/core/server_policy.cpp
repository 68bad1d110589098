#include "smp/server_policy.h"

#include <fmt/ranges.h>

#include <climits>
#include <iterator>
#include <string>
#include <vector>

#include "smp/error.h"

namespace smp {

PipelineKind parse_pipeline_kind(const std::string& name) {
  if (name == "simple") return PipelineKind::kSimple;
  if (name == "interleaved") return PipelineKind::kInterleaved;
  if (name == "static") return PipelineKind::kStatic;
  throw Error(fmt::format(
      FMT_STRING("pipeline must be \"simple\", \"interleaved\" or \"static\", got \"{}\""), name));
}

const char* pipeline_kind_name(PipelineKind kind) {
  switch (kind) {
    case PipelineKind::kSimple:
      return "simple";
    case PipelineKind::kInterleaved:
      return "interleaved";
    case PipelineKind::kStatic:
      return "static";
  }
  SMP_INTERNAL_ASSERT(false, "unknown PipelineKind");
}

const char* task_kind_name(TaskKind kind) {
  switch (kind) {
    case TaskKind::kStartMicrobatch:
      return "start";
    case TaskKind::kServeRequest:
      return "request";
    case TaskKind::kResume:
      return "resume";
    case TaskKind::kBackward:
      return "backward";
    case TaskKind::kWeight:
      return "weight";
  }
  SMP_INTERNAL_ASSERT(false, "unknown TaskKind");
}

std::string Task::to_string() const {
  return fmt::format(FMT_STRING("{}(mb={}, id={}, seq={})"), task_kind_name(kind), microbatch, id,
                     sequence);
}

namespace {

// The policy's class of a compute action: F, B (B and I) or W.
char action_class(schedule::ActionType type) {
  switch (type) {
    case schedule::ActionType::kForward:
      return 'F';
    case schedule::ActionType::kFullBackward:
    case schedule::ActionType::kBackwardInput:
      return 'B';
    case schedule::ActionType::kBackwardWeight:
      return 'W';
    default:
      return '\0';
  }
}

char task_class(TaskKind kind) {
  switch (kind) {
    case TaskKind::kStartMicrobatch:
    case TaskKind::kServeRequest:
    case TaskKind::kResume:
      return 'F';
    case TaskKind::kBackward:
      return 'B';
    case TaskKind::kWeight:
      return 'W';
  }
  SMP_INTERNAL_ASSERT(false, "unknown TaskKind");
}

}  // namespace

ServerPolicy::ServerPolicy(PipelineKind kind, int num_microbatches, int active_microbatches,
                           bool is_leader, int deferred_weight_microbatches,
                           const schedule::Program& program)
    : kind_(kind),
      num_microbatches_(num_microbatches),
      active_microbatches_(active_microbatches),
      is_leader_(is_leader),
      deferred_weight_microbatches_(deferred_weight_microbatches) {
  SMP_CHECK(kind == PipelineKind::kSimple || kind == PipelineKind::kInterleaved ||
                kind == PipelineKind::kStatic,
            "unknown pipeline kind {}", static_cast<int>(kind));
  SMP_CHECK(kind == PipelineKind::kStatic || program.empty(),
            "a program is for the \"static\" pipeline only, not \"{}\"", pipeline_kind_name(kind));
  SMP_CHECK(num_microbatches >= 1, "microbatches must be >= 1, got {}", num_microbatches);
  SMP_CHECK(active_microbatches >= 1 && active_microbatches <= num_microbatches,
            "active_microbatches must be in [1, microbatches={}], got {}", num_microbatches,
            active_microbatches);
  SMP_CHECK(deferred_weight_microbatches >= 0, "deferred_weight_microbatches must be >= 0, got {}",
            deferred_weight_microbatches);
  if (is_leader_) phase_.assign(num_microbatches_, Phase::kNotStarted);
  if (kind_ == PipelineKind::kStatic) build_program(program);
}

void ServerPolicy::build_program(const schedule::Program& program) {
  std::string text;
  std::vector<int> backward_before;  // leader: microbatches whose B came before, so far
  if (is_leader_) start_after_.assign(num_microbatches_, {});
  for (const auto& step : program) {
    if (!step) continue;
    const char cls = action_class(step->type);
    if (cls == '\0') continue;  // communication: messages drive it here
    const int mb = step->microbatch;
    SMP_CHECK(mb >= 0 && mb < num_microbatches_,
              "static pipeline: action {} names microbatch {}, outside [0, {})",
              schedule::to_string(*step), mb, num_microbatches_);
    const auto inserted = positions_.emplace(std::make_pair(cls, mb), positions_.size());
    SMP_CHECK(inserted.second,
              "static pipeline: the program has {} twice (or both B and I of microbatch {})",
              schedule::to_string(*step), mb);
    if (positions_.size() > 1) text += ' ';
    text += schedule::to_string(*step);
    if (!is_leader_) continue;
    if (cls == 'B') backward_before.push_back(mb);
    if (cls == 'F') start_after_[mb] = backward_before;
  }
  SMP_CHECK(!positions_.empty(), "static pipeline: the program has no compute action");
  if (is_leader_) {
    for (int mb = 0; mb < num_microbatches_; ++mb) {
      SMP_CHECK(positions_.count({'F', mb}),
                "static pipeline: the leader's program has no F of microbatch {} ({})", mb, text);
    }
  }
  program_text_ = text;
}

int64_t ServerPolicy::position(TaskKind kind, int microbatch) const {
  const auto it = positions_.find({task_class(kind), microbatch});
  return it == positions_.end() ? INT64_MAX : it->second;
}

int ServerPolicy::check_microbatch(int microbatch, const char* what) const {
  SMP_CHECK(microbatch >= 0 && microbatch < num_microbatches_,
            "{}: microbatch {} is outside [0, {})", what, microbatch, num_microbatches_);
  return microbatch;
}

void ServerPolicy::check_leader(const char* what) const {
  SMP_CHECK(is_leader_,
            "{} is for the leader (pp rank 0) only: other ranks track no microbatch lifecycle",
            what);
}

Task ServerPolicy::push(TaskKind kind, int microbatch, int64_t id) {
  check_microbatch(microbatch, "push");
  SMP_CHECK(
      kind != TaskKind::kStartMicrobatch,
      "push: start tasks are generated by the leader's policy, do not push them (microbatch {})",
      microbatch);
  SMP_CHECK(kind != TaskKind::kWeight || !is_leader_,
            "push: weight task (id {}) for microbatch {} on the leader: weight tasks are for other "
            "ranks, whose step ends when their queue is empty",
            id, microbatch);
  if (is_leader_) {
    const Phase phase = phase_[microbatch];
    SMP_CHECK(phase != Phase::kNotStarted,
              "push: {} task (id {}) for microbatch {}, which has not been started on the leader",
              task_kind_name(kind), id, microbatch);
    SMP_CHECK(phase != Phase::kFinished,
              "push: {} task (id {}) for microbatch {}, which has already finished",
              task_kind_name(kind), id, microbatch);
    SMP_CHECK(kind != TaskKind::kBackward || phase == Phase::kForwardDone,
              "push: backward task (id {}) for microbatch {} before its forward is done; call "
              "on_forward_done({}) first",
              id, microbatch, microbatch);
  }
  const Task task{kind, microbatch, id, next_sequence_++};
  switch (kind) {
    case TaskKind::kServeRequest:
      requests_.push_back(task);
      break;
    case TaskKind::kResume:
      resumes_.push_back(task);
      break;
    case TaskKind::kBackward:
      backwards_.insert(task);
      break;
    case TaskKind::kWeight:
      weights_.push_back(task);
      ++weights_per_microbatch_[microbatch];
      break;
    case TaskKind::kStartMicrobatch:
      SMP_INTERNAL_ASSERT(false, "start tasks are never queued");
  }
  return task;
}

bool ServerPolicy::may_start() const {
  if (!is_leader_ || num_started_ == num_microbatches_) return false;
  if (kind_ == PipelineKind::kStatic) {
    for (int mb : start_after_[num_started_]) {
      if (phase_[mb] != Phase::kFinished) return false;
    }
    return true;
  }
  return kind_ == PipelineKind::kSimple || num_in_flight() < active_microbatches_;
}

bool ServerPolicy::may_run_backward() const {
  if (backwards_.empty()) return false;
  // Interleaved: always. Simple, other ranks: the caller only asks once no forward-type task is
  // queued. Simple, leader: hold every backward until all forwards are done (GPipe).
  return kind_ == PipelineKind::kInterleaved || !is_leader_ ||
         num_forward_done_ == num_microbatches_;
}

bool ServerPolicy::weights_overflow() const {
  return static_cast<int>(weights_per_microbatch_.size()) > deferred_weight_microbatches_;
}

Task ServerPolicy::pop_weight(size_t index) {
  Task task = weights_[index];
  weights_.erase(weights_.begin() + static_cast<std::ptrdiff_t>(index));
  auto it = weights_per_microbatch_.find(task.microbatch);
  if (--it->second == 0) weights_per_microbatch_.erase(it);
  return task;
}

Task ServerPolicy::take_start() {
  const int microbatch = num_started_++;
  phase_[microbatch] = Phase::kForward;
  return Task{TaskKind::kStartMicrobatch, microbatch, microbatch, next_sequence_++};
}

Task ServerPolicy::pop_front(std::deque<Task>& queue) {
  Task task = queue.front();
  queue.pop_front();
  return task;
}

std::optional<Task> ServerPolicy::next() {
  auto pop_backward = [this] {
    Task task = *backwards_.begin();
    backwards_.erase(backwards_.begin());
    return task;
  };
  if (kind_ == PipelineKind::kStatic) return next_static();
  if (kind_ == PipelineKind::kInterleaved) {
    // 1. resume  2. backward  3. weight beyond the deferral limit  4. request  5. start while
    // fewer than active are in flight  6. weight.
    if (!resumes_.empty()) return pop_front(resumes_);
    if (!backwards_.empty()) return pop_backward();
    if (weights_overflow()) return pop_weight();
    if (!requests_.empty()) return pop_front(requests_);
    if (may_start()) return take_start();
    if (!weights_.empty()) return pop_weight();
    return std::nullopt;
  }
  // Simple: 1. resume  2. request  3. start  4. backward once allowed  5. weight.
  if (!resumes_.empty()) return pop_front(resumes_);
  if (!requests_.empty()) return pop_front(requests_);
  if (may_start()) return take_start();
  if (may_run_backward()) return pop_backward();
  if (!weights_.empty()) return pop_weight();
  return std::nullopt;
}

std::optional<Task> ServerPolicy::next_static() {
  if (!resumes_.empty()) return pop_front(resumes_);
  // The queued task (or start) whose action comes first in the program; ties by arrival.
  enum class From { kNone, kRequest, kBackward, kWeight, kStart };
  From from = From::kNone;
  std::pair<int64_t, int64_t> best{INT64_MAX, INT64_MAX};  // (position, sequence)
  size_t best_index = 0;
  auto consider = [&](const Task& task, From source, size_t index) {
    const std::pair<int64_t, int64_t> key{position(task.kind, task.microbatch), task.sequence};
    if (from == From::kNone || key < best) {
      best = key;
      from = source;
      best_index = index;
    }
  };
  for (size_t i = 0; i < requests_.size(); ++i) consider(requests_[i], From::kRequest, i);
  size_t i = 0;
  for (const Task& task : backwards_) consider(task, From::kBackward, i++);
  for (size_t j = 0; j < weights_.size(); ++j) consider(weights_[j], From::kWeight, j);
  if (may_start()) {
    const Task start{TaskKind::kStartMicrobatch, num_started_, num_started_, next_sequence_};
    consider(start, From::kStart, 0);
  }
  switch (from) {
    case From::kNone:
      return std::nullopt;
    case From::kStart:
      return take_start();
    case From::kRequest: {
      Task task = requests_[best_index];
      requests_.erase(requests_.begin() + static_cast<std::ptrdiff_t>(best_index));
      return task;
    }
    case From::kBackward: {
      auto it = std::next(backwards_.begin(), static_cast<std::ptrdiff_t>(best_index));
      Task task = *it;
      backwards_.erase(it);
      return task;
    }
    case From::kWeight:
      return pop_weight(best_index);
  }
  SMP_INTERNAL_ASSERT(false, "unreachable");
}

void ServerPolicy::on_forward_done(int microbatch) {
  check_leader("on_forward_done");
  check_microbatch(microbatch, "on_forward_done");
  Phase& phase = phase_[microbatch];
  SMP_CHECK(phase != Phase::kNotStarted, "on_forward_done: microbatch {} has not been started",
            microbatch);
  SMP_CHECK(phase != Phase::kFinished, "on_forward_done: microbatch {} has already finished",
            microbatch);
  if (phase == Phase::kForward) {
    phase = Phase::kForwardDone;
    ++num_forward_done_;
  }
}

void ServerPolicy::on_microbatch_finished(int microbatch) {
  check_leader("on_microbatch_finished");
  check_microbatch(microbatch, "on_microbatch_finished");
  Phase& phase = phase_[microbatch];
  SMP_CHECK(phase != Phase::kNotStarted,
            "on_microbatch_finished: microbatch {} has not been started", microbatch);
  SMP_CHECK(phase != Phase::kFinished, "on_microbatch_finished: microbatch {} has already finished",
            microbatch);
  auto of_microbatch = [microbatch](const Task& task) { return task.microbatch == microbatch; };
  for (const auto* queue : {&resumes_, &requests_}) {
    for (const Task& task : *queue) {
      SMP_CHECK(!of_microbatch(task),
                "on_microbatch_finished: microbatch {} still has a queued task {}", microbatch,
                task.to_string());
    }
  }
  for (const Task& task : backwards_) {
    SMP_CHECK(!of_microbatch(task),
              "on_microbatch_finished: microbatch {} still has a queued task {}", microbatch,
              task.to_string());
  }
  // A microbatch that returns without model.backward (evaluation) is forward done as it finishes.
  if (phase == Phase::kForward) ++num_forward_done_;
  phase = Phase::kFinished;
  ++num_finished_;
}

size_t ServerPolicy::num_queued() const {
  return resumes_.size() + requests_.size() + backwards_.size() + weights_.size();
}

bool ServerPolicy::all_finished() const {
  return is_leader_ ? num_finished_ == num_microbatches_ : num_queued() == 0;
}

bool ServerPolicy::is_finished(int microbatch) const {
  check_microbatch(microbatch, "is_finished");
  return is_leader_ && phase_[microbatch] == Phase::kFinished;
}

std::string ServerPolicy::describe() const {
  std::string out;
  const auto add = std::back_inserter(out);
  fmt::format_to(add, FMT_STRING("ServerPolicy({}, {}, microbatches={}, active={}"),
                 pipeline_kind_name(kind_), is_leader_ ? "leader" : "non-leader", num_microbatches_,
                 active_microbatches_);
  if (deferred_weight_microbatches_ > 0 && kind_ != PipelineKind::kStatic) {
    fmt::format_to(add, FMT_STRING(", deferred weights={}"), deferred_weight_microbatches_);
  }
  if (kind_ == PipelineKind::kStatic) {
    fmt::format_to(add, FMT_STRING(", program: {}"), program_text_);
  }
  out += ')';
  if (is_leader_) {
    auto list = [&](Phase wanted) {
      std::vector<int> ids;
      for (int m = 0; m < num_microbatches_; ++m) {
        if (phase_[m] == wanted) ids.push_back(m);
      }
      return ids;
    };
    fmt::format_to(
        add, FMT_STRING(": started {}/{}, in forward {{{}}}, forward done {{{}}}, finished {}"),
        num_started_, num_microbatches_, fmt::join(list(Phase::kForward), ", "),
        fmt::join(list(Phase::kForwardDone), ", "), num_finished_);
    if (kind_ == PipelineKind::kSimple && !backwards_.empty() && !may_run_backward()) {
      out += " (backwards held until every microbatch is forward done)";
    }
  }
  fmt::format_to(add, FMT_STRING("; queued {}:"), num_queued());
  // Listed in the order the policy considers the classes.
  auto dump = [&](const char* label, const auto& queue) {
    std::vector<std::string> tasks;
    for (const Task& task : queue) tasks.push_back(task.to_string());
    fmt::format_to(add, FMT_STRING(" {} [{}]"), label, fmt::join(tasks, ", "));
  };
  if (kind_ != PipelineKind::kSimple) dump("backward", backwards_);
  dump("resume", resumes_);
  dump("request", requests_);
  if (kind_ == PipelineKind::kSimple) dump("backward", backwards_);
  if (!weights_.empty()) dump("weight", weights_);
  return out;
}

}  // namespace smp
