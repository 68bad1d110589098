#include "smp/pytorch/transport.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "smp/error.h"
#include "thread_world.h"

// Ranks are threads meeting in ThreadWorld (thread_world.h), whose send/recv behave like gloo's
// (FIFO per (src, dst, tag), rendezvous completion, Work::abort() wakes a wait). The real gloo
// path is covered by tests/python/distributed/test_transport.py.

namespace smp::pytorch {
namespace {

using std::chrono::milliseconds;
using test_util::Event;
using test_util::expect_no_errors;
using test_util::make_rank;
using test_util::Rank;
using test_util::run_ranks;
using test_util::ThreadWorld;

constexpr milliseconds kLong{10000};  // bounds waits that should succeed
constexpr int kTag = 7;

std::vector<int> others(int rank, int world_size) {
  std::vector<int> peers;
  for (int r = 0; r < world_size; ++r) {
    if (r != rank) peers.push_back(r);
  }
  return peers;
}

// The i-th message's tensors from `src`: cycles through dtypes and shapes, including 0-dim,
// zero-element, int64, bool and float64 tensors; values depend on (src, i) so mix-ups show.
std::vector<at::Tensor> message_tensors(int src, int i) {
  const double base = 1000.0 * src + i;
  std::vector<at::Tensor> tensors;
  switch (i % 5) {
    case 0:
      tensors.push_back(at::arange(6, at::kFloat).reshape({2, 3}) + base);
      tensors.push_back(at::full({}, base, at::kDouble));  // 0-dim
      break;
    case 1:
      tensors.push_back(at::arange(5, at::kLong) * (i + 1) + src);
      tensors.push_back(at::arange(4, at::kLong).remainder(2).to(at::kBool));
      tensors.push_back(at::zeros({0, 3}, at::kFloat));  // zero elements: no payload
      break;
    case 2:
      break;  // header only
    case 3:
      tensors.push_back(at::arange(24, at::kDouble).reshape({2, 3, 4}) * base);
      tensors.push_back(at::zeros({0}, at::kLong));
      tensors.push_back(at::full({1}, i % 2 == 0, at::kBool));
      break;
    default:
      // Non-contiguous input: it must arrive with the logical values.
      tensors.push_back((at::arange(12, at::kFloat).reshape({3, 4}) + base).t());
      tensors.push_back(at::full({}, i, at::kLong));
  }
  return tensors;
}

std::vector<int64_t> message_header(int src, int i) {
  std::vector<int64_t> header{src, i};
  for (int k = 0; k < i % 4; ++k) header.push_back(-k * 1000000007LL);
  return header;
}

void expect_message(const Message& got, int src, int i) {
  EXPECT_EQ(got.peer, src);
  EXPECT_EQ(got.header, message_header(src, i)) << "message " << i << " from " << src;
  const std::vector<at::Tensor> want = message_tensors(src, i);
  ASSERT_EQ(got.tensors.size(), want.size()) << "message " << i << " from " << src;
  for (size_t k = 0; k < want.size(); ++k) {
    EXPECT_EQ(got.tensors[k].scalar_type(), want[k].scalar_type()) << "message " << i;
    EXPECT_EQ(got.tensors[k].sizes(), want[k].sizes()) << "message " << i;
    EXPECT_TRUE(got.tensors[k].is_contiguous());
    EXPECT_TRUE(at::equal(got.tensors[k], want[k]))
        << "message " << i << " from " << src << " tensor " << k << ":\n"
        << got.tensors[k] << "\nexpected\n"
        << want[k];
  }
}

// Expects fn() to throw E whose message contains every one of `parts`; returns the error.
template <typename E, typename Fn>
std::optional<E> expect_throw(Fn fn, const std::vector<std::string>& parts) {
  try {
    fn();
    ADD_FAILURE() << "expected an exception";
  } catch (const E& e) {
    for (const auto& part : parts) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos)
          << "'" << part << "' not in: " << e.what();
    }
    return e;
  }
  return std::nullopt;
}

// Runs fn on a new thread; an exception fails the test instead of terminating the process.
std::thread spawn(std::function<void()> fn) {
  return std::thread([fn = std::move(fn)] {
    try {
      fn();
    } catch (const std::exception& e) {
      ADD_FAILURE() << "sender thread threw: " << e.what();
    }
  });
}

// Rank 1 sends a forged wire header (magic and seq 0 set, the rest from `fill`); rank 0's
// recv() must fail with a TransportError naming each of `parts`.
void expect_corrupt(const std::function<void(int64_t*)>& fill,
                    const std::vector<std::string>& parts) {
  auto world = std::make_shared<ThreadWorld>(2);
  std::vector<Rank> ranks;
  const auto errors = run_ranks(2, world, ranks, [&](int r, Rank& rank) {
    if (r == 1) {
      at::Tensor wire = at::zeros({Transport::kHeaderSlots}, at::kLong);
      int64_t* w = wire.data_ptr<int64_t>();
      w[0] = 0x736d7074726e7331;
      fill(w);
      std::vector<at::Tensor> sent{wire};
      rank.group->send(sent, 0, kTag)->wait();
      return;
    }
    Transport transport(rank.group, {1}, kLong, kTag);
    transport.start();
    expect_throw<TransportError>([&] { transport.recv(kLong); }, parts);
  });
  expect_no_errors(errors);
}

