#include "smp/server_policy.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "smp/error.h"

namespace smp {
namespace {

constexpr PipelineKind kSimple = PipelineKind::kSimple;
constexpr PipelineKind kInterleaved = PipelineKind::kInterleaved;
constexpr PipelineKind kStatic = PipelineKind::kStatic;

// ---- scripts: a stream of events and the tasks next() must return ------------------------------
//
// A script is a string of space-separated tokens, one per call, applied in order:
//   "+Q1#5"  push(kServeRequest, 1, 5)   ("+R…" resume, "+B…" backward)
//   "Q1#5"   next() must return that task ("S2" is the start of microbatch 2, whose id is 2)
//   "-"      next() must return nullopt
//   "fwd1"   on_forward_done(1)
//   "fin1"   on_microbatch_finished(1)

char kind_letter(TaskKind kind) {
  switch (kind) {
    case TaskKind::kStartMicrobatch:
      return 'S';
    case TaskKind::kServeRequest:
      return 'Q';
    case TaskKind::kResume:
      return 'R';
    case TaskKind::kBackward:
      return 'B';
  }
  return '?';
}

TaskKind kind_of_letter(char letter) {
  switch (letter) {
    case 'S':
      return TaskKind::kStartMicrobatch;
    case 'Q':
      return TaskKind::kServeRequest;
    case 'R':
      return TaskKind::kResume;
    case 'B':
      return TaskKind::kBackward;
    default:
      ADD_FAILURE() << "bad task letter " << letter;
      return TaskKind::kResume;
  }
}

// "Q1#5" for a request; a start prints without its id ("S2").
std::string label(const std::optional<Task>& task) {
  if (!task) return "-";
  std::string s = fmt::format("{}{}", kind_letter(task->kind), task->microbatch);
  if (task->kind != TaskKind::kStartMicrobatch) s += fmt::format("#{}", task->id);
  return s;
}

// Parses "Q1#5" (kind, microbatch, id); the id of a start is its microbatch.
void parse_task(const std::string& token, TaskKind* kind, int* microbatch, int64_t* id) {
  *kind = kind_of_letter(token.at(0));
  const size_t hash = token.find('#');
  *microbatch = std::stoi(token.substr(1, hash - 1));
  *id = hash == std::string::npos ? *microbatch : std::stoll(token.substr(hash + 1));
}

// Runs the script; returns what next() returned, one label per expectation token, so a test can
// compare the whole sequence at once.
std::vector<std::string> run_script(ServerPolicy& policy, const std::string& script,
                                    std::vector<std::string>* expected) {
  std::vector<std::string> got;
  std::istringstream tokens(script);
  for (std::string token; tokens >> token;) {
    if (token.rfind("fwd", 0) == 0) {
      policy.on_forward_done(std::stoi(token.substr(3)));
    } else if (token.rfind("fin", 0) == 0) {
      policy.on_microbatch_finished(std::stoi(token.substr(3)));
    } else if (token[0] == '+') {
      TaskKind kind;
      int microbatch;
      int64_t id;
      parse_task(token.substr(1), &kind, &microbatch, &id);
      policy.push(kind, microbatch, id);
    } else {
      expected->push_back(token);
      got.push_back(label(policy.next()));
    }
  }
  return got;
}

struct ScriptCase {
  std::string name;
  PipelineKind kind;
  int num_microbatches;
  int active_microbatches;
  bool is_leader;
  std::string script;  // tokens separated by spaces
};

const std::vector<ScriptCase>& script_cases() {
  // clang-format off
  static const std::vector<ScriptCase> cases = {
      // Interleaved leader: resume > backward > request > start (while in flight < active).
      {"InterleavedLeaderPriorities", kInterleaved, 4, 2, true,
       "S0 S1 -"                           // 2 in flight: no third start
       " +Q0#20 +R0#10 R0#10 Q0#20 -"      // resume before request
       " fwd0 +R1#11 +Q1#21 +B0#30"        // one of each, pushed in reverse
       " R1#11 B0#30 Q1#21 -"
       " fin0 S2 -"                        // a slot frees: the next start
       " fwd1 +B1#31 B1#31 fin1 S3 -"},
      // Backward: lowest microbatch first, then FIFO; it overtakes older requests.
      {"InterleavedBackwardLowestMicrobatchThenFifo", kInterleaved, 3, 3, true,
       "S0 S1 S2 fwd0 fwd2 +Q1#1 +B2#2 +B0#3 +B2#4 +B0#5 B0#3 B0#5 B2#2 B2#4 Q1#1 -"},
      // Resumes and requests are FIFO, whatever their microbatch.
      {"InterleavedFifoWithinClass", kInterleaved, 3, 3, true,
       "S0 S1 S2 +R2#1 +R0#2 +R1#3 +Q1#4 +Q0#5 R2#1 R0#2 R1#3 Q1#4 Q0#5 -"},
      // active = 1: one microbatch at a time, start to finish.
      {"InterleavedActiveOne", kInterleaved, 2, 1, true,
       "S0 - +R0#1 R0#1 fwd0 +B0#2 B0#2 - fin0 S1 - +R1#3 R1#3 fin1 -"},
      // Non-leaders never start anything; same priorities.
      {"InterleavedNonLeader", kInterleaved, 4, 2, false,
       "- +Q0#1 +Q1#2 +R0#3 +B0#4 +B3#5 R0#3 B0#4 B3#5 Q0#1 Q1#2 -"},
      // Simple leader: every start at once (active ignored), forward-type first, backwards held
      // until every microbatch is forward done, then lowest microbatch first.
      {"SimpleLeaderAllForwardsThenBackwards", kSimple, 3, 1, true,
       "S0 S1 S2 - +R0#1 R0#1 fwd0 +B0#2 -"  // held: 1 and 2 in forward
       " +R2#3 R2#3 fwd2 +B2#4 -"            // held: 1 in forward
       " +R1#5 +Q0#6 R1#5 Q0#6 fwd1"
       " +B1#7 +Q2#8 Q2#8"                   // forward work first
       " B0#2 B1#7 B2#4 -"},
      // Forward-type order in simple: resume > request > start.
      {"SimpleLeaderForwardOrder", kSimple, 3, 3, true,
       "S0 +Q0#1 +R0#2 R0#2 Q0#1 S1 S2 -"},
      // A microbatch that finishes without model.backward counts as forward done.
      {"SimpleLeaderFinishedCountsAsForwardDone", kSimple, 2, 2, true,
       "S0 S1 +R0#1 R0#1 fin0 +R1#2 R1#2 fwd1 +B1#3 B1#3 fin1 -"},
      // Simple non-leader: a backward runs whenever no forward-type task is queued.
      {"SimpleNonLeader", kSimple, 4, 2, false,
       "+B0#1 +Q1#2 Q1#2 B0#1 - +B1#3 +R2#4 +Q3#5 R2#4 Q3#5 B1#3 -"},
  };
  // clang-format on
  return cases;
}

TEST(ServerPolicyTest, Scripts) {
  for (const ScriptCase& c : script_cases()) {
    SCOPED_TRACE(c.name);
    ServerPolicy policy(c.kind, c.num_microbatches, c.active_microbatches, c.is_leader);
    std::vector<std::string> expected;
    const std::vector<std::string> got = run_script(policy, c.script, &expected);
    EXPECT_EQ(got, expected) << policy.describe();
  }
}

TEST(ServerPolicyTest, SequenceNumbersFollowArrival) {
  ServerPolicy leader(kInterleaved, 2, 2, true);
  EXPECT_EQ(*leader.next(), (Task{TaskKind::kStartMicrobatch, 0, 0, 0}));
  const Task resume = leader.push(TaskKind::kResume, 0, 42);
  EXPECT_EQ(resume, (Task{TaskKind::kResume, 0, 42, 1}));
  // A start takes its number when handed out, after the queued resume.
  EXPECT_EQ(*leader.next(), resume);
  EXPECT_EQ(*leader.next(), (Task{TaskKind::kStartMicrobatch, 1, 1, 2}));
  // A rejected push consumes no number.
  EXPECT_THROW(leader.push(TaskKind::kBackward, 1, 7), Error);
  EXPECT_EQ(leader.push(TaskKind::kServeRequest, 1, 8).sequence, 3);
}

TEST(ServerPolicyTest, Accessors) {
  ServerPolicy leader(kInterleaved, 3, 2, true);
  EXPECT_EQ(leader.kind(), kInterleaved);
  EXPECT_EQ(leader.num_microbatches(), 3);
  EXPECT_EQ(leader.active_microbatches(), 2);
  EXPECT_TRUE(leader.is_leader());
  EXPECT_FALSE(leader.all_finished());
  leader.next();
  leader.next();
  EXPECT_EQ(leader.num_in_flight(), 2);
  EXPECT_EQ(leader.num_started(), 2);
  leader.push(TaskKind::kResume, 1, 5);
  leader.push(TaskKind::kServeRequest, 0, 6);
  EXPECT_EQ(leader.num_queued(), 2u);
  leader.next();
  leader.next();
  leader.on_microbatch_finished(0);
  leader.on_microbatch_finished(1);
  EXPECT_EQ(leader.num_in_flight(), 0);
  leader.next();
  leader.on_microbatch_finished(2);
  EXPECT_TRUE(leader.all_finished());
  EXPECT_FALSE(leader.next().has_value());

  ServerPolicy other(kSimple, 3, 3, false);
  EXPECT_TRUE(other.all_finished());
  other.push(TaskKind::kBackward, 2, 1);
  EXPECT_FALSE(other.all_finished());
  EXPECT_EQ(other.num_in_flight(), 0);
  other.next();
  EXPECT_TRUE(other.all_finished());
}

TEST(ServerPolicyTest, NamesAndParsing) {
  EXPECT_EQ(parse_pipeline_kind("simple"), kSimple);
  EXPECT_EQ(parse_pipeline_kind("interleaved"), kInterleaved);
  EXPECT_STREQ(pipeline_kind_name(kSimple), "simple");
  EXPECT_STREQ(pipeline_kind_name(kInterleaved), "interleaved");
  EXPECT_STREQ(task_kind_name(TaskKind::kStartMicrobatch), "start");
  EXPECT_STREQ(task_kind_name(TaskKind::kServeRequest), "request");
  EXPECT_STREQ(task_kind_name(TaskKind::kResume), "resume");
  EXPECT_STREQ(task_kind_name(TaskKind::kBackward), "backward");
  EXPECT_EQ((Task{TaskKind::kBackward, 1, 7, 5}).to_string(), "backward(mb=1, id=7, seq=5)");
}

TEST(ServerPolicyTest, DescribeListsLifecycleAndQueues) {
  ServerPolicy leader(kSimple, 3, 3, true);
  leader.next();
  leader.next();
  leader.on_forward_done(0);
  leader.push(TaskKind::kBackward, 0, 9);
  leader.push(TaskKind::kResume, 1, 4);
  EXPECT_EQ(leader.describe(),
            "ServerPolicy(simple, leader, microbatches=3, active=3): started 2/3, in forward {1}, "
            "forward done {0}, finished 0 (backwards held until every microbatch is forward done); "
            "queued 2: resume [resume(mb=1, id=4, seq=3)] request [] "
            "backward [backward(mb=0, id=9, seq=2)]");
  leader.next();  // the resume
  leader.next();  // the last start
  leader.on_forward_done(1);
  leader.on_forward_done(2);
  EXPECT_EQ(leader.describe().find("held"), std::string::npos) << leader.describe();

  ServerPolicy other(kInterleaved, 2, 1, false);
  other.push(TaskKind::kServeRequest, 1, 3);
  EXPECT_EQ(
      other.describe(),
      "ServerPolicy(interleaved, non-leader, microbatches=2, active=1); queued 1: backward [] "
      "resume [] request [request(mb=1, id=3, seq=0)]");
}

// Same calls, same tasks: two policies fed one random (but valid) stream answer identically, and
// both agree with a brute-force oracle of the rules in the header.
class Oracle {
 public:
  Oracle(PipelineKind kind, int n, int active, bool leader, int deferred = 0)
      : kind_(kind), n_(n), active_(active), leader_(leader), deferred_(deferred), phase_(n, 0) {}

