#include "smp/pytorch/grad_reduce.h"

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <ostream>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "smp/error.h"

// Why not c10d::ProcessGroupGloo: libtorch_cpu.so exports its symbols, but its header
// (ProcessGroupGloo.hpp) includes <gloo/...> headers that the torch wheel does not ship, so C++
// code outside torch cannot construct one. The real gloo path is covered by
// tests/python/unit/test_grad_reduce.py. Here each rank is a thread of one process, and the ranks
// meet in ThreadWorld, an in-memory c10d::Backend plugged into a real c10d::ProcessGroup: the
// collectives go through torch's dispatcher (c10d::allreduce_) exactly as with gloo.

namespace smp::pytorch {
namespace {

// A hang (e.g. ranks issuing different collectives) fails the test instead of blocking ctest.
constexpr auto kWaitTimeout = std::chrono::seconds(30);

// A Work that ThreadWorld completes once every rank has contributed to its collective.
class ThreadWork : public c10d::Work {
 public:
  explicit ThreadWork(int rank) : c10d::Work(rank, c10d::OpType::ALLREDUCE) {}

  void complete(std::exception_ptr error = nullptr) { finish(std::move(error)); }

  bool isCompleted() override {
    std::lock_guard<std::mutex> lock(mutex_);
    return completed_;
  }

  bool wait(std::chrono::milliseconds /*timeout*/) override {
    std::unique_lock<std::mutex> lock(mutex_);
    if (!cv_.wait_for(lock, kWaitTimeout, [this] { return completed_; })) {
      throw std::runtime_error("ThreadWork: timed out; did the ranks issue different collectives?");
    }
    if (exception_) std::rethrow_exception(exception_);
    return true;
  }
};

// The meeting point of the ranks: the k-th allreduce of every rank forms collective k. The last
// rank to arrive sums the contributions, writes the sum into every rank's tensor and completes
// every rank's Work, so a rank that reads its tensor without waiting sees stale data.
class ThreadWorld {
 public:
  explicit ThreadWorld(int world_size) : world_size_(world_size) {}

  // Makes collective `seq` fail (issue: allreduce throws; complete: its Work fails).
  int fail_issue_at = -1;
  int fail_complete_at = -1;

  void contribute(int64_t seq, int rank, const at::Tensor& tensor,
                  const c10::intrusive_ptr<ThreadWork>& work) {
    std::lock_guard<std::mutex> lock(mutex_);
    Slot& slot = slots_[seq];
    slot.tensors.emplace(rank, tensor);
    slot.works.push_back(work);
    if (static_cast<int>(slot.tensors.size()) < world_size_) return;

    std::exception_ptr error;
    if (seq == fail_complete_at) {
      error = std::make_exception_ptr(std::runtime_error("ThreadWorld: injected failure"));
    } else {
      at::Tensor sum = at::zeros_like(slot.tensors.begin()->second);
      for (const auto& [r, t] : slot.tensors) sum.add_(t);  // in rank order: deterministic
      for (auto& [r, t] : slot.tensors) t.copy_(sum);
    }
    for (const auto& w : slot.works) w->complete(error);
    slots_.erase(seq);
  }

 private:
  struct Slot {
    std::map<int, at::Tensor> tensors;
    std::vector<c10::intrusive_ptr<ThreadWork>> works;
  };
  const int world_size_;
  std::mutex mutex_;
  std::map<int64_t, Slot> slots_;
};

// One rank's backend over a ThreadWorld; it also records what the code under test asked for.
class ThreadBackend : public c10d::Backend {
 public:
  ThreadBackend(int rank, int size, std::shared_ptr<ThreadWorld> world)
      : c10d::Backend(rank, size), world_(std::move(world)) {}

  const std::string getBackendName() const override { return "smp_thread_world"; }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    const int64_t seq = num_allreduce_++;
    if (opts.reduceOp != c10d::ReduceOp::SUM) num_non_sum_ops_++;
    if (tensors.size() != 1) throw std::logic_error("ThreadBackend: expected one tensor");
    if (seq == world_->fail_issue_at) throw std::runtime_error("ThreadBackend: injected failure");
    auto work = c10::make_intrusive<ThreadWork>(getRank());
    world_->contribute(seq, getRank(), tensors[0], work);
    return work;
  }

  std::atomic<int64_t> num_allreduce_{0};
  std::atomic<int64_t> num_non_sum_ops_{0};

 private:
  std::shared_ptr<ThreadWorld> world_;
};

struct Rank {
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  c10::intrusive_ptr<ThreadBackend> backend;
};

Rank make_rank(const std::shared_ptr<ThreadWorld>& world, int rank, int world_size) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  auto group = c10::make_intrusive<c10d::ProcessGroup>(store, rank, world_size);
  auto backend = c10::make_intrusive<ThreadBackend>(rank, world_size, world);
  group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::CUSTOM, backend);
  group->setDefaultBackend(c10d::ProcessGroup::BackendType::CUSTOM);
  return {group, backend};
}