// ---- messages ----------------------------------------------------------------------------

// 200 messages of mixed dtypes and shapes each way between two ranks, sent and received at the
// same time: every one arrives intact, in order.
TEST(TransportTest, FifoOrderWithMixedTensorsBothWays) {
  constexpr int kNum = 200;
  auto world = std::make_shared<ThreadWorld>(2);
  std::vector<Rank> ranks;
  const auto errors = run_ranks(2, world, ranks, [&](int r, Rank& rank) {
    Transport transport(rank.group, {1 - r}, kLong, kTag);
    transport.start();
    std::thread sender = spawn([&] {
      for (int i = 0; i < kNum; ++i) {
        transport.send(1 - r, message_header(r, i), message_tensors(r, i));
      }
    });
    for (int i = 0; i < kNum; ++i) {
      std::optional<Message> got = transport.recv(kLong);
      if (!got) {
        ADD_FAILURE() << "recv() returned nullopt";
        break;
      }
      expect_message(*got, 1 - r, i);
    }
    sender.join();
    transport.finish();
  });
  expect_no_errors(errors);
}

// send_batch: the peer receives each message alone, intact and in order, mixed with plain
// sends; messages that fit one wire header cost one send of the backend, and a batch too big for
// one header is split over several.
TEST(TransportTest, BatchesArriveAsTheirMessagesInOrder) {
  constexpr int kNum = 200;
  auto world = std::make_shared<ThreadWorld>(2);
  std::vector<Rank> ranks;
  const auto errors = run_ranks(2, world, ranks, [&](int r, Rank& rank) {
    Transport transport(rank.group, {1 - r}, kLong, kTag);
    transport.start();
    if (r == 0) {
      // Ten header-only messages in one batch: one send.
      std::vector<Transport::OutgoingMessage> small;
      for (int i = 0; i < 10; ++i)
        small.emplace_back(message_header(0, i * 4 + 2), std::vector<at::Tensor>{});
      int64_t before = rank.backend->num_send_.load();
      transport.send_batch(1, small);
      EXPECT_EQ(rank.backend->num_send_.load() - before, 1);
      // Then kNum mixed messages: batches of 0 (a plain send) to 11 messages; the largest
      // batches take more than one header.
      before = rank.backend->num_send_.load();
      for (int i = 0; i < kNum;) {
        const int size = i % 12;
        if (size == 0) {
          transport.send(1, message_header(0, i), message_tensors(0, i));
          ++i;
          continue;
        }
        std::vector<Transport::OutgoingMessage> batch;
        for (; i < kNum && static_cast<int>(batch.size()) < size; ++i) {
          batch.emplace_back(message_header(0, i), message_tensors(0, i));
        }
        transport.send_batch(1, batch);
      }
      EXPECT_LT(rank.backend->num_send_.load() - before, kNum / 2);
    } else {
      for (int i = 0; i < 10; ++i) {
        std::optional<Message> got = transport.recv(kLong);
        ASSERT_TRUE(got.has_value());
        EXPECT_EQ(got->header, message_header(0, i * 4 + 2));
        EXPECT_TRUE(got->tensors.empty());
      }
      for (int i = 0; i < kNum; ++i) {
        std::optional<Message> got = transport.recv(kLong);
        ASSERT_TRUE(got.has_value()) << "message " << i;
        expect_message(*got, 0, i);
      }
    }
    transport.finish();
  });
  expect_no_errors(errors);
}

// A batch with one bad message is refused before anything of it is sent, naming the message.
TEST(TransportTest, BatchWithABadMessageSendsNothing) {
  auto world = std::make_shared<ThreadWorld>(2);
  std::vector<Rank> ranks;
  const auto errors = run_ranks(2, world, ranks, [&](int r, Rank& rank) {
    Transport transport(rank.group, {1 - r}, kLong, kTag);
    transport.start();
    if (r == 0) {
      const int64_t before = rank.backend->num_send_.load();
      std::vector<Transport::OutgoingMessage> batch{
          {{1}, {at::ones({2})}}, {{2}, {}}, {{3}, {at::Tensor()}}};
      expect_throw<smp::Error>(
          [&] { transport.send_batch(1, batch); },
          {"send_batch()", "peer 1", "message 2 of 3", "tensor 0", "undefined"});
      EXPECT_EQ(rank.backend->num_send_.load(), before) << "something was sent";
      transport.send_batch(1, {{{4}, {}}});
    } else {
      std::optional<Message> got = transport.recv(kLong);
      ASSERT_TRUE(got.has_value());
      EXPECT_EQ(got->header, std::vector<int64_t>{4});
    }
    transport.finish();
  });
  expect_no_errors(errors);
}