  void push(TaskKind kind, int m, int64_t id) { queued_.push_back({kind, m, id, seq_++}); }

  std::optional<Task> next() {
    const bool interleaved = kind_ == PipelineKind::kInterleaved;
    std::set<int> weight_microbatches;
    for (const Task& t : queued_) {
      if (t.kind == TaskKind::kWeight) weight_microbatches.insert(t.microbatch);
    }
    const bool overflow = static_cast<int>(weight_microbatches.size()) > deferred_;
    // Rank of a task's class under the policy (lower runs first); -1: may not run now.
    // Interleaved: resume 0, backward 2, weight beyond the limit 3, request 4, start 6,
    // weight 8. Simple: resume 0, request 2, start 4, backward 6, weight 8.
    auto klass = [&](const Task& t) {
      switch (t.kind) {
        case TaskKind::kBackward: {
          if (interleaved) return 2;
          const bool all_done =
              std::count_if(phase_.begin(), phase_.end(), [](int p) { return p >= 2; }) == n_;
          return (!leader_ || all_done) ? 6 : -1;
        }
        case TaskKind::kResume:
          return 0;
        case TaskKind::kServeRequest:
          return interleaved ? 4 : 2;
        case TaskKind::kWeight:
          return interleaved && overflow ? 3 : 8;
        default:
          return -1;
      }
    };
    std::optional<size_t> best;
    for (size_t i = 0; i < queued_.size(); ++i) {
      const Task& t = queued_[i];
      if (klass(t) < 0) continue;
      if (!best) {
        best = i;
        continue;
      }
      const Task& b = queued_[*best];
      auto key = [&](const Task& x) {
        return std::make_tuple(klass(x), x.kind == TaskKind::kBackward ? x.microbatch : 0,
                               x.sequence);
      };
      if (key(t) < key(b)) best = i;
    }
    const int start_class = interleaved ? 6 : 4;
    const bool can_start = leader_ && started_ < n_ &&
                           (kind_ == PipelineKind::kSimple || started_ - finished_ < active_);
    if (can_start && (!best || klass(queued_[*best]) > start_class)) {
      phase_[started_] = 1;
      ++started_;
      return Task{TaskKind::kStartMicrobatch, started_ - 1, started_ - 1, seq_++};
    }
    if (!best) return std::nullopt;
    const Task t = queued_[*best];
    queued_.erase(queued_.begin() + static_cast<long>(*best));
    return t;
  }

