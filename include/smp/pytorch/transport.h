// smp/pytorch/transport.h — the message transport of the pipeline runtime over c10d send/recv.
//
// Every pipeline rank runs a server; servers exchange messages (module-call requests, replies,
// gradients) through one Transport per rank. A message is a list of int64 (the header: message
// kind, ids, ... — the runtime decides) plus a list of tensors. On the wire a message is one
// fixed-size int64 tensor of kHeaderSlots entries (the wire header; Note [Wire header] in
// transport.cpp has its layout), which also carries the bytes of the tensors that fit in its
// free entries, and then one payload send per other non-empty tensor, all to the same peer on
// the same tag. send_batch() packs several messages into one wire message (Note [Batches]).
//
// The rules below come from peers' bugs on gloo (docs/design.md §4):
//   - One FIFO channel per peer pair: messages from one peer arrive in the order they were sent,
//     and a message's parts are never interleaved with another message to the same peer (sends
//     to one peer are serialised by a mutex).
//   - Receives are never batched over peers (no recvAnysource, no batch_isend_irecv): each peer
//     has its own receiver thread that posts, in a fixed order, the header receive, waits for
//     it, then posts every payload receive of that message at once and waits on them in order.
//   - Every Work is waited on: send() waits for all parts of its message before it returns (gloo
//     sends are a rendezvous: they complete once the peer's receiver thread has posted the
//     matching receive, i.e. promptly while the peer's Transport is started); receiver threads
//     wait on their receives; finish() waits for every receiver to end.
//   - Nothing hangs silently: every blocking call is bounded by a timeout and fails with a
//     TransportError that names the peers involved and the timeout. The receiver threads
//     themselves never time out on an idle channel (a gloo receive that times out closes every
//     pair of the group; see Note [Idle receivers] in transport.cpp): callers are bounded by
//     recv(timeout) and finish(), a dead peer surfaces as a backend error, and abort() (also run
//     by the destructor) wakes the receivers through Work::abort().
//
// Life cycle of one step (the runtime may keep one Transport for many steps):
//   start()          spawns one receiver thread per peer; the channels are open
//   send() / recv()  any number, from any threads (sends to one peer are serialised)
//   finish()         sends END to every peer, waits until every peer has sent END to this rank
//                    (i.e. has called finish() too), joins the receivers; start() may follow
// Every rank of a step must call start() and finish() once each, and every message sent in a
// step must be received (recv()) in that step: finish() fails on undelivered messages. A send to
// a peer that has not started the step yet waits for it (within the timeout).
//
// Invariants the caller must keep:
//   - Channels are matched by (group, tag, peer): two Transports on one group need two tags, and
//     nothing else may send or receive on that tag between these ranks.
//   - The peers lists are symmetric: if rank a lists b, b lists a.
//   - Tensors may live on the CPU or on a device (CUDA). Where they travel and where they land
//     (Note [Payload routes] in transport.cpp, docs/design.md §4.8): headers always go on `group`
//     (a host-side group: gloo). A device tensor goes device to device on a payload group whose
//     backend for its device is not gloo (NCCL: ordered on the streams, no host wait);
//     otherwise it is staged through host memory. Host bytes go inline in the header when they
//     fit, else on a payload group with a CPU backend, else on `group`. A device tensor lands
//     on this Transport's `device` (on the CPU if that is the CPU); CPU tensors land on the
//     CPU.
//   - Payload groups come in a pair (ascending, descending): a message from a lower to a higher
//     group rank uses the first, the other direction the second, so that each ordered pair of
//     ranks has a communicator of its own (c10d's NCCL point-to-point runs one communicator per
//     rank pair and group) and a send never waits behind a receive on one NCCL stream.
//   - After a failure (a TransportError from send() or finish(), a receiver's error raised by
//     recv(), abort(), or destruction without a successful finish(); a recv() timeout alone is
//     not one) the channels are in an undefined state: the backend may still hold a
//     posted receive that would swallow the next message. Do not reuse the group's channels on
//     that tag: the runtime tears the group down after a failed step.
//
// Errors: user mistakes (a bad peer, a header that does not fit, an unsupported tensor, calls out
// of order) throw smp::Error (ValueError in Python) before anything is communicated. Timeouts and
// backend failures throw TransportError (RuntimeError in Python), whose message names this rank,
// the tag, the peer(s) and, for timeouts, the timeout.
//
// Example (2 pipeline ranks; the group's ranks 0 and 1):
//   Transport transport(pp_group, /*peers=*/{1 - rank}, std::chrono::seconds(60), /*tag=*/7);
//   transport.start();
//   if (rank == 0) {
//     transport.send(1, /*header=*/{kRequest, module_id, microbatch}, {activations});
//     std::optional<Message> reply = transport.recv(std::chrono::seconds(60));
//     // reply->peer == 1, reply->header == {kReply, module_id, microbatch}, reply->tensors
//   } else {
//     std::optional<Message> request = transport.recv(std::chrono::seconds(60));
//     transport.send(0, {kReply, request->header[1], request->header[2]}, {outputs});
//   }
//   transport.finish();  // both ranks; then start() again for the next step
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <ATen/ATen.h>
#include <c10/core/Event.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace smp::pytorch {

