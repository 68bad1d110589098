#include "smp/schedule.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstddef>
#include <iterator>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "smp/error.h"

// Note [Send/recv order]
// ~~~~~~~~~~~~~~~~~~~~~~~
// The rule. add_communication() first simulates the compute-only schedule under the caller's
// costs (compute costs > 0), which gives every compute action an end time. A message gets the key
// (end time, rank) of the compute action that produces it: when it is sent. Keys are unique:
// a rank runs one action at a time and every compute action takes time, so end times increase
// along a rank's program.
//   1. A SEND goes right after the compute action that produces it.
//   2. On the consumer's rank, the RECV goes as late as possible such that it stays before its
//      consumer and the rank's communication stays in key order: right before the first of (a)
//      its consumer, (b) the rank's first SEND with a larger key, (c) the rank's next RECV.
// Every rank therefore issues its SENDs and RECVs in increasing key order, i.e. as a subsequence
// of one global order of all messages. The position of (2) exists: a SEND of the consumer's rank
// with a smaller key follows a compute action that ends no later than the producer, hence no
// later than the consumer starts, so that SEND comes before the consumer.
//
// Why it cannot deadlock, even when every SEND blocks until its RECV is reached (rendezvous).
// Induction over the global order: suppose every message before k has completed. The sender of k
// reaches its SEND: everything before it on its rank is communication with a smaller key
// (completed) or compute whose inputs arrived by RECVs earlier on the same rank (completed) or
// were made on the same rank. The same holds for the receiver and its RECV. Both reach message k,
// so it completes. Hence all messages complete, and every compute action runs. This holds for
// keys from any costs.
//
// Why these keys. With the costs used for the keys, free communication and buffered sends, the
// lowered schedule runs exactly like the compute-only one: a RECV sits before its consumer or
// right after a compute action that ends no earlier than the message is sent, so it never waits.
// Keys from other costs stay deadlock-free but may make a blocking RECV wait: keys from a unit-time
// run of interleaved 1F1B cost up to 14% makespan when B really takes 2 (p <= 8, v <= 3, m <= 16).
//
// Why this order and not another. A RECV placed right before its consumer alone is not enough:
// in 1F1B over 2 ranks, rank 1 would run 1B0 1SEND_B0 before 1RECV_F1 while rank 0 runs 0SEND_F1
// before 0RECV_B0 — with rendezvous sends each waits for the other forever. torch's
// _add_send_recv places each RECV as early as possible instead (also one global order, hence also
// safe); placing it as late as the order allows keeps a blocking RECV from stalling compute that
// does not need it.

namespace smp::schedule {
namespace {

constexpr ActionType kAllTypes[] = {
    ActionType::kForward,        ActionType::kFullBackward, ActionType::kBackwardInput,
    ActionType::kBackwardWeight, ActionType::kSendForward,  ActionType::kRecvForward,
    ActionType::kSendBackward,   ActionType::kRecvBackward,
};

const char* const kTypeList = "F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B";

// Types torch.distributed.pipelining writes that this IR does not model.
constexpr const char* kTorchOnlyTypes[] = {"UNSHARD", "RESHARD", "REDUCE_GRAD", "OVERLAP_F_B"};

bool is_backward_input(ActionType type) {
  return type == ActionType::kFullBackward || type == ActionType::kBackwardInput;
}

std::string trim(const std::string& text) {
  std::size_t begin = 0;
  std::size_t end = text.size();
  while (begin < end && std::isspace(static_cast<unsigned char>(text[begin]))) ++begin;
  while (end > begin && std::isspace(static_cast<unsigned char>(text[end - 1]))) --end;
  return text.substr(begin, end - begin);
}

// ---- where actions are --------------------------------------------------------------------------

// The actions of a schedule by position. Duplicates are kept out (the first one wins); callers
// that care check for them first.
class Index {
 public:
  explicit Index(const Schedule& schedule) {
    for (int rank = 0; rank < static_cast<int>(schedule.size()); ++rank) {
      const Program& program = schedule[rank];
      for (int step = 0; step < static_cast<int>(program.size()); ++step) {
        if (program[step]) cells_.emplace(*program[step], Cell{rank, step});
      }
    }
  }

  const Cell* find(const Action& action) const {
    auto it = cells_.find(action);
    return it == cells_.end() ? nullptr : &it->second;
  }
  bool contains(const Action& action) const { return find(action) != nullptr; }

  // The B of (stage, microbatch), else its I, else nullopt.
  std::optional<Action> backward_input(int stage, int microbatch) const {
    const Action b{stage, ActionType::kFullBackward, microbatch};
    if (contains(b)) return b;
    const Action i{stage, ActionType::kBackwardInput, microbatch};
    if (contains(i)) return i;
    return std::nullopt;
  }