  void forward_done(int m) { phase_[m] = std::max(phase_[m], 2); }
  void finished(int m) {
    phase_[m] = 3;
    ++finished_;
  }
  // 0 not started, 1 forward, 2 forward done, 3 finished
  int phase(int m) const { return phase_[m]; }
  bool has_queued(int m) const {
    return std::any_of(queued_.begin(), queued_.end(),
                       [m](const Task& t) { return t.microbatch == m; });
  }

 private:
  PipelineKind kind_;
  int n_;
  int active_;
  bool leader_;
  int deferred_;
  std::vector<int> phase_;
  std::vector<Task> queued_;
  int64_t seq_ = 0;
  int started_ = 0;
  int finished_ = 0;
};

TEST(ServerPolicyTest, RandomStreamsAreDeterministicAndMatchTheOracle) {
  std::mt19937 rng(1234);
  std::map<std::pair<PipelineKind, TaskKind>, int> handed_out;
  for (int trial = 0; trial < 400; ++trial) {
    const PipelineKind kind = trial % 2 ? kSimple : kInterleaved;
    const bool leader = (trial / 2) % 2 == 0;
    const int n = 1 + static_cast<int>(rng() % 6);
    const int active = 1 + static_cast<int>(rng() % n);
    const int deferred = static_cast<int>(rng() % 4);
    ServerPolicy a(kind, n, active, leader, deferred);
    ServerPolicy b(kind, n, active, leader, deferred);
    Oracle oracle(kind, n, active, leader, deferred);
    int64_t next_id = 100;
    for (int step = 0; step < 80; ++step) {
      const int action = static_cast<int>(rng() % 6);
      const int m = static_cast<int>(rng() % n);
      if (action <= 1) {
        const std::optional<Task> ta = a.next();
        ASSERT_EQ(ta, b.next());
        ASSERT_EQ(ta, oracle.next()) << a.describe();
        if (ta) ++handed_out[{kind, ta->kind}];
      } else if (action <= 3) {
        // Push only what the leader's lifecycle allows; weights only on other ranks.
        TaskKind kind_pushed = static_cast<TaskKind>(1 + rng() % (leader ? 3 : 4));
        if (leader) {
          const int phase = oracle.phase(m);
          if (phase == 0 || phase == 3) continue;
          if (kind_pushed == TaskKind::kBackward && phase != 2) continue;
        }
        const int64_t id = next_id++;
        ASSERT_EQ(a.push(kind_pushed, m, id), b.push(kind_pushed, m, id));
        oracle.push(kind_pushed, m, id);
      } else if (leader && action == 4) {
        if (oracle.phase(m) == 1 || oracle.phase(m) == 2) {
          a.on_forward_done(m);
          b.on_forward_done(m);
          oracle.forward_done(m);
        }
      } else if (leader && action == 5) {
        if ((oracle.phase(m) == 1 || oracle.phase(m) == 2) && !oracle.has_queued(m)) {
          a.on_microbatch_finished(m);
          b.on_microbatch_finished(m);
          oracle.finished(m);
        }
      }
      ASSERT_EQ(a.num_queued(), b.num_queued());
      if (leader && kind == kInterleaved) {
        ASSERT_LE(a.num_in_flight(), active);
      }
    }
  }
  // The stream reaches every kind of task under both policies (so the comparison means something).
  for (const auto& [key, count] : handed_out) {
    EXPECT_GE(count, 50) << pipeline_kind_name(key.first) << " " << task_kind_name(key.second);
  }
  EXPECT_EQ(handed_out.size(), 10u);
}

// ---- errors
// --------------------------------------------------------------------------------------

// Expects smp::Error whose message contains every fragment.
void expect_error(const std::function<void()>& call, const std::vector<std::string>& fragments) {
  try {
    call();
    ADD_FAILURE() << "expected smp::Error mentioning " << fragments.front();
  } catch (const Error& e) {
    for (const std::string& fragment : fragments) {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos)
          << "message: " << e.what() << "\nmissing: " << fragment;
    }
  }
}

TEST(ServerPolicyTest, ConstructorAndParsingErrors) {
  expect_error([] { parse_pipeline_kind("gpipe"); }, {"\"gpipe\"", "simple", "interleaved"});
  expect_error([] { parse_pipeline_kind("Simple"); }, {"\"Simple\""});
  expect_error([] { ServerPolicy(kSimple, 0, 1, true); }, {"microbatches must be >= 1, got 0"});
  expect_error([] { ServerPolicy(kSimple, -3, 1, false); }, {"got -3"});
  expect_error([] { ServerPolicy(kInterleaved, 4, 0, true); },
               {"active_microbatches", "[1, microbatches=4]", "got 0"});
  expect_error([] { ServerPolicy(kInterleaved, 4, 5, true); },
               {"active_microbatches", "[1, microbatches=4]", "got 5"});
  expect_error([] { ServerPolicy(static_cast<PipelineKind>(7), 4, 2, true); }, {"pipeline kind 7"});
}

TEST(ServerPolicyTest, PushErrors) {
  ServerPolicy leader(kInterleaved, 4, 2, true);
  leader.next();  // start 0
  expect_error([&] { leader.push(TaskKind::kStartMicrobatch, 1, 1); },
               {"start tasks are generated", "microbatch 1"});
  expect_error([&] { leader.push(TaskKind::kResume, 4, 1); }, {"microbatch 4", "[0, 4)"});
  expect_error([&] { leader.push(TaskKind::kResume, -1, 1); }, {"microbatch -1", "[0, 4)"});
  expect_error([&] { leader.push(TaskKind::kServeRequest, 2, 9); },
               {"request task (id 9)", "microbatch 2", "not been started"});
  expect_error([&] { leader.push(TaskKind::kBackward, 0, 3); },
               {"backward task (id 3)", "microbatch 0", "on_forward_done(0)"});
  leader.on_microbatch_finished(0);
  expect_error([&] { leader.push(TaskKind::kResume, 0, 5); },
               {"resume task (id 5)", "microbatch 0", "already finished"});
  EXPECT_EQ(leader.num_queued(), 0u);

  ServerPolicy other(kSimple, 2, 2, false);
  expect_error([&] { other.push(TaskKind::kStartMicrobatch, 0, 0); }, {"generated"});
  expect_error([&] { other.push(TaskKind::kBackward, 2, 0); }, {"microbatch 2", "[0, 2)"});
  other.push(TaskKind::kBackward, 1, 0);  // no lifecycle on other ranks
}

TEST(ServerPolicyTest, LifecycleErrors) {
  ServerPolicy leader(kInterleaved, 3, 3, true);
  expect_error([&] { leader.on_forward_done(0); }, {"microbatch 0", "not been started"});
  expect_error([&] { leader.on_microbatch_finished(1); }, {"microbatch 1", "not been started"});
  expect_error([&] { leader.on_forward_done(3); }, {"microbatch 3", "[0, 3)"});
  expect_error([&] { leader.on_microbatch_finished(-1); }, {"microbatch -1", "[0, 3)"});
  leader.next();
  leader.on_forward_done(0);
  leader.on_forward_done(0);  // a second model.backward: no-op
  leader.push(TaskKind::kBackward, 0, 11);
  expect_error([&] { leader.on_microbatch_finished(0); },
               {"microbatch 0", "still has a queued task backward(mb=0, id=11"});
  leader.next();
  leader.on_microbatch_finished(0);
  expect_error([&] { leader.on_microbatch_finished(0); }, {"microbatch 0", "already finished"});
  expect_error([&] { leader.on_forward_done(0); }, {"microbatch 0", "already finished"});
  EXPECT_EQ(leader.num_in_flight(), 0);

  ServerPolicy other(kInterleaved, 3, 3, false);
  expect_error([&] { other.on_forward_done(0); }, {"on_forward_done", "leader"});
  expect_error([&] { other.on_microbatch_finished(0); }, {"on_microbatch_finished", "leader"});
}

// ---- a simulated pipeline
// ------------------------------------------------------------------------
//
// Note [Simulated pipeline]
// S ranks, rank 0 the leader, one policy each. A microbatch follows a fixed path of visits; each
// visit is one task on one rank. Forward and backward compute of a stage take one tick; resumes
// and the backward segments that only route gradients across a boundary take zero ticks. Two
// shapes of model:
//   star  (the leader's model calls stage s's module, s = 1..S-1, one after the other)
//     forward : S0@0 (F0)  Q@1 (F1)  R@0  Q@2 (F2)  R@0 … Q@S-1  R@0 (loss, model.backward)
//     backward: B@0 (route)  B@S-1  B@0 (route) … B@1  B@0 (B0)
//   chain (stage s's module calls stage s+1's)
//     forward : S0@0 (F0)  Q@1 (F1) … Q@S-1  R@S-2 … R@1  R@0 (loss, model.backward)
//     backward: B@0 (route)  B@1 (route) … B@S-2 (route)  B@S-1  B@S-2 … B@0 (B0)
// (For S = 2 both are S@0 Q@1 R@0 | B@0 B@1 B@0.) The leader calls on_forward_done(m) when the
// last forward visit runs and on_microbatch_finished(m) when the last backward visit completes.
// A task sent to another rank arrives at the start of the next tick; one pushed on its own rank
// (model.backward's first backward) is queued at once. Each tick: deliver arrivals, then every
// idle rank, in rank order, runs zero-tick tasks and starts at most one one-tick task; the
// effects of a one-tick task apply at the end of the tick.

enum class Shape { kStar, kChain };

struct Visit {
  int rank;
  TaskKind kind;
  int ticks;
};

struct Path {
  std::vector<Visit> visits;
  size_t last_forward;  // index of the visit that calls model.backward
};

Path build_path(Shape shape, int stages) {
  Path path;
  std::vector<Visit>& v = path.visits;
  v.push_back({0, TaskKind::kStartMicrobatch, 1});
  if (shape == Shape::kStar) {
    for (int s = 1; s < stages; ++s) {
      v.push_back({s, TaskKind::kServeRequest, 1});
      v.push_back({0, TaskKind::kResume, 0});
    }
  } else {
    for (int s = 1; s < stages; ++s) v.push_back({s, TaskKind::kServeRequest, 1});
    for (int s = stages - 2; s >= 0; --s) v.push_back({s, TaskKind::kResume, 0});
  }
  path.last_forward = v.size() - 1;
  if (shape == Shape::kStar) {
    for (int s = stages - 1; s >= 1; --s) {
      v.push_back({0, TaskKind::kBackward, 0});
      v.push_back({s, TaskKind::kBackward, 1});
    }
  } else {
    for (int s = 0; s <= stages - 2; ++s) v.push_back({s, TaskKind::kBackward, 0});
    for (int s = stages - 1; s >= 1; --s) v.push_back({s, TaskKind::kBackward, 1});
  }
  v.push_back({0, TaskKind::kBackward, 1});
  return path;
}

struct Executed {
  int tick;
  Task task;
  bool compute;  // took a tick
};

struct SimResult {
  std::vector<std::vector<Executed>> executed;  // per rank, in order
  std::vector<std::string> leader_compute;      // "F0", "B0", … on the leader
  int ticks = 0;
  int max_in_flight = 0;
  bool deadlocked = false;
  std::string state;  // describe() of every rank when the simulation stopped
};

// `programs` (static only): one program per rank.
SimResult simulate(PipelineKind kind, int num_microbatches, int active, int stages, Shape shape,
                   const schedule::Schedule& programs = {}) {
  const Path path = build_path(shape, stages);
  constexpr int64_t kStride = 1000;  // id = microbatch * kStride + visit index
  std::vector<ServerPolicy> policies;
  for (int r = 0; r < stages; ++r) {
    policies.emplace_back(kind, num_microbatches, active, r == 0, 0,
                          programs.empty() ? schedule::Program{} : programs[r]);
  }

  struct Message {
    int rank;
    TaskKind kind;
    int microbatch;
    int64_t id;
  };
  std::vector<Message> in_transit;
  std::vector<std::optional<Task>> busy(stages);
  SimResult result;
  result.executed.resize(stages);

  auto describe_all = [&] {
    std::string out;
    for (int r = 0; r < stages; ++r) out += fmt::format("rank {}: {}\n", r, policies[r].describe());
    return out;
  };
  // Effects of visit `index` of microbatch m having run.
  auto complete = [&](int m, size_t index) {
    if (index == path.last_forward) policies[0].on_forward_done(m);
    if (index + 1 == path.visits.size()) {
      policies[0].on_microbatch_finished(m);
      return;
    }
    const Visit& here = path.visits[index];
    const Visit& next = path.visits[index + 1];
    const int64_t id = m * kStride + static_cast<int64_t>(index + 1);
    if (next.rank == here.rank) {
      policies[next.rank].push(next.kind, m, id);
    } else {
      in_transit.push_back({next.rank, next.kind, m, id});
    }
  };

  const int kTickLimit = 100 * num_microbatches * stages + 100;
  for (int tick = 0;; ++tick) {
    if (tick > kTickLimit) {
      ADD_FAILURE() << "no end after " << kTickLimit << " ticks\n" << describe_all();
      result.deadlocked = true;
      break;
    }
    const bool delivered = !in_transit.empty();
    for (const Message& msg : in_transit) policies[msg.rank].push(msg.kind, msg.microbatch, msg.id);
    in_transit.clear();

    bool ran = false;
    for (int r = 0; r < stages; ++r) {
      while (!busy[r]) {
        const std::optional<Task> task = policies[r].next();
        if (!task) break;
        ran = true;
        const int m = task->microbatch;
        const size_t index =
            task->kind == TaskKind::kStartMicrobatch ? 0 : static_cast<size_t>(task->id % kStride);
        const Visit& visit = path.visits.at(index);
        EXPECT_EQ(visit.rank, r);
        EXPECT_EQ(visit.kind, task->kind);
        EXPECT_EQ(task->kind == TaskKind::kStartMicrobatch ? m : task->id / kStride, m);
        result.executed[r].push_back({tick, *task, visit.ticks > 0});
        if (r == 0 && visit.ticks > 0) {
          result.leader_compute.push_back(
              fmt::format("{}{}", task->kind == TaskKind::kBackward ? "B" : "F", m));
        }
        if (visit.ticks == 0) {
          complete(m, index);
        } else {
          busy[r] = task;
        }
      }
    }
    result.max_in_flight = std::max(result.max_in_flight, policies[0].num_in_flight());

    bool any_busy = false;
    for (int r = 0; r < stages; ++r) {
      if (!busy[r]) continue;
      any_busy = true;
      const Task task = *busy[r];
      busy[r].reset();
      complete(task.microbatch, task.kind == TaskKind::kStartMicrobatch
                                    ? 0
                                    : static_cast<size_t>(task.id % kStride));
    }
    const bool done = std::all_of(policies.begin(), policies.end(),
                                  [](const ServerPolicy& p) { return p.all_finished(); }) &&
                      in_transit.empty();
    if (done) {
      result.ticks = tick + 1;
      break;
    }
    // Nothing arrived, nothing ran: the next tick would be the same one, forever.
    if (!delivered && !ran && !any_busy) {
      result.deadlocked = true;
      break;
    }
  }
  result.state = describe_all();
  return result;
}

std::string joined(const std::vector<std::string>& items) {
  std::string s;
  for (const std::string& item : items) s += (s.empty() ? "" : " ") + item;
  return s;
}

// Compute tasks of one rank as "tick F/B microbatch", e.g. "3B0 4F2".
std::string compute_trace(const SimResult& result, int rank) {
  std::vector<std::string> items;
  for (const Executed& e : result.executed[rank]) {
    if (!e.compute) continue;
    items.push_back(fmt::format("{}{}{}", e.tick, e.task.kind == TaskKind::kBackward ? "B" : "F",
                                e.task.microbatch));
  }
  return joined(items);
}

TEST(ServerPolicySimulationTest, InterleavedTwoStagesGoldenOrders) {
  // Derivation (2 stages, 4 microbatches, active 2; see Note [Simulated pipeline]):
  //   tick  leader (stage 0)                              rank 1 (stage 1)
  //   0     start 0: F0(0)                                -
  //   1     start 1: F0(1); then 2 in flight              request 0: F1(0)
  //   2     resume 0 (loss, model.backward), backward 0   request 1: F1(1)
  //         routes to rank 1 (0 ticks); idle: 2 in flight
  //   3     resume 1, backward 1 routes (0 ticks); idle   backward 0: B1(0)
  //   4     backward 0: B0(0) -> microbatch 0 finished    backward 1: B1(1)
  //   5     backward 1: B0(1) wins over start 2           -
  //         (backward first) -> microbatch 1 finished
  //   6, 7  start 2, start 3 …                            -
  // The round trip to rank 1 takes as long as two forwards, so with active 2 the microbatches
  // run in pairs: F0 F1 B0 B1 F2 F3 B2 B3, never more than 2 in flight.
  const SimResult two = simulate(kInterleaved, 4, 2, 2, Shape::kStar);
  ASSERT_FALSE(two.deadlocked) << two.state;
  EXPECT_EQ(joined(two.leader_compute), "F0 F1 B0 B1 F2 F3 B2 B3");
  EXPECT_EQ(compute_trace(two, 0), "0F0 1F1 4B0 5B1 6F2 7F3 10B2 11B3");
  EXPECT_EQ(compute_trace(two, 1), "1F0 2F1 3B0 4B1 7F2 8F3 9B2 10B3");
  EXPECT_EQ(two.max_in_flight, 2);

  // A third slot lets F2 fill the leader's wait; backward still goes first when both are ready.
  const SimResult three = simulate(kInterleaved, 4, 3, 2, Shape::kStar);
  ASSERT_FALSE(three.deadlocked) << three.state;
  EXPECT_EQ(joined(three.leader_compute), "F0 F1 F2 B0 B1 F3 B2 B3");
  EXPECT_EQ(three.max_in_flight, 3);

  // The default active_microbatches = pp + 2 = 4 over 8 microbatches: warm-up of 4 forwards,
  // then the steady state alternates two backwards and two forwards, then the cool-down.
  const SimResult steady = simulate(kInterleaved, 8, 4, 2, Shape::kStar);
  ASSERT_FALSE(steady.deadlocked) << steady.state;
  EXPECT_EQ(joined(steady.leader_compute), "F0 F1 F2 F3 B0 B1 F4 F5 B2 B3 F6 F7 B4 B5 B6 B7");
  EXPECT_EQ(compute_trace(steady, 1),
            "1F0 2F1 3B0 4B1 5F2 6F3 7B2 8B3 9F4 10F5 11B4 12B5 13F6 14F7 15B6 16B7");
  EXPECT_EQ(steady.max_in_flight, 4);
  EXPECT_EQ(steady.ticks, 18);

  // active 1: one microbatch at a time, end to end.
  const SimResult one = simulate(kInterleaved, 3, 1, 3, Shape::kChain);
  ASSERT_FALSE(one.deadlocked) << one.state;
  EXPECT_EQ(joined(one.leader_compute), "F0 B0 F1 B1 F2 B2");
  EXPECT_EQ(one.max_in_flight, 1);
}

TEST(ServerPolicySimulationTest, SimpleRunsAllForwardsThenAllBackwards) {
  const SimResult two = simulate(kSimple, 4, 2, 2, Shape::kStar);
  ASSERT_FALSE(two.deadlocked) << two.state;
  EXPECT_EQ(joined(two.leader_compute), "F0 F1 F2 F3 B0 B1 B2 B3");
  EXPECT_EQ(compute_trace(two, 1), "1F0 2F1 3F2 4F3 6B0 7B1 8B2 9B3");
  EXPECT_EQ(two.max_in_flight, 4);  // active_microbatches does not limit "simple"

  const SimResult three = simulate(kSimple, 4, 4, 3, Shape::kChain);
  ASSERT_FALSE(three.deadlocked) << three.state;
  EXPECT_EQ(compute_trace(three, 0), "0F0 1F1 2F2 3F3 11B0 12B1 13B2 14B3");
  EXPECT_EQ(compute_trace(three, 1), "1F0 2F1 3F2 4F3 10B0 11B1 12B2 13B3");
  EXPECT_EQ(compute_trace(three, 2), "2F0 3F1 4F2 5F3 9B0 10B1 11B2 12B3");
}

// Every (kind, shape, stages 2..3, microbatches 1..8, active 1..microbatches): the simulation
// finishes without a deadlock, every rank runs exactly each microbatch's visits, a microbatch's
// backward tasks come after its forward tasks on every rank, the leader keeps within
// active_microbatches (interleaved), "simple" runs every forward-type task before any backward on
// every rank, and a rerun gives the same tasks at the same ticks.
TEST(ServerPolicySimulationTest, SweepFinishesInOrderWithinLimits) {
  int runs = 0;
  for (PipelineKind kind : {kInterleaved, kSimple}) {
    for (Shape shape : {Shape::kStar, Shape::kChain}) {
      for (int stages = 2; stages <= 3; ++stages) {
        const Path path = build_path(shape, stages);
        for (int n = 1; n <= 8; ++n) {
          for (int active = 1; active <= 8; ++active) {
            if (active > n) {
              EXPECT_THROW(ServerPolicy(kind, n, active, true), Error);
              continue;
            }
            const std::string where =
                fmt::format("{} {} stages={} microbatches={} active={}", pipeline_kind_name(kind),
                            shape == Shape::kStar ? "star" : "chain", stages, n, active);
            SCOPED_TRACE(where);
            const SimResult r = simulate(kind, n, active, stages, shape);
            ++runs;
            ASSERT_FALSE(r.deadlocked) << r.state;

            EXPECT_GE(r.max_in_flight, 1);
            if (kind == kInterleaved) {
              EXPECT_LE(r.max_in_flight, active);
            } else {
              EXPECT_EQ(r.max_in_flight, n);
            }
            if (kind == kInterleaved && active == 1) {
              std::vector<std::string> sequential;
              for (int m = 0; m < n; ++m) {
                sequential.push_back(fmt::format("F{}", m));
                sequential.push_back(fmt::format("B{}", m));
              }
              EXPECT_EQ(r.leader_compute, sequential);
            }

            for (int rank = 0; rank < stages; ++rank) {
              // Visits of one microbatch on this rank, in path order.
              std::vector<TaskKind> expected_kinds;
              for (const Visit& v : path.visits) {
                if (v.rank == rank) expected_kinds.push_back(v.kind);
              }
              std::map<int, std::vector<TaskKind>> ran;
              std::map<int, bool> seen_backward;
              bool any_backward = false;
              for (const Executed& e : r.executed[rank]) {
                const int m = e.task.microbatch;
                ran[m].push_back(e.task.kind);
                const bool backward = e.task.kind == TaskKind::kBackward;
                EXPECT_FALSE(!backward && seen_backward[m])
                    << "rank " << rank << ": forward-type " << e.task.to_string()
                    << " after a backward of the same microbatch";
                if (kind == kSimple) {
                  EXPECT_FALSE(!backward && any_backward)
                      << "rank " << rank << ": simple ran " << e.task.to_string()
                      << " after a backward";
                }
                seen_backward[m] = seen_backward[m] || backward;
                any_backward = any_backward || backward;
              }
              for (int m = 0; m < n; ++m) {
                EXPECT_EQ(ran[m], expected_kinds) << "rank " << rank << " microbatch " << m;
              }
            }

            const SimResult again = simulate(kind, n, active, stages, shape);
            for (int rank = 0; rank < stages; ++rank) {
              ASSERT_EQ(again.executed[rank].size(), r.executed[rank].size());
              for (size_t i = 0; i < r.executed[rank].size(); ++i) {
                EXPECT_EQ(again.executed[rank][i].task, r.executed[rank][i].task);
                EXPECT_EQ(again.executed[rank][i].tick, r.executed[rank][i].tick);
              }
            }
          }
        }
      }
    }
  }
  EXPECT_EQ(runs, 2 * 2 * 2 * 36);
}

// A leader whose only queued work is a held backward, with no message coming, is the one state
// the simulation calls a deadlock; it cannot arise from a well-formed step (file comment of
// server_policy.h), and describe() says what is held.
TEST(ServerPolicySimulationTest, HeldBackwardIsReportedByDescribe) {
  ServerPolicy leader(kSimple, 2, 2, true);
  leader.next();
  leader.next();
  leader.on_forward_done(0);
  leader.push(TaskKind::kBackward, 0, 1);
  EXPECT_FALSE(leader.next().has_value());
  EXPECT_NE(leader.describe().find("in forward {1}"), std::string::npos) << leader.describe();
  EXPECT_NE(leader.describe().find("held"), std::string::npos) << leader.describe();
  leader.on_microbatch_finished(1);  // microbatch 1 returned without model.backward
  EXPECT_EQ(label(leader.next()), "B0#1");
}

// The walk-through in the Example of server_policy.h.
TEST(ServerPolicyTest, HeaderExample) {
  ServerPolicy policy(PipelineKind::kInterleaved, 4, 2, true);
  EXPECT_EQ(label(policy.next()), "S0");
  EXPECT_EQ(label(policy.next()), "S1");
  EXPECT_EQ(label(policy.next()), "-");
  policy.push(TaskKind::kResume, 0, 7);
  EXPECT_EQ(label(policy.next()), "R0#7");
  policy.on_forward_done(0);
  policy.push(TaskKind::kBackward, 0, 8);
  policy.push(TaskKind::kResume, 1, 9);
  EXPECT_EQ(label(policy.next()), "R1#9");
  EXPECT_EQ(label(policy.next()), "B0#8");
  EXPECT_EQ(label(policy.next()), "-");
  policy.on_microbatch_finished(0);
  EXPECT_EQ(label(policy.next()), "S2");
}

}  // namespace
// Weight halves of backward segments (design.md §4.4) wait for idle time, up to a number of
// microbatches; beyond it the oldest run before new forward work, never before a backward.
TEST(ServerPolicyTest, WeightsFillIdleTimeAndRunFirstBeyondTheLimit) {
  ServerPolicy other(kInterleaved, 4, 4, false, /*deferred_weight_microbatches=*/1);
  EXPECT_EQ(other.deferred_weight_microbatches(), 1);
  other.push(TaskKind::kWeight, 0, 1);
  other.push(TaskKind::kWeight, 0, 2);
  other.push(TaskKind::kServeRequest, 2, 3);
  EXPECT_EQ(other.next()->id, 3);  // one microbatch's weights may wait: the request first
  other.push(TaskKind::kBackward, 1, 4);
  other.push(TaskKind::kWeight, 1, 5);  // weights of two microbatches: over the limit
  other.push(TaskKind::kServeRequest, 3, 6);
  EXPECT_EQ(other.describe(),
            "ServerPolicy(interleaved, non-leader, microbatches=4, active=4, deferred weights=1); "
            "queued 5: backward [backward(mb=1, id=4, seq=3)] resume [] request "
            "[request(mb=3, id=6, seq=5)] weight [weight(mb=0, id=1, seq=0), weight(mb=0, id=2, "
            "seq=1), weight(mb=1, id=5, seq=4)]");
  EXPECT_EQ(other.next()->id, 4);  // a backward still comes first
  EXPECT_EQ(other.next()->id, 1);  // then the oldest weights, before the request
  EXPECT_EQ(other.next()->id, 2);
  EXPECT_EQ(other.next()->id, 6);  // within the limit again: the request
  EXPECT_FALSE(other.all_finished());
  EXPECT_EQ(other.next()->id, 5);  // nothing else to run: the weight fills the time
  EXPECT_FALSE(other.next());
  EXPECT_TRUE(other.all_finished());

  // Simple: weights after everything else (no limit).
  ServerPolicy simple(kSimple, 2, 2, false);
  simple.push(TaskKind::kWeight, 0, 1);
  simple.push(TaskKind::kWeight, 1, 2);
  simple.push(TaskKind::kBackward, 1, 3);
  simple.push(TaskKind::kServeRequest, 1, 4);
  for (int64_t id : {4, 3, 1, 2}) EXPECT_EQ(simple.next()->id, id);

  ServerPolicy leader(kInterleaved, 2, 2, true, 2);
  leader.next();
  expect_error([&] { leader.push(TaskKind::kWeight, 0, 7); },
               {"weight task (id 7)", "microbatch 0", "on the leader"});
  expect_error([] { ServerPolicy(kInterleaved, 2, 2, false, -1); },
               {"deferred_weight_microbatches", "got -1"});
}