// A batch whose counts do not add up is refused as corrupt, naming the peer.
TEST(TransportTest, InconsistentBatchIsCorrupt) {
  // kind batch, 7 header ints, no tensors; the batch: 2 messages, the first of 1 int, the
  // second claiming 5 ints where 1 is left
  expect_corrupt(
      [](int64_t* w) {
        w[1] = 2;
        w[3] = 7;
        const std::vector<int64_t> ints{2, 1, 0, 5, 0, 10, 11};
        std::copy(ints.begin(), ints.end(), w + 5);
      },
      {"corrupt batch #0 from peer 1", "message 1 of 2 has 5 header ints and 0 tensors"});
}

// Three ranks, each sending to both others from two threads per peer at once while receiving:
// messages of one sender thread arrive in its order, and no message is torn (parts of
// concurrent sends to one peer never interleave).
TEST(TransportTest, AllToAllThreeRanksConcurrently) {
  constexpr int kWorld = 3;
  constexpr int kThreadsPerPeer = 2;
  constexpr int kPerThread = 40;
  auto world = std::make_shared<ThreadWorld>(kWorld);
  std::vector<Rank> ranks;
  const auto errors = run_ranks(kWorld, world, ranks, [&](int r, Rank& rank) {
    const std::vector<int> peers = others(r, kWorld);
    Transport transport(rank.group, peers, kLong, kTag);
    transport.start();
    std::vector<std::thread> senders;
    for (int peer : peers) {
      for (int t = 0; t < kThreadsPerPeer; ++t) {
        senders.push_back(spawn([&, peer, t] {
          for (int i = 0; i < kPerThread; ++i) {
            const int index = t * kPerThread + i;  // thread t sends indices [t*k, (t+1)*k)
            transport.send(peer, message_header(r, index), message_tensors(r, index));
          }
        }));
      }
    }
    std::map<std::pair<int, int>, int> next;  // (peer, thread) -> next index expected
    for (int n = 0; n < static_cast<int>(peers.size()) * kThreadsPerPeer * kPerThread; ++n) {
      std::optional<Message> got = transport.recv(kLong);
      if (!got || got->header.size() < 2) {
        ADD_FAILURE() << "recv() returned nullopt or a short header";
        break;
      }
      const int index = static_cast<int>(got->header[1]);
      const int thread = index / kPerThread;
      int& expected = next[{got->peer, thread}];
      EXPECT_EQ(index, thread * kPerThread + expected) << "out of order from " << got->peer;
      ++expected;
      expect_message(*got, got->peer, index);
    }
    for (auto& s : senders) s.join();
    transport.finish();
  });
  expect_no_errors(errors);
}

// One Transport over several steps (start/finish), with recv() returning nullopt once every peer
// has finished, and message numbering restarting each step.
TEST(TransportTest, ReuseOverSeveralSteps) {
  constexpr int kWorld = 3;
  auto world = std::make_shared<ThreadWorld>(kWorld);
  std::vector<Rank> ranks;
  const auto errors = run_ranks(kWorld, world, ranks, [&](int r, Rank& rank) {
    const std::vector<int> peers = others(r, kWorld);
    Transport transport(rank.group, peers, kLong, kTag);
    EXPECT_FALSE(transport.started());
    for (int step = 0; step < 4; ++step) {
      transport.start();
      EXPECT_TRUE(transport.started());
      const int num = step + 1;  // a different count each step
      for (int peer : peers) {
        for (int i = 0; i < num; ++i) {
          transport.send(peer, {r, 100 * step + i}, {at::full({2}, step)});
        }
      }
      std::map<int, int> next;
      for (int n = 0; n < num * static_cast<int>(peers.size()); ++n) {
        std::optional<Message> got = transport.recv(kLong);
        ASSERT_TRUE(got.has_value());
        EXPECT_EQ(got->header, (std::vector<int64_t>{got->peer, 100 * step + next[got->peer]++}));
        EXPECT_TRUE(at::equal(got->tensors.at(0), at::full({2}, step)));
      }
      transport.finish();
      EXPECT_FALSE(transport.started());
    }
  });
  expect_no_errors(errors);
}