 private:
  std::map<Action, Cell> cells_;
};

std::string where(const Cell& cell) {
  return fmt::format(FMT_STRING("rank {}, step {}"), cell.rank, cell.step);
}

// ---- execution ----------------------------------------------------------------------------------

// Runs a schedule under the execution model of smp/schedule.h. Node = one non-idle step.
class Executor {
 public:
  // `lowered`: compute actions get their cross-rank inputs through RECVs (already ordered on
  // their rank), so only RECVs wait on other ranks; otherwise compute actions wait directly for
  // their cross-rank dependencies.
  // `costs`: one entry for every stage, or stage s's costs at index s.
  Executor(const Schedule& schedule, const Index& index, bool lowered,
           std::vector<ActionCosts> costs, bool rendezvous)
      : costs_(std::move(costs)), rendezvous_(rendezvous), ids_(schedule.size()) {
    std::map<Action, int> id_of;
    for (int rank = 0; rank < static_cast<int>(schedule.size()); ++rank) {
      for (int step = 0; step < static_cast<int>(schedule[rank].size()); ++step) {
        const std::optional<Action>& action = schedule[rank][step];
        if (!action) continue;
        id_of.emplace(*action, static_cast<int>(nodes_.size()));
        ids_[rank].push_back(static_cast<int>(nodes_.size()));
        nodes_.push_back(Node{rank, step, *action, {}, -1});
      }
    }
    const auto id = [&](const std::optional<Action>& action) {
      if (!action) return -1;
      auto it = id_of.find(*action);
      return it == id_of.end() ? -1 : it->second;
    };
    for (Node& node : nodes_) {
      const Action& a = node.action;
      switch (a.type) {
        case ActionType::kForward:
          if (!lowered && a.stage > 0) {
            node.deps.push_back(id(Action{a.stage - 1, ActionType::kForward, a.microbatch}));
          }
          break;
        case ActionType::kFullBackward:
        case ActionType::kBackwardInput:
          if (!lowered) node.deps.push_back(id(index.backward_input(a.stage + 1, a.microbatch)));
          break;
        case ActionType::kBackwardWeight:
          break;
        case ActionType::kSendForward:
          node.partner = id(Action{a.stage + 1, ActionType::kRecvForward, a.microbatch});
          break;
        case ActionType::kRecvForward:
          node.partner = id(Action{a.stage - 1, ActionType::kSendForward, a.microbatch});
          break;
        case ActionType::kSendBackward:
          node.partner = id(Action{a.stage - 1, ActionType::kRecvBackward, a.microbatch});
          break;
        case ActionType::kRecvBackward:
          node.partner = id(Action{a.stage + 1, ActionType::kSendBackward, a.microbatch});
          break;
      }
      // Same-rank dependencies are program order (checked by the validator); keep only the
      // cross-rank ones, which are the ones that can block.
      node.deps.erase(std::remove_if(node.deps.begin(), node.deps.end(),
                                     [&](int d) { return d < 0 || nodes_[d].rank == node.rank; }),
                      node.deps.end());
    }
    start_.assign(nodes_.size(), 0);
    end_.assign(nodes_.size(), 0);
    done_.assign(nodes_.size(), 0);
    pc_.assign(schedule.size(), 0);
    clock_.assign(schedule.size(), 0);
  }

  // Runs until every node has run (true) or no rank can proceed (false: deadlock).
  bool run() {
    std::size_t remaining = nodes_.size();
    while (remaining > 0) {
      bool progress = false;
      for (std::size_t rank = 0; rank < ids_.size(); ++rank) {
        while (pc_[rank] < ids_[rank].size() && try_run(ids_[rank][pc_[rank]])) {
          ++pc_[rank];
          --remaining;
          progress = true;
        }
      }
      if (!progress) return false;
    }
    return true;
  }

  // For a deadlocked run: each blocked rank's step, and what it waits for.
  std::vector<std::pair<Cell, std::string>> blocked() const {
    std::vector<std::pair<Cell, std::string>> result;
    for (std::size_t rank = 0; rank < ids_.size(); ++rank) {
      if (pc_[rank] == ids_[rank].size()) continue;
      const Node& node = nodes_[ids_[rank][pc_[rank]]];
      std::string reason;
      if (node.partner >= 0 && is_send(node.action.type)) {
        const Node& recv = nodes_[node.partner];
        reason = fmt::format(FMT_STRING("waits for rank {} to reach {} (step {}, rendezvous send)"),
                             recv.rank, to_string(recv.action), recv.step);
      } else if (node.partner >= 0) {
        const Node& send = nodes_[node.partner];
        reason =
            fmt::format(FMT_STRING("waits for {} ({})"), to_string(send.action), where(cell(send)));
      } else {
        for (int d : node.deps) {
          if (!done_[d]) {
            reason = fmt::format(FMT_STRING("waits for {} ({})"), to_string(nodes_[d].action),
                                 where(cell(nodes_[d])));
            break;
          }
        }
      }
      result.emplace_back(cell(node), reason);
    }
    return result;
  }

  // Per rank, the ids of its nodes in program order.
  const std::vector<std::vector<int>>& ids() const { return ids_; }
  const Action& action(int id) const { return nodes_[id].action; }
  int step(int id) const { return nodes_[id].step; }
  double start(int id) const { return start_[id]; }
  double end(int id) const { return end_[id]; }

 private:
  struct Node {
    int rank;
    int step;
    Action action;
    std::vector<int> deps;  // cross-rank compute dependencies
    int partner;            // SEND <-> RECV, -1 if none
  };

  static bool is_send(ActionType type) {
    return type == ActionType::kSendForward || type == ActionType::kSendBackward;
  }
  static Cell cell(const Node& node) { return Cell{node.rank, node.step}; }

  bool try_run(int id) {
    const Node& node = nodes_[id];
    const double ready = clock_[node.rank];
    double start = ready;
    double end = 0;
    const ActionCosts& costs = costs_.size() == 1 ? costs_[0] : costs_.at(node.action.stage);
    if (is_communication(node.action.type)) {
      SMP_INTERNAL_ASSERT(node.partner >= 0, "unmatched {}", to_string(node.action));
      const Node& peer = nodes_[node.partner];
      if (is_send(node.action.type)) {
        if (rendezvous_) {
          // The peer has reached the RECV iff it is the next node of its rank.
          const std::vector<int>& peer_ids = ids_[peer.rank];
          const std::size_t peer_pc = pc_[peer.rank];
          if (peer_pc == peer_ids.size() || peer_ids[peer_pc] != node.partner) return false;
          start = std::max(ready, clock_[peer.rank]);
        }
        end = start + costs.send;
      } else {
        if (!done_[node.partner]) return false;
        end = std::max(start, end_[node.partner] + costs.latency) + costs.recv;
      }
    } else {
      for (int d : node.deps) {
        if (!done_[d]) return false;
        start = std::max(start, end_[d] + costs.latency);
      }
      end = start + costs.of(node.action.type);
    }
    start_[id] = start;
    end_[id] = end;
    done_[id] = 1;
    clock_[node.rank] = end;
    return true;
  }