// ---- static: a program from the schedule IR orders the work ------------------------------------

schedule::Program program_of(const std::string& text) {
  schedule::Program program;
  std::istringstream in(text);
  for (std::string token; in >> token;) program.emplace_back(schedule::parse_action(token));
  return program;
}

// The leader starts microbatch k once every microbatch whose B precedes F k in its program has
// finished: 1F1B's program gives 1F1B's order on the leader (at most p in flight), GPipe's all
// forwards first. A later rank runs what has arrived in program order without idling: in the star
// model the loss is on the leader, so rank 1's B0 comes a round trip after its F0 and F1 fills it.
TEST(ServerPolicySimulationTest, StaticFollowsTheProgramAsWorkArrives) {
  const SimResult one = simulate(kStatic, 4, 4, 2, Shape::kStar, schedule::one_f_one_b(2, 4));
  ASSERT_FALSE(one.deadlocked) << one.state;
  EXPECT_EQ(joined(one.leader_compute), "F0 F1 B0 F2 B1 F3 B2 B3");
  EXPECT_EQ(one.max_in_flight, 2);
  EXPECT_EQ(compute_trace(one, 1), "1F0 2F1 3B0 4B1 6F2 8F3 9B2 10B3");

  const SimResult three = simulate(kStatic, 8, 8, 3, Shape::kChain, schedule::one_f_one_b(3, 8));
  ASSERT_FALSE(three.deadlocked) << three.state;
  EXPECT_EQ(joined(three.leader_compute),
            "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7");  // stage 0 of 1F1B(3, 8)
  EXPECT_EQ(three.max_in_flight, 3);

  const SimResult all = simulate(kStatic, 4, 4, 2, Shape::kStar, schedule::gpipe(2, 4));
  ASSERT_FALSE(all.deadlocked) << all.state;
  EXPECT_EQ(joined(all.leader_compute), "F0 F1 F2 F3 B0 B1 B2 B3");
  EXPECT_EQ(all.max_in_flight, 4);
}