// With payload groups (Note [Payload routes]), headers stay on the group and every tensor too
// big for the header travels on the payload group of its direction: here three ranks, each
// sending to both others, and the counts of sends per group show the routes. The ascending
// group carries only sends to higher ranks, the descending one only to lower ranks.
TEST(TransportTest, PayloadGroupsCarryTheLargeTensorsPerDirection) {
  constexpr int kWorld = 3;
  constexpr int kNum = 20;
  auto headers = std::make_shared<ThreadWorld>(kWorld);
  auto up = std::make_shared<ThreadWorld>(kWorld);
  auto down = std::make_shared<ThreadWorld>(kWorld);
  std::vector<Rank> up_ranks;
  std::vector<Rank> down_ranks;
  for (int r = 0; r < kWorld; ++r) {
    up_ranks.push_back(make_rank(up, r, kWorld));
    down_ranks.push_back(make_rank(down, r, kWorld));
  }
  // Message i to a peer: one large tensor (a payload) and a small one (inline in the header).
  auto large = [](int src, int dst, int i) {
    return at::arange(1000, at::kDouble) + (10000.0 * src + 100.0 * dst + i);
  };
  std::vector<Rank> ranks;
  const auto errors = run_ranks(kWorld, headers, ranks, [&](int r, Rank& rank) {
    const std::vector<int> peers = others(r, kWorld);
    Transport transport(rank.group, peers, kLong, kTag, {up_ranks[r].group, down_ranks[r].group});
    transport.start();
    std::vector<std::thread> senders;
    for (int peer : peers) {
      senders.push_back(spawn([&, peer] {
        for (int i = 0; i < kNum; ++i) {
          transport.send(peer, {r, i}, {large(r, peer, i), at::full({2}, i, at::kLong)});
        }
      }));
    }
    std::map<int, int> next;
    for (int n = 0; n < kNum * static_cast<int>(peers.size()); ++n) {
      std::optional<Message> got = transport.recv(kLong);
      ASSERT_TRUE(got.has_value());
      const int i = next[got->peer]++;
      EXPECT_EQ(got->header, (std::vector<int64_t>{got->peer, i}));
      ASSERT_EQ(got->tensors.size(), 2u);
      EXPECT_TRUE(at::equal(got->tensors[0], large(got->peer, r, i)));
      EXPECT_TRUE(at::equal(got->tensors[1], at::full({2}, i, at::kLong)));
      EXPECT_TRUE(got->tensors[0].device().is_cpu());
    }
    for (auto& sender : senders) sender.join();
    transport.finish();
  });
  expect_no_errors(errors);
  for (int r = 0; r < kWorld; ++r) {
    const int higher = kWorld - 1 - r;  // peers above r: its payloads on the ascending group
    const int lower = r;
    // Headers: kNum messages and one END per peer; payloads: one per message.
    EXPECT_EQ(ranks[r].backend->num_send_.load(), (kNum + 1) * (kWorld - 1)) << "rank " << r;
    EXPECT_EQ(up_ranks[r].backend->num_send_.load(), kNum * higher) << "rank " << r;
    EXPECT_EQ(down_ranks[r].backend->num_send_.load(), kNum * lower) << "rank " << r;
    EXPECT_EQ(up_ranks[r].backend->num_recv_.load(), kNum * lower) << "rank " << r;
    EXPECT_EQ(down_ranks[r].backend->num_recv_.load(), kNum * higher) << "rank " << r;
  }
}

// A peer configured without payload groups cannot read a message that used them: the receiver
// names the mismatch instead of reading payload bytes from the wrong group.
TEST(TransportTest, PayloadRouteWithoutPayloadGroupsIsACorruptHeader) {
  auto headers = std::make_shared<ThreadWorld>(2);
  auto up = std::make_shared<ThreadWorld>(2);
  auto down = std::make_shared<ThreadWorld>(2);
  std::vector<Rank> up_ranks{make_rank(up, 0, 2), make_rank(up, 1, 2)};
  std::vector<Rank> down_ranks{make_rank(down, 0, 2), make_rank(down, 1, 2)};
  std::vector<Rank> ranks;
  const auto errors = run_ranks(2, headers, ranks, [&](int r, Rank& rank) {
    if (r == 0) {
      // Nobody takes the payload: the send fails after the timeout, naming the peer.
      Transport transport(rank.group, {1}, milliseconds(300), kTag,
                          {up_ranks[0].group, down_ranks[0].group});
      transport.start();
      expect_throw<TransportError>([&] { transport.send(1, {7}, {at::zeros({2000})}); },
                                   {"peer 1"});
      transport.abort();
    } else {
      Transport transport(rank.group, {0}, kLong, kTag);
      transport.start();
      expect_throw<TransportError>(
          [&] { transport.recv(kLong); },
          {"corrupt message #0 from peer 0", "payload group", "configured alike"});
      transport.abort();
    }
  });
  expect_no_errors(errors);
}

// Payload groups must be two groups of the group's ranks.
TEST(TransportTest, BadPayloadGroupsAreRefused) {
  auto headers = std::make_shared<ThreadWorld>(2);
  auto other = std::make_shared<ThreadWorld>(3);
  Rank rank = make_rank(headers, 0, 2);
  Rank wrong_size = make_rank(other, 0, 3);
  expect_throw<smp::Error>([&] { Transport(rank.group, {1}, kLong, kTag, {rank.group}); },
                           {"two groups", "got 1"});
  expect_throw<smp::Error>(
      [&] {
        Transport(rank.group, {1}, kLong, kTag, {wrong_size.group, wrong_size.group});
      },
      {"size 2, rank 0", "got size 3, rank 0"});
}

