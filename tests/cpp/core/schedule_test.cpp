#include "smp/schedule.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <optional>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "smp/error.h"

namespace smp::schedule {

// gtest prints actions (and schedules, as vectors of optionals) in their string form.
void PrintTo(const Action& action, std::ostream* out) { *out << to_string(action); }

namespace {

// Cost models of the closed forms (see smp/schedule.h):
//   kUnit       every compute action 1 (F = B = I = W = 1): the grid's own time.
//   kDefault    F = 1, B = 2 = I + W: 1F1B and ZB-H1 do the same work per microbatch.
ActionCosts unit_costs() {
  ActionCosts costs;
  costs.full_backward = 1;
  return costs;
}
const ActionCosts kUnit = unit_costs();
const ActionCosts kDefault{};

constexpr ActionType kAllTypes[] = {
    ActionType::kForward,        ActionType::kFullBackward, ActionType::kBackwardInput,
    ActionType::kBackwardWeight, ActionType::kSendForward,  ActionType::kRecvForward,
    ActionType::kSendBackward,   ActionType::kRecvBackward,
};

Action act(const std::string& text) { return parse_action(text); }

// A schedule from rows of space-separated action strings; "." is an idle step.
Schedule rows(const std::vector<std::string>& lines) {
  Schedule schedule;
  for (const std::string& line : lines) {
    Program& program = schedule.emplace_back();
    std::size_t begin = 0;
    while (begin < line.size()) {
      std::size_t end = line.find(' ', begin);
      if (end == std::string::npos) end = line.size();
      const std::string cell = line.substr(begin, end - begin);
      if (!cell.empty()) {
        program.push_back(cell == "." ? std::nullopt : std::optional<Action>(act(cell)));
      }
      begin = end + 1;
    }
  }
  return schedule;
}

// The message of the smp::Error that `f` throws ("" and a test failure if it does not).
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected smp::Error";
  return "";
}

int count_actions(const Schedule& schedule) {
  int n = 0;
  for (const Program& program : schedule) {
    n += static_cast<int>(std::count_if(program.begin(), program.end(),
                                        [](const std::optional<Action>& a) { return a; }));
  }
  return n;
}

bool has_idle_step(const Schedule& schedule) {
  for (const Program& program : schedule) {
    for (const std::optional<Action>& slot : program) {
      if (!slot) return true;
    }
  }
  return false;
}

bool has_communication(const Schedule& schedule) {
  for (const Program& program : schedule) {
    for (const std::optional<Action>& slot : program) {
      if (slot && is_communication(slot->type)) return true;
    }
  }
  return false;
}

// ---- actions ------------------------------------------------------------------------------------

TEST(ScheduleAction, StringFormOfEveryType) {
  EXPECT_EQ(to_string(Action{1, ActionType::kForward, 0}), "1F0");
  EXPECT_EQ(to_string(Action{0, ActionType::kFullBackward, 3}), "0B3");
  EXPECT_EQ(to_string(Action{2, ActionType::kBackwardInput, 1}), "2I1");
  EXPECT_EQ(to_string(Action{2, ActionType::kBackwardWeight, 1}), "2W1");
  EXPECT_EQ(to_string(Action{1, ActionType::kSendForward, 2}), "1SEND_F2");
  EXPECT_EQ(to_string(Action{0, ActionType::kRecvForward, 3}), "0RECV_F3");
  EXPECT_EQ(to_string(Action{4, ActionType::kSendBackward, 0}), "4SEND_B0");
  EXPECT_EQ(to_string(Action{0, ActionType::kRecvBackward, 3}), "0RECV_B3");
}

TEST(ScheduleAction, RoundTripOfEveryType) {
  for (ActionType type : kAllTypes) {
    EXPECT_EQ(parse_action_type(action_type_name(type)), type);
    EXPECT_NE(is_compute(type), is_communication(type));
    for (int stage : {0, 3, 17, 123456}) {
      for (int microbatch : {0, 9, 10, 99999}) {
        const Action action{stage, type, microbatch};
        const std::string text = to_string(action);
        EXPECT_EQ(parse_action(text), action) << text;
        EXPECT_EQ(to_string(parse_action(text)), text);
      }
    }
  }
  EXPECT_EQ(parse_action("  12SEND_B34\t"), (Action{12, ActionType::kSendBackward, 34}));
}

TEST(ScheduleAction, ParseErrorsNameTheText) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"", "no stage index"},
      {"F0", "no stage index"},
      {"1F", "no microbatch index"},
      {"10", "no action type"},
      {"1X0", "unknown type \"X\""},
      {"1f0", "unknown type \"f\""},
      {"1SEND0", "unknown type \"SEND\""},
      {"1F0x", "unexpected \"x\""},
      {"1F0 2F0", "unexpected"},
      {"-1F0", "no stage index"},
      {"1234567890F0", "too large"},
      {"1REDUCE_GRAD", "REDUCE_GRAD of torch.distributed.pipelining is not supported"},
      {"0UNSHARD", "UNSHARD of torch.distributed.pipelining is not supported"},
      {"(0F0;1B0)OVERLAP_F_B", "OVERLAP_F_B"},
  };
  for (const auto& [text, reason] : cases) {
    const std::string message = error_of([&] { parse_action(text); });
    EXPECT_NE(message.find("invalid action \"" + text + "\""), std::string::npos) << message;
    EXPECT_NE(message.find(reason), std::string::npos) << message;
    EXPECT_NE(message.find("SEND_F, RECV_F, SEND_B, RECV_B"), std::string::npos) << message;
  }
  EXPECT_NE(error_of([] { parse_action_type("Q"); }).find("unknown action type \"Q\""),
            std::string::npos);
}

