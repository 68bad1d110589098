// PipelineServer: messages in, runnable tasks out, over two ranks as threads (thread_world.h).
#include "smp/pytorch/server.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <future>
#include <string>
#include <vector>

#include "thread_world.h"

namespace smp::pytorch {
namespace {

using std::chrono::milliseconds;
using test_util::Event;
using test_util::expect_no_errors;
using test_util::Rank;
using test_util::run_ranks;
using test_util::ThreadWorld;

constexpr milliseconds kLong{10000};
constexpr int kTag = 11;
constexpr auto kRequest = static_cast<int64_t>(MessageKind::kRequest);
constexpr auto kReply = static_cast<int64_t>(MessageKind::kReply);
constexpr auto kGradOut = static_cast<int64_t>(MessageKind::kGradOut);
constexpr auto kGradIn = static_cast<int64_t>(MessageKind::kGradIn);
constexpr auto kError = static_cast<int64_t>(MessageKind::kError);
constexpr auto kStepEnd = static_cast<int64_t>(MessageKind::kStepEnd);

// Rank 0 sends with `send` and then ends the step; rank 1 calls `serve` on its (non-leader)
// server only once all of rank 0's messages are queued there, so the order in which the server
// hands out tasks is its own, not the arrival's.
void queued_then_served(const std::function<void(Transport&)>& send,
                        const std::function<void(PipelineServer&)>& serve) {
  auto world = std::make_shared<ThreadWorld>(2);
  std::vector<Rank> ranks;
  std::promise<void> sent;
  std::shared_future<void> sent_future = sent.get_future().share();
  const auto errors = run_ranks(2, world, ranks, [&](int r, Rank& rank) {
    Transport transport(rank.group, {1 - r}, kLong, kTag);
    transport.start();
    PipelineServer server(&transport, PipelineKind::kInterleaved, 1, 1, /*is_leader=*/false);
    if (r == 0) {
      send(transport);  // each send returns once rank 1 has taken the message
      sent.set_value();
      transport.send(1, {kStepEnd, 1}, {});
    } else {
      sent_future.wait();
      serve(server);
    }
    transport.finish();
  });
  expect_no_errors(errors);
}

// One microbatch, one remote call and its backward: the leader starts the microbatch, calls a
// module on stage 1 (REQUEST / REPLY), runs backward (GRAD_OUT / GRAD_IN), finishes, and ends the
// step; stage 1 serves the call and its backward. Every task arrives with its message.
TEST(PipelineServerTest, OneCallForwardAndBackward) {
  auto world = std::make_shared<ThreadWorld>(2);
  std::vector<Rank> ranks;
  const auto errors = run_ranks(2, world, ranks, [&](int r, Rank& rank) {
    Transport transport(rank.group, {1 - r}, kLong, kTag);
    transport.start();
    PipelineServer server(&transport, PipelineKind::kInterleaved, 1, 1, /*is_leader=*/r == 0);
    if (r == 0) {
      auto start = server.next(kLong);
      ASSERT_TRUE(start);
      EXPECT_EQ(start->task.kind, TaskKind::kStartMicrobatch);
      EXPECT_FALSE(start->message);
      const int64_t worker = server.new_id();
      server.expect(/*call_id=*/42, TaskKind::kResume, 0, worker);
      transport.send(1, {kRequest, 0, 42, /*module=*/3}, {at::full({2}, 1.5)});
      auto resume = server.next(kLong);
      ASSERT_TRUE(resume && resume->message);
      EXPECT_EQ(resume->task.kind, TaskKind::kResume);
      EXPECT_EQ(resume->task.id, worker);
      EXPECT_TRUE(resume->message->tensors[0].equal(at::full({2}, 3.0)));
      server.policy().on_forward_done(0);
      server.expect(42, TaskKind::kBackward, 0, worker);
      transport.send(1, {kGradOut, 0, 42, 0}, {at::ones({2})});
      auto backward = server.next(kLong);
      ASSERT_TRUE(backward && backward->message);
      EXPECT_EQ(backward->task.kind, TaskKind::kBackward);
      EXPECT_EQ(backward->message->header[0], kGradIn);
      server.policy().on_microbatch_finished(0);
      EXPECT_FALSE(server.next(kLong));  // every microbatch finished
      transport.send(1, {kStepEnd, 1}, {});
    } else {
      auto serve = server.next(kLong);
      ASSERT_TRUE(serve && serve->message);
      EXPECT_EQ(serve->task.kind, TaskKind::kServeRequest);
      EXPECT_EQ(serve->message->header, (std::vector<int64_t>{kRequest, 0, 42, 3}));
      transport.send(0, {kReply, 0, 42}, {serve->message->tensors[0] * 2});
      auto backward = server.next(kLong);
      ASSERT_TRUE(backward && backward->message);
      EXPECT_EQ(backward->task.kind, TaskKind::kBackward);
      EXPECT_EQ(backward->target, serve->task.id);   // routed to the worker serving call 42
      EXPECT_NE(backward->task.id, serve->task.id);  // a task of its own
      transport.send(0, {kGradIn, 0, 42, 0}, {at::ones({2}) * 2});
      EXPECT_FALSE(server.next(kLong));  // STEP_END
      EXPECT_EQ(server.announced_backward_calls(), 1);
    }
    transport.finish();
  });
  expect_no_errors(errors);
}

// A caller that drops a call's outputs sends its GRAD_OUT right after the REQUEST; the owner may
// read both before it takes the REQUEST's task. Each is a task with its own message.
TEST(PipelineServerTest, GradOutQueuedBehindItsRequestKeepsBoth) {
  queued_then_served(
      [](Transport& transport) {
        transport.send(1, {kRequest, 0, 7, /*module=*/2}, {at::full({2}, 1.0)});
        transport.send(1, {kGradOut, 0, 7}, {});
      },
      [](PipelineServer& server) {
        auto serve = server.next(kLong);
        ASSERT_TRUE(serve && serve->message);
        EXPECT_EQ(serve->task.kind, TaskKind::kServeRequest);
        EXPECT_EQ(serve->message->header[0], kRequest);
        EXPECT_EQ(serve->target, serve->task.id);
        auto backward = server.next(kLong);
        ASSERT_TRUE(backward && backward->message);
        EXPECT_EQ(backward->task.kind, TaskKind::kBackward);
        EXPECT_EQ(backward->message->header[0], kGradOut);
        EXPECT_EQ(backward->target, serve->task.id);
        EXPECT_FALSE(server.next(kLong));  // STEP_END
      });
}

// A call's GRAD_OUT waits for every REQUEST of its microbatch that came before it (Note
// [Gradients after the requests before them]): the later call may take the first one's outputs
// by reference, and must be counted before the first one's backward may start. Each GRAD_OUT
// comes out after both REQUESTs, whatever the policy prefers.
TEST(PipelineServerTest, GradOutWaitsForTheRequestsBeforeIt) {
  queued_then_served(
      [](Transport& transport) {
        transport.send(1, {kRequest, 0, 7, /*module=*/2}, {at::full({2}, 1.0)});
        transport.send(1, {kRequest, 0, 8, /*module=*/3}, {});  // takes call 7's output
        transport.send(1, {kGradOut, 0, 8}, {});
        transport.send(1, {kGradOut, 0, 7}, {});
      },
      [](PipelineServer& server) {
        std::vector<int64_t> order;  // call ids, negative for a GRAD_OUT
        while (auto task = server.next(kLong)) {
          ASSERT_TRUE(task->message);
          const auto& header = task->message->header;
          order.push_back(header[0] == kGradOut ? -header[2] : header[2]);
        }
        ASSERT_EQ(order.size(), 4u);
        EXPECT_EQ((std::vector<int64_t>{order[0], order[1]}), (std::vector<int64_t>{7, 8}));
      });
}

// Note [Late answers]: a quiet call of microbatch 0 goes otherwise after the leader finished
// that microbatch; its REPLY, and a REQUEST it sends after it, are handed out (in that order)
// instead of failing the policy's check, and the step goes on with microbatch 1.
TEST(PipelineServerTest, MessagesForAFinishedMicrobatchAreHandedOutLate) {
  auto world = std::make_shared<ThreadWorld>(2);
  std::vector<Rank> ranks;
  Event finished, answered;
  const auto errors = run_ranks(2, world, ranks, [&](int r, Rank& rank) {
    Transport transport(rank.group, {1 - r}, kLong, kTag);
    transport.start();
    PipelineServer server(&transport, PipelineKind::kInterleaved, 2, 1, /*is_leader=*/r == 0);
    if (r == 0) {
      auto start = server.next(kLong);
      ASSERT_TRUE(start);
      EXPECT_EQ(start->task.microbatch, 0);
      const int64_t worker = server.new_id();
      server.expect(/*call_id=*/7, TaskKind::kResume, 0, worker);  // a quiet call: not awaited
      server.policy().on_forward_done(0);
      server.policy().on_microbatch_finished(0);
      finished.set();
      answered.wait();
      std::vector<TaskKind> late;  // microbatch 0's tasks, in the order handed out
      bool started = false;
      while (late.size() < 2 || !started) {
        auto task = server.next(kLong);
        ASSERT_TRUE(task);
        if (task->task.kind == TaskKind::kStartMicrobatch) {
          EXPECT_EQ(task->task.microbatch, 1);
          started = true;
          continue;
        }
        ASSERT_TRUE(task->message);
        EXPECT_EQ(task->task.microbatch, 0);
        late.push_back(task->task.kind);
        if (task->task.kind == TaskKind::kResume) {
          EXPECT_EQ(task->task.id, worker);
          EXPECT_EQ(task->message->header[0], kReply);
        }
      }
      EXPECT_EQ(late, (std::vector<TaskKind>{TaskKind::kResume, TaskKind::kServeRequest}));
      server.policy().on_forward_done(1);
      server.policy().on_microbatch_finished(1);
      EXPECT_FALSE(server.next(kLong));  // every microbatch finished
      transport.send(1, {kStepEnd, 1}, {});
    } else {
      finished.wait();
      transport.send(0, {kReply, 0, 7}, {});                   // the quiet call went otherwise
      transport.send(0, {kRequest, 0, 9, /*module=*/-1}, {});  // and fetches from its caller
      answered.set();
      EXPECT_FALSE(server.next(kLong));  // STEP_END
    }
    transport.finish();
  });
  expect_no_errors(errors);
}

// An ERROR message surfaces as RemoteStageError carrying the sender's text.
TEST(PipelineServerTest, ErrorMessageRaisesRemoteStageError) {
  auto world = std::make_shared<ThreadWorld>(2);
  std::vector<Rank> ranks;
  const auto errors = run_ranks(2, world, ranks, [&](int r, Rank& rank) {
    Transport transport(rank.group, {1 - r}, kLong, kTag);
    transport.start();
    PipelineServer server(&transport, PipelineKind::kSimple, 2, 2, /*is_leader=*/r == 0);
    if (r == 1) {
      const std::string text = "stage 1, microbatch 0: ValueError: boom";
      at::Tensor blob = at::empty({static_cast<int64_t>(text.size())}, at::kByte);
      std::memcpy(blob.data_ptr(), text.data(), text.size());
      transport.send(0, {kError}, {blob});
    } else {
      ASSERT_TRUE(server.next(kLong));  // the start of microbatch 0 is runnable at once
      try {
        while (server.next(kLong)) {
        }
        ADD_FAILURE() << "expected RemoteStageError";
      } catch (const RemoteStageError& e) {
        EXPECT_EQ(std::string(e.what()), "stage 1, microbatch 0: ValueError: boom");
      }
    }
    transport.finish();
  });
  expect_no_errors(errors);
}

// Nothing runnable and nothing arriving: the timeout error names the queued work.
TEST(PipelineServerTest, TimeoutNamesTheQueuedWork) {
  auto world = std::make_shared<ThreadWorld>(2);
  std::vector<Rank> ranks;
  std::promise<void> timed_out;  // rank 0 finishes only after rank 1 has seen its timeout
  std::shared_future<void> timed_out_future = timed_out.get_future().share();
  const auto errors = run_ranks(2, world, ranks, [&](int r, Rank& rank) {
    Transport transport(rank.group, {1 - r}, kLong, kTag);
    transport.start();
    if (r == 1) {
      PipelineServer server(&transport, PipelineKind::kInterleaved, 1, 1, false);
      try {
        server.next(milliseconds(200));
        ADD_FAILURE() << "expected a timeout";
      } catch (const TransportError& e) {
        EXPECT_NE(std::string(e.what()).find("queued work"), std::string::npos) << e.what();
      }
      timed_out.set_value();
    } else {
      ASSERT_EQ(timed_out_future.wait_for(std::chrono::seconds(30)), std::future_status::ready);
    }
    transport.finish();
  });
  expect_no_errors(errors);
}

}  // namespace
}  // namespace smp::pytorch