// Tensors whose bytes fit the wire header's free slots travel inside it (Note [Wire header]):
// a message of small tensors is one send, each larger tensor adds one, and every tensor arrives
// exact whichever way it went — also a small one after a large one, and one that no longer fits
// because the header ints took the room.
TEST(TransportTest, SmallTensorsTravelInsideTheHeader) {
  auto world = std::make_shared<ThreadWorld>(2);
  std::vector<Rank> ranks;
  const at::Tensor skeleton = at::arange(300, at::kByte);  // 300 bytes: inline
  const at::Tensor odd = at::arange(3, at::kShort);        // 6 bytes, padded to a slot
  const at::Tensor big = at::arange(2000, at::kDouble);    // 16000 bytes: a payload
  const at::Tensor strided = (at::arange(960, at::kFloat).reshape({32, 30}) - 7).t();
  struct Case {
    std::vector<int64_t> header;
    std::vector<at::Tensor> tensors;
    int64_t sends;
  };
  const std::vector<int64_t> long_header(Transport::kHeaderSlots - 5 - 3 * 2 - 30, -5);
  const std::vector<Case> cases = {
      {{1}, {skeleton, odd}, 1},
      {{2, 3}, {big, skeleton}, 2},
      // strided (3840 bytes) would fit alone, not after skeleton and odd: a payload
      {{4}, {skeleton, big, odd, strided}, 3},
      {long_header, {odd, skeleton, odd}, 2},  // 30 free slots: odd, odd inline; skeleton not
  };
  const auto errors = run_ranks(2, world, ranks, [&](int r, Rank& rank) {
    Transport transport(rank.group, {1 - r}, kLong, kTag);
    transport.start();
    if (r == 0) {
      for (const Case& c : cases) {
        const int64_t before = rank.backend->num_send_.load();
        transport.send(1, c.header, c.tensors);
        EXPECT_EQ(rank.backend->num_send_.load() - before, c.sends) << "header " << c.header[0];
      }
    } else {
      for (const Case& c : cases) {
        std::optional<Message> got = transport.recv(kLong);
        ASSERT_TRUE(got.has_value());
        EXPECT_EQ(got->header, c.header);
        ASSERT_EQ(got->tensors.size(), c.tensors.size());
        for (size_t k = 0; k < c.tensors.size(); ++k) {
          EXPECT_EQ(got->tensors[k].scalar_type(), c.tensors[k].scalar_type());
          EXPECT_TRUE(at::equal(got->tensors[k], c.tensors[k]))
              << "header " << c.header[0] << " tensor " << k;
        }
      }
    }
    transport.finish();
  });
  expect_no_errors(errors);
}

// A header that claims an inline tensor larger than the room left is refused as corrupt.
TEST(TransportTest, OversizedInlineTensorIsACorruptHeader) {
  // kind data, no header ints, one float tensor of 5000 elements marked inline
  expect_corrupt(
      [](int64_t* w) {
        w[4] = 1;
        w[5] = static_cast<int64_t>(at::kFloat) + (int64_t{1} << 32);
        w[6] = 1;
        w[7] = 5000;
      },
      {"corrupt message #0 from peer 1", "inline tensor 0", "overflows the header"});
}

TEST(TransportTest, RecvReturnsNulloptOnceEveryPeerFinished) {
  auto world = std::make_shared<ThreadWorld>(2);
  std::vector<Rank> ranks;
  const auto errors = run_ranks(2, world, ranks, [&](int r, Rank& rank) {
    Transport transport(rank.group, {1 - r}, kLong, kTag);
    transport.start();
    if (r == 1) {
      transport.send(0, {42}, {});
      transport.finish();  // returns once rank 0 has called finish() too
      return;
    }
    std::optional<Message> got = transport.recv(kLong);
    ASSERT_TRUE(got.has_value());
    EXPECT_EQ(got->header, std::vector<int64_t>{42});
    EXPECT_FALSE(transport.recv(kLong).has_value());  // rank 1's END: nothing more can come
    transport.finish();
  });
  expect_no_errors(errors);
}

// The sender may reuse its tensors as soon as send() returns (every part was taken), and
// requires_grad tensors are sent as plain data.
TEST(TransportTest, SendReturnsAfterThePeerTookEveryPart) {
  auto world = std::make_shared<ThreadWorld>(2);
  std::vector<Rank> ranks;
  const auto errors = run_ranks(2, world, ranks, [&](int r, Rank& rank) {
    Transport transport(rank.group, {1 - r}, kLong, kTag);
    transport.start();
    if (r == 0) {
      at::Tensor t = at::arange(4, at::kFloat);
      at::Tensor w = at::ones({3}, at::kDouble).requires_grad_();
      transport.send(1, {}, {t, w});
      t.fill_(-1);  // ThreadWorld copies at matching time: too early a return would show here
    } else {
      std::optional<Message> got = transport.recv(kLong);
      ASSERT_TRUE(got.has_value());
      EXPECT_TRUE(at::equal(got->tensors[0], at::arange(4, at::kFloat)));
      EXPECT_TRUE(at::equal(got->tensors[1], at::ones({3}, at::kDouble)));
      EXPECT_FALSE(got->tensors[1].requires_grad());
    }
    transport.finish();
  });
  expect_no_errors(errors);
}

TEST(TransportTest, NoPeersIsATrivialTransport) {
  auto world = std::make_shared<ThreadWorld>(1);
  Rank rank = make_rank(world, 0, 1);
  Transport transport(rank.group, {}, kLong, kTag);
  transport.start();
  EXPECT_FALSE(transport.recv(milliseconds(0)).has_value());
  transport.finish();
  EXPECT_EQ(rank.backend->num_send_.load(), 0);
}