  std::vector<ActionCosts> costs_;
  bool rendezvous_;
  std::vector<Node> nodes_;
  std::vector<std::vector<int>> ids_;
  std::vector<double> start_, end_;
  std::vector<char> done_;
  std::vector<std::size_t> pc_;
  std::vector<double> clock_;
};

ActionCosts unit_costs() {
  ActionCosts costs;
  costs.forward = costs.full_backward = costs.backward_input = costs.backward_weight = 1;
  costs.send = costs.recv = costs.latency = 0;
  return costs;
}

// ---- validation ---------------------------------------------------------------------------------

constexpr const char* kGridLegend = "(>x< marks the failing step; '.' is an idle step)";

[[noreturn]] void fail(const Schedule& schedule, const std::vector<Cell>& marked,
                       const std::string& what) {
  throw Error(fmt::format(FMT_STRING("invalid schedule: {}\n{}{}"), what,
                          format_grid(schedule, marked), kGridLegend));
}

// `rendezvous`: say that the deadlock needs rendezvous sends (a lowered schedule run so).
[[noreturn]] void fail_deadlock(const Schedule& schedule, const Executor& executor,
                                bool rendezvous) {
  std::string what = fmt::format(FMT_STRING("the schedule deadlocks{}: no rank can proceed"),
                                 rendezvous ? " under rendezvous sends" : "");
  std::vector<Cell> marked;
  for (const auto& [cell, reason] : executor.blocked()) {
    fmt::format_to(std::back_inserter(what), FMT_STRING("\n  {} ({}) {}"), where(cell),
                   to_string(*schedule[cell.rank][cell.step]), reason);
    marked.push_back(cell);
  }
  fail(schedule, marked, what);
}

// The checks of validate_schedule(), in order; the deadlock check is optional (simulate() runs
// its own execution instead).
class Checker {
 public:
  Checker(const Schedule& schedule, int num_stages, int num_microbatches,
          const std::vector<int>& stage_to_rank)
      : schedule_(schedule),
        num_stages_(num_stages),
        num_microbatches_(num_microbatches),
        stage_to_rank_(stage_to_rank),
        index_(schedule) {}

  void check(bool check_deadlock) {
    check_cells();
    check_complete();
    check_program_order();
    if (check_deadlock) {
      Executor executor(schedule_, index_, lowered_, {unit_costs()}, /*rendezvous=*/true);
      if (!executor.run()) fail_deadlock(schedule_, executor, /*rendezvous=*/lowered_);
    }
  }

  bool lowered() const { return lowered_; }
  const Index& index() const { return index_; }

 private:
  int rank_of(int stage) const { return stage_to_rank_[stage]; }

  // Where `action` is; the checks that ran before guarantee that it exists.
  Cell locate(const Action& action) const {
    const Cell* cell = index_.find(action);
    SMP_INTERNAL_ASSERT(cell != nullptr, "{} not found", to_string(action));
    return *cell;
  }

  // 1. Every action on its own: ranges, placement, communication between ranks, no duplicates.
  void check_cells() {
    std::map<Action, Cell> seen;
    for (int rank = 0; rank < static_cast<int>(schedule_.size()); ++rank) {
      for (int step = 0; step < static_cast<int>(schedule_[rank].size()); ++step) {
        const std::optional<Action>& slot = schedule_[rank][step];
        if (!slot) continue;
        const Action& a = *slot;
        const Cell cell{rank, step};
        const auto bad = [&](const std::string& what) {
          fail(schedule_, {cell},
               fmt::format(FMT_STRING("{}: {} {}"), where(cell), to_string(a), what));
        };
        if (a.stage < 0 || a.stage >= num_stages_) {
          bad(fmt::format(FMT_STRING("names stage {}, outside [0, {})"), a.stage, num_stages_));
        }
        if (a.microbatch < 0 || a.microbatch >= num_microbatches_) {
          bad(fmt::format(FMT_STRING("names microbatch {}, outside [0, {})"), a.microbatch,
                          num_microbatches_));
        }
        if (rank_of(a.stage) != rank) {
          bad(fmt::format(FMT_STRING("runs on rank {}, but stage {} is on rank {} (stage_to_rank)"),
                          rank, a.stage, rank_of(a.stage)));
        }
        if (is_communication(a.type)) {
          lowered_ = true;
          const bool forward =
              a.type == ActionType::kSendForward || a.type == ActionType::kRecvBackward;
          const int peer_stage = forward ? a.stage + 1 : a.stage - 1;
          if (peer_stage < 0 || peer_stage >= num_stages_) {
            bad(fmt::format(FMT_STRING("has no peer: stage {} is the {} stage"), a.stage,
                            forward ? "last" : "first"));
          }
          if (rank_of(peer_stage) == rank) {
            bad(fmt::format(FMT_STRING("is not needed: stages {} and {} are both on rank {}"),
                            a.stage, peer_stage, rank));
          }
        }
        auto [it, inserted] = seen.emplace(a, cell);
        if (!inserted) {
          fail(schedule_, {it->second, cell},
               fmt::format(FMT_STRING("{} appears twice: at {} and at {}"), to_string(a),
                           where(it->second), where(cell)));
        }
      }
    }
  }

  // 2. Every (stage, microbatch) has its F and its backward; a lowered schedule has the SEND
  //    and RECV of every dependency across ranks.
  void check_complete() const {
    for (int s = 0; s < num_stages_; ++s) {
      for (int m = 0; m < num_microbatches_; ++m) {
        const auto missing = [&](ActionType type, const std::string& why) {
          const Action a{s, type, m};
          fail(schedule_, {},
               fmt::format(FMT_STRING("{} is missing (it belongs on rank {}): {}"), to_string(a),
                           rank_of(s), why));
        };
        const Action f{s, ActionType::kForward, m};
        const Action b{s, ActionType::kFullBackward, m};
        const Action i{s, ActionType::kBackwardInput, m};
        const Action w{s, ActionType::kBackwardWeight, m};
        if (!index_.contains(f)) missing(f.type, "every stage runs a forward of every microbatch");
        if (index_.contains(b)) {
          for (const Action& half : {i, w}) {
            if (index_.contains(half)) {
              fail(schedule_, {locate(b), locate(half)},
                   fmt::format(
                       FMT_STRING("{} and {} both present: a backward is either B, or I and W"),
                       to_string(b), to_string(half)));
            }
          }
        } else if (!index_.contains(i) && !index_.contains(w)) {
          missing(b.type, "every stage runs a backward of every microbatch (B, or I and W)");
        } else if (!index_.contains(w)) {
          missing(w.type,
                  fmt::format(FMT_STRING("{} computes only the input gradient"), to_string(i)));
        } else if (!index_.contains(i)) {
          missing(i.type,
                  fmt::format(FMT_STRING("{} needs the input-gradient half first"), to_string(w)));
        }
        if (!lowered_) continue;
        // Forward edge s -> s+1 and backward edge s -> s-1, when they cross ranks.
        if (s + 1 < num_stages_ && rank_of(s + 1) != rank_of(s)) {
          require_message(f, Action{s, ActionType::kSendForward, m},
                          Action{s + 1, ActionType::kRecvForward, m});
        }
        if (s > 0 && rank_of(s - 1) != rank_of(s)) {
          require_message(*index_.backward_input(s, m), Action{s, ActionType::kSendBackward, m},
                          Action{s - 1, ActionType::kRecvBackward, m});
        }
      }
    }
  }