// ---- generators: the sweep ----------------------------------------------------------------------

// Everything every generated schedule must satisfy; returns the unit-cost timeline.
Timeline check_generated(const std::string& name, const Schedule& compute, int num_stages,
                         int num_microbatches, const std::vector<int>& stage_to_rank) {
  SCOPED_TRACE(name + "\n" + format_grid(compute));
  EXPECT_NO_THROW(validate_schedule(compute, num_stages, num_microbatches, stage_to_rank));
  EXPECT_FALSE(has_communication(compute));

  // The grid is the unit-time timeline: every action starts at its step.
  const Timeline unit = simulate(compute, kUnit);
  for (const TimedAction& t : unit.actions) {
    EXPECT_EQ(t.start, t.step) << to_string(t.action);
    EXPECT_EQ(compute[t.rank][t.step], t.action);
  }
  std::size_t longest = 0;
  for (const Program& program : compute) {
    longest = std::max(longest, program.size());
    EXPECT_TRUE(!program.empty() && program.back()) << "programs end in an action";
  }
  EXPECT_EQ(unit.makespan, static_cast<double>(longest));

  // Lowered: valid, no idle steps, communication exactly where stages change rank; with the
  // costs that ordered its messages it runs exactly like the compute-only schedule.
  const Schedule lowered = add_communication(compute, stage_to_rank);
  EXPECT_NO_THROW(validate_schedule(lowered, num_stages, num_microbatches, stage_to_rank));
  EXPECT_FALSE(has_idle_step(lowered));
  int crossings = 0;
  for (int s = 0; s + 1 < num_stages; ++s) crossings += stage_to_rank[s] != stage_to_rank[s + 1];
  EXPECT_EQ(count_actions(lowered), count_actions(compute) + 4 * crossings * num_microbatches);
  for (const ActionCosts& costs : {kUnit, kDefault}) {
    const Schedule lowered_for = add_communication(compute, stage_to_rank, costs);
    EXPECT_NO_THROW(validate_schedule(lowered_for, num_stages, num_microbatches, stage_to_rank));
    const Timeline expected = simulate(compute, costs);
    const Timeline actual = simulate(lowered_for, costs);
    EXPECT_EQ(actual.makespan, expected.makespan);
    EXPECT_EQ(actual.peak_in_flight, expected.peak_in_flight);
    // Compute actions start when they would without communication.
    for (const TimedAction& t : actual.actions) {
      if (!is_compute(t.action.type)) continue;
      const auto same = std::find_if(expected.actions.begin(), expected.actions.end(),
                                     [&](const TimedAction& e) { return e.action == t.action; });
      EXPECT_TRUE(same != expected.actions.end() && t.start == same->start)
          << to_string(t.action) << " starts at " << t.start;
    }
    // Rendezvous sends cannot deadlock it (validate_schedule checks that too) nor make it faster.
    EXPECT_GE(simulate(lowered_for, costs, /*rendezvous=*/true).makespan, expected.makespan);
  }
  EXPECT_EQ(add_communication(compute, stage_to_rank, kDefault), lowered);  // the default costs
  // Messages ordered for other costs: still valid, never faster.
  EXPECT_GE(simulate(add_communication(compute, stage_to_rank, kUnit), kDefault).makespan,
            simulate(compute, kDefault).makespan);

  // CSV round trips, both kinds.
  EXPECT_EQ(from_csv(to_csv(compute)), compute);
  EXPECT_EQ(from_csv(to_csv(lowered)), lowered);
  return unit;
}

TEST(ScheduleGenerators, GPipeAnd1F1BSweep) {
  for (int p = 1; p <= 8; ++p) {
    for (int m = 1; m <= 16; ++m) {
      SCOPED_TRACE(::testing::Message() << "p=" << p << " m=" << m);
      const std::vector<int> stage_to_rank = round_robin_stage_to_rank(p, p);
      const double bubble = static_cast<double>(p - 1) / (m + p - 1);
      for (const bool is_gpipe : {true, false}) {
        const Schedule compute = is_gpipe ? gpipe(p, m) : one_f_one_b(p, m);
        const Timeline unit =
            check_generated(is_gpipe ? "gpipe" : "1f1b", compute, p, m, stage_to_rank);
        EXPECT_EQ(unit.makespan, 2 * (m + p - 1));
        EXPECT_NEAR(unit.bubble_fraction, bubble, 1e-12);
        const Timeline weighted = simulate(compute, kDefault);  // F = 1, B = 2
        EXPECT_EQ(weighted.makespan, 3 * (m + p - 1));
        EXPECT_NEAR(weighted.bubble_fraction, bubble, 1e-12);
        for (int r = 0; r < p; ++r) {
          EXPECT_EQ(unit.peak_in_flight[r], is_gpipe ? m : std::min(p - r, m)) << "rank " << r;
        }
      }
    }
  }
}

