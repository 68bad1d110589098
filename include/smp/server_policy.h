// smp/server_policy.h — the task queue of a pipeline rank's execution server and the policy that
// picks which task runs next (design.md §4, api.md §1 keys `pipeline` and `active_microbatches`).
//
// Every pipeline rank runs one server; exactly one task runs on a rank at a time. Whenever the
// running task finishes or suspends, the runtime asks next() for the task to run now. Tasks become
// runnable as events:
//   kStartMicrobatch  leader only: begin the step function for microbatch m. The leader's policy
//                     generates these itself, for microbatches 0, 1, …, n−1 in order; the runtime
//                     never pushes them (their id is the microbatch).
//   kServeRequest     a peer asked this rank to run a module's forward for microbatch m.
//   kResume           a suspended forward worker of microbatch m may continue (its reply arrived).
//   kBackward         run a backward segment of microbatch m (its gradients arrived, or the
//                     leader's model.backward(loss)).
//   kWeight           non-leaders only: the weight-gradient half of a backward segment whose
//                     input gradients have been sent (a zero-bubble split, design.md §4.4). Its
//                     results stay on this rank, so it can wait: it fills time in which nothing
//                     else may run, and the step is not over on this rank until it has run.
// Resume, request and start are "forward-type"; backward and weight are "backward-type".
//
// Microbatch lifecycle, tracked on the leader only (pp rank 0, which runs the step function):
//   not started ──next() hands out its start──▶ in flight (forward)
//               ──on_forward_done(m)──▶ in flight (forward done)
//               ──on_microbatch_finished(m)──▶ finished.
// "In flight" = started and not finished. on_forward_done(m) is called at the first
// model.backward(loss) of m (further calls are no-ops); finished means no task of m will be pushed
// on this rank again (its step function has returned and its backward on this rank is complete),
// and implies forward done. Other ranks track no lifecycle: they only queue and pick.
//
// Policies (PipelineKind). Within one class, tasks run FIFO (by arrival), except backward tasks,
// which run lowest microbatch first, then FIFO.
//   interleaved (default, 1F1B-like):
//     1. a resume   2. a backward   3. a weight, when queued weights span more microbatches
//     than deferred_weight_microbatches   4. a request
//     5. leader: start the next microbatch if fewer than active_microbatches are in flight
//     6. a weight.
//     A resume is short and others wait for it: on the leader it usually computes a loss and
//     starts that microbatch's backward, which every other stage's backward waits for; a
//     backward task is one slice of a worker's backward (design.md §4.4), so a resume that
//     arrives during a long backward waits for one slice, not the whole.
//   simple (GPipe-like, all forwards then all backwards):
//     1. a resume   2. a request   3. leader: start the next microbatch (no in-flight limit)
//     4. a backward — on the leader only once every microbatch is forward done (or finished);
//        on other ranks whenever no forward-type task is queued
//     5. a weight. No limit: every microbatch's activations are alive when the backwards
//        begin, so weights waiting for the end do not raise the peak.
//   static (a per-rank program from the schedule IR, design.md §4.5):
//     1. a resume   2. of the queued tasks and, on the leader, the next start when its gate is
//     open, the one whose action comes first in this rank's program (requests are F, backwards
//     B or I, weights W of their microbatch; a task whose action is not in the program comes
//     after every one that is), ties by arrival.
//     The leader's gate: microbatch k starts once every microbatch whose B (or I) comes before
//     F k in the program has finished. Nothing else waits: a rank with a queued task runs one
//     (the program orders the work that has arrived; messages decide when it arrives).
//   Weights run FIFO in simple and interleaved, so the weight gradients of a parameter are summed
//   in the order their segments' input halves ran, whatever the timing; in static they run in
//   program order, which for every generator's program is microbatch order, then FIFO.
// next() returns std::nullopt when no queued task may run now; the runtime then waits for the
// next event (a message), and a wait past timeout_s becomes an error that should quote
// describe(). The simple leader's hold on backwards cannot deadlock a well-formed step: forward
// work never waits for backward work (forward-type tasks come first on every rank, and a
// microbatch is forward done from its first model.backward on), so the hold ends once every
// microbatch has reached model.backward or returned.
//
// Invariants:
//   - Deterministic: the same sequence of calls gives the same sequence of tasks from next(), so
//     the ranks of a tensor-parallel group can derive (or replay) the same order of collectives.
//   - Every task gets a sequence number from one per-policy counter, strictly increasing in the
//     order tasks become known: at push() for pushed tasks, when next() hands out a start.
//   - Leader: num_in_flight() <= active_microbatches under "interleaved" (<= num_microbatches
//     under "simple"; under "static" the program's gate decides, active_microbatches is
//     ignored); starts are handed out in microbatch order, each exactly once.
//   - Misuse throws smp::Error naming the microbatch: an index outside [0, num_microbatches), a
//     pushed kStartMicrobatch, and on the leader a task for a microbatch not started or already
//     finished, a backward before on_forward_done, finishing a microbatch that is not in flight or
//     still has queued tasks, lifecycle calls on a non-leader rank.
//
// Example (leader of a 2-stage pipeline, 4 microbatches, at most 2 in flight):
//   smp::ServerPolicy policy(smp::PipelineKind::kInterleaved, /*num_microbatches=*/4,
//                            /*active_microbatches=*/2, /*is_leader=*/true);
//   policy.next();                       // start(mb=0): forward of stage 0, request to rank 1
//   policy.next();                       // start(mb=1)
//   policy.next();                       // nullopt: 2 in flight, nothing queued
//   policy.push(smp::TaskKind::kResume, 0, /*id=*/7);   // rank 1 replied for microbatch 0
//   policy.next();                       // resume(mb=0, id=7): loss, model.backward(loss) ->
//   policy.on_forward_done(0);           //   forward done, and the runtime pushes its backward
//   policy.push(smp::TaskKind::kBackward, 0, /*id=*/8);
//   policy.push(smp::TaskKind::kResume, 1, /*id=*/9);
//   policy.next();                       // resume(mb=1, id=9): a resume comes first
//   policy.next();                       // backward(mb=0, id=8)
//   policy.next();                       // nullopt: still 2 in flight
//   policy.on_microbatch_finished(0);    // (after its last backward on the leader)
//   policy.next();                       // start(mb=2): 1 in flight < 2
// In a simulated 2-stage pipeline (one tick per stage forward or backward, one tick per message;
// Note [Simulated pipeline] in tests/cpp/core/server_policy_test.cpp) the leader computes
//   active 2, 4 microbatches:  F0 F1 B0 B1 F2 F3 B2 B3   (the round trip to stage 1 takes two
//                                                          forwards, so microbatches go in pairs)
//   active 4, 8 microbatches:  F0 F1 F2 F3 B0 B1 F4 F5 B2 B3 F6 F7 B4 B5 B6 B7
//   simple:                    F0 F1 F2 F3 … then B0 B1 B2 B3 …
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "smp/schedule.h"

