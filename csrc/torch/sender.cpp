#include "smp/pytorch/sender.h"

#include <c10/core/DeviceGuard.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include "smp/error.h"

namespace smp::pytorch {
namespace {

constexpr size_t kBatch = 64;  // messages sent as one batch at most (what fits the header goes)

// The device of the first device tensor of `tensors`, if any.
std::optional<c10::Device> device_of(const std::vector<at::Tensor>& tensors) {
  for (const at::Tensor& t : tensors) {
    if (t.defined() && !t.device().is_cpu() && !t.is_meta()) return t.device();
  }
  return std::nullopt;
}

}  // namespace

struct Sender::State {
  struct Item {
    Transport::OutgoingMessage message;
    std::shared_ptr<c10::Event> produced;  // on the producer's stream, for device tensors
    int64_t number = 0;                    // its position in its queue, from 1
  };
  struct Queue {
    int peer = -1;
    std::deque<Item> items;
    std::condition_variable cv;  // an item was queued, or the sender closes
    int64_t queued = 0;          // items queued so far
    int64_t finished = 0;        // items sent or failed so far (in order)
    bool closing = false;
    bool ended = false;  // the thread has returned
    std::thread thread;
    std::optional<c10::Stream> stream;  // the thread's send stream (device messages only)
  };

  Transport* transport = nullptr;
  std::chrono::milliseconds timeout{0};
  std::mutex mutex;               // guards everything below
  std::condition_variable moved;  // an item finished, or a thread ended
  std::map<int, std::unique_ptr<Queue>> queues;
  std::exception_ptr error;
  int64_t sent = 0;
  bool closed = false;