// Every generator's program, both shapes, stages 2..3, microbatches 1..8 (interleaved 1F1B where
// the microbatches divide evenly, with its rank programs): no deadlock, each microbatch's visits
// run on every rank with backward after forward, at most as many microbatches in flight on the
// leader as its program has Fs before its first B, and a rerun gives the same ticks.
TEST(ServerPolicySimulationTest, StaticSweepFinishes) {
  int runs = 0;
  for (Shape shape : {Shape::kStar, Shape::kChain}) {
    for (int stages = 2; stages <= 3; ++stages) {
      for (int n = 1; n <= 8; ++n) {
        std::vector<std::pair<std::string, schedule::Schedule>> schedules = {
            {"gpipe", schedule::gpipe(stages, n)},
            {"1f1b", schedule::one_f_one_b(stages, n)},
            {"zbh1", schedule::zero_bubble_h1(stages, n)}};
        for (const auto& [name, programs] : schedules) {
          SCOPED_TRACE(fmt::format("{} {} stages={} microbatches={}", name,
                                   shape == Shape::kStar ? "star" : "chain", stages, n));
          const SimResult r = simulate(kStatic, n, n, stages, shape, programs);
          ++runs;
          ASSERT_FALSE(r.deadlocked) << r.state;
          int warmup = 0;
          for (const auto& action : programs[0]) {
            if (!action) continue;
            if (action->type != schedule::ActionType::kForward) break;
            ++warmup;
          }
          EXPECT_LE(r.max_in_flight, warmup);
          for (int rank = 0; rank < stages; ++rank) {
            std::map<int, bool> seen_backward;
            std::map<int, int> visits;
            for (const Executed& e : r.executed[rank]) {
              const bool backward = e.task.kind == TaskKind::kBackward;
              EXPECT_FALSE(!backward && seen_backward[e.task.microbatch]) << e.task.to_string();
              seen_backward[e.task.microbatch] |= backward;
              ++visits[e.task.microbatch];
            }
            const Path path = build_path(shape, stages);
            const auto expected = std::count_if(path.visits.begin(), path.visits.end(),
                                                [rank](const Visit& v) { return v.rank == rank; });
            for (int m = 0; m < n; ++m) EXPECT_EQ(visits[m], expected) << "rank " << rank;
          }
          const SimResult again = simulate(kStatic, n, n, stages, shape, programs);
          ASSERT_EQ(again.ticks, r.ticks);
          for (int rank = 0; rank < stages; ++rank) {
            ASSERT_EQ(again.executed[rank].size(), r.executed[rank].size());
            for (size_t i = 0; i < r.executed[rank].size(); ++i) {
              EXPECT_EQ(again.executed[rank][i].task, r.executed[rank][i].task);
            }
          }
        }
      }
    }
  }
  EXPECT_EQ(runs, 2 * 2 * 8 * 3);
}

