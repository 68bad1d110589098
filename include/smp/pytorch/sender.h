// smp/pytorch/sender.h — sends a step's pipeline messages without making the caller wait.
//
// Transport::send() returns only once the peer has taken every part of the message; on gloo that
// includes waking the peer's receiver thread, which costs milliseconds when every core is busy
// computing. A Sender hands each message to one thread per peer, which sends them in the order
// they were given (each channel stays FIFO) while the caller goes on computing. The messages
// that queue up for a peer while one is on the wire go together, as one Transport::send_batch()
// (Note [Batches] in transport.cpp): a gloo message costs a rendezvous and a wake-up of the
// peer's receiver whatever its size. Queueing a message is a lock, a move and a notify: no
// thread hand-off, allocation of Python objects or GIL on the sending path.
//
// Device tensors (docs/design.md §4.8, Note [Stream discipline] in transport.cpp): send()
// records an event on the calling thread's current stream, where the tensors were produced; the
// peer's thread sends from a stream of its own that waits on that event only, so the send never
// waits on compute the producer enqueued after it, and the caller's stream never waits on the
// send.
//
// The tensors of a message must not be modified in place until it is sent: the runtime queues
// only tensors it owns (a served call's outputs, gradients, copies of a call's arguments).
// send(..., wait=true) returns once the message is on the wire, for callers that cannot copy.
//
// Errors: the first failed send aborts the transport (the peers' servers may wait for a message
// that now cannot come) and is rethrown by every later send() and by check(). close() drains the
// queues within the timeout; a thread still sending then is stopped by aborting the transport,
// and close() returns the peers it was sending to.
#pragma once

#include <ATen/ATen.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <vector>

#include "smp/pytorch/transport.h"

namespace smp::pytorch {

class Sender {
 public:
  /// Starts one sending thread per peer of `transport` (started, and kept alive by the caller
  /// until close() has returned). `timeout` bounds close()'s wait, per queued message for a
  /// waiting send().
  Sender(Transport* transport, const std::vector<int>& peers, std::chrono::milliseconds timeout);
  /// close(), if it was not called.
  ~Sender();
  Sender(const Sender&) = delete;
  Sender& operator=(const Sender&) = delete;

  /// Queues a message for `peer`; with `wait`, returns once it has been sent. Rethrows the first
  /// error of an earlier send; throws smp::Error for an unknown peer or after close().
  void send(int peer, std::vector<int64_t> header, std::vector<at::Tensor> tensors,
            bool wait = false);
  /// Waits until every queued message has been sent (or failed) and ends the threads, within
  /// the timeout; returns the peers whose thread was still sending then (the transport was
  /// aborted to stop them). Idempotent.
  std::vector<int> close();
  /// Rethrows the first send error, if any.
  void check() const;
  /// Messages sent so far (batches count their messages).
  int64_t sent() const;

 private:
  struct State;  // shared with the sending threads, which may outlive a Sender (close())
  std::shared_ptr<State> state_;
};

}  // namespace smp::pytorch
