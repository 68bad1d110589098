// ThreadWorld: an in-process fake c10d backend for tests of the torch layer, ranks as threads.
//
// Why not c10d::ProcessGroupGloo: libtorch_cpu.so exports its symbols, but its header
// (ProcessGroupGloo.hpp) includes <gloo/...> headers that the torch wheel does not ship, so C++
// code outside torch cannot construct one. The real gloo path is covered by the Python tests.
// Here each rank is a thread of one process, and the ranks meet in a ThreadWorld through
// ThreadBackend, a c10d::Backend plugged into a real c10d::ProcessGroup: the ops go through
// torch's dispatcher (c10d::allreduce_, c10d::send, c10d::recv_) exactly as with gloo.
//
// What it models:
//   - Collectives: the k-th collective of every rank (allreduce, _allgather_base and
//     _reduce_scatter_base counted together) forms collective k; the last rank to arrive
//     computes the result for every rank and completes the Works. Ranks that issue different
//     kinds (or sizes) as collective k all fail with an error naming them.
//       allreduce (SUM)              the sum in rank order, written into every rank's tensor
//       _allgather_base              output = the ranks' inputs, flattened, in rank order
//       _reduce_scatter_base (SUM)   output on rank r = chunk r of the flat sum (rank order)
//     Tensors must be contiguous (as with gloo); the input of _allgather_base and the output of
//     _reduce_scatter_base must have 1/world_size the elements of the other side.
//   - send/recv like gloo's: (src, dst, tag) is one FIFO channel; a send and a receive are
//     matched in posting order, and neither Work completes before both are posted (gloo's
//     point-to-point is a rendezvous). The bytes are copied at matching time, so a sender that
//     touches its tensor before wait() returns can be caught. Sizes must match exactly.
//   - Work::abort() wakes the current wait(), which returns false (gloo's RecvWork/SendWork do
//     the same); the aborted op stays posted, as in gloo.
//   - Failure injection: collective `fail_issue_at` throws when issued, `fail_complete_at` fails
//     its Works; fail_sends_from(r) fails r's sends; kill(r) fails every pending and future
//     point-to-point op with r on the other side (a peer that died).
//
// Example:
//   auto world = std::make_shared<ThreadWorld>(2);
//   std::vector<Rank> ranks;
//   auto errors = run_ranks(2, world, ranks, [&](int r, Rank& rank) {
//     std::vector<at::Tensor> t{at::ones({4})};
//     rank.group->allreduce(t)->wait();  // t == 2 on both ranks
//   });
#pragma once

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

namespace smp::pytorch::test_util {

// A hang (e.g. ranks issuing different collectives) fails the test instead of blocking ctest.
constexpr auto kWaitTimeout = std::chrono::seconds(30);

// A Work that ThreadWorld completes (or fails).
class ThreadWork : public c10d::Work {
 public:
  explicit ThreadWork(int rank, c10d::OpType type = c10d::OpType::ALLREDUCE)
      : c10d::Work(rank, type) {}

  void complete(std::exception_ptr error = nullptr) { finish(std::move(error)); }

  bool isCompleted() override {
    std::lock_guard<std::mutex> lock(mutex_);
    return completed_;
  }

  // Waits up to `timeout`, and throws then like gloo; kNoTimeout (0 ms) and anything longer than
  // kWaitTimeout wait kWaitTimeout (a safety net for tests). Returns false if abort() interrupted
  // this wait.
  bool wait(std::chrono::milliseconds timeout) override {
    std::unique_lock<std::mutex> lock(mutex_);
    const bool safety_net = timeout == kNoTimeout || timeout > kWaitTimeout;
    const auto limit = safety_net ? std::chrono::milliseconds(kWaitTimeout) : timeout;
    if (!cv_.wait_for(lock, limit, [this] { return completed_ || aborted_; })) {
      throw std::runtime_error(
          safety_net ? "ThreadWork: no completion within the test's safety "
                       "timeout; did the ranks issue different ops?"
                     : fmt::format("ThreadWork: timed out after {} ms", timeout.count()));
    }
    if (completed_) {
      if (exception_) std::rethrow_exception(exception_);
      return true;
    }
    aborted_ = false;  // like gloo: one abort interrupts one wait
    return false;
  }