namespace internal {
struct TransportState;  // shared with the receiver threads, which may outlive a Transport
}  // namespace internal

/// One message: who sent it, the header ints and the tensors, exactly as passed to send().
struct Message {
  int peer = -1;                ///< group rank of the sender
  std::vector<int64_t> header;  ///< the sender's header ints
  /// Fresh contiguous tensors (same dtypes and shapes): on the Transport's device where the
  /// sender's was on a device, else on the CPU. Device tensors are written on a stream of the
  /// receiver's own: use them after wait_ready() (Note [Stream discipline] in transport.cpp).
  std::vector<at::Tensor> tensors;
  /// Recorded on the receiver's stream once every device tensor of the message is written;
  /// null when it has none.
  std::shared_ptr<c10::Event> ready;

  /// Makes the calling thread's current stream on the message's device wait for its device
  /// tensors (no host wait); nothing for a message without them. The consumer calls it when it
  /// starts using the tensors, not before: PipelineServer::next() when it hands the message
  /// out, the Python binding of Transport.recv() when it returns it.
  void wait_ready() const;
};

/// A timeout or a backend failure of the transport (not a user mistake). The message names this
/// rank, the tag and the peers; peers() lists those peers (group ranks).
class TransportError : public std::runtime_error {
 public:
  TransportError(const std::string& message, std::vector<int> peers)
      : std::runtime_error(message), peers_(std::move(peers)) {}

  /// The peers the failure concerns: the failed peer, or the peers still open on a timeout.
  const std::vector<int>& peers() const { return peers_; }

 private:
  std::vector<int> peers_;
};

/// Point-to-point messages between this rank and a fixed set of peers over a c10d group, with
/// one FIFO channel per peer, one receiver thread per peer and bounded waits (see the file
/// comment for the rules and the life cycle).
///
/// Thread safety: send() and recv() may be called concurrently from several threads. start(),
/// finish() and the destructor must not run concurrently with other calls; abort() may.
class Transport {
 public:
  /// Entries of the wire header tensor (int64). See Note [Wire header] in transport.cpp.
  static constexpr int64_t kHeaderSlots = 512;

  /// Prepares (does not start) a transport between this rank of `group` and `peers`.
  ///
  /// Args:
  ///   group: the c10d group whose point-to-point ops carry the messages.
  ///   peers: group ranks this rank exchanges messages with; distinct, in [0, group size), not
  ///     this rank. May be empty (then there is nothing to send or receive).
  ///   timeout: bounds the waits of send() (all parts of one message), of finish() (for the
  ///     peers' END), of a message's payload once its header has arrived, and of abort() for the
  ///     receivers to end; > 0. recv() takes its own timeout.
  ///   tag: the c10d tag of every send and receive, >= 0; distinct per Transport on one group.
  ///   payload_groups: empty, or two groups of the same ranks as `group` (ascending,
  ///     descending; see the file comment) that carry the tensors their backends support.
  ///   device: where received device tensors land (the rank's device); the CPU by default.
  ///     Receiver threads make it their current device.
  ///
  /// Throws smp::Error for a null group, a bad peer list, timeout <= 0, tag < 0, or payload
  /// groups that are not two groups of the same size and rank as `group`.
  Transport(c10::intrusive_ptr<c10d::ProcessGroup> group, std::vector<int> peers,
            std::chrono::milliseconds timeout, int tag,
            std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> payload_groups = {},
            c10::Device device = c10::Device(c10::kCPU));

  /// Aborts (see abort()) unless the last start() was followed by a successful finish(). Never
  /// throws; blocks at most about `timeout` (only if the backend ignores Work::abort()).
  ~Transport();

  Transport(const Transport&) = delete;
  Transport& operator=(const Transport&) = delete;