// ---- user mistakes -----------------------------------------------------------------------

TEST(TransportTest, HeaderCapacity) {
  EXPECT_EQ(Transport::header_capacity({}), Transport::kHeaderSlots - 5);
  // 5 fixed + (2 + 0) + (2 + 3) entries
  EXPECT_EQ(Transport::header_capacity({at::zeros({}), at::zeros({1, 2, 3})}),
            Transport::kHeaderSlots - 12);
}

// A header that exactly fills the wire header arrives; one more int is refused before anything
// is sent.
TEST(TransportTest, HeaderTooLongIsRefusedBeforeSending) {
  auto world = std::make_shared<ThreadWorld>(2);
  std::vector<Rank> ranks;
  const auto errors = run_ranks(2, world, ranks, [&](int r, Rank& rank) {
    Transport transport(rank.group, {1 - r}, kLong, kTag);
    transport.start();
    const std::vector<at::Tensor> tensors = {at::ones({2, 2}), at::zeros({})};
    const int64_t capacity = Transport::header_capacity(tensors);
    if (r == 0) {
      std::vector<int64_t> full(capacity);
      for (int64_t i = 0; i < capacity; ++i) full[i] = i * i;
      const int64_t sends_before = rank.backend->num_send_.load();
      std::vector<int64_t> too_long(capacity + 1, 1);
      expect_throw<smp::Error>(
          [&] { transport.send(1, too_long, tensors); },
          {"peer 1", "does not fit", "512-entry", fmt::format("{}", capacity + 1),
           fmt::format("room for {}", capacity)});
      EXPECT_EQ(rank.backend->num_send_.load(), sends_before) << "something was sent";
      transport.send(1, full, tensors);
    } else {
      std::optional<Message> got = transport.recv(kLong);
      ASSERT_TRUE(got.has_value());
      ASSERT_EQ(static_cast<int64_t>(got->header.size()), capacity);
      EXPECT_EQ(got->header.back(), (capacity - 1) * (capacity - 1));
    }
    transport.finish();
  });
  expect_no_errors(errors);
}

TEST(TransportTest, UserMistakesThrowSmpError) {
  auto world = std::make_shared<ThreadWorld>(3);
  Rank rank = make_rank(world, 0, 3);
  const auto g = rank.group;
  auto make = [](c10::intrusive_ptr<c10d::ProcessGroup> group, std::vector<int> peers,
                 milliseconds timeout, int tag) {
    Transport transport(std::move(group), std::move(peers), timeout, tag);
  };
  expect_throw<smp::Error>([&] { make({}, {1}, kLong, kTag); }, {"group"});
  expect_throw<smp::Error>([&] { make(g, {0}, kLong, kTag); }, {"peer 0", "this rank"});
  expect_throw<smp::Error>([&] { make(g, {3}, kLong, kTag); }, {"peer 3", "size 3"});
  expect_throw<smp::Error>([&] { make(g, {-1}, kLong, kTag); }, {"peer -1"});
  expect_throw<smp::Error>(
      [&] {
        make(g, {1, 2, 1}, kLong, kTag);
      },
      {"peer 1", "twice", "[1, 2, 1]"});
  expect_throw<smp::Error>([&] { make(g, {1}, milliseconds(0), kTag); }, {"timeout", "got 0"});
  expect_throw<smp::Error>([&] { make(g, {1}, kLong, -3); }, {"tag", "got -3"});

  Transport transport(g, {1, 2}, kLong, kTag);
  EXPECT_EQ(transport.rank(), 0);
  EXPECT_EQ(transport.peers(), (std::vector<int>{1, 2}));
  EXPECT_EQ(transport.tag(), kTag);
  EXPECT_EQ(transport.timeout(), kLong);
  expect_throw<smp::Error>([&] { transport.send(1, {}, {}); }, {"start()"});
  expect_throw<smp::Error>([&] { transport.recv(kLong); }, {"start()"});
  expect_throw<smp::Error>([&] { transport.finish(); }, {"without start()"});
  transport.start();
  expect_throw<smp::Error>([&] { transport.start(); }, {"twice"});
  expect_throw<smp::Error>([&] { transport.send(3, {}, {}); }, {"peer 3", "[1, 2]"});
  expect_throw<smp::Error>(
      [&] {
        transport.send(1, {}, {at::ones({1}), at::Tensor()});
      },
      {"peer 1", "tensor 1", "undefined"});
  expect_throw<smp::Error>(
      [&] {
        transport.send(2, {}, {at::ones({2, 3}).to_sparse()});
      },
      {"peer 2", "tensor 0", "[2, 3]", "Sparse"});
  expect_throw<smp::Error>(
      [&] { transport.send(1, {}, {at::empty({4}, at::TensorOptions().device(at::kMeta))}); },
      {"tensor 0", "meta", "no data"});
  expect_throw<smp::Error>([&] { transport.recv(milliseconds(-1)); }, {"timeout", "got -1"});
  EXPECT_EQ(rank.backend->num_send_.load(), 0);
  // Destroyed while started, peers absent: the destructor aborts the receivers and returns.
}