TEST(ScheduleGenerators, InterleavedSweep) {
  for (int v = 1; v <= 3; ++v) {
    for (int p = 1; p <= 8; ++p) {
      for (int m = p; m <= 16; m += p) {
        SCOPED_TRACE(::testing::Message() << "p=" << p << " v=" << v << " m=" << m);
        const int num_stages = p * v;
        const std::vector<int> stage_to_rank = round_robin_stage_to_rank(num_stages, p);
        const Schedule compute = interleaved_1f1b(p, v, m);
        ASSERT_EQ(compute.size(), static_cast<std::size_t>(p));
        const Timeline unit = check_generated("interleaved", compute, num_stages, m, stage_to_rank);
        const double bubble = static_cast<double>(p - 1) / (v * m + p - 1);
        EXPECT_EQ(unit.makespan, 2 * (v * m + p - 1));
        EXPECT_NEAR(unit.bubble_fraction, bubble, 1e-12);
        const Timeline weighted = simulate(compute, kDefault);
        EXPECT_EQ(weighted.makespan, 3 * (v * m + p - 1));
        EXPECT_NEAR(weighted.bubble_fraction, bubble, 1e-12);
        for (int r = 0; r < p; ++r) {
          const int warmup = m == p ? v * m : std::min(2 * (p - 1 - r) + (v - 1) * p, v * m);
          EXPECT_EQ(unit.peak_in_flight[r], std::min(warmup + 1, v * m)) << "rank " << r;
        }
      }
    }
  }
}

TEST(ScheduleGenerators, InterleavedWithOneVirtualStageMatches1F1BBubble) {
  for (int p = 1; p <= 8; ++p) {
    EXPECT_EQ(simulate(interleaved_1f1b(p, 1, 2 * p), kUnit).makespan,
              simulate(one_f_one_b(p, 2 * p), kUnit).makespan);
  }
}

TEST(ScheduleGenerators, ZeroBubbleH1Sweep) {
  for (int p = 1; p <= 8; ++p) {
    for (int m = 1; m <= 16; ++m) {
      SCOPED_TRACE(::testing::Message() << "p=" << p << " m=" << m);
      const Schedule compute = zero_bubble_h1(p, m);
      const Timeline unit =
          check_generated("zb-h1", compute, p, m, round_robin_stage_to_rank(p, p));
      // Same work per microbatch as 1F1B with B = 2 (I = W = 1): compare under kDefault.
      const Timeline zb = simulate(compute, kDefault);
      const Timeline baseline = simulate(one_f_one_b(p, m), kDefault);
      EXPECT_EQ(zb.makespan, unit.makespan);
      EXPECT_LE(zb.bubble_fraction, baseline.bubble_fraction + 1e-12);
      if (m >= p) {
        EXPECT_EQ(zb.makespan, 3 * m + p - 1);
        EXPECT_NEAR(zb.bubble_fraction, static_cast<double>(p - 1) / (3 * m + p - 1), 1e-12);
        if (p >= 2) {
          EXPECT_LT(zb.bubble_fraction, baseline.bubble_fraction);
        }
      }
      for (int r = 0; r < p; ++r) {
        EXPECT_EQ(zb.peak_in_flight[r], std::min(p - r, m)) << "rank " << r;
      }
    }
  }
}

TEST(ScheduleGenerators, GridsLookRight) {
  EXPECT_EQ(one_f_one_b(2, 2), rows({"0F0 0F1 . 0B0 . 0B1", ". 1F0 1B0 1F1 1B1"}));
  EXPECT_EQ(gpipe(2, 2), rows({"0F0 0F1 . . 0B0 0B1", ". 1F0 1F1 1B0 1B1"}));
  // ZB-H1, p = 2: stage 1 defers one W, so its I's reach stage 0 early.
  EXPECT_EQ(zero_bubble_h1(2, 2), rows({"0F0 0F1 . 0I0 0W0 0I1 0W1", ". 1F0 1I0 1F1 1I1 1W0 1W1"}));
  // Interleaved, 2 ranks x 2 chunks (stages 0, 2 on rank 0; 1, 3 on rank 1), 2 microbatches.
  EXPECT_EQ(interleaved_1f1b(2, 2, 2),
            rows({"0F0 0F1 2F0 2F1 . . 2B0 2B1 0B0 0B1", ". 1F0 1F1 3F0 3F1 3B0 3B1 1B0 1B1"}));
}