  void abort() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      aborted_ = true;
    }
    cv_.notify_all();
  }

 private:
  bool aborted_ = false;  // guarded by mutex_
};

// The meeting point of the ranks (see the file comment).
class ThreadWorld {
 public:
  explicit ThreadWorld(int world_size) : world_size_(world_size) {}

  // Makes collective `seq` fail (issue: the op throws; complete: its Work fails).
  int fail_issue_at = -1;
  int fail_complete_at = -1;

  enum class Kind { kAllreduce, kAllgatherBase, kReduceScatterBase };

  static const char* kind_name(Kind kind) {
    switch (kind) {
      case Kind::kAllreduce:
        return "allreduce";
      case Kind::kAllgatherBase:
        return "_allgather_base";
      case Kind::kReduceScatterBase:
        return "_reduce_scatter_base";
    }
    return "?";
  }

  // Rank `rank`'s part of collective `seq`: it reads `input` and writes `output` (the same
  // tensor for allreduce).
  void contribute(int64_t seq, int rank, Kind kind, const at::Tensor& input,
                  const at::Tensor& output, const c10::intrusive_ptr<ThreadWork>& work) {
    std::lock_guard<std::mutex> lock(mutex_);
    Slot& slot = slots_[seq];
    slot.parts.emplace(rank, Part{kind, input, output});
    slot.works.push_back(work);
    if (static_cast<int>(slot.parts.size()) < world_size_) return;

    std::exception_ptr error;
    if (seq == fail_complete_at) {
      error = std::make_exception_ptr(std::runtime_error("ThreadWorld: injected failure"));
    } else {
      try {
        complete(seq, slot);
      } catch (...) {
        error = std::current_exception();
      }
    }
    for (const auto& w : slot.works) w->complete(error);
    slots_.erase(seq);
  }

  // ---- point-to-point ----