// ---- timeouts and failures -----------------------------------------------------------------

// recv() names the peers whose channels are still open, and the timeout; a peer that has
// finished (sent END) drops out of the list.
TEST(TransportTest, RecvTimeoutNamesOpenPeers) {
  auto world = std::make_shared<ThreadWorld>(3);
  std::vector<Rank> ranks;
  Event timed_out;
  const auto errors = run_ranks(3, world, ranks, [&](int r, Rank& rank) {
    Transport transport(rank.group, others(r, 3), kLong, kTag);
    transport.start();
    if (r == 0) {
      const auto started = std::chrono::steady_clock::now();
      auto error = expect_throw<TransportError>([&] { transport.recv(milliseconds(200)); },
                                                {"rank 0", "tag 7", "200 ms", "peers [1, 2]"});
      EXPECT_LT(std::chrono::steady_clock::now() - started, std::chrono::seconds(5));
      if (error) {
        EXPECT_EQ(error->peers(), (std::vector<int>{1, 2}));
      }
      timed_out.set();
      // Rank 2 finishes now; once its END is here only peer 1 stays open.
      std::optional<TransportError> last;
      for (int attempt = 0; attempt < 100; ++attempt) {
        try {
          transport.recv(milliseconds(50));
        } catch (const TransportError& e) {
          last = e;
          if (e.peers() == std::vector<int>{1}) break;
        }
      }
      ASSERT_TRUE(last.has_value());
      EXPECT_EQ(last->peers(), std::vector<int>{1});
      EXPECT_NE(std::string(last->what()).find("peers [1]"), std::string::npos) << last->what();
    } else {
      timed_out.wait();
      if (r == 1) std::this_thread::sleep_for(milliseconds(500));  // rank 2 finishes first
    }
    transport.finish();
  });
  expect_no_errors(errors);
}

// A rank whose sends fail: its send() names the destination peer and breaks that channel; the
// receiver's recv() times out naming the silent peer; nothing hangs on destruction.
TEST(TransportTest, FailedSendNamesThePeer) {
  auto world = std::make_shared<ThreadWorld>(2);
  world->fail_sends_from(1);
  std::vector<Rank> ranks;
  const auto errors = run_ranks(2, world, ranks, [&](int r, Rank& rank) {
    const auto started = std::chrono::steady_clock::now();
    {
      Transport transport(rank.group, {1 - r}, milliseconds(300), kTag);
      transport.start();
      if (r == 1) {
        auto error = expect_throw<TransportError>(
            [&] { transport.send(0, {1}, {at::ones({3})}); },
            {"rank 1", "sending message #0 to peer 0 failed", "injected send failure"});
        if (error) {
          EXPECT_EQ(error->peers(), std::vector<int>{0});
        }
        expect_throw<TransportError>([&] { transport.send(0, {2}, {}); },
                                     {"peer 0", "earlier send", "broken"});
      } else {
        expect_throw<TransportError>([&] { transport.recv(milliseconds(300)); },
                                     {"rank 0", "300 ms", "peers [1]"});
      }
      // Destroyed without finish(): aborts.
    }
    EXPECT_LT(std::chrono::steady_clock::now() - started, std::chrono::seconds(5));
  });
  expect_no_errors(errors);
}

// A peer that dies: messages that arrived before are delivered, then recv() raises naming it,
// and finish() fails naming it too.
TEST(TransportTest, PeerDeathIsRaisedWithThePeerNamed) {
  auto world = std::make_shared<ThreadWorld>(2);
  std::vector<Rank> ranks;
  Event received;
  const auto errors = run_ranks(2, world, ranks, [&](int r, Rank& rank) {
    Transport transport(rank.group, {1 - r}, milliseconds(2000), kTag);
    transport.start();
    if (r == 1) {
      transport.send(0, {1}, {at::ones({2})});
      received.wait();
      world->kill(1);
      return;  // the destructor aborts
    }
    std::optional<Message> got = transport.recv(kLong);
    ASSERT_TRUE(got.has_value());
    EXPECT_EQ(got->header, std::vector<int64_t>{1});
    received.set();
    auto error = expect_throw<TransportError>(
        [&] { transport.recv(kLong); },
        {"rank 0", "receiving the header of message #1 from peer 1 failed", "died"});
    if (error) {
      EXPECT_EQ(error->peers(), std::vector<int>{1});
    }
    // Sticky.
    expect_throw<TransportError>([&] { transport.recv(kLong); }, {"peer 1", "died"});
    expect_throw<TransportError>([&] { transport.finish(); }, {"peer 1"});
    EXPECT_FALSE(transport.started());
    expect_throw<smp::Error>([&] { transport.start(); }, {"after a failure"});
  });
  expect_no_errors(errors);
}

