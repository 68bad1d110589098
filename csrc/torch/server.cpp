#include "smp/pytorch/server.h"

#include <cstdint>
#include <utility>
#include <vector>

#include "smp/error.h"

namespace smp::pytorch {

PipelineServer::PipelineServer(Transport* transport, PipelineKind kind, int num_microbatches,
                               int active_microbatches, bool is_leader,
                               int deferred_weight_microbatches, const schedule::Program& program)
    : transport_(transport),
      policy_(kind, num_microbatches, active_microbatches, is_leader, deferred_weight_microbatches,
              program),
      is_leader_(is_leader) {
  SMP_CHECK(transport_ != nullptr, "PipelineServer: transport must not be null");
}

void PipelineServer::expect(int64_t call_id, TaskKind kind, int microbatch, int64_t worker_id) {
  SMP_CHECK(kind == TaskKind::kResume || kind == TaskKind::kBackward,
            "PipelineServer::expect: kind must be a resume or a backward");
  (void)microbatch;  // the message carries it; kept in the signature for symmetry with push
  expected_[{call_id, kind}] = worker_id;
}

void PipelineServer::dispatch(Message message) {
  SMP_INTERNAL_ASSERT(!message.header.empty(), "pipeline message without a header");
  const auto kind = static_cast<MessageKind>(message.header[0]);
  switch (kind) {
    case MessageKind::kRequest: {
      const int microbatch = static_cast<int>(message.header.at(1));
      const int64_t call_id = message.header.at(2);
      const int64_t id = new_id();  // the served call's worker, and its task
      served_[{message.peer, call_id}] = id;
      const int64_t seq = next_seq_++;
      unserved_[id] = Unserved{message.peer, microbatch, seq};
      unserved_seqs_[{message.peer, microbatch}].insert(seq);
      hold(id, id, std::move(message));
      push(TaskKind::kServeRequest, microbatch, id);
      return;
    }
    case MessageKind::kReply:
    case MessageKind::kGradIn: {
      const int microbatch = static_cast<int>(message.header.at(1));
      const int64_t call_id = message.header.at(2);
      const TaskKind task_kind =
          kind == MessageKind::kReply ? TaskKind::kResume : TaskKind::kBackward;
      auto it = expected_.find({call_id, task_kind});
      SMP_INTERNAL_ASSERT(it != expected_.end(), "unexpected {} for call {} from stage {}",
                          kind == MessageKind::kReply ? "reply" : "gradient", call_id,
                          message.peer);
      const int64_t task = it->second;  // registered by expect(): used once
      expected_.erase(it);
      hold(task, task, std::move(message));
      push(task_kind, microbatch, task);
      return;
    }
    case MessageKind::kGradOut: {
      const int microbatch = static_cast<int>(message.header.at(1));
      auto it = served_.find({message.peer, message.header.at(2)});
      SMP_INTERNAL_ASSERT(it != served_.end(), "gradients for an unknown served call from stage {}",
                          message.peer);
      // A task of its own, runnable once the REQUESTs before it are handed out (Note
      // [Gradients after the requests before them]).
      const int64_t task = new_id();
      const PeerMicrobatch key{message.peer, microbatch};
      hold(task, it->second, std::move(message));
      auto seqs = unserved_seqs_.find(key);
      if (seqs != unserved_seqs_.end() && !seqs->second.empty()) {
        parked_[key].push_back(Parked{next_seq_, Task{TaskKind::kBackward, microbatch, task}});
      } else {
        policy_.push(TaskKind::kBackward, microbatch, task);
      }
      return;
    }
    case MessageKind::kError: {
      std::string text = "another stage failed";
      if (!message.tensors.empty()) {
        const at::Tensor& blob = message.tensors.front();
        text.assign(static_cast<const char*>(blob.data_ptr()), blob.numel());
      }
      throw RemoteStageError(text);
    }
    case MessageKind::kStepEnd:
      ended_ = true;
      announced_backward_calls_ = message.header.size() > 1 ? message.header[1] : 0;
      return;
  }
  SMP_INTERNAL_ASSERT(false, "unknown pipeline message kind {} from stage {}", message.header[0],
                      message.peer);
}

// Note [Gradients after the requests before them]
// A GRAD_OUT is runnable only once every REQUEST (or FETCH) that reached this rank before it
// from the same peer, for the same microbatch, has been handed out. Handing a REQUEST out is
// what makes its served call count, on the calls whose outputs it takes by reference, the
// share of the gradient it will add (PipelineRuntime._served_worker): a producer whose
// gradients all seem in starts its backward, and a consumer served after that fails the step.
// The caller sends a microbatch's GRAD_OUTs after its REQUESTs, but the policy may hand out a
// backward before a forward; so the GRAD_OUT of a call waits for its own REQUEST, and for
// those of the calls after it, which may take its outputs. Same microbatch only: a policy that
// holds back a later microbatch's REQUEST until an earlier one's backward is done does not
// wait on itself.

void PipelineServer::release_parked(const PeerMicrobatch& key) {
  auto parked = parked_.find(key);
  auto seqs = unserved_seqs_.find(key);
  const bool none_left = seqs == unserved_seqs_.end() || seqs->second.empty();
  if (parked != parked_.end()) {
    const int64_t oldest = none_left ? INT64_MAX : *seqs->second.begin();
    std::vector<Parked> waiting;
    for (const Parked& item : parked->second) {
      if (item.bound <= oldest) {
        policy_.push(item.task.kind, item.task.microbatch, item.task.id);
      } else {
        waiting.push_back(item);
      }
    }
    if (waiting.empty()) {
      parked_.erase(parked);
    } else {
      parked->second = std::move(waiting);
    }
  }
  if (none_left && seqs != unserved_seqs_.end()) unserved_seqs_.erase(seqs);
}

// Note [Late answers]
// A quiet call's owner answers only when the call went otherwise (Note [Quiet calls] in
// smp/pipeline/protocol.py), and nobody waits for that: the leader's microbatch may have
// finished by then when the call's outputs are not needed by its loss. Such a REPLY or GRAD_IN
// (and a REQUEST the call sends after it, a FETCH of an argument its caller kept) is for a
// microbatch the policy takes no more tasks of. The server hands these tasks out first, in
// arrival order, and the runtime answers the REPLY or GRAD_IN of a quiet call by running the
// step again (CallStructureChanged); before, the policy's check failed the step with an
// internal error.
void PipelineServer::push(TaskKind kind, int microbatch, int64_t id) {
  if (is_leader_ && policy_.is_finished(microbatch)) {
    late_.push_back(Task{kind, microbatch, id, -1});
  } else {
    policy_.push(kind, microbatch, id);
  }
}

void PipelineServer::hold(int64_t task, int64_t target, Message message) {
  const bool fresh = pending_.try_emplace(task, Held{target, std::move(message)}).second;
  SMP_INTERNAL_ASSERT(fresh, "two pipeline messages for task {}", task);
}

std::optional<ServerTask> PipelineServer::next(std::chrono::milliseconds timeout) {
  while (true) {
    while (auto message = transport_->try_recv()) dispatch(std::move(*message));
    std::optional<Task> task;
    if (!late_.empty()) {  // Note [Late answers]
      task = late_.front();
      late_.pop_front();
    } else {
      task = policy_.next();
    }
    if (task) {
      if (task->kind == TaskKind::kServeRequest) {
        auto unserved = unserved_.find(task->id);
        if (unserved != unserved_.end()) {
          const PeerMicrobatch key{unserved->second.peer, unserved->second.microbatch};
          unserved_seqs_[key].erase(unserved->second.seq);
          unserved_.erase(unserved);
          release_parked(key);
        }
      }
      ServerTask out{*task, std::nullopt, -1};
      auto it = pending_.find(task->id);
      if (task->kind != TaskKind::kStartMicrobatch && it != pending_.end()) {
        out.target = it->second.target;
        out.message = std::move(it->second.message);
        pending_.erase(it);
        // Its consumer runs now: the compute stream waits for its device tensors from here on
        // (Note [Stream discipline] in transport.cpp).
        out.message->wait_ready();
      }
      return out;
    }
    if (is_leader_ ? policy_.all_finished() : ended_ && !hold_open_) return std::nullopt;
    std::optional<Message> message;
    try {
      message = transport_->recv(timeout);
    } catch (const TransportError& error) {
      throw TransportError(
          fmt::format(FMT_STRING("{}; queued work: {}"), error.what(), policy_.describe()),
          error.peers());
    }
    if (!message) return std::nullopt;  // every peer finished
    dispatch(std::move(*message));
  }
}

}  // namespace smp::pytorch