// Queued tasks run in program order, not by class: a weight half placed before the next forward
// runs before that request (interleaved would run the request and leave the weight for idle
// time); a task the program does not name runs after those it does; resumes come first.
TEST(ServerPolicyTest, StaticRunsQueuedWorkInProgramOrder) {
  ServerPolicy other(kStatic, 3, 3, false, 0, program_of("1F0 1I0 1W0 1F1 1I1 1W1 1F2 1I2 1W2"));
  other.push(TaskKind::kServeRequest, 1, 1);
  other.push(TaskKind::kWeight, 0, 2);
  other.push(TaskKind::kBackward, 0, 3);
  other.push(TaskKind::kServeRequest, 1, 4);
  other.push(TaskKind::kResume, 2, 5);
  for (int64_t id : {5, 3, 2, 1, 4}) EXPECT_EQ(other.next()->id, id);
  EXPECT_FALSE(other.next());
  EXPECT_EQ(other.describe(),
            "ServerPolicy(static, non-leader, microbatches=3, active=3, program: 1F0 1I0 1W0 1F1 "
            "1I1 1W1 1F2 1I2 1W2); queued 0: backward [] resume [] request []");

  ServerPolicy partial(kStatic, 2, 2, false, 0, program_of("1F1 1B1"));
  partial.push(TaskKind::kServeRequest, 0, 1);  // microbatch 0 is not in the program
  partial.push(TaskKind::kBackward, 1, 2);
  partial.push(TaskKind::kServeRequest, 1, 3);
  for (int64_t id : {3, 2, 1}) EXPECT_EQ(partial.next()->id, id);

  // The leader's gate: 1F1B(2, 3) stage 0 is F0 F1 B0 F2 B1 B2; F2 waits for microbatch 0.
  ServerPolicy leader(kStatic, 3, 3, true, 0, schedule::one_f_one_b(2, 3)[0]);
  EXPECT_EQ(leader.next()->kind, TaskKind::kStartMicrobatch);
  EXPECT_EQ(leader.next()->microbatch, 1);
  EXPECT_FALSE(leader.next());
  leader.on_forward_done(0);
  leader.push(TaskKind::kBackward, 0, 7);
  EXPECT_EQ(leader.next()->id, 7);
  EXPECT_FALSE(leader.next());
  leader.on_microbatch_finished(0);
  EXPECT_EQ(leader.next()->microbatch, 2);
}