TEST(ScheduleGenerators, ArgumentErrors) {
  EXPECT_NE(error_of([] { gpipe(0, 1); }).find("gpipe: num_stages must be >= 1, got 0"),
            std::string::npos);
  EXPECT_NE(error_of([] { one_f_one_b(2, 0); }).find("num_microbatches must be >= 1"),
            std::string::npos);
  EXPECT_NE(error_of([] { zero_bubble_h1(-1, 2); }).find("num_stages"), std::string::npos);
  EXPECT_NE(error_of([] { interleaved_1f1b(2, 0, 2); }).find("virtual_stages_per_rank"),
            std::string::npos);
  const std::string message = error_of([] { interleaved_1f1b(4, 2, 6); });
  EXPECT_NE(message.find("num_microbatches must be a multiple of num_ranks"), std::string::npos);
  EXPECT_NE(message.find("num_microbatches=6, num_ranks=4; use num_microbatches=4 or 8"),
            std::string::npos)
      << message;
  EXPECT_NE(error_of([] { interleaved_1f1b(4, 2, 3); }).find("use num_microbatches=4"),
            std::string::npos);
  EXPECT_EQ(round_robin_stage_to_rank(6, 3), (std::vector<int>{0, 1, 2, 0, 1, 2}));
  EXPECT_THROW(round_robin_stage_to_rank(2, 0), Error);
}

// ---- lowering -----------------------------------------------------------------------------------

TEST(ScheduleLowering, OneFOneBOnTwoRanks) {
  const Schedule lowered = add_communication(one_f_one_b(2, 2), {0, 1});
  // Rank 1 receives F1 before it sends B0: see Note [Send/recv order].
  EXPECT_EQ(lowered, rows({"0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
                           "1RECV_F0 1F0 1B0 1RECV_F1 1SEND_B0 1F1 1B1 1SEND_B1"}));
  const Timeline timeline = simulate(lowered);
  EXPECT_EQ(timeline.makespan, 9);
  EXPECT_NEAR(timeline.bubble_fraction, 1.0 / 3, 1e-12);
  EXPECT_EQ(timeline.peak_in_flight, (std::vector<int>{2, 1}));
}

TEST(ScheduleLowering, RecvRightBeforeItsConsumerDeadlocksUnderRendezvous) {
  // The naive order: each RECV right before its consumer. Fine with buffered sends, but rank 0
  // blocks in 0SEND_F1 while rank 1 blocks in 1SEND_B0.
  const Schedule naive = rows({"0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
                               "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1"});
  EXPECT_EQ(simulate(naive).makespan, 9);
  const std::string message = error_of([&] { validate_schedule(naive, 2, 2, {0, 1}); });
  EXPECT_NE(message.find("deadlocks under rendezvous sends"), std::string::npos) << message;
  EXPECT_NE(message.find("rank 0, step 3 (0SEND_F1) waits for rank 1 to reach 1RECV_F1"),
            std::string::npos)
      << message;
  EXPECT_NE(message.find(">0SEND_F1<"), std::string::npos) << message;
  EXPECT_NE(message.find(">1SEND_B0<"), std::string::npos) << message;
  EXPECT_NE(error_of([&] { simulate(naive, kDefault, /*rendezvous=*/true); }).find("deadlocks"),
            std::string::npos);
}

TEST(ScheduleLowering, SameRankStagesNeedNoCommunication) {
  // One rank holding all three chunks: nothing to send.
  const Schedule compute = interleaved_1f1b(1, 3, 2);
  const Schedule lowered = add_communication(compute, {0, 0, 0});
  EXPECT_FALSE(has_communication(lowered));
  EXPECT_EQ(count_actions(lowered), count_actions(compute));
}

TEST(ScheduleLowering, ContiguousStagesPerRank) {
  // Stages 0, 1 on rank 0 and 2, 3 on rank 1 (a hand-written GPipe over 4 stages, 2 ranks).
  const Schedule compute =
      rows({"0F0 1F0 0F1 1F1 . . . . 1B0 0B0 1B1 0B1", ". . 2F0 3F0 2F1 3F1 3B0 2B0 3B1 2B1"});
  const std::vector<int> stage_to_rank = {0, 0, 1, 1};
  ASSERT_NO_THROW(validate_schedule(compute, 4, 2, stage_to_rank));
  const Schedule lowered = add_communication(compute, stage_to_rank);
  EXPECT_NO_THROW(validate_schedule(lowered, 4, 2, stage_to_rank));
  EXPECT_EQ(count_actions(lowered), count_actions(compute) + 4 * 2);
  EXPECT_EQ(simulate(lowered, kUnit).makespan, simulate(compute, kUnit).makespan);
}