// Runs body(rank, Rank&) on `world_size` threads, one per rank, and returns each rank's exception
// (null if it returned normally).
template <typename Body>
std::vector<std::exception_ptr> run_ranks(int world_size, const std::shared_ptr<ThreadWorld>& world,
                                          std::vector<Rank>& ranks, Body body) {
  ranks.clear();
  for (int r = 0; r < world_size; ++r) ranks.push_back(make_rank(world, r, world_size));
  std::vector<std::exception_ptr> errors(world_size);
  std::vector<std::thread> threads;
  for (int r = 0; r < world_size; ++r) {
    threads.emplace_back([&, r] {
      try {
        body(r, ranks[r]);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

// The tensors of the reduction tests, with bucket_bytes = 64 in mind (sizes in bytes):
//   0: f32 [2,4] 32   1: f64 [4] 32     2: f32 [4,4] 64 (fills a bucket exactly)
//   3: f32 [17] 68    4: f64 [3,3] 72   (each over 64: a bucket of its own)
//   5: f32 [2,2] 16   6: f64 [0] 0 (skipped)   7: f64 [2] 16   8: f32 [] 4 (0-dim)
// Tensor i on rank r holds (i + 1) * arange + r, so the sum over W ranks is
// W * (i + 1) * arange + W * (W - 1) / 2.
struct Spec {
  std::vector<int64_t> shape;
  at::ScalarType dtype;
};
const std::vector<Spec> kSpecs = {
    {{2, 4}, at::kFloat}, {{4}, at::kDouble},    {{4, 4}, at::kFloat},
    {{17}, at::kFloat},   {{3, 3}, at::kDouble}, {{2, 2}, at::kFloat},
    {{0}, at::kDouble},   {{2}, at::kDouble},    {{}, at::kFloat},
};

at::Tensor base_tensor(size_t i) {
  const Spec& spec = kSpecs[i];
  const int64_t numel = c10::multiply_integers(spec.shape);
  return (at::arange(numel, at::TensorOptions().dtype(spec.dtype)) * static_cast<double>(i + 1))
      .reshape(spec.shape);
}

std::vector<at::Tensor> rank_tensors(int rank) {
  std::vector<at::Tensor> tensors;
  for (size_t i = 0; i < kSpecs.size(); ++i) tensors.push_back(base_tensor(i) + rank);
  return tensors;
}

at::Tensor expected_tensor(size_t i, int world_size, double divisor) {
  return (base_tensor(i) * world_size + world_size * (world_size - 1) / 2.0) / divisor;
}

// ---- plan_grad_buckets ---------------------------------------------------------------------

using Buckets = std::vector<std::vector<size_t>>;

TEST(PlanGradBuckets, HeaderExample) {
  // f = float32, d = float64; bytes 40, 80, 40, 40, 400, 16.
  std::vector<at::Tensor> tensors = {at::zeros({10}),  at::zeros({10}, at::kDouble),
                                     at::zeros({10}),  at::zeros({10}),
                                     at::zeros({100}), at::zeros({2}, at::kDouble)};
  EXPECT_EQ(plan_grad_buckets(tensors, 100), (Buckets{{0, 2}, {1, 5}, {3}, {4}}));
}

TEST(PlanGradBuckets, ReductionTensors) {
  std::vector<at::Tensor> tensors = rank_tensors(0);
  EXPECT_EQ(plan_grad_buckets(tensors, 64), (Buckets{{0}, {1, 7}, {2}, {3}, {4}, {5, 8}}));
  EXPECT_EQ(plan_grad_buckets(tensors, 1 << 20), (Buckets{{0, 2, 3, 5, 8}, {1, 4, 7}}));
  EXPECT_EQ(plan_grad_buckets(tensors, 1),
            (Buckets{{0}, {1}, {2}, {3}, {4}, {5}, {7}, {8}}));  // 6 is empty: skipped
}

TEST(PlanGradBuckets, EmptyList) { EXPECT_TRUE(plan_grad_buckets({}, 8).empty()); }

// ---- allreduce_mean_ over several ranks ----------------------------------------------------

struct ReduceCase {
  int world_size;
  int64_t bucket_bytes;
  int64_t num_collectives;  // what plan_grad_buckets says for rank_tensors (see above)
  double divisor;           // 0: use world_size, i.e. a true mean
};

// Readable parameters in failure messages (gtest would print the struct's bytes).
void PrintTo(const ReduceCase& c, std::ostream* os) {
  *os << "{world_size=" << c.world_size << ", bucket_bytes=" << c.bucket_bytes
      << ", num_collectives=" << c.num_collectives << ", divisor=" << c.divisor << "}";
}

class AllreduceMean : public testing::TestWithParam<ReduceCase> {};

TEST_P(AllreduceMean, SumsThenDividesInPlace) {
  const ReduceCase c = GetParam();
  const double divisor = c.divisor > 0 ? c.divisor : c.world_size;
  auto world = std::make_shared<ThreadWorld>(c.world_size);
  std::vector<Rank> ranks;
  std::vector<std::vector<at::Tensor>> tensors(c.world_size);
  std::vector<int64_t> returned(c.world_size, -1);

  const auto errors = run_ranks(c.world_size, world, ranks, [&](int r, Rank& rank) {
    tensors[r] = rank_tensors(r);
    returned[r] = allreduce_mean_(tensors[r], rank.group, divisor, c.bucket_bytes);
  });

  for (int r = 0; r < c.world_size; ++r) {
    ASSERT_FALSE(errors[r]) << "rank " << r << " threw";
    EXPECT_EQ(returned[r], c.num_collectives) << "rank " << r;
    EXPECT_EQ(ranks[r].backend->num_allreduce_.load(), c.num_collectives) << "rank " << r;
    EXPECT_EQ(ranks[r].backend->num_non_sum_ops_.load(), 0) << "ReduceOp::AVG or other used";
    for (size_t i = 0; i < kSpecs.size(); ++i) {
      const at::Tensor& got = tensors[r][i];
      EXPECT_EQ(got.scalar_type(), kSpecs[i].dtype);
      EXPECT_EQ(got.sizes(), at::IntArrayRef(kSpecs[i].shape));
      EXPECT_TRUE(at::allclose(got, expected_tensor(i, c.world_size, divisor)))
          << "rank " << r << " tensor " << i << ":\n"
          << got << "\nexpected\n"
          << expected_tensor(i, c.world_size, divisor);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, AllreduceMean,
                         testing::Values(ReduceCase{2, 64, 6, 0}, ReduceCase{3, 64, 6, 0},
                                         ReduceCase{2, 1 << 20, 2, 0}, ReduceCase{3, 1, 8, 0},
                                         ReduceCase{3, 64, 6, 2.5}),
                         [](const testing::TestParamInfo<ReduceCase>& info) {
                           return "world" + std::to_string(info.param.world_size) + "_bucket" +
                                  std::to_string(info.param.bucket_bytes) +
                                  (info.param.divisor > 0 ? "_divisor" : "_mean");
                         });

TEST(AllreduceMeanTest, WorldSizeOneOnlyDivides) {
  auto world = std::make_shared<ThreadWorld>(1);
  Rank rank = make_rank(world, 0, 1);
  std::vector<at::Tensor> tensors = rank_tensors(0);
  EXPECT_EQ(allreduce_mean_(tensors, rank.group, 4.0, 64), 0);
  EXPECT_EQ(rank.backend->num_allreduce_.load(), 0);
  for (size_t i = 0; i < kSpecs.size(); ++i) {
    EXPECT_TRUE(at::allclose(tensors[i], expected_tensor(i, 1, 4.0))) << "tensor " << i;
  }
}

TEST(AllreduceMeanTest, EmptyListIssuesNothing) {
  auto world = std::make_shared<ThreadWorld>(2);
  Rank rank = make_rank(world, 0, 2);  // no peer thread: any collective would time out
  EXPECT_EQ(allreduce_mean_({}, rank.group, 2.0, 64), 0);
  std::vector<at::Tensor> only_empty = {at::zeros({0}), at::zeros({3, 0}, at::kDouble)};
  EXPECT_EQ(allreduce_mean_(only_empty, rank.group, 2.0, 64), 0);
  EXPECT_EQ(rank.backend->num_allreduce_.load(), 0);
}

TEST(AllreduceMeanTest, RequiresGradTensorsAreAccepted) {
  auto world = std::make_shared<ThreadWorld>(1);
  Rank rank = make_rank(world, 0, 1);
  std::vector<at::Tensor> tensors = {at::ones({3}).requires_grad_()};
  EXPECT_EQ(allreduce_mean_(tensors, rank.group, 2.0, 64), 0);
  EXPECT_TRUE(at::allclose(tensors[0].detach(), at::full({3}, 0.5)));
}

// ---- failures ------------------------------------------------------------------------------

// Expects fn() to throw smp::Error whose message contains every one of `parts`.
template <typename Fn>
void expect_error(Fn fn, const std::vector<std::string>& parts) {
  try {
    fn();
    ADD_FAILURE() << "expected smp::Error";
  } catch (const smp::Error& e) {
    for (const auto& part : parts) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos)
          << "'" << part << "' not in: " << e.what();
    }
  }
}

TEST(AllreduceMeanTest, UserMistakesThrowBeforeAnyCollective) {
  // World size 2 without a peer: a collective issued before the check would time out, and the
  // backend's counter proves none was issued.
  auto world = std::make_shared<ThreadWorld>(2);
  Rank rank = make_rank(world, 0, 2);
  const auto g = rank.group;
  std::vector<at::Tensor> ok = {at::ones({2})};
  const double inf = std::numeric_limits<double>::infinity();
  const double nan = std::numeric_limits<double>::quiet_NaN();

  expect_error([&] { allreduce_mean_(ok, g, 0.0, 64); }, {"divisor", "> 0", "got 0"});
  expect_error([&] { allreduce_mean_(ok, g, -2.0, 64); }, {"divisor", "got -2"});
  expect_error([&] { allreduce_mean_(ok, g, nan, 64); }, {"divisor"});
  expect_error([&] { allreduce_mean_(ok, g, inf, 64); }, {"divisor"});
  expect_error([&] { allreduce_mean_(ok, g, 2.0, 0); }, {"bucket_bytes", "got 0"});
  expect_error([&] { allreduce_mean_(ok, g, 2.0, -8); }, {"bucket_bytes", "got -8"});
  expect_error([&] { allreduce_mean_(ok, nullptr, 2.0, 64); }, {"group"});
  // The bad tensor comes last so that a late check would already have issued a collective.
  expect_error(
      [&] {
        allreduce_mean_({at::ones({2}), at::ones({3, 4}, at::kDouble).t()}, g, 2.0, 64);
      },
      {"tensor 1", "[4, 3]", "Double", "not contiguous"});
  expect_error(
      [&] {
        allreduce_mean_({at::ones({2}), at::ones({2, 3}).to_sparse()}, g, 2.0, 64);
      },
      {"tensor 1", "[2, 3]", "Float", "Sparse"});
  expect_error(
      [&] {
        allreduce_mean_({at::ones({2}), at::Tensor()}, g, 2.0, 64);
      },
      {"tensor 1", "undefined"});
  expect_error(
      [&] {
        allreduce_mean_({at::ones({2}), at::ones({5}, at::kLong)}, g, 2.0, 64);
      },
      {"tensor 1", "[5]", "Long", "floating-point"});
  EXPECT_EQ(rank.backend->num_allreduce_.load(), 0);
}

// A backend error while issuing collective 1 reaches the caller, and only after collective 0
// (a single-tensor bucket, reduced in place) has completed: nothing is left writing.
TEST(AllreduceMeanTest, IssueFailureWaitsForIssuedCollectives) {
  auto world = std::make_shared<ThreadWorld>(2);
  world->fail_issue_at = 1;
  std::vector<Rank> ranks;
  std::vector<std::vector<at::Tensor>> tensors(2);
  const auto errors = run_ranks(2, world, ranks, [&](int r, Rank& rank) {
    tensors[r] = {at::full({4}, r + 1.0), at::ones({4})};
    allreduce_mean_(tensors[r], rank.group, 2.0, /*bucket_bytes=*/16);  // one tensor per bucket
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(errors[r]) << "rank " << r;
    EXPECT_THROW(std::rethrow_exception(errors[r]), std::runtime_error);
    EXPECT_TRUE(at::equal(tensors[r][0], at::full({4}, 3.0))) << "collective 0 not completed";
  }
}

// A collective that fails asynchronously surfaces from wait(), and the other collectives are still
// waited on.
TEST(AllreduceMeanTest, WorkFailureIsRethrown) {
  auto world = std::make_shared<ThreadWorld>(3);
  world->fail_complete_at = 0;
  std::vector<Rank> ranks;
  std::vector<std::vector<at::Tensor>> tensors(3);
  const auto errors = run_ranks(3, world, ranks, [&](int r, Rank& rank) {
    tensors[r] = {at::ones({4}), at::full({4}, r + 1.0)};
    allreduce_mean_(tensors[r], rank.group, 3.0, /*bucket_bytes=*/16);
  });
  for (int r = 0; r < 3; ++r) {
    ASSERT_TRUE(errors[r]) << "rank " << r;
    try {
      std::rethrow_exception(errors[r]);
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("injected failure"), std::string::npos) << e.what();
    }
    // Collective 1 was waited on: its in-place sum is there (not divided: the call failed).
    EXPECT_TRUE(at::equal(tensors[r][1], at::full({4}, 6.0))) << "rank " << r;
  }
}

}  // namespace
}  // namespace smp::pytorch
