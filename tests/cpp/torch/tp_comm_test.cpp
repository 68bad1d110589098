#include "smp/pytorch/tp_comm.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "smp/error.h"
#include "thread_world.h"

// Ranks are threads meeting in ThreadWorld (thread_world.h): the collectives go through torch's
// dispatcher exactly as with gloo, and the backward runs in the autograd engine with no Python.
// The real gloo path is covered from Python.
//
// Notation: on a group of n ranks, rank r's input is x_r = input(shape, r) and its upstream
// gradient is g_r = upstream(shape, r); every rank can compute every other rank's values, so the
// expectations below are written with sums and concatenations over ranks.

namespace smp::pytorch::tp {
namespace {

using test_util::expect_no_errors;
using test_util::make_rank;
using test_util::Rank;
using test_util::run_ranks;
using test_util::ThreadWorld;

// Distinct, deterministic float64 values for each seed.
at::Tensor values(at::IntArrayRef shape, int seed) {
  const int64_t numel = c10::multiply_integers(shape);
  return at::sin(at::arange(numel, at::kDouble) * 0.7 + seed * 1.3).reshape(shape);
}

at::Tensor input(at::IntArrayRef shape, int rank) { return values(shape, rank); }
at::Tensor upstream(at::IntArrayRef shape, int rank) { return values(shape, 100 + rank); }

// sum over r < n of make(shape, r), in rank order (as the backends sum).
at::Tensor sum_over_ranks(const std::function<at::Tensor(int)>& make, int n) {
  at::Tensor sum = at::zeros_like(make(0));
  for (int r = 0; r < n; ++r) sum.add_(make(r));
  return sum;
}

// cat([make(0), ..., make(n - 1)], dim).
at::Tensor cat_over_ranks(const std::function<at::Tensor(int)>& make, int n, int64_t dim) {
  std::vector<at::Tensor> parts;
  for (int r = 0; r < n; ++r) parts.push_back(make(r));
  return at::cat(parts, dim);
}

at::Tensor chunk(const at::Tensor& t, int n, int64_t dim, int r) { return t.chunk(n, dim)[r]; }

void expect_close(const at::Tensor& got, const at::Tensor& expected, const std::string& what) {
  ASSERT_TRUE(got.defined()) << what << " is undefined";
  ASSERT_EQ(got.sizes(), expected.sizes()) << what;
  EXPECT_TRUE(at::allclose(got, expected)) << what << ":\n" << got << "\nexpected\n" << expected;
}

// Every dim divides by 1, 2 and 4: the input of the functions that split.
const std::vector<int64_t> kFullShape = {4, 8, 12};
// The input of the functions that concatenate (odd sizes: nothing to split).
const std::vector<int64_t> kShardShape = {2, 3, 5};

// ---- each function's forward and backward, on its own ------------------------------------------

struct Case {
  int world_size;
  int64_t dim;
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << "{world_size=" << c.world_size << ", dim=" << c.dim << "}";
}

struct RankResult {
  at::Tensor x;
  at::Tensor y;
  at::Tensor dx;
};

// On c.world_size ranks: x_r = input(shape, r) requiring grad, y = fn(x_r, group), then
// y.backward(upstream(y.sizes(), r)); returns each rank's x, y (detached) and x.grad. `ranks`
// keeps the backends, to count their collectives.
std::vector<RankResult> run_function(
    int world_size, const std::vector<int64_t>& shape,
    const std::function<at::Tensor(const at::Tensor&, const Group&)>& fn,
    std::vector<Rank>& ranks) {
  auto world = std::make_shared<ThreadWorld>(world_size);
  std::vector<RankResult> results(world_size);
  const auto errors = run_ranks(world_size, world, ranks, [&](int r, Rank& rank) {
    at::Tensor x = input(shape, r).requires_grad_();
    at::Tensor y = fn(x, rank.group);
    y.backward(upstream(y.sizes(), r));
    results[r] = {x.detach(), y.detach(), x.grad()};
  });
  expect_no_errors(errors);
  return results;
}

struct Collectives {
  int64_t allreduce = 0;
  int64_t allgather = 0;
  int64_t reduce_scatter = 0;
};

// The collectives of forward + backward on every rank: as given for n > 1, none for n == 1.
void expect_collectives(const std::vector<Rank>& ranks, Collectives c) {
  if (ranks.size() == 1) c = Collectives{};
  for (size_t r = 0; r < ranks.size(); ++r) {
    EXPECT_EQ(ranks[r].backend->num_allreduce_.load(), c.allreduce) << "rank " << r;
    EXPECT_EQ(ranks[r].backend->num_allgather_base_.load(), c.allgather) << "rank " << r;
    EXPECT_EQ(ranks[r].backend->num_reduce_scatter_base_.load(), c.reduce_scatter) << "rank " << r;
    EXPECT_EQ(ranks[r].backend->num_non_sum_ops_.load(), 0) << "rank " << r;
  }
}

// A communicated output is a new contiguous tensor, not a view of the input.
void expect_new_tensor(const RankResult& result, int world_size) {
  if (world_size == 1) return;  // identity: an alias of the input
  EXPECT_TRUE(result.y.is_contiguous());
  EXPECT_FALSE(result.y.is_alias_of(result.x));
}

// copy_to_region and reduce_from_region, which take no dim.
class TpRegionFunction : public testing::TestWithParam<int> {};

TEST_P(TpRegionFunction, CopyToRegion) {
  const int n = GetParam();
  std::vector<Rank> ranks;
  const auto results = run_function(n, kFullShape, copy_to_region, ranks);
  const at::Tensor dx = sum_over_ranks([&](int r) { return upstream(kFullShape, r); }, n);
  for (int r = 0; r < n; ++r) {
    expect_close(results[r].y, input(kFullShape, r), "y (identity)");
    expect_close(results[r].dx, dx, "dx (all-reduce of g)");
  }
  expect_collectives(ranks, {1, 0, 0});
}

TEST_P(TpRegionFunction, ReduceFromRegion) {
  const int n = GetParam();
  std::vector<Rank> ranks;
  const auto results = run_function(n, kFullShape, reduce_from_region, ranks);
  const at::Tensor y = sum_over_ranks([&](int r) { return input(kFullShape, r); }, n);
  for (int r = 0; r < n; ++r) {
    expect_close(results[r].y, y, "y (all-reduce of x)");
    expect_close(results[r].dx, upstream(kFullShape, r), "dx (identity)");
    expect_new_tensor(results[r], n);
  }
  expect_collectives(ranks, {1, 0, 0});
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, TpRegionFunction, testing::Values(1, 2, 4),
                         [](const testing::TestParamInfo<int>& info) {
                           return fmt::format("world{}", info.param);
                         });

// The functions along a dim.
class TpFunction : public testing::TestWithParam<Case> {};

TEST_P(TpFunction, ScatterToRegion) {
  const int n = GetParam().world_size;
  const int64_t dim = GetParam().dim;
  std::vector<Rank> ranks;
  const auto results = run_function(
      n, kFullShape,
      [&](const at::Tensor& x, const Group& g) { return scatter_to_region(x, dim, g); }, ranks);
  const std::vector<int64_t> chunk_shape = chunk(input(kFullShape, 0), n, dim, 0).sizes().vec();
  const at::Tensor dx = cat_over_ranks([&](int r) { return upstream(chunk_shape, r); }, n, dim);
  for (int r = 0; r < n; ++r) {
    expect_close(results[r].y, chunk(input(kFullShape, r), n, dim, r), "y (chunk r of x)");
    expect_close(results[r].dx, dx, "dx (all-gather of g)");
    expect_new_tensor(results[r], n);
  }
  expect_collectives(ranks, {0, 1, 0});
}

TEST_P(TpFunction, GatherFromRegion) {
  const int n = GetParam().world_size;
  const int64_t dim = GetParam().dim;
  std::vector<Rank> ranks;
  const auto results = run_function(
      n, kShardShape,
      [&](const at::Tensor& x, const Group& g) { return gather_from_region(x, dim, g); }, ranks);
  const at::Tensor y = cat_over_ranks([&](int r) { return input(kShardShape, r); }, n, dim);
  for (int r = 0; r < n; ++r) {
    expect_close(results[r].y, y, "y (all-gather of x)");
    expect_close(results[r].dx, chunk(upstream(y.sizes(), r), n, dim, r), "dx (chunk r of g)");
    expect_new_tensor(results[r], n);
  }
  expect_collectives(ranks, {0, 1, 0});
}

TEST_P(TpFunction, ReduceScatter) {
  const int n = GetParam().world_size;
  const int64_t dim = GetParam().dim;
  std::vector<Rank> ranks;
  const auto results = run_function(
      n, kFullShape, [&](const at::Tensor& x, const Group& g) { return reduce_scatter(x, dim, g); },
      ranks);
  const at::Tensor sum = sum_over_ranks([&](int r) { return input(kFullShape, r); }, n);
  const std::vector<int64_t> chunk_shape = chunk(sum, n, dim, 0).sizes().vec();
  const at::Tensor dx = cat_over_ranks([&](int r) { return upstream(chunk_shape, r); }, n, dim);
  for (int r = 0; r < n; ++r) {
    expect_close(results[r].y, chunk(sum, n, dim, r), "y (chunk r of the sum of x)");
    expect_close(results[r].dx, dx, "dx (all-gather of g)");
    expect_new_tensor(results[r], n);
  }
  expect_collectives(ranks, {0, 1, 1});
}

TEST_P(TpFunction, AllGather) {
  const int n = GetParam().world_size;
  const int64_t dim = GetParam().dim;
  std::vector<Rank> ranks;
  const auto results = run_function(
      n, kShardShape, [&](const at::Tensor& x, const Group& g) { return all_gather(x, dim, g); },
      ranks);
  const at::Tensor y = cat_over_ranks([&](int r) { return input(kShardShape, r); }, n, dim);
  const at::Tensor g_sum = sum_over_ranks([&](int r) { return upstream(y.sizes(), r); }, n);
  for (int r = 0; r < n; ++r) {
    expect_close(results[r].y, y, "y (all-gather of x)");
    expect_close(results[r].dx, chunk(g_sum, n, dim, r), "dx (chunk r of the sum of g)");
    expect_new_tensor(results[r], n);
  }
  expect_collectives(ranks, {0, 1, 1});
}

INSTANTIATE_TEST_SUITE_P(WorldSizesAndDims, TpFunction,
                         testing::Values(Case{1, 0}, Case{1, 1}, Case{1, -1}, Case{2, 0},
                                         Case{2, 1}, Case{2, -1}, Case{4, 0}, Case{4, 1},
                                         Case{4, -1}, Case{4, 2}),
                         [](const testing::TestParamInfo<Case>& info) {
                           const int64_t dim = info.param.dim;
                           return fmt::format("world{}_dim{}{}", info.param.world_size,
                                              dim < 0 ? "minus" : "", dim < 0 ? -dim : dim);
                         });

// ---- errors ------------------------------------------------------------------------------------

// The message of the smp::Error that `fn` throws ("" and a failure if it throws nothing else).
std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const smp::Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "no smp::Error thrown";
  return "";
}

TEST(TpErrors, DivisibilityNamesDimSizeAndGroupSize) {
  // Checked before anything is communicated, so one rank of a group of 4 is enough.
  auto world = std::make_shared<ThreadWorld>(4);
  Rank rank = make_rank(world, 0, 4);
  const at::Tensor x = at::zeros({4, 6, 8});
  for (const auto& fn : {scatter_to_region, reduce_scatter}) {
    const std::string message = error_of([&] { fn(x, 1, rank.group); });
    EXPECT_NE(message.find("size 6 of dim 1"), std::string::npos) << message;
    EXPECT_NE(message.find("group size 4"), std::string::npos) << message;
    EXPECT_NE(message.find("[4, 6, 8]"), std::string::npos) << message;
    // A negative dim is reported as the dim it stands for.
    EXPECT_NE(error_of([&] { fn(x, -2, rank.group); }).find("size 6 of dim 1"), std::string::npos);
  }
  EXPECT_EQ(
      rank.backend->num_allgather_base_.load() + rank.backend->num_reduce_scatter_base_.load(), 0);
}

TEST(TpErrors, DivisibleSizesPassTheCheck) {
  // Group size 1 divides everything: no error, and the identity.
  auto world = std::make_shared<ThreadWorld>(1);
  Rank rank = make_rank(world, 0, 1);
  const at::Tensor x = values({3, 5}, 0);
  expect_close(scatter_to_region(x, 1, rank.group), x, "scatter on 1 rank");
  expect_close(reduce_scatter(x, 0, rank.group), x, "reduce_scatter on 1 rank");
}

TEST(TpErrors, BadArguments) {
  auto world = std::make_shared<ThreadWorld>(2);
  Rank rank = make_rank(world, 0, 2);
  const at::Tensor x = at::zeros({2, 4});
  std::string message = error_of([&] { all_gather(x, 2, rank.group); });
  EXPECT_NE(message.find("dim 2 is out of range"), std::string::npos) << message;
  message = error_of([&] { gather_from_region(x, -3, rank.group); });
  EXPECT_NE(message.find("dim -3 is out of range"), std::string::npos) << message;
  message = error_of([&] { all_gather(at::zeros({}), 0, rank.group); });
  EXPECT_NE(message.find("0-dim"), std::string::npos) << message;
  message = error_of([&] { copy_to_region(x, Group()); });
  EXPECT_NE(message.find("copy_to_region: group must not be null"), std::string::npos) << message;
  message = error_of([&] { reduce_from_region(at::Tensor(), rank.group); });
  EXPECT_NE(message.find("undefined"), std::string::npos) << message;
}

TEST(TpErrors, RanksIssuingDifferentCollectivesAllFail) {
  // The fake backend's own check (thread_world.h), which the tests above rely on to catch ranks
  // that pair different collectives.
  auto world = std::make_shared<ThreadWorld>(2);
  std::vector<Rank> ranks;
  const auto errors = run_ranks(2, world, ranks, [&](int r, Rank& rank) {
    const at::Tensor x = at::ones({2, 4});
    if (r == 0) {
      reduce_from_region(x, rank.group);
    } else {
      all_gather(x, 0, rank.group);
    }
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(errors[r]) << "rank " << r;
    try {
      std::rethrow_exception(errors[r]);
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("collective 0"), std::string::npos) << e.what();
    }
  }
}

// ---- autograd details --------------------------------------------------------------------------

TEST(TpAutograd, InputsWithoutGradGiveNoGraph) {
  std::vector<Rank> ranks;
  auto world = std::make_shared<ThreadWorld>(2);
  const auto errors = run_ranks(2, world, ranks, [&](int r, Rank& rank) {
    const at::Tensor x = input(kFullShape, r);
    for (const at::Tensor& y :
         {copy_to_region(x, rank.group), reduce_from_region(x, rank.group),
          scatter_to_region(x, 1, rank.group), gather_from_region(x, 1, rank.group),
          reduce_scatter(x, 1, rank.group), all_gather(x, 1, rank.group)}) {
      EXPECT_FALSE(y.requires_grad());
      EXPECT_FALSE(y.grad_fn());
    }
  });
  expect_no_errors(errors);
}

TEST(TpAutograd, SizeOneGroupIsAnAliasWithIdentityGradient) {
  auto world = std::make_shared<ThreadWorld>(1);
  Rank rank = make_rank(world, 0, 1);
  const std::vector<std::function<at::Tensor(const at::Tensor&)>> fns = {
      [&](const at::Tensor& x) { return copy_to_region(x, rank.group); },
      [&](const at::Tensor& x) { return reduce_from_region(x, rank.group); },
      [&](const at::Tensor& x) { return scatter_to_region(x, 0, rank.group); },
      [&](const at::Tensor& x) { return gather_from_region(x, 1, rank.group); },
      [&](const at::Tensor& x) { return reduce_scatter(x, -1, rank.group); },
      [&](const at::Tensor& x) { return all_gather(x, 0, rank.group); }};
  for (size_t i = 0; i < fns.size(); ++i) {
    at::Tensor x = input(kShardShape, 0).requires_grad_();
    at::Tensor y = fns[i](x);
    EXPECT_TRUE(y.is_alias_of(x)) << "function " << i;
    EXPECT_TRUE(y.grad_fn()) << "function " << i;
    const at::Tensor g = upstream(kShardShape, 0);
    y.backward(g);
    expect_close(x.grad(), g, fmt::format("dx of function {}", i));
  }
  EXPECT_EQ(rank.backend->num_allreduce_.load() + rank.backend->num_allgather_base_.load() +
                rank.backend->num_reduce_scatter_base_.load(),
            0);
}

TEST(TpAutograd, GraphKeepsTheGroupAlive) {
  // See Note [The group in the autograd graph]: the caller drops its group after the forward.
  constexpr int kWorldSize = 2;
  auto world = std::make_shared<ThreadWorld>(kWorldSize);
  std::vector<Rank> ranks;
  const auto errors = run_ranks(kWorldSize, world, ranks, [&](int r, Rank& rank) {
    at::Tensor x = input(kShardShape, r).requires_grad_();
    at::Tensor y = all_gather(x, 1, rank.group);
    c10::weak_intrusive_ptr<c10d::ProcessGroup> weak(rank.group);
    rank.group.reset();  // the only other owner left is y's graph
    EXPECT_FALSE(weak.expired());
    y.backward(upstream(y.sizes(), r));  // reduce-scatter over the dropped group
    EXPECT_EQ(x.grad().sizes(), x.sizes());
    // The node holds its saved data (the group) until the graph is freed, as a Python
    // autograd.Function's ctx does; freeing y frees the graph and the group.
    EXPECT_FALSE(weak.expired());
    y.reset();
    EXPECT_TRUE(weak.expired());
  });
  expect_no_errors(errors);
  EXPECT_EQ(ranks[0].backend->num_reduce_scatter_base_.load(), 1);
}

TEST(TpAutograd, AutogradGradAndDoubleBackward) {
  // torch::autograd::grad instead of backward(), and a backward that is itself differentiated:
  // dx = all_gather's backward = reduce_scatter(g); d<dx, h>/dg = all_gather(h).
  constexpr int kWorldSize = 2;
  constexpr int64_t kDim = 1;
  auto world = std::make_shared<ThreadWorld>(kWorldSize);
  std::vector<Rank> ranks;
  std::vector<at::Tensor> dx(kWorldSize);
  std::vector<at::Tensor> dg(kWorldSize);
  const auto errors = run_ranks(kWorldSize, world, ranks, [&](int r, Rank& rank) {
    at::Tensor x = input(kShardShape, r).requires_grad_();
    at::Tensor y = all_gather(x, kDim, rank.group);
    at::Tensor g = upstream(y.sizes(), r).requires_grad_();
    dx[r] = torch::autograd::grad({y}, {x}, {g}, /*retain_graph=*/true, /*create_graph=*/true)[0];
    EXPECT_TRUE(dx[r].requires_grad());
    dg[r] = torch::autograd::grad({dx[r]}, {g}, {upstream(kShardShape, 50 + r)})[0];
  });
  expect_no_errors(errors);
  const std::vector<int64_t> full_shape = {2, 3 * kWorldSize, 5};
  const at::Tensor g_sum = sum_over_ranks([&](int r) { return upstream(full_shape, r); }, 2);
  const at::Tensor h_cat =
      cat_over_ranks([&](int r) { return upstream(kShardShape, 50 + r); }, 2, kDim);
  for (int r = 0; r < kWorldSize; ++r) {
    expect_close(dx[r].detach(), chunk(g_sum, kWorldSize, kDim, r), "dx");
    expect_close(dg[r], h_cat, "d<dx, h>/dg");
  }
}

// ---- composition: parallel MLPs equal the unsplit MLP ------------------------------------------

// The unsplit MLP y = gelu(x W1^T + b1) W2^T + b2, its parameters and their gradients for the
// upstream gradient g, all float64.
struct Mlp {
  static constexpr int64_t kBatch = 4;
  static constexpr int64_t kModel = 6;
  static constexpr int64_t kHidden = 8;