  /// Opens the channels: spawns one receiver thread per peer, each of which loops "receive a
  /// message from its peer, append it to the inbox" until the peer's END arrives.
  ///
  /// Throws smp::Error if already started, or after a failure (create a new Transport).
  void start();

  /// Sends one message to `peer`: the wire header, then each tensor with at least one element
  /// (made contiguous; requires_grad tensors are sent detached). Returns when every host part
  /// has been taken by the peer, and every device part is ordered before the work the calling
  /// thread's current stream does next (c10d's Work::wait() without a timeout), so the caller
  /// may modify the tensors right away.
  ///
  /// Throws smp::Error, before anything is sent, if not started (or finish() has begun), `peer`
  /// is not one of the peers, a tensor is undefined, not strided, quantized, or
  /// the header does not fit (header_capacity(tensors) < header.size()). Throws TransportError
  /// if the backend fails or a part is not taken within the timeout (is the peer started?); the
  /// channel to `peer` is then broken and every later send to it throws as well.
  void send(int peer, const std::vector<int64_t>& header, const std::vector<at::Tensor>& tensors);

  /// One message to send: its header ints and its tensors.
  using OutgoingMessage = std::pair<std::vector<int64_t>, std::vector<at::Tensor>>;

  /// Sends `messages` to `peer` in order, as that many send() calls would, but packed into as
  /// few wire messages as fit the wire header (Note [Batches] in transport.cpp): the peer's
  /// recv() returns them one by one, as if sent one by one, at a fraction of the wire's cost.
  /// Checks every message as send() does before anything is sent; returns and throws as
  /// send() does.
  void send_batch(int peer, const std::vector<OutgoingMessage>& messages);

  /// Returns the next message of the inbox: messages from one peer in the order they were sent,
  /// messages from different peers in the order they arrived. Waits up to `timeout` for one.
  ///
  /// Returns std::nullopt when no message can arrive any more: every peer has sent END (called
  /// finish()) and the inbox is empty.
  ///
  /// Throws TransportError if nothing arrives within `timeout` (the message names the peers
  /// whose channels are still open and the timeout; the transport stays usable, so a caller may
  /// wait again), or if a receiver thread failed (the peer died, the backend failed, or a
  /// corrupt header): that error names the peer, is sticky, and wins over queued messages (fail
  /// fast). Throws smp::Error if not started or timeout < 0.
  std::optional<Message> recv(std::chrono::milliseconds timeout);

  /// Like recv() but never waits: the next message if one is queued, else std::nullopt. A
  /// receiver's failure is rethrown as in recv().
  std::optional<Message> try_recv();

  /// Ends the step: sends END to every peer (ascending rank), waits up to the timeout for END
  /// from every peer, joins the receiver threads and checks that every received message was
  /// delivered by recv(). Afterwards start() may open the next step.
  ///
  /// Throws smp::Error if not started. Throws TransportError if an END cannot be sent, a peer's
  /// END does not arrive within the timeout (the message names it: did it call finish()?), a
  /// receiver failed, or messages remain undelivered (named per peer); the transport is then
  /// aborted and cannot be started again, unless `abort_on_failure` is false: then the
  /// receivers stay posted (messages a late peer still sends on this tag, its END or an error
  /// report, are taken instead of leaving its send to time out, which on gloo closes every pair
  /// of the group) and the caller aborts once every peer is known to be done with the tag.
  void finish(bool abort_on_failure = true);

  /// Stops now, without END: wakes every receiver thread by aborting its pending receive
  /// (Work::abort()), aborts sends in flight, fails waiting recv() calls with TransportError,
  /// joins the receivers (detaching any the backend does not wake within the timeout; they hold
  /// only shared state and end when the backend gives up). Idempotent; a no-op when no step is
  /// open. The transport cannot be started again. Never throws.
  void abort() noexcept;

  /// How many header ints fit in one message with these tensors:
  /// kHeaderSlots - 5 - sum over tensors of (2 + ndim).
  static int64_t header_capacity(const std::vector<at::Tensor>& tensors);

  /// This rank in the group.
  int rank() const;
  /// The peers, as given.
  const std::vector<int>& peers() const;
  /// The c10d tag.
  int tag() const;
  /// The timeout given at construction.
  std::chrono::milliseconds timeout() const;
  /// Where received device tensors land.
  c10::Device device() const;
  /// Whether a step is open: start() was called and finish()/abort() not yet.
  bool started() const;

 private:
  std::shared_ptr<internal::TransportState> state_;
};

}  // namespace smp::pytorch