  void require_message(const Action& producer, const Action& send, const Action& recv) const {
    for (const Action& a : {send, recv}) {
      if (!index_.contains(a)) {
        fail(schedule_, {locate(producer)},
             fmt::format(FMT_STRING("{} is missing (it belongs on rank {}): the schedule is "
                                    "lowered and {} feeds a stage on another rank"),
                         to_string(a), rank_of(a.stage), to_string(producer)));
      }
    }
  }

  // 3. The dependency rules that stay on one rank hold in program order.
  void check_program_order() const {
    for (int rank = 0; rank < static_cast<int>(schedule_.size()); ++rank) {
      for (int step = 0; step < static_cast<int>(schedule_[rank].size()); ++step) {
        const std::optional<Action>& slot = schedule_[rank][step];
        if (!slot) continue;
        for (const auto& [before, why] : same_rank_prerequisites(*slot)) {
          const Cell at = locate(before);
          if (at.step > step) {
            fail(schedule_, {Cell{rank, step}},
                 fmt::format(FMT_STRING("{}: {} runs before {} (step {}), {}"),
                             where(Cell{rank, step}), to_string(*slot), to_string(before), at.step,
                             why));
          }
        }
      }
    }
  }

  // What must come earlier on the same rank, with the rule's wording.
  std::vector<std::pair<Action, std::string>> same_rank_prerequisites(const Action& a) const {
    std::vector<std::pair<Action, std::string>> result;
    const int s = a.stage;
    const int m = a.microbatch;
    switch (a.type) {
      case ActionType::kForward:
        if (s > 0 && rank_of(s - 1) == rank_of(s)) {
          result.emplace_back(Action{s - 1, ActionType::kForward, m},
                              "the forward of the previous stage it consumes");
        } else if (s > 0 && lowered_) {
          result.emplace_back(Action{s, ActionType::kRecvForward, m}, "the receive of its input");
        }
        break;
      case ActionType::kFullBackward:
      case ActionType::kBackwardInput:
        result.emplace_back(Action{s, ActionType::kForward, m}, "its forward");
        if (s + 1 < num_stages_ && rank_of(s + 1) == rank_of(s)) {
          result.emplace_back(*index_.backward_input(s + 1, m),
                              "the backward of the next stage it consumes");
        } else if (s + 1 < num_stages_ && lowered_) {
          result.emplace_back(Action{s, ActionType::kRecvBackward, m},
                              "the receive of its output gradient");
        }
        break;
      case ActionType::kBackwardWeight:
        result.emplace_back(Action{s, ActionType::kBackwardInput, m}, "its input-gradient half");
        break;
      case ActionType::kSendForward:
        result.emplace_back(Action{s, ActionType::kForward, m},
                            "the forward whose output it sends");
        break;
      case ActionType::kSendBackward:
        result.emplace_back(*index_.backward_input(s, m),
                            "the backward whose input gradient it sends");
        break;
      case ActionType::kRecvForward:
      case ActionType::kRecvBackward:
        break;
    }
    return result;
  }

