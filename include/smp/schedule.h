// smp/schedule.h — the pipeline schedule IR: actions, per-rank programs, generators, the lowering
// pass that adds communication, the validator, CSV exchange with torch.distributed.pipelining and
// an event-driven simulator (design.md §5).
//
// Vocabulary. An action is (stage, type, microbatch). Its string form is exactly the one
// torch.distributed.pipelining writes: the stage index, the type, the microbatch index, e.g. "1F0"
// (stage 1, forward, microbatch 0), "0B3", "2I1", "2W1", "1SEND_F2", "0RECV_B3". A program is one
// rank's ordered list of steps; a step holds an action or is idle (std::nullopt, printed "." by
// format_grid() and as an empty cell in CSV — a real "do nothing now", never a placeholder to be
// filled later). A schedule is one program per rank, indexed by rank; stage_to_rank[stage] says
// which rank runs a stage.
//
// Dependency rules (S stages, "backward-input of (s, m)" = its B, or its I when B is split):
//   F(s, m)       after F(s-1, m)                                  (s > 0)
//   B/I(s, m)     after F(s, m), and after the backward-input of (s+1, m)   (s < S-1)
//   W(s, m)       after I(s, m)
//   SEND_F(s, m)  after F(s, m), to rank(s+1);   its RECV_F(s+1, m) runs on rank(s+1)
//   SEND_B(s, m)  after B/I(s, m), to rank(s-1); its RECV_B(s-1, m) runs on rank(s-1)
//   and in a lowered schedule a compute action whose input comes from another rank runs after the
//   RECV of that input on its own rank.
// Every (s, m) has exactly one F and either one B, or one I and one W.
//
// Two kinds of schedules:
//   compute-only  F/B/I/W only; data crossing ranks is implicit. The generators emit these, laid
//                 out on a unit-time grid: every compute action takes one step and starts at the
//                 first step after its rank's previous action and after all of its dependencies,
//                 so step index = start time and the bubble is visible as idle steps.
//   lowered       also SEND/RECV for every dependency between stages on different ranks (and
//                 none between stages on the same rank): what each rank executes, in order. No
//                 idle steps (timing comes from the dependencies). add_communication() makes one.
// A schedule is lowered iff it contains a SEND or RECV.
//
// Execution model (validate_schedule(), simulate()): each rank runs its program in order, one
// action at a time; a compute action waits for its dependencies, a RECV for its SEND. Sends are
// buffered (a SEND completes without waiting for the RECV) or, stricter, rendezvous (a SEND starts
// only once the peer has reached the matching RECV, as a blocking NCCL send of a large tensor
// does). Lowered schedules from add_communication() cannot deadlock even under rendezvous sends
// (Note [Send/recv order] in csrc/core/schedule.cpp), and validate_schedule() checks that property.
//
// Closed forms (simulate() of the generated schedules; verified in
// tests/cpp/core/schedule_test.cpp for p <= 8, m <= 16, v <= 3), p stages (ranks), m microbatches,
// v virtual stages per rank, rank r; bubble = non-compute time / (ranks x makespan):
//   gpipe, one_f_one_b    makespan 2(m+p-1) with F = B = 1 (the grid), 3(m+p-1) with F = 1,
//                         B = 2; bubble (p-1)/(m+p-1) for both. Peak in-flight: gpipe m,
//                         1F1B min(p-r, m).
//   interleaved_1f1b      makespan 2(vm+p-1) with F = B = 1 per chunk (the grid), 3(vm+p-1) with
//                         F = 1, B = 2; bubble (p-1)/(vm+p-1) for both (m a multiple of p). Peak
//                         in-flight (stage, microbatch) pairs: min(warm-up + 1, vm).
//   zero_bubble_h1        makespan 3m+p-1 with F = I = W = 1 (the grid; m >= p); bubble
//                         (p-1)/(3m+p-1), about a third of 1F1B's (p-1)/(m+p-1) at the same work
//                         per microbatch (B = I + W = 2), and never above it for m < p. Peak
//                         in-flight min(p-r, m), like 1F1B.
//
// Example:
//   using namespace smp::schedule;
//   Schedule compute = one_f_one_b(/*num_stages=*/2, /*num_microbatches=*/2);
//   format_grid(compute);
//   //   step   0    1    2    3    4    5
//   //   rank 0 0F0  0F1  .    0B0  .    0B1
//   //   rank 1 .    1F0  1B0  1F1  1B1
//   std::vector<int> stage_to_rank = round_robin_stage_to_rank(2, 2);  // {0, 1}
//   Schedule lowered = add_communication(compute, stage_to_rank);
//   //   rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1
//   //   rank 1: 1RECV_F0 1F0 1B0 1RECV_F1 1SEND_B0 1F1 1B1 1SEND_B1
//   validate_schedule(lowered, 2, 2, stage_to_rank);   // throws smp::Error with the grid if not
//   Timeline timeline = simulate(lowered, ActionCosts{});  // F = 1, B = 2
//   timeline.makespan;          // 9 = 3(m+p-1)
//   timeline.bubble_fraction;   // 1/3 = (p-1)/(m+p-1)
//   timeline.peak_in_flight;    // {2, 1}
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace smp::schedule {

/// What an action does. The comment gives its string form.
enum class ActionType {
  kForward,         // "F"
  kFullBackward,    // "B": input and weight gradients together
  kBackwardInput,   // "I": input gradient only (zero-bubble schedules)
  kBackwardWeight,  // "W": weight gradient only, after the I of the same stage and microbatch
  kSendForward,     // "SEND_F": the output of F(s, m) to the rank of stage s+1
  kRecvForward,     // "RECV_F": the input of F(s, m) from the rank of stage s-1
  kSendBackward,    // "SEND_B": the input gradient of B/I(s, m) to the rank of stage s-1
  kRecvBackward,    // "RECV_B": the output gradient of B/I(s, m) from the rank of stage s+1
};

/// The string form of a type: "F", "B", "I", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B".
const char* action_type_name(ActionType type);

/// Parses a type's string form. Throws smp::Error naming the text and the allowed names.
ActionType parse_action_type(const std::string& name);

/// F, B, I or W.
bool is_compute(ActionType type);

/// SEND_F, RECV_F, SEND_B or RECV_B.
bool is_communication(ActionType type);

/// One action: `type` of `stage` for `microbatch`.
struct Action {
  int stage = 0;
  ActionType type = ActionType::kForward;
  int microbatch = 0;

  bool operator==(const Action& other) const {
    return stage == other.stage && type == other.type && microbatch == other.microbatch;
  }
  bool operator!=(const Action& other) const { return !(*this == other); }
  /// Orders by (stage, type, microbatch), for use as a map key.
  bool operator<(const Action& other) const;
};

/// The string form: stage, type, microbatch, e.g. "1F0", "0SEND_B3".
std::string to_string(const Action& action);

/// Parses the string form (surrounding whitespace ignored). Throws smp::Error naming the text
/// when it is not <stage><type><microbatch> with a known type, e.g. "1F0", and when the type is
/// one torch.distributed.pipelining knows but smp does not (UNSHARD, RESHARD, REDUCE_GRAD,
/// OVERLAP_F_B).
Action parse_action(const std::string& text);

/// One rank's steps in order; std::nullopt is an idle step.
using Program = std::vector<std::optional<Action>>;

/// One program per rank, indexed by rank.
using Schedule = std::vector<Program>;

// ---- generators: compute-only schedules on the unit-time grid -----------------------------------
// Each generator fixes the order of the compute actions on every rank (its doc comment) and lays
// them out on the grid (file comment). Throws smp::Error for counts < 1.

/// stage s on rank s % num_ranks. With num_stages = num_ranks: stage s on rank s; with
/// num_stages = v·num_ranks: the layout of interleaved_1f1b().
std::vector<int> round_robin_stage_to_rank(int num_stages, int num_ranks);

/// GPipe: stage s on rank s; every rank runs F0 … F(m-1), then B0 … B(m-1). Peak in-flight m.
Schedule gpipe(int num_stages, int num_microbatches);

/// 1F1B (PipeDream-flush): stage s on rank s; 1. warm-up: min(p-1-s, m) forwards; 2. steady: F
/// of the next microbatch, then B of the oldest, while forwards remain; 3. cool-down: the
/// remaining backwards. Peak in-flight min(p-s, m).
Schedule one_f_one_b(int num_stages, int num_microbatches);

/// Megatron's interleaved 1F1B: num_ranks·v stages, stage s on rank s % num_ranks (rank r holds
/// chunks c = 0 … v-1, chunk c being stage c·num_ranks + r). Microbatches go in groups of
/// num_ranks: forward k of a rank (k = 0 … v·m-1) is chunk (k / p) % v of microbatch
/// (k / (p·v))·p + k % p, and backward k is chunk v-1-(k / p) % v of the same microbatch formula.
/// 1. warm-up: all v·m forwards if m == p, else min(2(p-1-r) + (v-1)·p, v·m); 2. steady:
/// forward k, backward k - warm-up; 3. cool-down: the remaining backwards. Throws smp::Error
/// unless num_microbatches is a multiple of num_ranks.
Schedule interleaved_1f1b(int num_ranks, int virtual_stages_per_rank, int num_microbatches);

/// ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2023): 1F1B with every B split into I
/// and W, stage s on rank s. Stage s defers its first s W's to the end, so that its I's start as
/// early as 1F1B's warm-up allows and the deferred W's fill the cool-down bubble:
/// 1. warm-up: p-1-s forwards; 2. s times F, I; 3. F, I, W while forwards remain; 4. I, W while
/// I's remain; 5. the deferred W's (each phase stops early when it runs out of microbatches).
/// Peak in-flight (F done, I not done) min(p-s, m), like 1F1B; at most s+1 W's pending.
Schedule zero_bubble_h1(int num_stages, int num_microbatches);

// ---- lowering, validation, printing -------------------------------------------------------------

/// Duration of each action type in any time unit, all >= 0 and finite. The defaults are the
/// usual model F = 1, B = 2 = I + W, free communication.
struct ActionCosts {
  double forward = 1;          // F
  double full_backward = 2;    // B
  double backward_input = 1;   // I
  double backward_weight = 1;  // W
  double send = 0;             // SEND_F, SEND_B: time the sender is busy
  double recv = 0;             // RECV_F, RECV_B: time the receiver is busy once the data is there
  /// Time from the end of a SEND (or, in a compute-only schedule, of the producing compute
  /// action) until the data is usable on the other rank.
  double latency = 0;

  /// The duration of an action of type `type`.
  double of(ActionType type) const;
};

/// Lowers a valid compute-only schedule: after every compute action whose result another rank
/// needs (F of stage s when stage s+1 is elsewhere, B/I of stage s when stage s-1 is elsewhere) a
/// SEND, and on the consumer's rank the matching RECV before the consumer. Every rank issues its
/// SENDs and RECVs in one global order — by when the message is sent in a simulation of the
/// compute-only schedule under `costs` — so the result cannot deadlock, even under rendezvous
/// sends, and with these costs and free communication it runs exactly as fast as the
/// compute-only schedule (Note [Send/recv order] in csrc/core/schedule.cpp). Idle steps are
/// dropped. The number of microbatches is taken as 1 + the largest one in the schedule. Throws
/// smp::Error when the schedule already holds communication or is not valid
/// (validate_schedule()), or when a compute cost is not > 0.
Schedule add_communication(const Schedule& schedule, const std::vector<int>& stage_to_rank,
                           const ActionCosts& costs = {});

/// Checks a compute-only or lowered schedule of num_stages stages and num_microbatches
/// microbatches, stage s on rank stage_to_rank[s] (one program per rank: schedule.size() ranks):
///   - every action's stage and microbatch are in range and it runs on the rank of its stage;
///     SEND/RECV only between stages on different ranks; no action twice;
///   - every (stage, microbatch) has one F and either one B or one I and one W; a lowered schedule
///     has the SEND and the RECV of every dependency that crosses ranks;
///   - the dependency rules (file comment) hold in program order on each rank;
///   - across ranks, the schedule runs to completion: executing it under the execution model
///     with rendezvous sends (file comment) does not deadlock.
/// Throws smp::Error naming the rank, the step, the action and the rule violated, followed by the
/// rank × step grid (format_grid()) with the failing step(s) marked >like this<. Throws
/// smp::Error without a grid for invalid arguments (counts < 1, stage_to_rank of the wrong size
/// or naming a rank outside the schedule).
void validate_schedule(const Schedule& schedule, int num_stages, int num_microbatches,
                       const std::vector<int>& stage_to_rank);

/// A (rank, step) position in a schedule.
struct Cell {
  int rank = 0;
  int step = 0;
};

/// The schedule as a rank × step grid: a header row of step indices, then one row per rank with
/// one column per step; idle steps print ".", and the cells listed in `marked` print >like this<.
/// Example:
///   step   0    1    2
///   rank 0 0F0  0F1 >0B0<
///   rank 1 .    1F0  1B0
std::string format_grid(const Schedule& schedule, const std::vector<Cell>& marked = {});

// ---- CSV ----------------------------------------------------------------------------------------

/// The schedule in the CSV format of torch.distributed.pipelining's _dump_csv: one row per rank
/// (rank 0 first), one cell per step holding the action's string form, an empty cell for an idle
/// step; rows end in "\r\n" like Python's csv.writer.
std::string to_csv(const Schedule& schedule);

/// Reads what to_csv() or torch's _dump_csv writes (rows end in "\r\n" or "\n"; a blank row is a
/// rank with an empty program; empty or blank cells are idle). from_csv(to_csv(s)) == s. Throws
/// smp::Error naming the row (= rank), the column (= step) and the bad text.
Schedule from_csv(const std::string& text);

// ---- simulation ---------------------------------------------------------------------------------

/// One executed action of a Timeline.
struct TimedAction {
  int rank = 0;
  /// Index of the action in its rank's program (idle steps count).
  int step = 0;
  Action action;
  double start = 0;
  double end = 0;
};

/// The result of simulate().
struct Timeline {
  /// Every action, rank by rank, each rank's in program order.
  std::vector<TimedAction> actions;
  /// Largest end time (0 for an empty schedule).
  double makespan = 0;
  /// 1 - (time spent in F/B/I/W over all ranks) / (ranks × makespan): idle and communication
  /// time as a fraction of the whole; 0 for an empty schedule.
  double bubble_fraction = 0;
  /// Per rank, the largest number of (stage, microbatch) pairs whose F has finished and whose B
  /// (or I) has not: the activations a rank holds at once.
  std::vector<int> peak_in_flight;
};

/// Simulates a compute-only or lowered schedule under the execution model (file comment): each
/// rank runs its program in order (idle steps take no time); an action starts when its rank is
/// free and its dependencies have finished (+ costs.latency across ranks), a RECV ends at
/// max(its start, its SEND's end + latency) + costs.recv. With `rendezvous`, a SEND also waits
/// until the receiving rank has reached the RECV. A RECV blocks its rank (a blocking recv, or
/// irecv + wait at the same point): schedules lowered for runtimes that post non-blocking irecvs
/// early, such as torch's _add_send_recv output, look slower here than they run. The number of
/// stages and microbatches and the stage-to-rank map are read off the schedule. Throws smp::Error
/// when a cost is negative or not finite, when the schedule breaks a rule of validate_schedule()
/// other than the deadlock check, or when the execution deadlocks (the message holds the grid with
/// each blocked rank's step marked and what it waits for).
Timeline simulate(const Schedule& schedule, const ActionCosts& costs = {}, bool rendezvous = false);

/// simulate() with costs per stage: stage s's actions (its compute, and the SENDs and RECVs on
/// its side) take stage_costs[s], for stages whose work differs, such as costs measured per
/// stage from a run. Throws smp::Error when stage_costs does not hold exactly one entry per stage
/// of the schedule, and as simulate().
Timeline simulate(const Schedule& schedule, const std::vector<ActionCosts>& stage_costs,
                  bool rendezvous = false);

}  // namespace smp::schedule
