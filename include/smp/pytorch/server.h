// smp/pytorch/server.h — the module server's loop: messages in, runnable tasks out.
//
// Every pipeline rank runs one PipelineServer per step. It owns the step's scheduling policy
// (smp/server_policy.h) and reads the rank's Transport (smp/pytorch/transport.h): each incoming
// message is decoded from its header and turned into a runnable task of the policy, and next()
// returns the task the policy picks together with the message that made it runnable. What runs
// a task (Python: the step function, a module's forward, a backward segment) stays outside.
//
// Protocol (header[0] is the MessageKind; ids are the sender's call ids):
//   kRequest  {kind, microbatch, call id, module index}  caller -> owner: run a module forward
//   kReply    {kind, microbatch, call id}                owner -> caller: its outputs
//   kGradOut  {kind, microbatch, call id, slots...}      caller -> owner: gradients of outputs
//   kGradIn   {kind, microbatch, call id, slots...}      owner -> caller: gradients of inputs
//   kError    {kind}, tensors {utf-8 text}               any -> all: abort the step
//   kStepEnd  {kind, backward calls}                     leader -> all: the step is over
// Ids: every task id comes from new_id(); the leader's microbatch starts carry the microbatch
// index as the policy gives them. Every message is a task of its own, never sharing an id with
// another message (a REQUEST and the GRAD_OUT of the same call may both be queued): a REQUEST's
// task id is also the id of the worker that serves it; a REPLY or GRAD_IN takes the task id the
// caller registered with expect(); a GRAD_OUT gets a fresh task id and names, as its target, the
// worker serving that (peer, call id), and becomes runnable only after that worker's REQUEST task
// has been handed out (so the runtime always meets a served call before its gradients).
//
// Example (one step on a non-leader stage):
//   PipelineServer server(&transport, PipelineKind::kInterleaved, 4, 4, /*is_leader=*/false);
//   while (auto task = server.next(std::chrono::seconds(300))) { run(*task); }
//   // next() returned nullopt: STEP_END arrived and nothing is left to run
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "smp/pytorch/transport.h"
#include "smp/server_policy.h"

namespace smp::pytorch {

/// Kinds of pipeline messages (header[0]).
enum class MessageKind : int64_t {
  kRequest = 1,
  kReply = 2,
  kGradOut = 3,
  kGradIn = 4,
  kError = 5,
  kStepEnd = 6
};

/// Another stage failed the step; the message is that stage's description of the failure.
class RemoteStageError : public std::runtime_error {
 public:
  explicit RemoteStageError(const std::string& message) : std::runtime_error(message) {}
};

/// A task the policy picked, with the message that made it runnable (none for a start, or a
/// task the runtime pushed itself: a backward slice, a weight half).
struct ServerTask {
  Task task;
  std::optional<Message> message;
  int64_t target = -1;  // the worker the message is for (-1: none)
};

class PipelineServer {
 public:
  /// `transport` must outlive the server and be started; the server never starts or finishes it.
  PipelineServer(Transport* transport, PipelineKind kind, int num_microbatches,
                 int active_microbatches, bool is_leader, int deferred_weight_microbatches = 0,
                 const schedule::Program& program = {});

  /// A fresh task / worker id.
  int64_t new_id() { return next_id_++; }

  /// Routes the REPLY (`kind` = kResume) or GRAD_IN (`kind` = kBackward) of this rank's call
  /// `call_id` to worker `worker_id` of `microbatch`.
  void expect(int64_t call_id, TaskKind kind, int microbatch, int64_t worker_id);

  /// Reads every queued message, then returns the next task to run: waits up to `timeout` for a
  /// message while nothing is runnable. Returns std::nullopt when the step is over on this rank:
  /// on the leader when every microbatch has finished, elsewhere when STEP_END has arrived and
  /// hold_open() is false.
  /// Throws RemoteStageError for an ERROR message, TransportError on a transport failure, and
  /// TransportError naming the queued work if nothing arrives within `timeout`.
  std::optional<ServerTask> next(std::chrono::milliseconds timeout);

  /// The step's policy (lifecycle calls: on_forward_done, on_microbatch_finished).
  ServerPolicy& policy() { return policy_; }
  /// The leader's number of model.backward calls, as announced by STEP_END (non-leaders).
  int64_t announced_backward_calls() const { return announced_backward_calls_; }
  /// While set, next() does not end the step at STEP_END (non-leaders): this rank still serves
  /// calls whose end nobody waits for (quiet calls), and it waits for what they need.
  void set_hold_open(bool hold) { hold_open_ = hold; }
  bool hold_open() const { return hold_open_; }

 private:
  struct Held {
    int64_t target;
    Message message;
  };

  void dispatch(Message message);
  // Queues a message's task: with the policy, or first for a finished microbatch (Note [Late
  // answers] in server.cpp).
  void push(TaskKind kind, int microbatch, int64_t id);
  // Keeps `message` until its task runs; asserts that no other message holds `task`.
  void hold(int64_t task, int64_t target, Message message);

  Transport* transport_;
  ServerPolicy policy_;
  bool is_leader_;
  bool ended_ = false;
  bool hold_open_ = false;
  int64_t announced_backward_calls_ = 0;
  int64_t next_id_ = 1 << 20;  // above any microbatch index
  // (call id, kind) -> worker. Keyed by kind too: a caller may send GRAD_OUT for a call whose
  // outputs it only passed on before their REPLY has arrived.
  std::map<std::pair<int64_t, TaskKind>, int64_t> expected_;
  std::map<std::pair<int, int64_t>, int64_t> served_;  // (peer, call id) -> worker
  std::map<int64_t, Held> pending_;                    // task -> its message
  // Leader: tasks of messages for microbatches that have finished, handed out first (Note
  // [Late answers] in server.cpp).
  std::deque<Task> late_;
  // REQUESTs not handed out yet and the GRAD_OUTs waiting for them: Note [Gradients after the
  // requests before them] in server.cpp.
  struct Unserved {
    int peer;
    int microbatch;
    int64_t seq;  // arrival order among REQUESTs
  };
  struct Parked {
    int64_t bound;  // runnable once no REQUEST of the key with seq < bound is unserved
    Task task;
  };
  using PeerMicrobatch = std::pair<int, int>;
  void release_parked(const PeerMicrobatch& key);
  int64_t next_seq_ = 0;
  std::map<int64_t, Unserved> unserved_;                       // worker -> its REQUEST
  std::map<PeerMicrobatch, std::set<int64_t>> unserved_seqs_;  // their seqs
  std::map<PeerMicrobatch, std::vector<Parked>> parked_;       // GRAD_OUT tasks, arrival order
};

}  // namespace smp::pytorch
