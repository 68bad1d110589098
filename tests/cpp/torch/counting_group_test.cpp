#include "smp/pytorch/counting_group.h"

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <ATen/ATen.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "smp/error.h"
#include "smp/pytorch/tp_comm.h"
#include "thread_world.h"

// The wrapped groups are ThreadWorld ranks (thread_world.h); the Python tests wrap real gloo
// groups.

namespace smp::pytorch {
namespace {

using test_util::expect_no_errors;
using test_util::make_rank;
using test_util::Rank;
using test_util::run_ranks;
using test_util::ThreadWorld;

using Counts = std::map<std::string, OpCount>;

TEST(CountingGroup, SameRankAndSizeAsTheWrappedGroup) {
  auto world = std::make_shared<ThreadWorld>(3);
  Rank rank = make_rank(world, 2, 3);
  CountingGroup counting(rank.group);
  EXPECT_EQ(counting.group()->getRank(), 2);
  EXPECT_EQ(counting.group()->getSize(), 3);
  EXPECT_EQ(counting.backend()->inner(), rank.group->getBackend(c10::DeviceType::CPU));
  EXPECT_EQ(counting.group()->getBackend(c10::DeviceType::CPU)->getBackendName(), "smp_counting");
  EXPECT_TRUE(counting.counts().empty());
}

TEST(CountingGroup, CountsTensorParallelFunctionsForwardAndBackward) {
  constexpr int kWorldSize = 2;
  auto world = std::make_shared<ThreadWorld>(kWorldSize);
  std::vector<Rank> ranks;
  std::vector<Counts> forward(kWorldSize), backward(kWorldSize), after_reset(kWorldSize);
  const auto errors = run_ranks(kWorldSize, world, ranks, [&](int r, Rank& rank) {
    CountingGroup counting(rank.group);
    const auto& group = counting.group();

    // [3, 4] float64: 96 bytes. The all-reduce runs in forward, its partner's in backward.
    at::Tensor x = at::ones({3, 4}, at::kDouble).requires_grad_();
    at::Tensor y = tp::reduce_from_region(tp::copy_to_region(x, group), group);
    forward[r] = counting.counts();
    y.backward(at::ones_like(y));
    backward[r] = counting.counts();
    EXPECT_TRUE(at::allclose(y, at::full({3, 4}, 2.0, at::kDouble)));

    // all_gather of a [2, 3] float32 shard (24 bytes) along dim 1; its backward reduce-scatters
    // the [2, 6] gradient (48 bytes in).
    counting.reset();
    at::Tensor shard = at::ones({2, 3}).requires_grad_();
    at::Tensor gathered = tp::all_gather(shard, 1, group);
    gathered.backward(at::ones_like(gathered));
    after_reset[r] = counting.counts();
    EXPECT_TRUE(at::allclose(shard.grad(), at::full({2, 3}, 2.0f)));
  });
  expect_no_errors(errors);
  for (int r = 0; r < kWorldSize; ++r) {
    EXPECT_EQ(forward[r], (Counts{{"allreduce", {1, 96}}})) << "rank " << r;
    EXPECT_EQ(backward[r], (Counts{{"allreduce", {2, 192}}})) << "rank " << r;
    EXPECT_EQ(after_reset[r],
              (Counts{{"_allgather_base", {1, 24}}, {"_reduce_scatter_base", {1, 48}}}))
        << "rank " << r;
    // Forwarded to the wrapped backend, which did the work.
    EXPECT_EQ(ranks[r].backend->num_allreduce_.load(), 2);
    EXPECT_EQ(ranks[r].backend->num_allgather_base_.load(), 1);
    EXPECT_EQ(ranks[r].backend->num_reduce_scatter_base_.load(), 1);
  }
}

TEST(CountingGroup, CountsPointToPointBytes) {
  constexpr int kWorldSize = 2;
  auto world = std::make_shared<ThreadWorld>(kWorldSize);
  std::vector<Rank> ranks;
  std::vector<Counts> counts(kWorldSize);
  const auto errors = run_ranks(kWorldSize, world, ranks, [&](int r, Rank& rank) {
    CountingGroup counting(rank.group);
    std::vector<at::Tensor> tensors{at::full({5}, static_cast<int64_t>(r))};  // 40 bytes
    if (r == 0) {
      counting.group()->send(tensors, 1, /*tag=*/3)->wait();
      counting.group()->send(tensors, 1, /*tag=*/3)->wait();
    } else {
      counting.group()->recv(tensors, 0, /*tag=*/3)->wait();
      counting.group()->recv(tensors, 0, /*tag=*/3)->wait();
      EXPECT_EQ(tensors[0][0].item<int64_t>(), 0);
    }
    counts[r] = counting.counts();
  });
  expect_no_errors(errors);
  EXPECT_EQ(counts[0], (Counts{{"send", {2, 80}}}));
  EXPECT_EQ(counts[1], (Counts{{"recv", {2, 80}}}));
}

TEST(CountingGroup, CountsAnOpTheInnerBackendRejects) {
  // ThreadBackend has no barrier: the call is counted (it was issued), then fails as it would
  // without the wrapper.
  auto world = std::make_shared<ThreadWorld>(1);
  Rank rank = make_rank(world, 0, 1);
  CountingGroup counting(rank.group);
  EXPECT_THROW(counting.group()->barrier(), c10::Error);
  EXPECT_EQ(counting.counts(), (Counts{{"barrier", {1, 0}}}));
}

TEST(CountingGroup, GroupOutlivesTheWrapper) {
  auto world = std::make_shared<ThreadWorld>(1);
  Rank rank = make_rank(world, 0, 1);
  c10::intrusive_ptr<CountingBackend> backend;
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  {
    CountingGroup counting(rank.group);
    backend = counting.backend();
    group = counting.group();
  }
  std::vector<at::Tensor> tensors{at::ones({2})};
  group->allreduce(tensors)->wait();
  EXPECT_EQ(backend->counts(), (Counts{{"allreduce", {1, 8}}}));
}

TEST(CountingGroup, RejectsNullAndBackendlessGroups) {
  EXPECT_THROW(CountingGroup(c10::intrusive_ptr<c10d::ProcessGroup>()), smp::Error);
  auto bare = c10::make_intrusive<c10d::ProcessGroup>(c10::make_intrusive<c10d::HashStore>(), 0, 1);
  try {
    CountingGroup counting(bare);
    ADD_FAILURE() << "no error";
  } catch (const smp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("no CPU backend"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace smp::pytorch
