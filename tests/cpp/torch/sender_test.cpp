// Tests of the pipeline's message sender (smp/pytorch/sender.h) over ThreadWorld ranks.
#include "smp/pytorch/sender.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "smp/error.h"
#include "smp/pytorch/transport.h"
#include "thread_world.h"

namespace smp::pytorch {
namespace {

using std::chrono::milliseconds;
using test_util::Event;
using test_util::expect_no_errors;
using test_util::Rank;
using test_util::run_ranks;
using test_util::ThreadWorld;

constexpr milliseconds kLong{10000};  // bounds waits that should succeed
constexpr int kTag = 7;

std::vector<at::Tensor> tensors_of(int i) {
  if (i % 3 == 0) return {};
  return {at::arange(i % 7 + 1, at::kFloat) + i, at::full({40}, i, at::kLong)};
}

void expect_in_order(Transport& transport, int peer, int count, int base = 0) {
  for (int i = 0; i < count; ++i) {
    std::optional<Message> got = transport.recv(kLong);
    ASSERT_TRUE(got.has_value()) << "message " << i;
    EXPECT_EQ(got->peer, peer);
    EXPECT_EQ(got->header, (std::vector<int64_t>{base + i, peer}));
    const auto want = tensors_of(base + i);
    ASSERT_EQ(got->tensors.size(), want.size());
    for (size_t k = 0; k < want.size(); ++k) EXPECT_TRUE(at::equal(got->tensors[k], want[k]));
  }
}

// Rank 0 queues messages for two peers at once: each peer gets its own in the order queued, and
// close() drains both queues.
TEST(SenderTest, EachPeerGetsItsMessagesInOrder) {
  constexpr int kNum = 150;
  auto world = std::make_shared<ThreadWorld>(3);
  std::vector<Rank> ranks;
  const auto errors = run_ranks(3, world, ranks, [&](int r, Rank& rank) {
    const std::vector<int> peers = r == 0 ? std::vector<int>{1, 2} : std::vector<int>{0};
    Transport transport(rank.group, peers, kLong, kTag);
    transport.start();
    if (r == 0) {
      Sender sender(&transport, {1, 2}, kLong);
      for (int i = 0; i < kNum; ++i) {
        for (int peer : {1, 2}) sender.send(peer, {i, 0}, tensors_of(i));
      }
      EXPECT_TRUE(sender.close().empty());
      EXPECT_EQ(sender.sent(), 2 * kNum);
      sender.check();
    } else {
      expect_in_order(transport, 0, kNum);
    }
    transport.finish();
  });
  expect_no_errors(errors);
}

// Messages that queue up while the first is on the wire (the peer has not started yet) go as
// one batch: far fewer sends of the backend than messages, each intact and in order.
TEST(SenderTest, WhatQueuesUpGoesAsOneBatch) {
  constexpr int kNum = 40;
  auto world = std::make_shared<ThreadWorld>(2);
  std::vector<Rank> ranks;
  Event queued;
  const auto errors = run_ranks(2, world, ranks, [&](int r, Rank& rank) {
    Transport transport(rank.group, {1 - r}, kLong, kTag);
    if (r == 0) {
      transport.start();
      const int64_t before = rank.backend->num_send_.load();
      Sender sender(&transport, {1}, kLong);
      for (int i = 0; i < kNum; ++i) sender.send(1, {i, 0}, {});
      queued.set();
      EXPECT_TRUE(sender.close().empty());
      // The first message alone (its send waits for the peer), then the rest together.
      EXPECT_LE(rank.backend->num_send_.load() - before, 3);
    } else {
      queued.wait();
      transport.start();
      for (int i = 0; i < kNum; ++i) {
        std::optional<Message> got = transport.recv(kLong);
        ASSERT_TRUE(got.has_value());
        EXPECT_EQ(got->header, (std::vector<int64_t>{i, 0}));
      }
    }
    transport.finish();
  });
  expect_no_errors(errors);
}

// send(..., wait=true) returns once the message is sent; without, at once.
TEST(SenderTest, WaitReturnsOnceSent) {
  auto world = std::make_shared<ThreadWorld>(2);
  std::vector<Rank> ranks;
  Event queued;
  const auto errors = run_ranks(2, world, ranks, [&](int r, Rank& rank) {
    Transport transport(rank.group, {1 - r}, kLong, kTag);
    if (r == 0) {
      transport.start();
      Sender sender(&transport, {1}, kLong);
      sender.send(1, {0, 0}, tensors_of(0));  // the peer has not started: cannot be sent yet
      EXPECT_EQ(sender.sent(), 0);
      queued.set();
      sender.send(1, {1, 0}, tensors_of(1), /*wait=*/true);
      EXPECT_EQ(sender.sent(), 2);
      EXPECT_TRUE(sender.close().empty());
    } else {
      queued.wait();
      transport.start();
      expect_in_order(transport, 0, 2);
    }
    transport.finish();
  });
  expect_no_errors(errors);
}

// A send that fails aborts the transport; the next send() and check() raise it, naming the peer.
TEST(SenderTest, AFailedSendIsRaisedByTheNextSend) {
  auto world = std::make_shared<ThreadWorld>(2);
  world->fail_sends_from(1);
  std::vector<Rank> ranks;
  const auto errors = run_ranks(2, world, ranks, [&](int r, Rank& rank) {
    Transport transport(rank.group, {1 - r}, milliseconds(300), kTag);
    transport.start();
    if (r == 1) {
      Sender sender(&transport, {0}, milliseconds(300));
      sender.send(0, {1}, {at::ones({3})});
      EXPECT_THROW(sender.send(0, {2}, {}, /*wait=*/true), TransportError);
      try {
        sender.check();
        ADD_FAILURE() << "check() did not raise";
      } catch (const TransportError& e) {
        EXPECT_NE(std::string(e.what()).find("peer 0"), std::string::npos) << e.what();
      }
      EXPECT_THROW(sender.send(0, {3}, {}), TransportError);
      EXPECT_TRUE(sender.close().empty());
    }
    // Rank 0 ends its step without a message: destroyed unfinished, its transport aborts.
  });
  expect_no_errors(errors);
}

// A peer that never receives: close() gives up after its timeout, names the peer and aborts
// the transport, within about twice the timeout.
TEST(SenderTest, CloseNamesAPeerThatTakesNothing) {
  auto world = std::make_shared<ThreadWorld>(2);
  std::vector<Rank> ranks;
  Event closed;
  const auto errors = run_ranks(2, world, ranks, [&](int r, Rank& rank) {
    if (r == 1) {
      closed.wait();  // never starts a transport
      return;
    }
    Transport transport(rank.group, {1}, milliseconds(5000), kTag);
    transport.start();
    Sender sender(&transport, {1}, milliseconds(200));
    sender.send(1, {0}, {at::ones({100})});
    const auto started = std::chrono::steady_clock::now();
    EXPECT_EQ(sender.close(), std::vector<int>{1});
    EXPECT_LT(std::chrono::steady_clock::now() - started, std::chrono::seconds(3));
    EXPECT_FALSE(transport.started());  // aborted
    closed.set();
  });
  expect_no_errors(errors);
}

TEST(SenderTest, UserMistakesThrowSmpError) {
  auto world = std::make_shared<ThreadWorld>(2);
  std::vector<Rank> ranks;
  const auto errors = run_ranks(2, world, ranks, [&](int r, Rank& rank) {
    if (r == 1) return;
    Transport transport(rank.group, {1}, kLong, kTag);
    EXPECT_THROW(Sender(&transport, {0}, kLong), smp::Error);  // not a peer
    EXPECT_THROW(Sender(&transport, {1, 1}, kLong), smp::Error);
    Sender sender(&transport, {1}, kLong);
    EXPECT_THROW(sender.send(0, {1}, {}), smp::Error);
    EXPECT_TRUE(sender.close().empty());
    EXPECT_THROW(sender.send(1, {1}, {}), smp::Error);  // closed
  });
  expect_no_errors(errors);
}

}  // namespace
}  // namespace smp::pytorch