// A peer that never calls finish(): finish() fails within the timeout, naming it.
TEST(TransportTest, FinishTimeoutNamesThePeer) {
  auto world = std::make_shared<ThreadWorld>(3);
  std::vector<Rank> ranks;
  Event done[2];
  const auto errors = run_ranks(3, world, ranks, [&](int r, Rank& rank) {
    Transport transport(rank.group, others(r, 3), milliseconds(300), kTag);
    transport.start();
    if (r == 2) {
      done[0].wait();  // never finishes; destroyed (aborted) once the others are through
      done[1].wait();
      return;
    }
    const auto started = std::chrono::steady_clock::now();
    auto error = expect_throw<TransportError>(
        [&] { transport.finish(); },
        {fmt::format("rank {}", r), "no END from peers [2]", "300 ms", "finish()"});
    if (error) {
      EXPECT_EQ(error->peers(), std::vector<int>{2});
    }
    EXPECT_LT(std::chrono::steady_clock::now() - started, std::chrono::seconds(5));
    expect_throw<TransportError>([&] { transport.recv(kLong); }, {"aborted"});
    done[r].set();
  });
  expect_no_errors(errors);
}

// finish(abort_on_failure=false) that times out on a late peer keeps receiving: the peer's later
// message and END are taken (its sends complete) until the caller aborts.
TEST(TransportTest, FinishWithoutAbortKeepsReceivingForALatePeer) {
  auto world = std::make_shared<ThreadWorld>(2);
  std::vector<Rank> ranks;
  Event timed_out;
  Event peer_done;
  const auto errors = run_ranks(2, world, ranks, [&](int r, Rank& rank) {
    Transport transport(rank.group, {1 - r}, milliseconds(300), kTag);
    transport.start();
    if (r == 1) {
      timed_out.wait();                         // late: rank 0 has given up on its END
      transport.send(0, {5}, {at::ones({2})});  // completes: rank 0 still receives
      EXPECT_NO_THROW(transport.finish());      // rank 0's END arrived before it timed out
      peer_done.set();
      return;
    }
    expect_throw<TransportError>([&] { transport.finish(/*abort_on_failure=*/false); },
                                 {"no END from peers [1]"});
    timed_out.set();
    peer_done.wait();
    transport.abort();  // the caller's turn, once the peer is done with the tag
  });
  expect_no_errors(errors);
}

// Messages nobody took by recv() make finish() fail: every message of a step must be received.
TEST(TransportTest, UndeliveredMessagesFailFinish) {
  auto world = std::make_shared<ThreadWorld>(2);
  std::vector<Rank> ranks;
  const auto errors = run_ranks(2, world, ranks, [&](int r, Rank& rank) {
    Transport transport(rank.group, {1 - r}, kLong, kTag);
    transport.start();
    if (r == 1) {
      transport.send(0, {1}, {});
      transport.send(0, {2}, {at::ones({1})});
      transport.finish();
    } else {
      expect_throw<TransportError>([&] { transport.finish(); },
                                   {"2 received message(s)", "2 from peer 1", "never taken"});
    }
  });
  expect_no_errors(errors);
}

// Something else sending on the transport's tag is caught by the wire header's checks.
TEST(TransportTest, ForeignMessageIsACorruptHeader) {
  auto world = std::make_shared<ThreadWorld>(2);
  std::vector<Rank> ranks;
  const auto errors = run_ranks(2, world, ranks, [&](int r, Rank& rank) {
    if (r == 1) {
      std::vector<at::Tensor> junk{at::full({Transport::kHeaderSlots}, 3, at::kLong)};
      rank.group->send(junk, 0, kTag)->wait();
      return;
    }
    Transport transport(rank.group, {1}, kLong, kTag);
    transport.start();
    auto error = expect_throw<TransportError>(
        [&] { transport.recv(kLong); },
        {"corrupt message #0 from peer 1", "bad magic number 3", "tag 7"});
    if (error) {
      EXPECT_EQ(error->peers(), std::vector<int>{1});
    }
  });
  expect_no_errors(errors);
}

// Destroying a started Transport (no finish(), peers silent) wakes its receivers via
// Work::abort() and returns promptly; abort() is idempotent and fails pending recv() calls.
TEST(TransportTest, AbortAndDestructionDoNotHang) {
  auto world = std::make_shared<ThreadWorld>(3);
  Rank rank = make_rank(world, 0, 3);
  const auto started = std::chrono::steady_clock::now();
  {
    Transport transport(rank.group, {1, 2}, milliseconds(20000), kTag);
    transport.start();
  }
  {
    Transport transport(rank.group, {1, 2}, milliseconds(20000), kTag + 1);
    transport.start();
    std::thread waiter([&] {
      expect_throw<TransportError>([&] { transport.recv(milliseconds(20000)); }, {"aborted"});
    });
    std::this_thread::sleep_for(milliseconds(50));
    transport.abort();
    transport.abort();
    waiter.join();
    EXPECT_FALSE(transport.started());
  }
  EXPECT_LT(std::chrono::steady_clock::now() - started, std::chrono::seconds(5));
  // At most one header receive per peer and Transport (the first may abort before posting).
  EXPECT_LE(rank.backend->num_recv_.load(), 4);
  EXPECT_GE(rank.backend->num_recv_.load(), 2);
}

}  // namespace
}  // namespace smp::pytorch