  void post_send(int src, int dst, int tag, const at::Tensor& tensor,
                 const c10::intrusive_ptr<ThreadWork>& work) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (failing_senders_.count(src)) {
      work->complete(std::make_exception_ptr(
          std::runtime_error(fmt::format("ThreadWorld: injected send failure on rank {}", src))));
      return;
    }
    if (fail_if_dead(src, dst, work)) return;
    Mailbox& box = mailboxes_[{src, dst, tag}];
    box.sends.push_back({tensor, work});
    match(box);
  }

  void post_recv(int src, int dst, int tag, const at::Tensor& tensor,
                 const c10::intrusive_ptr<ThreadWork>& work) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (fail_if_dead(src, dst, work)) return;
    Mailbox& box = mailboxes_[{src, dst, tag}];
    box.recvs.push_back({tensor, work});
    match(box);
  }

  // Sends from `rank` fail from now on (their Works complete with an error).
  void fail_sends_from(int rank) {
    std::lock_guard<std::mutex> lock(mutex_);
    failing_senders_.insert(rank);
  }

  // `rank` dies: every pending and future point-to-point op to or from it fails.
  void kill(int rank) {
    std::lock_guard<std::mutex> lock(mutex_);
    dead_.insert(rank);
    for (auto& [key, box] : mailboxes_) {
      const auto [src, dst, tag] = key;
      if (src != rank && dst != rank) continue;
      for (auto* ops : {&box.sends, &box.recvs}) {
        for (auto& op : *ops) op.work->complete(dead_error(rank));
        ops->clear();
      }
    }
  }

 private:
  struct Part {
    Kind kind;
    at::Tensor input;
    at::Tensor output;
  };
  struct Slot {
    std::map<int, Part> parts;  // by rank: iteration in rank order
    std::vector<c10::intrusive_ptr<ThreadWork>> works;
  };

  // Computes every rank's output of a full collective; throws (failing every rank's Work) if the
  // ranks disagree on the kind or the sizes. Caller holds mutex_.
  void complete(int64_t seq, Slot& slot) const {
    const Part& first = slot.parts.begin()->second;
    for (const auto& [r, part] : slot.parts) {
      if (part.kind != first.kind || part.input.numel() != first.input.numel() ||
          part.output.numel() != first.output.numel() || !part.input.is_contiguous() ||
          !part.output.is_contiguous()) {
        throw std::runtime_error(fmt::format(
            "ThreadWorld: collective {}: rank {} issued {} of {} -> {} elements, rank {} {} of "
            "{} -> {} (or a tensor is not contiguous)",
            seq, r, kind_name(part.kind), part.input.numel(), part.output.numel(),
            slot.parts.begin()->first, kind_name(first.kind), first.input.numel(),
            first.output.numel()));
      }
    }
    const int64_t in_numel = first.input.numel();
    const int64_t out_numel = first.output.numel();
    switch (first.kind) {
      case Kind::kAllreduce: {
        at::Tensor sum = at::zeros_like(first.input);
        for (const auto& [r, part] : slot.parts) sum.add_(part.input);  // rank order
        for (auto& [r, part] : slot.parts) part.output.copy_(sum);
        break;
      }
      case Kind::kAllgatherBase: {
        if (out_numel != in_numel * world_size_) {
          throw std::runtime_error(
              fmt::format("ThreadWorld: _allgather_base output has {} elements, expected {}",
                          out_numel, in_numel * world_size_));
        }
        for (auto& [r, dst] : slot.parts) {
          at::Tensor flat = dst.output.view({-1});
          for (const auto& [src_rank, src] : slot.parts) {
            flat.narrow(0, src_rank * in_numel, in_numel).copy_(src.input.view({-1}));
          }
        }
        break;
      }
      case Kind::kReduceScatterBase: {
        if (in_numel != out_numel * world_size_) {
          throw std::runtime_error(
              fmt::format("ThreadWorld: _reduce_scatter_base input has {} elements, expected {}",
                          in_numel, out_numel * world_size_));
        }
        at::Tensor sum = at::zeros({in_numel}, first.input.options());
        for (const auto& [r, part] : slot.parts) sum.add_(part.input.view({-1}));  // rank order
        for (auto& [r, part] : slot.parts) {
          part.output.view({-1}).copy_(sum.narrow(0, r * out_numel, out_numel));
        }
        break;
      }
    }
  }

  struct P2pOp {
    at::Tensor tensor;
    c10::intrusive_ptr<ThreadWork> work;
  };
  struct Mailbox {
    std::deque<P2pOp> sends;
    std::deque<P2pOp> recvs;
  };

  static std::exception_ptr dead_error(int rank) {
    return std::make_exception_ptr(std::runtime_error(
        fmt::format("ThreadWorld: rank {} died (injected): connection closed", rank)));
  }

  bool fail_if_dead(int src, int dst, const c10::intrusive_ptr<ThreadWork>& work) {
    for (int rank : {src, dst}) {
      if (dead_.count(rank)) {
        work->complete(dead_error(rank));
        return true;
      }
    }
    return false;
  }

  // Pairs the oldest send with the oldest receive while both exist. Caller holds mutex_.
  static void match(Mailbox& box) {
    while (!box.sends.empty() && !box.recvs.empty()) {
      P2pOp send = std::move(box.sends.front());
      P2pOp recv = std::move(box.recvs.front());
      box.sends.pop_front();
      box.recvs.pop_front();
      if (send.tensor.nbytes() != recv.tensor.nbytes() || !send.tensor.is_contiguous() ||
          !recv.tensor.is_contiguous()) {
        auto error = std::make_exception_ptr(std::runtime_error(
            fmt::format("ThreadWorld: send of {} bytes matched a receive of {} bytes",
                        send.tensor.nbytes(), recv.tensor.nbytes())));
        send.work->complete(error);
        recv.work->complete(error);
        continue;
      }
      if (send.tensor.nbytes() > 0) {
        std::memcpy(recv.tensor.data_ptr(), send.tensor.data_ptr(), send.tensor.nbytes());
      }
      send.work->complete();
      recv.work->complete();
    }
  }

  const int world_size_;
  std::mutex mutex_;
  std::map<int64_t, Slot> slots_;
  std::map<std::tuple<int, int, int>, Mailbox> mailboxes_;  // (src, dst, tag)
  std::set<int> failing_senders_;
  std::set<int> dead_;
};