TEST(ScheduleLowering, Errors) {
  const Schedule lowered = add_communication(gpipe(2, 1), {0, 1});
  ActionCosts free_backward;
  free_backward.full_backward = 0;
  EXPECT_NE(error_of([] {
              add_communication(gpipe(2, 1), {0, 1}, ActionCosts{0});
            }).find("compute costs must be > 0"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              add_communication(gpipe(2, 1), {0, 1}, free_backward);
            }).find("got 0 for B"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              add_communication(lowered, {0, 1});
            }).find("already holds 0SEND_F0; pass a compute-only schedule"),
            std::string::npos);
  // Invalid input is reported by the validator, grid included.
  const std::string message = error_of([] {
    add_communication(rows({"0F0 0B0", "1B0 1F0"}), {0, 1});
  });
  EXPECT_NE(message.find("invalid schedule"), std::string::npos);
  EXPECT_NE(message.find(">1B0<"), std::string::npos) << message;
}

// ---- validation ---------------------------------------------------------------------------------

TEST(ScheduleValidate, SwappedActionsAreCaughtWithTheGrid) {
  Schedule schedule = one_f_one_b(4, 8);
  ASSERT_NO_THROW(validate_schedule(schedule, 4, 8, {0, 1, 2, 3}));
  // Rank 2 runs 2F0 at step 2 and 2B0 at step 5: swap them.
  ASSERT_EQ(schedule[2][2], act("2F0"));
  ASSERT_EQ(schedule[2][5], act("2B0"));
  std::swap(schedule[2][2], schedule[2][5]);
  const std::string message = error_of([&] { validate_schedule(schedule, 4, 8, {0, 1, 2, 3}); });
  EXPECT_NE(message.find("invalid schedule: rank 2, step 2: 2B0 runs before 2F0 (step 5), its "
                         "forward"),
            std::string::npos)
      << message;
  // The whole grid, one row per rank, with the failing cell marked.
  EXPECT_NE(message.find("step   0    1    2"), std::string::npos) << message;
  for (const char* row : {"\nrank 0 0F0  0F1  0F2  0F3", "\nrank 1 .    1F0  1F1  1F2",
                          "\nrank 2 .    .   >2B0< 2F1", "\nrank 3 .    .    .    3F0"}) {
    EXPECT_NE(message.find(row), std::string::npos) << row << "\n" << message;
  }
  EXPECT_NE(message.find(">x< marks the failing step"), std::string::npos);
}

TEST(ScheduleValidate, SwapAcrossRanksDeadlocks) {
  // Rank 0 waits in 0B0 for 1B0; rank 1 runs 1F1 first, which waits for 0F1 after 0B0.
  const Schedule schedule = rows({"0F0 0B0 0F1 0B1", "1F0 1F1 1B0 1B1"});
  const std::string message = error_of([&] { validate_schedule(schedule, 2, 2, {0, 1}); });
  EXPECT_NE(message.find("the schedule deadlocks: no rank can proceed"), std::string::npos)
      << message;
  EXPECT_NE(message.find("rank 0, step 1 (0B0) waits for 1B0 (rank 1, step 2)"), std::string::npos)
      << message;
  EXPECT_NE(message.find("rank 1, step 1 (1F1) waits for 0F1 (rank 0, step 2)"), std::string::npos)
      << message;
  EXPECT_NE(message.find("rank 0 0F0 >0B0< 0F1"), std::string::npos) << message;
  EXPECT_NE(message.find("rank 1 1F0 >1F1< 1B0"), std::string::npos) << message;
}

TEST(ScheduleValidate, SwappedSendAndRecvDeadlock) {
  Schedule lowered = add_communication(one_f_one_b(2, 2), {0, 1});
  ASSERT_EQ(lowered[1][3], act("1RECV_F1"));
  ASSERT_EQ(lowered[1][4], act("1SEND_B0"));
  std::swap(lowered[1][3], lowered[1][4]);
  const std::string message = error_of([&] { validate_schedule(lowered, 2, 2, {0, 1}); });
  EXPECT_NE(message.find("deadlocks under rendezvous sends"), std::string::npos) << message;
  EXPECT_NE(message.find(">1SEND_B0<"), std::string::npos) << message;
}