namespace smp {

/// The scheduling policy of the pipeline server (api.md §1 key `pipeline`).
enum class PipelineKind { kSimple, kInterleaved, kStatic };

/// Parses the `pipeline` config value: "simple", "interleaved" or "static". Throws smp::Error
/// naming the value and the allowed ones otherwise.
PipelineKind parse_pipeline_kind(const std::string& name);

/// The config spelling of a policy: "simple", "interleaved" or "static".
const char* pipeline_kind_name(PipelineKind kind);

/// What a task does (file comment). kResume, kServeRequest and kStartMicrobatch are forward-type.
enum class TaskKind { kStartMicrobatch, kServeRequest, kResume, kBackward, kWeight };

/// Short name of a task kind: "start", "request", "resume", "backward", "weight".
const char* task_kind_name(TaskKind kind);

/// One runnable task.
struct Task {
  TaskKind kind = TaskKind::kStartMicrobatch;
  /// Microbatch index in [0, num_microbatches).
  int microbatch = 0;
  /// Caller-defined (a request or worker id); the microbatch for policy-generated starts.
  int64_t id = 0;
  /// Arrival number assigned by the policy; unique and increasing (file comment).
  int64_t sequence = 0;

  bool operator==(const Task& other) const {
    return kind == other.kind && microbatch == other.microbatch && id == other.id &&
           sequence == other.sequence;
  }
  bool operator!=(const Task& other) const { return !(*this == other); }
  /// E.g. "backward(mb=1, id=7, seq=5)".
  std::string to_string() const;
};

/// The task queue and scheduling policy of one rank's pipeline server, for one step. Not
/// thread-safe: the server calls it from one thread (or under its own lock). Build a new one per
/// step.
class ServerPolicy {
 public:
  /// Throws smp::Error unless num_microbatches >= 1, 1 <= active_microbatches <=
  /// num_microbatches (the config rejects larger values too; "simple" ignores the limit) and
  /// deferred_weight_microbatches >= 0. `is_leader`: this rank runs the step function (pp rank
  /// 0); only the leader starts microbatches and tracks their lifecycle.
  /// `deferred_weight_microbatches` (interleaved): weight tasks of at most this many
  /// microbatches wait for idle time; beyond that the oldest run before new forward work.
  /// `program` (static only, required there): this rank's compute actions in order (F, B, I,
  /// W of one stage; idle steps and communication are skipped), e.g. one rank's program of
  /// schedule::one_f_one_b. Throws smp::Error when it is given to another kind, or is empty,
  /// names a microbatch outside [0, num_microbatches), names an action twice, or, on the
  /// leader, lacks an F of some microbatch.
  ServerPolicy(PipelineKind kind, int num_microbatches, int active_microbatches, bool is_leader,
               int deferred_weight_microbatches = 0, const schedule::Program& program = {});