  at::Tensor x = values({kBatch, kModel}, 1).requires_grad_();
  at::Tensor w1 = values({kHidden, kModel}, 2).requires_grad_();
  at::Tensor b1 = values({kHidden}, 3).requires_grad_();
  at::Tensor w2 = values({kModel, kHidden}, 4).requires_grad_();
  at::Tensor b2 = values({kModel}, 5).requires_grad_();
  at::Tensor g = values({kBatch, kModel}, 6);
  at::Tensor y;

  Mlp() {
    y = at::linear(at::gelu(at::linear(x, w1, b1)), w2, b2);
    y.backward(g);
  }
};

// Rank r's shard of the MLP (Megatron layout): W1, b1 split by rows (column-parallel: each rank
// computes hidden units [r*h/n, (r+1)*h/n)), W2 split by columns (row-parallel: each rank's
// output is a partial sum over its hidden units); b2 replicated.
struct MlpShard {
  at::Tensor w1, b1, w2, b2;
  MlpShard(const Mlp& mlp, int n, int r)
      : w1(chunk(mlp.w1.detach(), n, 0, r).clone().requires_grad_()),
        b1(chunk(mlp.b1.detach(), n, 0, r).clone().requires_grad_()),
        w2(chunk(mlp.w2.detach(), n, 1, r).clone().requires_grad_()),
        b2(mlp.b2.detach().clone().requires_grad_()) {}