TEST(ScheduleValidate, EachRule) {
  const std::vector<int> two = {0, 1};
  const auto message = [&](const std::vector<std::string>& lines, int num_microbatches = 1,
                           const std::vector<int>& stage_to_rank = {0, 1}) {
    return error_of([&] { validate_schedule(rows(lines), 2, num_microbatches, stage_to_rank); });
  };
  const auto contains = [](const std::string& text, const std::string& part) {
    return text.find(part) != std::string::npos;
  };
  EXPECT_NO_THROW(validate_schedule(rows({"0F0 . . 0B0", ". 1F0 1B0"}), 2, 1, two));
  EXPECT_NO_THROW(validate_schedule(rows({"0F0 . . 0I0 0W0", ". 1F0 1I0 1W0"}), 2, 1, two));
  // A mix of B and I/W across stages is fine.
  EXPECT_NO_THROW(validate_schedule(rows({"0F0 . . 0B0", ". 1F0 1I0 1W0"}), 2, 1, two));

  std::string m = message({"0F0 . . 0B0", ". 2F0 1F0 1B0"});
  EXPECT_TRUE(contains(m, "rank 1, step 1: 2F0 names stage 2, outside [0, 2)")) << m;
  EXPECT_TRUE(contains(m, ">2F0<")) << m;
  m = message({"0F0 . . 0B0", ". 1F0 1B0 1F1"});
  EXPECT_TRUE(contains(m, "1F1 names microbatch 1, outside [0, 1)")) << m;
  m = message({"0F0 1F0 . 0B0", ". . 1B0"});
  EXPECT_TRUE(contains(m, "rank 0, step 1: 1F0 runs on rank 0, but stage 1 is on rank 1")) << m;
  m = message({"0F0 . . 0B0 0F0", ". 1F0 1B0"});
  EXPECT_TRUE(contains(m, "0F0 appears twice: at rank 0, step 0 and at rank 0, step 4")) << m;
  EXPECT_TRUE(contains(m, ">0F0<") && contains(m, ">0B0<") == false) << m;
  m = message({"0F0 . . 0B0", ". . 1B0"});
  EXPECT_TRUE(contains(m, "1F0 is missing (it belongs on rank 1)")) << m;
  m = message({"0F0", ". 1F0 1B0"});
  EXPECT_TRUE(contains(m, "0B0 is missing (it belongs on rank 0)")) << m;
  m = message({"0F0 . . 0I0", ". 1F0 1B0"});
  EXPECT_TRUE(contains(m, "0W0 is missing")) << m;
  m = message({"0F0 . . 0W0", ". 1F0 1B0"});
  EXPECT_TRUE(contains(m, "0I0 is missing")) << m;
  m = message({"0F0 . . 0B0 0W0", ". 1F0 1B0"});
  EXPECT_TRUE(contains(m, "0B0 and 0W0 both present")) << m;
  m = message({"0F0 . . 0W0 0I0", ". 1F0 1B0"});
  EXPECT_TRUE(contains(m, "0W0 runs before 0I0 (step 4), its input-gradient half")) << m;
  m = message({"0F0 . . 0B0", ". 1B0 1F0"});
  EXPECT_TRUE(contains(m, "1B0 runs before 1F0 (step 2), its forward")) << m;
  // Stages 0 and 1 on one rank: program order is the dependency.
  m = message({"1F0 0F0 0B0 1B0"}, 1, {0, 0});
  EXPECT_TRUE(contains(m, "1F0 runs before 0F0 (step 1), the forward of the previous stage")) << m;
  m = message({"0F0 1F0 0B0 1B0"}, 1, {0, 0});
  EXPECT_TRUE(contains(m, "0B0 runs before 1B0 (step 3), the backward of the next stage")) << m;
  // Lowered schedules.
  m = message({"0F0 0SEND_F0 0B0", "1RECV_F0 1F0 1B0"});
  EXPECT_TRUE(contains(m, "1SEND_B0 is missing (it belongs on rank 1): the schedule is lowered"))
      << m;
  m = message({"0F0 0SEND_F0 0RECV_B0 0B0", "1F0 1RECV_F0 1B0 1SEND_B0"});
  EXPECT_TRUE(contains(m, "1F0 runs before 1RECV_F0 (step 1), the receive of its input")) << m;
  m = message({"0SEND_F0 0F0 0RECV_B0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0"});
  EXPECT_TRUE(contains(m, "0SEND_F0 runs before 0F0 (step 1), the forward whose output it sends"))
      << m;
  m = message({"0F0 0SEND_F0 0B0 0RECV_B0", "1RECV_F0 1F0 1B0 1SEND_B0"});
  EXPECT_TRUE(contains(m, "0B0 runs before 0RECV_B0 (step 3), the receive of its output gradient"))
      << m;
  m = message({"0F0 0SEND_F0 0B0 0SEND_B0"}, 1, {0, 0});
  EXPECT_TRUE(contains(m, "0SEND_F0 is not needed: stages 0 and 1 are both on rank 0")) << m;
  m = message({"0F0 0RECV_F0 . 0B0", ". 1F0 1B0"});
  EXPECT_TRUE(contains(m, "0RECV_F0 has no peer: stage 0 is the first stage")) << m;

  // Arguments.
  EXPECT_TRUE(contains(error_of([] { validate_schedule({}, 0, 1, {}); }), "num_stages must be"));
  EXPECT_TRUE(
      contains(error_of([] { validate_schedule({{}}, 1, 0, {0}); }), "num_microbatches must be"));
  EXPECT_TRUE(contains(error_of([] { validate_schedule({{}}, 2, 1, {0}); }),
                       "stage_to_rank must have one entry per stage (2), got 1"));
  EXPECT_TRUE(contains(error_of([] { validate_schedule({{}}, 1, 1, {1}); }),
                       "stage_to_rank[0] = 1 is not a rank of the schedule (1 ranks"));
}