  const Schedule& schedule_;
  int num_stages_;
  int num_microbatches_;
  const std::vector<int>& stage_to_rank_;
  Index index_;
  bool lowered_ = false;
};

void check_arguments(const Schedule& schedule, int num_stages, int num_microbatches,
                     const std::vector<int>& stage_to_rank) {
  SMP_CHECK(num_stages >= 1, "num_stages must be >= 1, got {}", num_stages);
  SMP_CHECK(num_microbatches >= 1, "num_microbatches must be >= 1, got {}", num_microbatches);
  SMP_CHECK(static_cast<int>(stage_to_rank.size()) == num_stages,
            "stage_to_rank must have one entry per stage ({}), got {}", num_stages,
            stage_to_rank.size());
  for (int s = 0; s < num_stages; ++s) {
    SMP_CHECK(stage_to_rank[s] >= 0 && stage_to_rank[s] < static_cast<int>(schedule.size()),
              "stage_to_rank[{}] = {} is not a rank of the schedule ({} ranks, one program each)",
              s, stage_to_rank[s], schedule.size());
  }
}

void check_costs(const char* function, const ActionCosts& costs) {
  const std::pair<const char*, double> named_costs[] = {
      {"forward", costs.forward},
      {"full_backward", costs.full_backward},
      {"backward_input", costs.backward_input},
      {"backward_weight", costs.backward_weight},
      {"send", costs.send},
      {"recv", costs.recv},
      {"latency", costs.latency},
  };
  for (const auto& [name, value] : named_costs) {
    SMP_CHECK(std::isfinite(value) && value >= 0, "{}: cost {} must be finite and >= 0, got {:g}",
              function, name, value);
  }
}

// ---- generators ---------------------------------------------------------------------------------

void check_count(const char* generator, const char* name, int value) {
  SMP_CHECK(value >= 1, "{}: {} must be >= 1, got {}", generator, name, value);
}

// Lays per-rank orders of compute actions out on the unit-time grid (file comment of schedule.h):
// step = start time of a unit-time execution; the steps in between are idle.
Schedule lay_out(const std::vector<std::vector<Action>>& orders) {
  Schedule compact(orders.size());
  for (std::size_t rank = 0; rank < orders.size(); ++rank) {
    compact[rank].assign(orders[rank].begin(), orders[rank].end());
  }
  const Index index(compact);
  Executor executor(compact, index, /*lowered=*/false, {unit_costs()}, /*rendezvous=*/false);
  SMP_INTERNAL_ASSERT(executor.run(), "generated schedule deadlocks");
  Schedule grid(orders.size());
  for (std::size_t rank = 0; rank < orders.size(); ++rank) {
    for (int id : executor.ids()[rank]) {
      const auto step = static_cast<std::size_t>(std::lround(executor.start(id)));
      if (grid[rank].size() <= step) grid[rank].resize(step + 1);
      grid[rank][step] = executor.action(id);
    }
  }
  return grid;
}

Action forward_of(int stage, int microbatch) {
  return Action{stage, ActionType::kForward, microbatch};
}

}  // namespace

// ---- actions ------------------------------------------------------------------------------------

const char* action_type_name(ActionType type) {
  switch (type) {
    case ActionType::kForward:
      return "F";
    case ActionType::kFullBackward:
      return "B";
    case ActionType::kBackwardInput:
      return "I";
    case ActionType::kBackwardWeight:
      return "W";
    case ActionType::kSendForward:
      return "SEND_F";
    case ActionType::kRecvForward:
      return "RECV_F";
    case ActionType::kSendBackward:
      return "SEND_B";
    case ActionType::kRecvBackward:
      return "RECV_B";
  }
  SMP_INTERNAL_ASSERT(false, "unknown ActionType {}", static_cast<int>(type));
}

ActionType parse_action_type(const std::string& name) {
  for (ActionType type : kAllTypes) {
    if (name == action_type_name(type)) return type;
  }
  for (const char* torch_only : kTorchOnlyTypes) {
    SMP_CHECK(name != torch_only,
              "action type {} of torch.distributed.pipelining is not supported by smp's schedule "
              "IR; supported: {}",
              name, kTypeList);
  }
  throw Error(
      fmt::format(FMT_STRING("unknown action type \"{}\"; expected one of {}"), name, kTypeList));
}

bool is_compute(ActionType type) { return !is_communication(type); }

bool is_communication(ActionType type) {
  return type == ActionType::kSendForward || type == ActionType::kRecvForward ||
         type == ActionType::kSendBackward || type == ActionType::kRecvBackward;
}

bool Action::operator<(const Action& other) const {
  return std::make_tuple(stage, static_cast<int>(type), microbatch) <
         std::make_tuple(other.stage, static_cast<int>(other.type), other.microbatch);
}

std::string to_string(const Action& action) {
  return fmt::format(FMT_STRING("{}{}{}"), action.stage, action_type_name(action.type),
                     action.microbatch);
}

Action parse_action(const std::string& text) {
  const std::string s = trim(text);
  const auto bad = [&](const std::string& why) {
    return Error(
        fmt::format(FMT_STRING("invalid action \"{}\": {}; expected <stage><type><microbatch> such "
                               "as \"1F0\" or \"0SEND_B3\", with type one of {}"),
                    text, why, kTypeList));
  };
  if (!s.empty() && s.front() == '(') {
    throw bad("OVERLAP_F_B groups of torch.distributed.pipelining are not supported");
  }
  std::size_t pos = 0;
  const auto read_number = [&](const char* what) {
    const std::size_t begin = pos;
    while (pos < s.size() && std::isdigit(static_cast<unsigned char>(s[pos]))) ++pos;
    if (pos == begin) throw bad(fmt::format(FMT_STRING("no {} index"), what));
    if (pos - begin > 9) throw bad(fmt::format(FMT_STRING("the {} index is too large"), what));
    return std::stoi(s.substr(begin, pos - begin));
  };
  Action action;
  action.stage = read_number("stage");
  const std::size_t type_begin = pos;
  while (pos < s.size() && (std::isalpha(static_cast<unsigned char>(s[pos])) || s[pos] == '_')) {
    ++pos;
  }
  if (pos == type_begin) throw bad("no action type after the stage index");
  const std::string type = s.substr(type_begin, pos - type_begin);
  const auto known = std::find_if(std::begin(kAllTypes), std::end(kAllTypes),
                                  [&](ActionType t) { return type == action_type_name(t); });
  if (known == std::end(kAllTypes)) {
    const bool torch_only = std::any_of(std::begin(kTorchOnlyTypes), std::end(kTorchOnlyTypes),
                                        [&](const char* name) { return type == name; });
    if (torch_only) {
      throw bad(fmt::format(
          FMT_STRING("type {} of torch.distributed.pipelining is not supported by smp"), type));
    }
    throw bad(fmt::format(FMT_STRING("unknown type \"{}\""), type));
  }
  action.type = *known;
  action.microbatch = read_number("microbatch");
  if (pos != s.size()) {
    throw bad(fmt::format(FMT_STRING("unexpected \"{}\" after the action"), s.substr(pos)));
  }
  return action;
}

// ---- generators ---------------------------------------------------------------------------------

std::vector<int> round_robin_stage_to_rank(int num_stages, int num_ranks) {
  check_count("round_robin_stage_to_rank", "num_stages", num_stages);
  check_count("round_robin_stage_to_rank", "num_ranks", num_ranks);
  std::vector<int> stage_to_rank(num_stages);
  for (int s = 0; s < num_stages; ++s) stage_to_rank[s] = s % num_ranks;
  return stage_to_rank;
}

Schedule gpipe(int num_stages, int num_microbatches) {
  check_count("gpipe", "num_stages", num_stages);
  check_count("gpipe", "num_microbatches", num_microbatches);
  std::vector<std::vector<Action>> orders(num_stages);
  for (int s = 0; s < num_stages; ++s) {
    for (int m = 0; m < num_microbatches; ++m) orders[s].push_back(forward_of(s, m));
    for (int m = 0; m < num_microbatches; ++m) {
      orders[s].push_back(Action{s, ActionType::kFullBackward, m});
    }
  }
  return lay_out(orders);
}

Schedule one_f_one_b(int num_stages, int num_microbatches) {
  check_count("one_f_one_b", "num_stages", num_stages);
  check_count("one_f_one_b", "num_microbatches", num_microbatches);
  const int p = num_stages;
  const int m = num_microbatches;
  std::vector<std::vector<Action>> orders(p);
  for (int s = 0; s < p; ++s) {
    std::vector<Action>& order = orders[s];
    const auto backward = [&](int mb) {
      order.push_back(Action{s, ActionType::kFullBackward, mb});
    };
    // 1. warm-up  2. steady 1F1B  3. cool-down
    const int warmup = std::min(p - 1 - s, m);
    for (int mb = 0; mb < warmup; ++mb) order.push_back(forward_of(s, mb));
    for (int j = 0; j < m - warmup; ++j) {
      order.push_back(forward_of(s, warmup + j));
      backward(j);
    }
    for (int mb = m - warmup; mb < m; ++mb) backward(mb);
  }
  return lay_out(orders);
}

Schedule interleaved_1f1b(int num_ranks, int virtual_stages_per_rank, int num_microbatches) {
  check_count("interleaved_1f1b", "num_ranks", num_ranks);
  check_count("interleaved_1f1b", "virtual_stages_per_rank", virtual_stages_per_rank);
  check_count("interleaved_1f1b", "num_microbatches", num_microbatches);
  const int p = num_ranks;
  const int v = virtual_stages_per_rank;
  const int m = num_microbatches;
  if (m % p != 0) {
    const int lower = (m / p) * p;
    throw Error(fmt::format(
        FMT_STRING("interleaved_1f1b: num_microbatches must be a multiple of num_ranks "
                   "(microbatches go through the virtual stages in groups of num_ranks), got "
                   "num_microbatches={}, num_ranks={}; use num_microbatches={}{}"),
        m, p, lower > 0 ? fmt::format(FMT_STRING("{} or "), lower) : "", lower + p));
  }
  const int total = m * v;  // forwards (and backwards) per rank
  std::vector<std::vector<Action>> orders(p);
  for (int r = 0; r < p; ++r) {
    // Virtual microbatch k of rank r: chunk (k / p) % v (reversed for backwards) of microbatch
    // (k / (p·v))·p + k % p; chunk c of rank r is stage c·p + r.
    const auto microbatch = [&](int k) { return (k / (p * v)) * p + k % p; };
    const auto fwd = [&](int k) { return forward_of(((k / p) % v) * p + r, microbatch(k)); };
    const auto bwd = [&](int k) {
      return Action{(v - 1 - (k / p) % v) * p + r, ActionType::kFullBackward, microbatch(k)};
    };
    // 1. warm-up  2. steady 1F1B  3. cool-down
    const int warmup = m == p ? total : std::min(2 * (p - 1 - r) + (v - 1) * p, total);
    std::vector<Action>& order = orders[r];
    for (int k = 0; k < warmup; ++k) order.push_back(fwd(k));
    for (int k = 0; k < total - warmup; ++k) {
      order.push_back(fwd(warmup + k));
      order.push_back(bwd(k));
    }
    for (int k = total - warmup; k < total; ++k) order.push_back(bwd(k));
  }
  return lay_out(orders);
}

Schedule zero_bubble_h1(int num_stages, int num_microbatches) {
  check_count("zero_bubble_h1", "num_stages", num_stages);
  check_count("zero_bubble_h1", "num_microbatches", num_microbatches);
  const int p = num_stages;
  const int m = num_microbatches;
  std::vector<std::vector<Action>> orders(p);
  for (int s = 0; s < p; ++s) {
    std::vector<Action>& order = orders[s];
    int num_f = 0;
    int num_i = 0;
    int num_w = 0;
    const auto f = [&] { order.push_back(forward_of(s, num_f++)); };
    const auto i = [&] { order.push_back(Action{s, ActionType::kBackwardInput, num_i++}); };
    const auto w = [&] { order.push_back(Action{s, ActionType::kBackwardWeight, num_w++}); };
    // 1. warm-up  2. F I (W deferred)  3. F I W  4. I W  5. the deferred W's
    for (int k = 0; k < p - 1 - s && num_f < m; ++k) f();
    for (int k = 0; k < s && num_f < m; ++k) {
      f();
      i();
    }
    while (num_f < m) {
      f();
      i();
      w();
    }
    while (num_i < m) {
      i();
      w();
    }
    while (num_w < m) w();
  }
  return lay_out(orders);
}

// ---- lowering -----------------------------------------------------------------------------------

Schedule add_communication(const Schedule& schedule, const std::vector<int>& stage_to_rank,
                           const ActionCosts& costs) {
  check_costs("add_communication", costs);
  for (ActionType type : {ActionType::kForward, ActionType::kFullBackward,
                          ActionType::kBackwardInput, ActionType::kBackwardWeight}) {
    SMP_CHECK(costs.of(type) > 0,
              "add_communication: compute costs must be > 0 (they order the messages, "
              "Note [Send/recv order]), got {:g} for {}",
              costs.of(type), action_type_name(type));
  }
  int num_microbatches = 0;
  for (const Program& program : schedule) {
    for (const std::optional<Action>& slot : program) {
      if (!slot) continue;
      SMP_CHECK(is_compute(slot->type),
                "add_communication: the schedule already holds {}; pass a compute-only schedule "
                "(F, B, I, W)",
                to_string(*slot));
      num_microbatches = std::max(num_microbatches, slot->microbatch + 1);
    }
  }
  const int num_stages = static_cast<int>(stage_to_rank.size());
  validate_schedule(schedule, num_stages, num_microbatches, stage_to_rank);
  const int num_ranks = static_cast<int>(schedule.size());

  // End time of every compute action under `costs`: the keys of Note [Send/recv order].
  const Index index(schedule);
  Executor executor(schedule, index, /*lowered=*/false, {costs}, /*rendezvous=*/false);
  SMP_INTERNAL_ASSERT(executor.run(), "a valid compute-only schedule deadlocked");

  using Key = std::pair<double, int>;  // (end time, rank) of the producer
  struct Recv {
    Key key;
    Action recv;
    Action consumer;
  };
  // Per rank: the compute actions, each SEND right after its producer (rule 1), and in parallel
  // the key of each SEND.
  std::vector<std::vector<Action>> fixed(num_ranks);
  std::vector<std::vector<std::optional<Key>>> send_key(num_ranks);
  std::vector<std::vector<Recv>> recvs(num_ranks);
  for (int rank = 0; rank < num_ranks; ++rank) {
    for (int id : executor.ids()[rank]) {
      const Action& a = executor.action(id);
      fixed[rank].push_back(a);
      send_key[rank].emplace_back();
      const Key key{executor.end(id), rank};
      const int s = a.stage;
      const int m = a.microbatch;
      if (a.type == ActionType::kForward && s + 1 < num_stages && stage_to_rank[s + 1] != rank) {
        fixed[rank].push_back(Action{s, ActionType::kSendForward, m});
        send_key[rank].push_back(key);
        recvs[stage_to_rank[s + 1]].push_back(
            Recv{key, Action{s + 1, ActionType::kRecvForward, m}, forward_of(s + 1, m)});
      } else if (is_backward_input(a.type) && s > 0 && stage_to_rank[s - 1] != rank) {
        fixed[rank].push_back(Action{s, ActionType::kSendBackward, m});
        send_key[rank].push_back(key);
        recvs[stage_to_rank[s - 1]].push_back(Recv{key, Action{s - 1, ActionType::kRecvBackward, m},
                                                   *index.backward_input(s - 1, m)});
      }
    }
  }

  Schedule lowered(num_ranks);
  for (int rank = 0; rank < num_ranks; ++rank) {
    const std::vector<Action>& seq = fixed[rank];
    std::vector<Recv>& incoming = recvs[rank];
    std::sort(incoming.begin(), incoming.end(),
              [](const Recv& a, const Recv& b) { return a.key < b.key; });
    // The rank's SENDs in program order; their keys increase along the program.
    std::vector<std::pair<Key, std::size_t>> sends;  // (key, position in seq)
    std::map<Action, std::size_t> position;
    for (std::size_t k = 0; k < seq.size(); ++k) {
      if (send_key[rank][k]) sends.emplace_back(*send_key[rank][k], k);
      position.emplace(seq[k], k);
    }
    // Anchor of each RECV: the position it goes right before (rule 2 of the note).
    std::vector<std::size_t> anchor(incoming.size());
    for (std::size_t j = 0; j < incoming.size(); ++j) {
      const Key& key = incoming[j].key;
      const auto later_send = std::upper_bound(
          sends.begin(), sends.end(), key,
          [](const Key& k, const std::pair<Key, std::size_t>& send) { return k < send.first; });
      anchor[j] = position.at(incoming[j].consumer);
      if (later_send != sends.end()) anchor[j] = std::min(anchor[j], later_send->second);
    }
    for (std::size_t j = incoming.size(); j-- > 1;) {
      anchor[j - 1] = std::min(anchor[j - 1], anchor[j]);
    }
    for (std::size_t j = 0; j < incoming.size(); ++j) {
      // The SENDs with a smaller key stay before the RECV (see the note).
      const auto later_send = std::upper_bound(
          sends.begin(), sends.end(), incoming[j].key,
          [](const Key& k, const std::pair<Key, std::size_t>& send) { return k < send.first; });
      SMP_INTERNAL_ASSERT(later_send == sends.begin() || std::prev(later_send)->second < anchor[j],
                          "Note [Send/recv order] broken for {}", to_string(incoming[j].recv));
    }
    Program& program = lowered[rank];
    std::size_t next = 0;
    for (std::size_t k = 0; k < seq.size(); ++k) {
      for (; next < incoming.size() && anchor[next] == k; ++next) {
        program.emplace_back(incoming[next].recv);
      }
      program.emplace_back(seq[k]);
    }
    SMP_INTERNAL_ASSERT(next == incoming.size(), "RECV placed past the end of rank {}", rank);
  }
  return lowered;
}

// ---- validation and printing --------------------------------------------------------------------

void validate_schedule(const Schedule& schedule, int num_stages, int num_microbatches,
                       const std::vector<int>& stage_to_rank) {
  check_arguments(schedule, num_stages, num_microbatches, stage_to_rank);
  Checker(schedule, num_stages, num_microbatches, stage_to_rank).check(/*check_deadlock=*/true);
}

std::string format_grid(const Schedule& schedule, const std::vector<Cell>& marked) {
  std::size_t num_steps = 0;
  std::size_t width = 1;
  for (const Program& program : schedule) {
    num_steps = std::max(num_steps, program.size());
    for (const std::optional<Action>& slot : program) {
      if (slot) width = std::max(width, to_string(*slot).size());
    }
  }
  if (num_steps > 0) width = std::max(width, fmt::format(FMT_STRING("{}"), num_steps - 1).size());
  const std::string last_label =
      fmt::format(FMT_STRING("rank {}"), schedule.empty() ? 0 : schedule.size() - 1);
  const std::size_t label_width = std::max<std::size_t>(4, last_label.size());

  std::string out;
  const auto emit_line = [&](std::string line) {
    line.erase(line.find_last_not_of(' ') + 1);
    out += line;
    out += '\n';
  };
  const auto pad = [](std::string text, std::size_t size) {
    text.resize(std::max(size, text.size()), ' ');
    return text;
  };
  std::string header = pad("step", label_width);
  for (std::size_t step = 0; step < num_steps; ++step) {
    header += " " + pad(fmt::format(FMT_STRING("{}"), step), width) + " ";
  }
  emit_line(header);
  for (std::size_t rank = 0; rank < schedule.size(); ++rank) {
    std::string line = pad(fmt::format(FMT_STRING("rank {}"), rank), label_width);
    for (std::size_t step = 0; step < schedule[rank].size(); ++step) {
      const std::optional<Action>& slot = schedule[rank][step];
      const std::string text = slot ? to_string(*slot) : ".";
      const bool is_marked = std::any_of(marked.begin(), marked.end(), [&](const Cell& c) {
        return c.rank == static_cast<int>(rank) && c.step == static_cast<int>(step);
      });
      line += is_marked ? pad(">" + text + "<", width + 2) : " " + pad(text, width) + " ";
    }
    emit_line(line);
  }
  return out;
}

// ---- CSV ----------------------------------------------------------------------------------------

std::string to_csv(const Schedule& schedule) {
  std::string out;
  for (const Program& program : schedule) {
    // Python's csv.writer quotes a row that is a single empty field, to tell it from an empty row.
    if (program.size() == 1 && !program[0]) {
      out += "\"\"";
    } else {
      for (std::size_t step = 0; step < program.size(); ++step) {
        if (step > 0) out += ',';
        if (program[step]) out += to_string(*program[step]);
      }
    }
    out += "\r\n";
  }
  return out;
}

Schedule from_csv(const std::string& text) {
  Schedule schedule;
  std::size_t begin = 0;
  while (begin < text.size()) {
    std::size_t end = text.find('\n', begin);
    if (end == std::string::npos) end = text.size();
    std::string line = text.substr(begin, end - begin);
    begin = end + 1;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    const int rank = static_cast<int>(schedule.size());
    Program& program = schedule.emplace_back();
    if (line.empty()) continue;  // a rank with an empty program
    std::size_t cell_begin = 0;
    while (true) {
      std::size_t cell_end = line.find(',', cell_begin);
      const bool last = cell_end == std::string::npos;
      if (last) cell_end = line.size();
      std::string cell = trim(line.substr(cell_begin, cell_end - cell_begin));
      if (cell.size() >= 2 && cell.front() == '"' && cell.back() == '"') {
        cell = trim(cell.substr(1, cell.size() - 2));  // csv quoting; actions never hold quotes
      }
      if (cell.empty()) {
        program.emplace_back();
      } else {
        try {
          program.emplace_back(parse_action(cell));
        } catch (const Error& e) {
          throw Error(fmt::format(FMT_STRING("CSV row {} (rank {}), cell {} (step {}): {}"),
                                  rank + 1, rank, program.size() + 1, program.size(), e.what()));
        }
      }
      if (last) break;
      cell_begin = cell_end + 1;
    }
  }
  return schedule;
}

// ---- simulation ---------------------------------------------------------------------------------

double ActionCosts::of(ActionType type) const {
  switch (type) {
    case ActionType::kForward:
      return forward;
    case ActionType::kFullBackward:
      return full_backward;
    case ActionType::kBackwardInput:
      return backward_input;
    case ActionType::kBackwardWeight:
      return backward_weight;
    case ActionType::kSendForward:
    case ActionType::kSendBackward:
      return send;
    case ActionType::kRecvForward:
    case ActionType::kRecvBackward:
      return recv;
  }
  SMP_INTERNAL_ASSERT(false, "unknown ActionType {}", static_cast<int>(type));
}

namespace {

// simulate() with `costs` holding one entry for every stage (`per_stage` false) or one per stage.
Timeline simulate_with(const Schedule& schedule, const std::vector<ActionCosts>& costs,
                       bool per_stage, bool rendezvous) {
  for (const ActionCosts& c : costs) check_costs("simulate", c);
  const int num_ranks = static_cast<int>(schedule.size());
  Timeline timeline;
  timeline.peak_in_flight.assign(num_ranks, 0);

  // Read the layout off the schedule.
  int num_stages = 0;
  int num_microbatches = 0;
  std::map<int, Cell> first_cell_of_stage;
  for (int rank = 0; rank < num_ranks; ++rank) {
    for (int step = 0; step < static_cast<int>(schedule[rank].size()); ++step) {
      const std::optional<Action>& slot = schedule[rank][step];
      if (!slot) continue;
      SMP_CHECK(slot->stage >= 0 && slot->microbatch >= 0,
                "simulate: {} at rank {}, step {} has a negative index", to_string(*slot), rank,
                step);
      num_stages = std::max(num_stages, slot->stage + 1);
      num_microbatches = std::max(num_microbatches, slot->microbatch + 1);
      auto [it, inserted] = first_cell_of_stage.emplace(slot->stage, Cell{rank, step});
      if (!inserted && it->second.rank != rank) {
        fail(schedule, {it->second, Cell{rank, step}},
             fmt::format(
                 FMT_STRING(
                     "stage {} has actions on rank {} and on rank {}; a stage runs on one rank"),
                 slot->stage, it->second.rank, rank));
      }
    }
  }
  if (num_stages == 0) return timeline;
  std::vector<int> stage_to_rank(num_stages);
  for (int s = 0; s < num_stages; ++s) {
    auto it = first_cell_of_stage.find(s);
    SMP_CHECK(it != first_cell_of_stage.end(),
              "simulate: stage {} has no actions, but stage {} has", s, num_stages - 1);
    stage_to_rank[s] = it->second.rank;
  }
  SMP_CHECK(!per_stage || static_cast<int>(costs.size()) == num_stages,
            "simulate: {} per-stage costs for a schedule of {} stages; give one ActionCosts per "
            "stage, or one for all",
            costs.size(), num_stages);
  Checker checker(schedule, num_stages, num_microbatches, stage_to_rank);
  checker.check(/*check_deadlock=*/false);

  Executor executor(schedule, checker.index(), checker.lowered(), costs, rendezvous);
  if (!executor.run()) fail_deadlock(schedule, executor, rendezvous && checker.lowered());

  double compute_time = 0;
  for (int rank = 0; rank < num_ranks; ++rank) {
    int in_flight = 0;
    for (int id : executor.ids()[rank]) {
      const Action& a = executor.action(id);
      timeline.actions.push_back(
          TimedAction{rank, executor.step(id), a, executor.start(id), executor.end(id)});
      timeline.makespan = std::max(timeline.makespan, executor.end(id));
      if (is_compute(a.type)) compute_time += executor.end(id) - executor.start(id);
      // Actions of a rank run one after another, so program order is time order.
      if (a.type == ActionType::kForward) {
        timeline.peak_in_flight[rank] = std::max(timeline.peak_in_flight[rank], ++in_flight);
      } else if (is_backward_input(a.type)) {
        --in_flight;
      }
    }
  }
  if (timeline.makespan > 0) {
    timeline.bubble_fraction = 1 - compute_time / (num_ranks * timeline.makespan);
  }
  return timeline;
}

}  // namespace

Timeline simulate(const Schedule& schedule, const ActionCosts& costs, bool rendezvous) {
  return simulate_with(schedule, {costs}, /*per_stage=*/false, rendezvous);
}

Timeline simulate(const Schedule& schedule, const std::vector<ActionCosts>& stage_costs,
                  bool rendezvous) {
  return simulate_with(schedule, stage_costs, /*per_stage=*/true, rendezvous);
}

}  // namespace smp::schedule