  void run(Queue& q);
};

void Sender::State::run(Queue& q) {
  std::vector<Item> items;
  while (true) {
    bool failed;
    {
      std::unique_lock<std::mutex> lock(mutex);
      q.cv.wait(lock, [&] { return !q.items.empty() || q.closing; });
      if (q.items.empty()) {  // closing, and everything is sent
        q.ended = true;
        moved.notify_all();
        return;
      }
      // What queued up while the last send was on the wire goes as one batch.
      while (!q.items.empty() && items.size() < kBatch) {
        items.push_back(std::move(q.items.front()));
        q.items.pop_front();
      }
      failed = static_cast<bool>(error);
    }
    if (!failed) {
      try {
        // Note [Stream discipline] (transport.cpp): the send waits on its producers' events
        // only, from a stream of this thread's own.
        std::optional<c10::StreamGuard> guard;
        for (const Item& item : items) {
          if (!item.produced) continue;
          const c10::impl::VirtualGuardImpl impl(item.produced->device_type());
          if (!q.stream) {
            q.stream = impl.getStreamFromGlobalPool(
                c10::Device(item.produced->device_type(), item.produced->device_index()));
          }
          if (!guard) guard.emplace(*q.stream);
          item.produced->block(*q.stream);
          // The send reads the tensors on this stream (after the work's wait, below): the
          // caching allocator must not hand their memory to the producer's stream again before
          // it has, once the message is released.
          for (const at::Tensor& t : item.message.second) {
            if (t.device().type() == q.stream->device_type()) {
              impl.recordDataPtrOnStream(t.storage().data_ptr(), *q.stream);
            }
          }
        }
        if (items.size() == 1) {
          transport->send(q.peer, items[0].message.first, items[0].message.second);
        } else {
          std::vector<Transport::OutgoingMessage> batch;
          batch.reserve(items.size());
          for (Item& item : items) batch.push_back(std::move(item.message));
          transport->send_batch(q.peer, batch);
        }
      } catch (...) {
        {
          std::lock_guard<std::mutex> lock(mutex);
          if (!error) error = std::current_exception();
        }
        // The peers' servers may wait for a message that now cannot come.
        transport->abort();
      }
    }
    {
      std::lock_guard<std::mutex> lock(mutex);
      q.finished = items.back().number;
      sent += static_cast<int64_t>(items.size());
    }
    items.clear();  // the tensors are released outside the lock
    moved.notify_all();
  }
}

Sender::Sender(Transport* transport, const std::vector<int>& peers,
               std::chrono::milliseconds timeout)
    : state_(std::make_shared<State>()) {
  SMP_CHECK(transport != nullptr, "Sender: transport must not be null");
  SMP_CHECK(timeout.count() > 0, "Sender: timeout must be > 0 ms, got {}", timeout.count());
  state_->transport = transport;
  state_->timeout = timeout;
  for (int peer : peers) {
    SMP_CHECK(std::find(transport->peers().begin(), transport->peers().end(), peer) !=
                  transport->peers().end(),
              "Sender: {} is not a peer of the transport (its peers: {})", peer,
              transport->peers());
    auto queue = std::make_unique<State::Queue>();
    queue->peer = peer;
    const bool fresh = state_->queues.emplace(peer, std::move(queue)).second;
    SMP_CHECK(fresh, "Sender: peer {} listed twice", peer);
  }
  for (auto& [peer, queue] : state_->queues) {
    State::Queue* q = queue.get();
    // The thread holds the state: it may outlive the Sender (close() gave up on it).
    q->thread = std::thread([state = state_, q] { state->run(*q); });
  }
}

Sender::~Sender() {
  try {
    close();
  } catch (...) {  // NOLINT(bugprone-empty-catch): a destructor must not throw
  }
}

void Sender::send(int peer, std::vector<int64_t> header, std::vector<at::Tensor> tensors,
                  bool wait) {
  State& s = *state_;
  std::shared_ptr<c10::Event> produced;
  if (const auto device = device_of(tensors)) {
    // Where the tensors were produced: the calling thread's current stream.
    const c10::impl::VirtualGuardImpl impl(device->type());
    produced = std::make_shared<c10::Event>(device->type());
    produced->record(impl.getStream(*device));
  }
  std::unique_lock<std::mutex> lock(s.mutex);
  if (s.error) std::rethrow_exception(s.error);
  SMP_CHECK(!s.closed, "Sender::send: the sender is closed");
  auto it = s.queues.find(peer);
  SMP_CHECK(it != s.queues.end(), "Sender::send: {} is not one of its peers", peer);
  State::Queue& q = *it->second;
  const int64_t number = ++q.queued;
  q.items.push_back(
      State::Item{{std::move(header), std::move(tensors)}, std::move(produced), number});
  if (!wait) {
    lock.unlock();  // the woken thread takes the lock at once
    q.cv.notify_one();
    return;
  }
  q.cv.notify_one();
  // Each send ends within the timeout (Transport::send fails then); those queued before it may
  // each take as long.
  const auto limit = s.timeout * (number - q.finished);
  if (!s.moved.wait_for(lock, limit, [&] { return q.finished >= number || s.error; })) {
    throw TransportError(
        fmt::format(FMT_STRING("smp pipeline: a message to stage {} was not sent within {} ms "
                               "({} ms per queued message)"),
                    peer, limit.count(), s.timeout.count()),
        {peer});
  }
  if (s.error) std::rethrow_exception(s.error);
}

std::vector<int> Sender::close() {
  State& s = *state_;
  std::unique_lock<std::mutex> lock(s.mutex);
  if (s.closed) return {};
  s.closed = true;
  for (auto& [peer, q] : s.queues) {
    q->closing = true;
    q->cv.notify_one();
  }
  const auto all_ended = [&] {
    return std::all_of(s.queues.begin(), s.queues.end(),
                       [](const auto& entry) { return entry.second->ended; });
  };
  std::vector<int> late;
  if (!s.moved.wait_for(lock, s.timeout, all_ended)) {
    for (const auto& [peer, q] : s.queues) {
      if (!q->ended) late.push_back(peer);
    }
    lock.unlock();
    s.transport->abort();  // the sends in flight fail at once; the threads end
    lock.lock();
    s.moved.wait_for(lock, s.timeout, all_ended);
  }
  std::vector<std::thread> threads;
  for (auto& [peer, q] : s.queues) {
    if (q->ended) {
      threads.push_back(std::move(q->thread));
    } else {
      q->thread.detach();  // the backend ignored the abort: it keeps the state alive
    }
  }
  lock.unlock();
  for (std::thread& thread : threads) thread.join();
  return late;
}

void Sender::check() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  if (state_->error) std::rethrow_exception(state_->error);
}

int64_t Sender::sent() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->sent;
}

}  // namespace smp::pytorch