TEST(ScheduleValidate, FormatGrid) {
  const Schedule schedule = one_f_one_b(2, 2);
  EXPECT_EQ(format_grid(schedule),
            "step   0    1    2    3    4    5\n"
            "rank 0 0F0  0F1  .    0B0  .    0B1\n"
            "rank 1 .    1F0  1B0  1F1  1B1\n");
  EXPECT_EQ(format_grid(schedule, {Cell{1, 2}, Cell{0, 0}}),
            "step   0    1    2    3    4    5\n"
            "rank 0>0F0< 0F1  .    0B0  .    0B1\n"
            "rank 1 .    1F0 >1B0< 1F1  1B1\n");
  EXPECT_EQ(format_grid({}), "step\n");
  EXPECT_EQ(format_grid({{}, {std::nullopt}}), "step   0\nrank 0\nrank 1 .\n");
}

// ---- CSV ----------------------------------------------------------------------------------------

TEST(ScheduleCsv, TorchFormat) {
  const Schedule schedule = one_f_one_b(2, 2);
  const std::string csv = "0F0,0F1,,0B0,,0B1\r\n,1F0,1B0,1F1,1B1\r\n";
  EXPECT_EQ(to_csv(schedule), csv);
  EXPECT_EQ(from_csv(csv), schedule);
  // "\n" line ends, spaces, quoted cells and a missing final line end read the same.
  EXPECT_EQ(from_csv("0F0, 0F1,\"\",0B0,,0B1\n,1F0,1B0,1F1,1B1"), schedule);
  // Python's csv.writer writes an empty row as "" and a row of one empty cell as "\"\"".
  const Schedule odd = {{}, {std::nullopt}, {act("0F0"), std::nullopt}};
  EXPECT_EQ(to_csv(odd), "\r\n\"\"\r\n0F0,\r\n");
  EXPECT_EQ(from_csv(to_csv(odd)), odd);
  EXPECT_EQ(from_csv(""), Schedule{});
  EXPECT_EQ(to_csv({}), "");
  const Schedule lowered = add_communication(schedule, {0, 1});
  EXPECT_EQ(to_csv(lowered),
            "0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0B0,0RECV_B1,0B1\r\n"
            "1RECV_F0,1F0,1B0,1RECV_F1,1SEND_B0,1F1,1B1,1SEND_B1\r\n");
}

TEST(ScheduleCsv, ErrorsNameRowAndCell) {
  const std::string message = error_of([] { from_csv("0F0,0F1\r\n,1F0,1Q0\r\n"); });
  EXPECT_NE(message.find("CSV row 2 (rank 1), cell 3 (step 2): invalid action \"1Q0\""),
            std::string::npos)
      << message;
}

// ---- simulation ---------------------------------------------------------------------------------

TEST(ScheduleSimulate, TimelineOfALoweredSchedule) {
  const Schedule lowered = add_communication(gpipe(2, 1), {0, 1});
  ActionCosts costs;  // F = 1, B = 2
  costs.latency = 0.5;
  costs.send = 0.25;
  const Timeline timeline = simulate(lowered, costs);
  // 0F0 [0, 1], 0SEND_F0 [1, 1.25], 1RECV_F0 [0, 1.75], 1F0 [1.75, 2.75], 1B0 [2.75, 4.75],
  // 1SEND_B0 [4.75, 5], 0RECV_B0 [1.25, 5.5], 0B0 [5.5, 7.5].
  ASSERT_EQ(timeline.actions.size(), 8u);
  const auto at = [&](const std::string& text) {
    for (const TimedAction& t : timeline.actions) {
      if (t.action == act(text)) return std::make_pair(t.start, t.end);
    }
    ADD_FAILURE() << text;
    return std::make_pair(-1.0, -1.0);
  };
  EXPECT_EQ(at("0F0"), std::make_pair(0.0, 1.0));
  EXPECT_EQ(at("0SEND_F0"), std::make_pair(1.0, 1.25));
  EXPECT_EQ(at("1RECV_F0"), std::make_pair(0.0, 1.75));
  EXPECT_EQ(at("1F0"), std::make_pair(1.75, 2.75));
  EXPECT_EQ(at("1B0"), std::make_pair(2.75, 4.75));
  EXPECT_EQ(at("0RECV_B0"), std::make_pair(1.25, 5.5));
  EXPECT_EQ(at("0B0"), std::make_pair(5.5, 7.5));
  EXPECT_EQ(timeline.makespan, 7.5);
  EXPECT_NEAR(timeline.bubble_fraction, 1 - 6.0 / (2 * 7.5), 1e-12);
  EXPECT_EQ(timeline.peak_in_flight, (std::vector<int>{1, 1}));
  // Rank by rank, program order, steps as in the schedule.
  EXPECT_EQ(timeline.actions[0].rank, 0);
  EXPECT_EQ(timeline.actions[4].rank, 1);
  EXPECT_EQ(timeline.actions[4].step, 0);
  // Compute-only: the latency applies to the cross-rank dependency itself.
  costs.send = 0;
  EXPECT_EQ(simulate(gpipe(2, 1), costs).makespan, simulate(lowered, costs).makespan);
}