  /// Queues a task that became runnable and returns it with its sequence number. Throws
  /// smp::Error for a kStartMicrobatch (the leader generates those), a microbatch outside
  /// [0, num_microbatches), on the leader a kWeight, a microbatch not started or already
  /// finished, or a backward of a microbatch whose forward is not done.
  Task push(TaskKind kind, int microbatch, int64_t id);

  /// Removes and returns the task to run now under the policy, or std::nullopt when no task may
  /// run until another event. Handing out a kStartMicrobatch puts that microbatch in flight.
  std::optional<Task> next();

  /// Leader: microbatch m reached model.backward(loss) (all of its forward is done). Repeated
  /// calls are no-ops. Throws smp::Error on a non-leader or when m is not in flight.
  void on_forward_done(int microbatch);

  /// Leader: microbatch m is complete on this rank (no task of it will be pushed again); it
  /// leaves the in-flight set. Throws smp::Error on a non-leader, when m is not in flight, or
  /// when a task of m is still queued.
  void on_microbatch_finished(int microbatch);

  PipelineKind kind() const { return kind_; }
  int num_microbatches() const { return num_microbatches_; }
  int active_microbatches() const { return active_microbatches_; }
  bool is_leader() const { return is_leader_; }
  int deferred_weight_microbatches() const { return deferred_weight_microbatches_; }

  /// Tasks pushed and not yet handed out (starts not yet handed out are not counted).
  size_t num_queued() const;
  /// Leader: microbatches started and not finished; 0 on other ranks.
  int num_in_flight() const { return num_started_ - num_finished_; }
  /// Leader: microbatches whose start has been handed out; 0 on other ranks.
  int num_started() const { return num_started_; }
  /// Leader: every microbatch finished. Other ranks: nothing queued.
  bool all_finished() const;
  /// Leader: microbatch m has finished (no task of it may be pushed). Other ranks: false.
  bool is_finished(int microbatch) const;

  /// One-line summary of the policy, the lifecycle and every queued task in the order the
  /// policy would consider them, for error messages and debugging.
  std::string describe() const;

 private:
  enum class Phase { kNotStarted, kForward, kForwardDone, kFinished };

  // Backward order: lowest microbatch first, then FIFO.
  struct BackwardOrder {
    bool operator()(const Task& a, const Task& b) const {
      return a.microbatch != b.microbatch ? a.microbatch < b.microbatch : a.sequence < b.sequence;
    }
  };

  int check_microbatch(int microbatch, const char* what) const;
  void check_leader(const char* what) const;
  bool may_start() const;
  // Static: the program position of a task's action (INT64_MAX when the program lacks it).
  int64_t position(TaskKind kind, int microbatch) const;
  std::optional<Task> next_static();
  void build_program(const schedule::Program& program);
  bool may_run_backward() const;
  bool weights_overflow() const;
  Task pop_weight(size_t index = 0);  // the oldest by default
  Task take_start();
  static Task pop_front(std::deque<Task>& queue);

  PipelineKind kind_;
  int num_microbatches_;
  int active_microbatches_;
  bool is_leader_;

  int64_t next_sequence_ = 0;
  std::deque<Task> resumes_;
  std::deque<Task> requests_;
  std::set<Task, BackwardOrder> backwards_;
  int deferred_weight_microbatches_;
  std::deque<Task> weights_;
  std::map<int, int> weights_per_microbatch_;  // microbatch -> its queued weight tasks

  // Static: (F/B/W class, microbatch) -> position in the program; I counts as B.
  std::map<std::pair<char, int>, int64_t> positions_;
  // Static, leader: microbatches that must finish before microbatch k starts.
  std::vector<std::vector<int>> start_after_;
  std::string program_text_;  // for describe()

  // Leader lifecycle; phase_ is empty on other ranks.
  std::vector<Phase> phase_;
  int num_started_ = 0;  // microbatches [0, num_started_) have been handed out
  int num_forward_done_ = 0;
  int num_finished_ = 0;
};

}  // namespace smp
