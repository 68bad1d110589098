#include "smp/pytorch/grad_reduce.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <exception>
#include <limits>
#include <memory>
#include <ostream>
#include <stdexcept>
#include <string>
#include <vector>

#include "smp/error.h"
#include "thread_world.h"

// Ranks are threads meeting in ThreadWorld (thread_world.h), an in-memory c10d backend: the
// collectives go through torch's dispatcher exactly as with gloo. The real gloo path is covered by
// tests/python/unit/test_grad_reduce.py.

namespace smp::pytorch {
namespace {

using test_util::make_rank;
using test_util::Rank;
using test_util::run_ranks;
using test_util::ThreadWorld;

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
                           return fmt::format("world{}_bucket{}{}", info.param.world_size,
                                              info.param.bucket_bytes,
                                              info.param.divisor > 0 ? "_divisor" : "_mean");
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

// ---- PendingAllreduces ---------------------------------------------------------------------

// Buffers issued one at a time, as the overlapped gradient reduction issues them: flattened in
// order (strided inputs too), summed, divided by each one's divisor; the inputs are untouched.
TEST(PendingAllreducesTest, IssuesFlatCopiesAndWaitsForAll) {
  auto world = std::make_shared<ThreadWorld>(3);
  std::vector<Rank> ranks;
  std::vector<std::vector<at::Tensor>> inputs(3);
  std::vector<std::vector<at::Tensor>> outputs(3);
  const auto errors = run_ranks(3, world, ranks, [&](int r, Rank& rank) {
    inputs[r] = {at::full({2, 3}, r + 1.0).t(), at::full({2}, 10.0 * r),
                 at::full({3}, 1.0, at::kDouble)};
    PendingAllreduces pending(rank.group);
    EXPECT_EQ(pending.issue({inputs[r][0], inputs[r][1]}, 2.0), 0u);
    EXPECT_EQ(pending.issue({inputs[r][2]}, 3.0), 1u);
    EXPECT_EQ(pending.size(), 2u);
    outputs[r] = pending.wait();
    EXPECT_EQ(pending.size(), 0u);
  });
  for (int r = 0; r < 3; ++r) {
    ASSERT_FALSE(errors[r]) << "rank " << r;
    EXPECT_EQ(ranks[r].backend->num_allreduce_.load(), 2);
    ASSERT_EQ(outputs[r].size(), 2u);
    // (1 + 2 + 3) / 2 = 3 for the first six values, (0 + 10 + 20) / 2 = 15 for the next two.
    at::Tensor want = at::cat({at::full({6}, 3.0), at::full({2}, 15.0)});
    EXPECT_TRUE(at::equal(outputs[r][0], want)) << outputs[r][0];
    EXPECT_TRUE(at::equal(outputs[r][1], at::full({3}, 1.0, at::kDouble)));
    EXPECT_TRUE(at::equal(inputs[r][2], at::full({3}, 1.0, at::kDouble))) << "input changed";
  }
}

TEST(PendingAllreducesTest, WorldSizeOneOnlyDivides) {
  auto world = std::make_shared<ThreadWorld>(1);
  Rank rank = make_rank(world, 0, 1);
  PendingAllreduces pending(rank.group);
  at::Tensor input = at::full({4}, 6.0);
  pending.issue({input}, 3.0);
  const std::vector<at::Tensor> out = pending.wait();
  EXPECT_TRUE(at::equal(out.at(0), at::full({4}, 2.0)));
  EXPECT_TRUE(at::equal(input, at::full({4}, 6.0)));
  EXPECT_EQ(rank.backend->num_allreduce_.load(), 0);
}

TEST(PendingAllreducesTest, UserMistakesThrowBeforeAnyCollective) {
  auto world = std::make_shared<ThreadWorld>(2);
  Rank rank = make_rank(world, 0, 2);  // no peer: an issued collective would never complete
  PendingAllreduces pending(rank.group);
  expect_error([&] { pending.issue({}, 2.0); }, {"no tensors"});
  expect_error([&] { pending.issue({at::ones({2})}, 0.0); }, {"divisor", "got 0"});
  expect_error(
      [&] {
        pending.issue({at::ones({2}), at::ones({5}, at::kLong)}, 2.0);
      },
      {"tensor 1", "[5]", "Long", "floating-point"});
  expect_error(
      [&] {
        pending.issue({at::ones({2}), at::ones({2}, at::kDouble)}, 2.0);
      },
      {"tensor 1", "Double", "differs in dtype or device"});
  expect_error([&] { PendingAllreduces null_group(nullptr); }, {"group"});
  EXPECT_EQ(pending.size(), 0u);
  EXPECT_EQ(rank.backend->num_allreduce_.load(), 0);
}

// A failed collective surfaces from wait() after every other one completed; drain() waits without
// throwing (the path of a step given up on).
TEST(PendingAllreducesTest, FailureIsRethrownAfterAllCompleteAndDrainSwallowsIt) {
  for (const bool drain : {false, true}) {
    auto world = std::make_shared<ThreadWorld>(2);
    world->fail_complete_at = 0;
    std::vector<Rank> ranks;
    std::vector<std::string> messages(2);
    const auto errors = run_ranks(2, world, ranks, [&](int r, Rank& rank) {
      PendingAllreduces pending(rank.group);
      pending.issue({at::ones({4})}, 2.0);
      pending.issue({at::ones({4})}, 2.0);
      if (drain) {
        pending.drain();
        EXPECT_EQ(pending.size(), 0u);
        return;
      }
      try {
        pending.wait();
      } catch (const std::exception& e) {
        messages[r] = e.what();
      }
      EXPECT_EQ(pending.size(), 0u);
    });
    for (int r = 0; r < 2; ++r) {
      ASSERT_FALSE(errors[r]) << "rank " << r;
      if (!drain) {
        EXPECT_NE(messages[r].find("injected failure"), std::string::npos) << messages[r];
      }
    }
  }
}

}  // namespace
}  // namespace smp::pytorch