TEST(ScheduleSimulate, RendezvousSendWaitsForTheReceiver) {
  // Rank 1 is busy (1F0, 1B0 of microbatch 0) before it reaches 1RECV_F1.
  const Schedule lowered = add_communication(one_f_one_b(2, 2), {0, 1});
  const Timeline buffered = simulate(lowered, kDefault);
  const Timeline rendezvous = simulate(lowered, kDefault, /*rendezvous=*/true);
  const auto start_of = [](const Timeline& t, const std::string& text) {
    for (const TimedAction& a : t.actions) {
      if (a.action == act(text)) return a.start;
    }
    return -1.0;
  };
  EXPECT_EQ(start_of(buffered, "0SEND_F1"), 2);
  EXPECT_EQ(start_of(rendezvous, "0SEND_F1"), 4);  // 1RECV_F1 is reached at 4
  EXPECT_EQ(rendezvous.makespan, buffered.makespan);
}

TEST(ScheduleSimulate, CostsPerStage) {
  // The same costs for every stage simulate like the single-costs form.
  for (const Schedule& compute : {one_f_one_b(4, 8), zero_bubble_h1(3, 6), gpipe(2, 3)}) {
    const int stages = static_cast<int>(compute.size());
    const Timeline one = simulate(compute, kDefault);
    const Timeline each = simulate(compute, std::vector<ActionCosts>(stages, kDefault));
    EXPECT_EQ(each.makespan, one.makespan);
    EXPECT_EQ(each.bubble_fraction, one.bubble_fraction);
    EXPECT_EQ(each.peak_in_flight, one.peak_in_flight);
  }
  // A slower last stage runs back to back once its first input is there:
  // makespan = F0 + m (F1 + B1) + B0 for 1F1B on two stages.
  ActionCosts first;  // F = 1, B = 2
  ActionCosts last;
  last.forward = 2;
  last.full_backward = 4;
  for (int m = 1; m <= 8; ++m) {
    SCOPED_TRACE(m);
    EXPECT_EQ(simulate(one_f_one_b(2, m), {first, last}).makespan, 1 + m * 6 + 2);
    // Lowered, with each side's send and receive costs.
    ActionCosts first_comm = first;
    first_comm.send = 0.5;
    EXPECT_EQ(simulate(add_communication(one_f_one_b(2, m), {0, 1}), {first_comm, last}).makespan,
              1 + 0.5 + m * 6 + 2);
  }
  EXPECT_NE(error_of([] {
              simulate(one_f_one_b(3, 4), std::vector<ActionCosts>(2));
            }).find("2 per-stage costs for a schedule of 3 stages"),
            std::string::npos);
  ActionCosts negative;
  negative.forward = -1;
  EXPECT_THROW(simulate(one_f_one_b(2, 4), {kDefault, negative}), Error);
}

TEST(ScheduleSimulate, EdgeCasesAndErrors) {
  EXPECT_EQ(simulate({}).makespan, 0);
  const Timeline idle = simulate({{}, {std::nullopt}});
  EXPECT_EQ(idle.makespan, 0);
  EXPECT_EQ(idle.bubble_fraction, 0);
  EXPECT_EQ(idle.peak_in_flight, (std::vector<int>{0, 0}));
  ActionCosts negative;
  negative.recv = -1;
  EXPECT_NE(error_of([] {
              ActionCosts c;
              c.latency = std::nan("");
              simulate(gpipe(1, 1), c);
            }).find("latency must be finite and >= 0"),
            std::string::npos);
  EXPECT_THROW(simulate(gpipe(1, 1), negative), Error);
  // A stage on two ranks; a missing stage; a deadlock.
  EXPECT_NE(error_of([] {
              simulate(rows({"0F0 0B0", "0F1 0B1"}));
            }).find("stage 0 has actions on rank 0 and on rank 1"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              simulate(rows({"0F0 0B0", "2F0 2B0"}));
            }).find("stage 1 has no actions"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              simulate(rows({"0F0 0B0 0F1 0B1", "1F0 1F1 1B0 1B1"}));
            }).find("the schedule deadlocks"),
            std::string::npos);
  // A compact (idle steps removed) compute-only schedule simulates like its grid.
  Schedule compact = one_f_one_b(4, 8);
  for (Program& program : compact) {
    program.erase(std::remove(program.begin(), program.end(), std::nullopt), program.end());
  }
  EXPECT_NO_THROW(validate_schedule(compact, 4, 8, {0, 1, 2, 3}));
  EXPECT_EQ(simulate(compact, kUnit).makespan, simulate(one_f_one_b(4, 8), kUnit).makespan);
  EXPECT_EQ(add_communication(compact, {0, 1, 2, 3}),
            add_communication(one_f_one_b(4, 8), {0, 1, 2, 3}));
}

}  // namespace
}  // namespace smp::schedule