// One rank's backend over a ThreadWorld; it also counts what the code under test asked for.
class ThreadBackend : public c10d::Backend {
 public:
  ThreadBackend(int rank, int size, std::shared_ptr<ThreadWorld> world)
      : c10d::Backend(rank, size), world_(std::move(world)) {}

  const std::string getBackendName() const override { return "smp_thread_world"; }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    num_allreduce_++;
    if (opts.reduceOp != c10d::ReduceOp::SUM) num_non_sum_ops_++;
    if (tensors.size() != 1) throw std::logic_error("ThreadBackend: expected one tensor");
    return issue(ThreadWorld::Kind::kAllreduce, c10d::OpType::ALLREDUCE, tensors[0], tensors[0]);
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override {
    num_allgather_base_++;
    return issue(ThreadWorld::Kind::kAllgatherBase, c10d::OpType::_ALLGATHER_BASE, input, output);
  }

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override {
    num_reduce_scatter_base_++;
    if (opts.reduceOp != c10d::ReduceOp::SUM) num_non_sum_ops_++;
    return issue(ThreadWorld::Kind::kReduceScatterBase, c10d::OpType::_REDUCE_SCATTER_BASE, input,
                 output);
  }

  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst_rank,
                                      int tag) override {
    num_send_++;
    if (tensors.size() != 1) throw std::logic_error("ThreadBackend: expected one tensor");
    auto work = c10::make_intrusive<ThreadWork>(getRank(), c10d::OpType::SEND);
    world_->post_send(getRank(), dst_rank, tag, tensors[0], work);
    return work;
  }

  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src_rank,
                                      int tag) override {
    num_recv_++;
    if (tensors.size() != 1) throw std::logic_error("ThreadBackend: expected one tensor");
    auto work = c10::make_intrusive<ThreadWork>(getRank(), c10d::OpType::RECV);
    world_->post_recv(src_rank, getRank(), tag, tensors[0], work);
    return work;
  }
  // recvAnysource is deliberately not implemented: the base class throws (design.md §4).

  std::atomic<int64_t> num_allreduce_{0};
  std::atomic<int64_t> num_allgather_base_{0};
  std::atomic<int64_t> num_reduce_scatter_base_{0};
  std::atomic<int64_t> num_non_sum_ops_{0};
  std::atomic<int64_t> num_send_{0};
  std::atomic<int64_t> num_recv_{0};

 private:
  // Collective number `seq` of this rank, whatever its kind (see the file comment).
  c10::intrusive_ptr<c10d::Work> issue(ThreadWorld::Kind kind, c10d::OpType type,
                                       const at::Tensor& input, const at::Tensor& output) {
    const int64_t seq = num_collectives_++;
    if (seq == world_->fail_issue_at) throw std::runtime_error("ThreadBackend: injected failure");
    auto work = c10::make_intrusive<ThreadWork>(getRank(), type);
    world_->contribute(seq, getRank(), kind, input, output, work);
    return work;
  }

  std::shared_ptr<ThreadWorld> world_;
  std::atomic<int64_t> num_collectives_{0};
};

struct Rank {
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  c10::intrusive_ptr<ThreadBackend> backend;
};

inline Rank make_rank(const std::shared_ptr<ThreadWorld>& world, int rank, int world_size) {
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

// Reports, as test failures, every rank's exception returned by run_ranks().
inline void expect_no_errors(const std::vector<std::exception_ptr>& errors) {
  for (size_t r = 0; r < errors.size(); ++r) {
    if (!errors[r]) continue;
    try {
      std::rethrow_exception(errors[r]);
    } catch (const std::exception& e) {
      ADD_FAILURE() << "rank " << r << " threw: " << e.what();
    }
  }
}

// A one-shot event between rank threads: wait() fails the test after 30 s without set().
class Event {
 public:
  void set() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      set_ = true;
    }
    cv_.notify_all();
  }
  void wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    ASSERT_TRUE(cv_.wait_for(lock, std::chrono::seconds(30), [this] { return set_; }));
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  bool set_ = false;
};

}  // namespace smp::pytorch::test_util