TEST(ServerPolicyTest, StaticProgramErrors) {
  EXPECT_EQ(parse_pipeline_kind("static"), kStatic);
  EXPECT_STREQ(pipeline_kind_name(kStatic), "static");
  expect_error([] { parse_pipeline_kind("1f1b"); }, {"\"static\"", "got \"1f1b\""});
  expect_error([] { ServerPolicy(kInterleaved, 2, 2, false, 0, program_of("1F0")); },
               {"static", "not \"interleaved\""});
  expect_error([] { ServerPolicy(kStatic, 2, 2, false, 0, {}); }, {"no compute action"});
  expect_error([] { ServerPolicy(kStatic, 2, 2, false, 0, program_of("1F0 1F2")); },
               {"1F2", "microbatch 2", "outside [0, 2)"});
  expect_error([] { ServerPolicy(kStatic, 2, 2, false, 0, program_of("1F0 1B0 1I0")); },
               {"1I0 twice", "both B and I"});
  expect_error([] { ServerPolicy(kStatic, 2, 2, true, 0, program_of("0F0 0B0")); },
               {"no F of microbatch 1", "0F0 0B0"});
  // Communication actions are skipped: the lowered form of a program works as well.
  ServerPolicy lowered(kStatic, 1, 1, false, 0, program_of("1RECV_F0 1F0 1SEND_F0"));
  lowered.push(TaskKind::kServeRequest, 0, 1);
  EXPECT_EQ(lowered.next()->id, 1);
}

}  // namespace smp