  // hidden -> partial output, both local.
  at::Tensor partial(const at::Tensor& h) const {
    return at::linear(at::gelu(at::linear(h, w1, b1)), w2);
  }

  void expect_grads(const Mlp& mlp, int n, int r) const {
    expect_close(w1.grad(), chunk(mlp.w1.grad(), n, 0, r), "dW1 shard");
    expect_close(b1.grad(), chunk(mlp.b1.grad(), n, 0, r), "db1 shard");
    expect_close(w2.grad(), chunk(mlp.w2.grad(), n, 1, r), "dW2 shard");
  }
};

TEST(TpComposition, ColumnThenRowParallelMlpEqualsUnsplitMlp) {
  // y = reduce_from_region(gelu(copy_to_region(x) W1_r^T + b1_r) W2_r^T) + b2
  constexpr int kWorldSize = 2;
  const Mlp mlp;
  auto world = std::make_shared<ThreadWorld>(kWorldSize);
  std::vector<Rank> ranks;
  const auto errors = run_ranks(kWorldSize, world, ranks, [&](int r, Rank& rank) {
    const MlpShard shard(mlp, kWorldSize, r);
    at::Tensor x = mlp.x.detach().clone().requires_grad_();
    at::Tensor y =
        reduce_from_region(shard.partial(copy_to_region(x, rank.group)), rank.group) + shard.b2;
    y.backward(mlp.g);  // y is replicated, and so is its gradient
    expect_close(y.detach(), mlp.y.detach(), fmt::format("y on rank {}", r));
    shard.expect_grads(mlp, kWorldSize, r);
    expect_close(shard.b2.grad(), mlp.b2.grad(), "db2");
    expect_close(x.grad(), mlp.x.grad(), "dx (all-reduced by copy_to_region's backward)");
  });
  expect_no_errors(errors);
  for (const Rank& rank : ranks) {
    EXPECT_EQ(rank.backend->num_allreduce_.load(), 2);  // the output, the input gradient
  }
}

TEST(TpComposition, SequenceParallelMlpEqualsUnsplitMlp) {
  // The batch (sequence) dim sharded outside the block:
  //   y_r = reduce_scatter(gelu(all_gather(x_r) W1_r^T + b1_r) W2_r^T, 0) + b2
  constexpr int kWorldSize = 2;
  const Mlp mlp;
  auto world = std::make_shared<ThreadWorld>(kWorldSize);
  std::vector<Rank> ranks;
  std::vector<at::Tensor> db2(kWorldSize);
  const auto errors = run_ranks(kWorldSize, world, ranks, [&](int r, Rank& rank) {
    const MlpShard shard(mlp, kWorldSize, r);
    at::Tensor x = chunk(mlp.x.detach(), kWorldSize, 0, r).clone().requires_grad_();
    at::Tensor y =
        reduce_scatter(shard.partial(all_gather(x, 0, rank.group)), 0, rank.group) + shard.b2;
    y.backward(chunk(mlp.g, kWorldSize, 0, r));
    expect_close(y.detach(), chunk(mlp.y.detach(), kWorldSize, 0, r), "y shard");
    shard.expect_grads(mlp, kWorldSize, r);
    expect_close(x.grad(), chunk(mlp.x.grad(), kWorldSize, 0, r), "dx shard");
    db2[r] = shard.b2.grad();  // partial: b2 sees only this rank's rows
  });
  expect_no_errors(errors);
  expect_close(db2[0] + db2[1], mlp.b2.grad(), "db2 summed over ranks");
}

}  // namespace
}  // namespace smp::pytorch::tp
