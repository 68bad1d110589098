#include "smp/pytorch/transport.h"

#include <c10/core/DeviceGuard.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "smp/error.h"
#include "smp/pytorch/format.h"

namespace smp::pytorch {

// Note [Wire header]
// A message starts with one int64 tensor of Transport::kHeaderSlots entries:
//   [0]  kMagic      catches a peer that speaks something else on this (group, tag)
//   [1]  kind        kData, kBatch (several messages: Note [Batches]), or kEnd (the peer's
//                    finish(): its last message of the step)
//   [2]  seq         index of the message on its channel since start(), END included
//   [3]  H           number of header ints
//   [4]  N           number of tensors
//   then per tensor: dtype (c10::ScalarType as an integer, plus the flags kInline when its
//   bytes are in this header, kOnDevice when the sender's tensor was on a device, kOnPayload
//   when its bytes travel on the payload group, kDeviceBytes when they go from device memory
//   to device memory there), ndim, size_0 ... size_{ndim-1}
//   then the H header ints, then the bytes of the inline tensors in tensor order, each from a
//   slot boundary; the rest is zero.
// The receiver checks magic, kind and seq, so a foreign, lost or duplicated message fails with
// the peer named instead of pairing a header with the wrong payloads. A tensor whose bytes fit
// the header's free slots (taken in tensor order) travels inline: the pickled skeleton of a
// call's arguments or outputs does, so most messages are one send instead of two. The other
// payloads follow in tensor order, one send each, as bytes (a uint8 view of the contiguous
// tensor: any dtype, and the backend need not support it); tensors with no elements send
// nothing.

// Note [Payload routes]
// The header always travels on the Transport's group, a host-side (gloo) group: the receiver
// thread must read it on the host to know what follows, and gloo's receive is what abort()
// can wake. A tensor travels
//   - on the payload group for its direction (kOnPayload, kDeviceBytes) when it is on a device
//     and that group has a backend for the device's type: with NCCL, CUDA tensors go device to
//     device, never inline (that would read device memory on the host). The streams they
//     wait on follow Note [Stream discipline];
//   - else as host bytes: a device tensor is first copied to the host (kOnDevice;
//     synchronous on the sender's current stream, so it sees the producer's writes) and the
//     receiver copies it to its device. Host bytes go inline when they fit the header, else
//     on the payload group if it has a CPU backend (kOnPayload), else on the header's group.
//     This is the gloo path: ranks that share one GPU (NCCL refuses two ranks on one device)
//     and CPU-only runs. A CPU tensor with an NCCL payload group stays on the header's group
//     (NCCL has no CPU backend), e.g. a call's pickled skeleton too big for the header.

// Note [Stream discipline]
// c10d orders a device send or receive against the *current stream of the thread that issues or
// waits on it*: the NCCL stream waits for the issuing thread's current stream, and
// Work::wait() makes the waiting thread's current stream wait for the NCCL stream. Were those
// the compute stream (the device's default stream, where smp runs every module), stage A's
// compute would wait for a gradient B has not sent yet while A's activation send to B waits
// for A's compute: in 1F1B's steady state both stages do this at once, and neither send can
// start. So no thread that issues or waits on a payload does it on the compute stream:
//   - a send waits only on its tensors' producer: smp::pytorch::Sender records an event on the
//     producer's current stream when the message is queued, and its thread for the peer sends
//     from a stream of its own that waits on that event alone (sender.cpp);
//   - a receive is posted and waited, and host-staged bytes are copied to the device, on a
//     stream of the receiver thread's own (one per peer), where its buffers are allocated too;
//     then the message's `ready` event is recorded there;
//   - the consumer's stream waits on `ready` when the message is handed to the task that uses
//     it (Message::wait_ready()), never earlier, and the buffers are recorded on that stream,
//     so the caching allocator reuses their memory only after the consumer's uses. A sent
//     tensor is recorded on its send stream likewise before the sender releases it.
// The compute stream thus waits only for messages whose consumer runs, a send never waits for
// compute enqueued after its tensor was produced, and sends and receives of one pair of ranks
// are on different NCCL streams (Note [Payload routes]: one communicator per direction), so
// neither orders behind the other. tests/python/unit/test_stream_discipline.py checks these
// rules with a model of the streams over the schedules' orders (and that the rules above,
// broken as described, deadlock 1F1B). On the CPU, and for host-only messages, all of this
// is a no-op.

namespace internal {
namespace {

constexpr int64_t kMagic = 0x736d7074726e7331;  // "smptrns1"
constexpr int64_t kData = 0;
constexpr int64_t kEnd = 1;
constexpr int64_t kBatch = 2;
constexpr int64_t kFixedSlots = 5;
// Flags added to a tensor's dtype code (see Note [Wire header]).
constexpr int64_t kInline = int64_t{1} << 32;       // its bytes are in the header
constexpr int64_t kOnDevice = int64_t{1} << 33;     // the sender's tensor was on a device
constexpr int64_t kOnPayload = int64_t{1} << 34;    // its bytes travel on the payload group
constexpr int64_t kDeviceBytes = int64_t{1} << 35;  // ... from device to device memory
constexpr int64_t kDtypeMask = kInline - 1;
// Longer waits are clamped (a caller may pass "forever"): deadlines must not overflow.
constexpr std::chrono::milliseconds kMaxWait = std::chrono::hours(24 * 365);

std::chrono::milliseconds clamp_wait(std::chrono::milliseconds timeout) {
  return std::min(timeout, kMaxWait);
}

// The text of the exception in `error` (which must be non-null).
std::string what(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown exception";
  }
}

// A byte view of a contiguous tensor (shares its storage): payloads travel as bytes.
at::Tensor as_bytes(const at::Tensor& tensor) { return tensor.reshape({-1}).view(at::kByte); }

}  // namespace

enum class Phase { kIdle, kRunning, kFinishing, kFailed };

// One peer's channel. Lock order: TransportState::mutex is never held while taking the others.
struct Channel {
  explicit Channel(int peer_rank) : peer(peer_rank) {}
  const int peer;

  // Sending side: one message at a time, so that messages' parts never interleave.
  std::mutex send_mutex;
  int64_t send_seq = 0;      // guarded by send_mutex
  bool send_broken = false;  // guarded by send_mutex: a failed send left a partial message

  // Works in flight, so that abort() can wake whoever waits on them.
  std::mutex work_mutex;
  bool stop = false;                                          // guarded by work_mutex
  std::vector<c10::intrusive_ptr<c10d::Work>> pending_recvs;  // guarded by work_mutex
  std::vector<c10::intrusive_ptr<c10d::Work>> pending_sends;  // guarded by work_mutex

  // Receiving side; `open` and `done` are guarded by TransportState::mutex.
  bool open = false;     // the receiver runs and END has not arrived
  bool done = true;      // the receiver thread has finished (or was never started)
  std::thread receiver;  // joined/detached under TransportState::threads_mutex
};

struct TransportState {
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  // Empty, or (ascending, descending): see Note [Payload routes].
  std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> payload_groups;
  c10::Device device{c10::kCPU};  // where received device tensors land
  int rank = -1;
  std::vector<int> peers;
  std::chrono::milliseconds timeout{0};
  int tag = 0;
  std::map<int, std::unique_ptr<Channel>> channels;  // fixed after construction

  std::mutex mutex;            // guards the fields below and Channel::{open, done}
  std::condition_variable cv;  // signalled when any of them changes
  Phase phase = Phase::kIdle;
  bool aborted = false;
  std::deque<Message> inbox;
  std::exception_ptr first_error;  // of a receiver thread, or of abort()

  std::mutex threads_mutex;  // serialises joining/detaching Channel::receiver

  std::string where() const {
    return fmt::format(FMT_STRING("Transport(rank {}, tag {})"), rank, tag);
  }

  Channel* channel(int peer) const {
    auto it = channels.find(peer);
    return it == channels.end() ? nullptr : it->second.get();
  }

  // The payload group of messages from `src` to `dst` (null if there is none).
  c10d::ProcessGroup* payload_group(int src, int dst) const {
    if (payload_groups.empty()) return nullptr;
    return (src < dst ? payload_groups[0] : payload_groups[1]).get();
  }
};

// Whether `group` sends tensors of `type` device to device: it has a backend for them and that
// is not gloo (whose point-to-point takes host memory only, although torch registers it for
// CUDA too).
inline bool moves_device_bytes(c10d::ProcessGroup* group, c10::DeviceType type) {
  return group && group->hasBackendForDeviceType(type) &&
         group->getBackend(type)->getBackendName() != "gloo";
}

// One part of a message on the wire: its bytes, the group it travels on, and whether its works
// are waited on the streams (device parts) or on the host.
struct Part {
  at::Tensor bytes;
  c10d::ProcessGroup* group;
  bool on_stream;
};

namespace {

TransportError error_for(const TransportState& s, int peer, const std::string& message) {
  return TransportError(fmt::format(FMT_STRING("{}: {}"), s.where(), message), {peer});
}

// Receives posted together: the parts, their names for errors, and their works (null where
// abort() came first and a host part was not posted).
struct Posted {
  std::vector<Part> parts;
  std::vector<std::string> names;
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
};

// Posts the receives of `parts` from the channel's peer, all at once and in order; wait_parts()
// waits for them. All at once because gloo's unbound-buffer protocol moves a part's bytes only
// once the receive for it is posted (the sender announces the send, the receiver answers
// "ready", then the bytes flow): a message's parts received one after the other would pay that
// round trip, and a wake-up of this thread, per part. After abort() only device parts are still
// posted (Note [Device payloads are always matched]). Throws TransportError naming the peer and
// the part (`names[i]`) if the backend refuses one.
Posted post_parts(TransportState& s, Channel& c, std::vector<Part> parts,
                  std::vector<std::string> names) {
  Posted posted{std::move(parts), std::move(names), {}};
  std::lock_guard<std::mutex> lock(c.work_mutex);
  for (size_t i = 0; i < posted.parts.size(); ++i) {
    const Part& part = posted.parts[i];
    if (c.stop && !part.on_stream) {
      posted.works.emplace_back();  // not posted
      continue;
    }
    std::vector<at::Tensor> one{part.bytes};
    try {
      posted.works.push_back(part.group->recv(one, c.peer, s.tag));
    } catch (...) {
      throw error_for(s, c.peer,
                      fmt::format(FMT_STRING("receiving {} from peer {} failed: {}"),
                                  posted.names[i], c.peer, what(std::current_exception())));
    }
    c.pending_recvs.push_back(posted.works.back());
  }
  return posted;
}

// Waits for the receives post_parts() posted, in order, up to `timeout` in total. Returns false
// if the transport was aborted; throws TransportError naming the peer and the part on a backend
// failure. A device part (`on_stream`) is waited on the receiver thread's current stream
// instead: the host does not block (Note [Payload routes]).
bool wait_parts(TransportState& s, Channel& c, const Posted& posted,
                std::chrono::milliseconds timeout) {
  const auto& works = posted.works;
  const auto deadline = std::chrono::steady_clock::now() + clamp_wait(timeout);
  std::exception_ptr error;
  size_t failed = 0;  // the first part that did not arrive
  bool completed = true;
  for (size_t i = 0; i < works.size(); ++i) {
    const bool fine = completed && !error;
    if (!works[i] || (!fine && !posted.parts[i].on_stream)) {
      // Not posted (abort() came first), or an earlier part failed: host parts are not waited
      // on any more. Posted device parts still are, on the stream, which never blocks the host.
      if (fine) {
        completed = false;
        failed = i;
      }
      continue;
    }
    // At least 1 ms: a wait of 0 ms means "no timeout" to c10d.
    const auto left = std::max(std::chrono::milliseconds(1),
                               std::chrono::duration_cast<std::chrono::milliseconds>(
                                   deadline - std::chrono::steady_clock::now()));
    try {
      if (!(posted.parts[i].on_stream ? works[i]->wait() : works[i]->wait(left)) && fine) {
        completed = false;
        failed = i;
      }
    } catch (...) {
      if (fine) {
        error = std::current_exception();
        failed = i;
      }
    }
  }
  bool stopped = false;
  {
    std::lock_guard<std::mutex> lock(c.work_mutex);
    auto& pending = c.pending_recvs;
    pending.erase(std::remove_if(pending.begin(), pending.end(),
                                 [&](const auto& work) {
                                   return std::find(works.begin(), works.end(), work) !=
                                          works.end();
                                 }),
                  pending.end());
    stopped = c.stop;
  }
  if (stopped) return false;  // abort() woke us; whatever the wait says is a consequence
  if (error) {
    throw error_for(s, c.peer,
                    fmt::format(FMT_STRING("receiving {} from peer {} failed: {}"),
                                posted.names[failed], c.peer, what(error)));
  }
  if (!completed) {
    throw error_for(s, c.peer,
                    fmt::format(FMT_STRING("receiving {} from peer {} was aborted by the backend"),
                                posted.names[failed], c.peer));
  }
  return true;
}

// Sends `parts` to the channel's peer, in order, and waits on every posted part (also after a
// failure, so nothing is left reading the caller's tensors) within `timeout` in total. Throws
// TransportError naming the peer. The caller holds c.send_mutex.
// `posted_anyway`: post even after abort() (device parts whose header the peer has taken: see
// Note [Device payloads are always matched]).
void send_parts(TransportState& s, Channel& c, const std::vector<Part>& parts,
                const std::string& message, bool posted_anyway = false) {
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  std::exception_ptr error;
  {
    std::lock_guard<std::mutex> lock(c.work_mutex);
    if (c.stop && !posted_anyway) {
      throw error_for(s, c.peer,
                      fmt::format(FMT_STRING("sending {}: the transport was aborted"), message));
    }
    for (const Part& part : parts) {
      std::vector<at::Tensor> buffers{part.bytes};
      try {
        works.push_back(part.group->send(buffers, c.peer, s.tag));
      } catch (...) {
        error = std::current_exception();
        break;
      }
    }
    c.pending_sends = works;
  }
  const auto deadline = std::chrono::steady_clock::now() + clamp_wait(s.timeout);
  bool aborted = false;
  for (size_t i = 0; i < works.size(); ++i) {
    const auto& work = works[i];
    // At least 1 ms: a wait of 0 ms means "no timeout" to c10d.
    const auto left = std::max(std::chrono::milliseconds(1),
                               std::chrono::duration_cast<std::chrono::milliseconds>(
                                   deadline - std::chrono::steady_clock::now()));
    try {
      // A device part is waited on the streams (Note [Payload routes]).
      if (!(parts[i].on_stream ? work->wait() : work->wait(left))) aborted = true;
    } catch (...) {
      if (!error) error = std::current_exception();
    }
  }
  {
    std::lock_guard<std::mutex> lock(c.work_mutex);
    c.pending_sends.clear();
    aborted = aborted || c.stop;
  }
  if (aborted) {
    throw error_for(s, c.peer,
                    fmt::format(FMT_STRING("sending {} to peer {} was aborted"), message, c.peer));
  }
  if (error) {
    throw error_for(
        s, c.peer,
        fmt::format(
            FMT_STRING(
                "sending {} to peer {} failed (is its Transport started? timeout {} ms): {}"),
            message, c.peer, s.timeout.count(), what(error)));
  }
}

// Sends one message (data or END) to `c.peer`: numbers it and serialises it with the channel's
// other messages. `wire` is the encoded header with slot 2 (seq) still to fill.
void send_message(TransportState& s, Channel& c, const at::Tensor& wire, std::vector<Part> payloads,
                  const char* kind) {
  std::lock_guard<std::mutex> lock(c.send_mutex);
  if (c.send_broken) {
    throw error_for(s, c.peer,
                    fmt::format(FMT_STRING("cannot send {} to peer {}: an earlier send to it "
                                           "failed and left the channel broken"),
                                kind, c.peer));
  }
  wire.data_ptr<int64_t>()[2] = c.send_seq;
  const std::string what_message = fmt::format(FMT_STRING("{} #{}"), kind, c.send_seq);
  const Part header{wire, s.group.get(), false};
  try {
    if (std::none_of(payloads.begin(), payloads.end(), [](const Part& p) { return p.on_stream; })) {
      payloads.insert(payloads.begin(), header);
      send_parts(s, c, payloads, what_message);
    } else {  // Note [Device payloads are always matched]
      send_parts(s, c, {header}, what_message);
      send_parts(s, c, payloads, what_message, /*posted_anyway=*/true);
    }
  } catch (...) {
    c.send_broken = true;
    throw;
  }
  ++c.send_seq;
}

at::Tensor empty_wire() { return at::zeros({Transport::kHeaderSlots}, at::kLong); }

struct Parsed {
  int64_t kind = kData;
  std::vector<int64_t> header;
  std::vector<at::ScalarType> dtypes;
  std::vector<std::vector<int64_t>> sizes;
  std::vector<int64_t> inline_slot;  // per tensor: where its bytes start in the header, or -1
  std::vector<bool> on_device;       // per tensor: kOnDevice
  std::vector<bool> on_payload;      // per tensor: kOnPayload
  std::vector<bool> device_bytes;    // per tensor: kDeviceBytes
};

int64_t slots_for(int64_t nbytes) {
  return (nbytes + static_cast<int64_t>(sizeof(int64_t)) - 1) /
         static_cast<int64_t>(sizeof(int64_t));
}

// Decodes and checks a wire header (see Note [Wire header]); throws TransportError on anything
// a well-behaved peer cannot have sent.
Parsed parse_wire(const TransportState& s, int peer, const at::Tensor& wire, int64_t seq) {
  const int64_t* w = wire.data_ptr<int64_t>();
  auto corrupt = [&](const std::string& why) {
    return error_for(s, peer,
                     fmt::format(FMT_STRING("corrupt message #{} from peer {}: {} (is something "
                                            "else sending on tag {} of this group?)"),
                                 seq, peer, why, s.tag));
  };
  if (w[0] != kMagic) throw corrupt(fmt::format(FMT_STRING("bad magic number {}"), w[0]));
  if (w[1] != kData && w[1] != kBatch && w[1] != kEnd) {
    throw corrupt(fmt::format(FMT_STRING("unknown kind {}"), w[1]));
  }
  if (w[2] != seq) {
    throw corrupt(fmt::format(FMT_STRING("sequence number {}, expected {}"), w[2], seq));
  }
  Parsed parsed;
  parsed.kind = w[1];
  const int64_t num_header = w[3];
  const int64_t num_tensors = w[4];
  if (num_header < 0 || num_tensors < 0 || num_header > Transport::kHeaderSlots ||
      num_tensors > Transport::kHeaderSlots) {
    throw corrupt(
        fmt::format(FMT_STRING("{} header ints and {} tensors"), num_header, num_tensors));
  }
  int64_t pos = kFixedSlots;
  std::vector<bool> inlined;
  for (int64_t i = 0; i < num_tensors; ++i) {
    if (pos + 2 > Transport::kHeaderSlots) throw corrupt("tensor metadata overflows the header");
    const int64_t code = w[pos];
    const int64_t ndim = w[pos + 1];
    pos += 2;
    const bool device_bytes = (code & kDeviceBytes) != 0;
    if (code < 0 || (code & ~(kDtypeMask | kInline | kOnDevice | kOnPayload | kDeviceBytes)) ||
        ((code & kInline) && (code & kOnPayload)) ||
        (device_bytes && !((code & kOnPayload) && (code & kOnDevice)))) {
      throw corrupt(fmt::format(FMT_STRING("tensor {} has dtype code {}"), i, code));
    }
    if ((code & kOnPayload) && s.payload_groups.empty()) {
      throw corrupt(fmt::format(FMT_STRING("tensor {} travels on a payload group, and this "
                                           "rank's Transport has none (are the ranks configured "
                                           "alike?)"),
                                i));
    }
    inlined.push_back((code & kInline) != 0);
    parsed.on_device.push_back((code & kOnDevice) != 0);
    parsed.on_payload.push_back((code & kOnPayload) != 0);
    parsed.device_bytes.push_back(device_bytes);
    const int64_t dtype = code & kDtypeMask;
    if (dtype >= static_cast<int64_t>(at::ScalarType::NumOptions) ||
        dtype == static_cast<int64_t>(at::ScalarType::Undefined)) {
      throw corrupt(fmt::format(FMT_STRING("tensor {} has dtype code {}"), i, w[pos - 2]));
    }
    if (ndim < 0 || pos + ndim > Transport::kHeaderSlots) {
      throw corrupt(fmt::format(FMT_STRING("tensor {} has ndim {}"), i, ndim));
    }
    std::vector<int64_t> sizes(w + pos, w + pos + ndim);
    pos += ndim;
    for (int64_t size : sizes) {
      if (size < 0) throw corrupt(fmt::format(FMT_STRING("tensor {} has size {}"), i, size));
    }
    parsed.dtypes.push_back(static_cast<at::ScalarType>(dtype));
    parsed.sizes.push_back(std::move(sizes));
  }
  if (pos + num_header > Transport::kHeaderSlots) throw corrupt("header ints overflow the header");
  parsed.header.assign(w + pos, w + pos + num_header);
  pos += num_header;
  for (int64_t i = 0; i < num_tensors; ++i) {
    if (!inlined[i]) {
      parsed.inline_slot.push_back(-1);
      continue;
    }
    // Overflow-safe: every size is checked against what is left of the header.
    int64_t nbytes = static_cast<int64_t>(c10::elementSize(parsed.dtypes[i]));
    const int64_t room = (Transport::kHeaderSlots - pos) * static_cast<int64_t>(sizeof(int64_t));
    for (int64_t size : parsed.sizes[i]) {
      if (size > 0 && nbytes > room / size) {
        throw corrupt(fmt::format(FMT_STRING("inline tensor {} overflows the header"), i));
      }
      nbytes *= size;
    }
    if (nbytes == 0 || nbytes > room) {
      throw corrupt(
          fmt::format(FMT_STRING("inline tensor {} of {} bytes overflows the header"), i, nbytes));
    }
    parsed.inline_slot.push_back(pos);
    pos += slots_for(nbytes);
  }
  return parsed;
}

// Note [Device payloads are always matched]
// Device payloads (NCCL) carry no tag and no host-side completion: one left unmatched would
// stall its rank's stream (and everything ordered after it) until NCCL's watchdog kills the
// process, and a stray one would be taken by a later receive. So both sides keep them paired
// through failures: a sender posts a message's device parts only once the peer has taken its
// header (header first, waited, then the payloads, even if abort() came in between), and a
// receiver that took a header posts receives for all of its device parts, even after abort()
// (the message is then dropped). Posting never blocks the host. After a failed step the runtime
// also replaces the payload groups (State.renew_pipeline_payload_groups), aborting the old
// communicators.

// Note [Next header posted early]
// A receiver thread posts the receive of the next message's header right behind the parts of
// the message it is receiving, before it waits for them: gloo moves a header's bytes only once
// its receive is posted, and a thread that posted it only after handing the last message to the
// inbox made a sender that was quicker wait a round trip through both event loops. Receives
// match in the order they are posted per group, and the sender sends a message's parts before
// the next header, so the order is the wire's. END posts nothing after it.

// Note [Idle receivers]
// A receiver waits for the next header with a timeout of a year, not with the group's timeout
// (what kNoTimeout means to gloo): a channel may legitimately stay idle for a whole step (two
// stages that never call each other), and a gloo receive that times out does not fail alone — it
// signals the error to the whole gloo context, closing every pair of the group. Hangs are caught
// where someone waits for a message: recv(timeout) and finish() (its END wait); a peer that dies
// surfaces at once as a backend error ("connection closed"); abort() wakes idle receivers through
// Work::abort(). (Polling is no alternative: gloo's receive Work reports isCompleted() only
// after wait() has returned.)

// Note [Batches]
// send_batch() packs consecutive messages to one peer into one wire message of kind kBatch, as
// many as fit the header: its header ints are
//   k, then (H_i, N_i) for each of the k messages, then the k messages' header ints in order,
// and its tensors are the k messages' tensors in order. The receiver splits it back into k
// messages before they reach the inbox, so nothing above the transport tells a batch from k
// sends. A batch costs the wire what one message does: one header send, and one payload send
// per tensor that does not fit the header, where k messages cost k header sends, each a gloo
// rendezvous (notify, ready, bytes) with a wake-up of the peer's receiver thread.

// Splits a received batch (Note [Batches]) into its messages; throws TransportError on a batch a
// well-behaved peer cannot have sent.
std::vector<Message> split_batch(const TransportState& s, Message batch, int64_t seq) {
  const std::vector<int64_t>& h = batch.header;
  auto corrupt = [&](const std::string& why) {
    return error_for(s, batch.peer,
                     fmt::format(FMT_STRING("corrupt batch #{} from peer {}: {} (is something "
                                            "else sending on tag {} of this group?)"),
                                 seq, batch.peer, why, s.tag));
  };
  if (h.empty() || h[0] < 1 || 1 + 2 * h[0] > static_cast<int64_t>(h.size())) {
    throw corrupt(fmt::format(FMT_STRING("{} header ints"), h.size()));
  }
  const int64_t k = h[0];
  int64_t header_pos = 1 + 2 * k;
  int64_t tensor_pos = 0;
  std::vector<Message> messages;
  for (int64_t i = 0; i < k; ++i) {
    const int64_t num_header = h[1 + 2 * i];
    const int64_t num_tensors = h[2 + 2 * i];
    if (num_header < 0 || num_tensors < 0 ||
        num_header > static_cast<int64_t>(h.size()) - header_pos ||
        num_tensors > static_cast<int64_t>(batch.tensors.size()) - tensor_pos) {
      throw corrupt(fmt::format(FMT_STRING("message {} of {} has {} header ints and {} tensors"), i,
                                k, num_header, num_tensors));
    }
    Message m{batch.peer,
              std::vector<int64_t>(h.begin() + header_pos, h.begin() + header_pos + num_header),
              {}};
    m.tensors.assign(std::make_move_iterator(batch.tensors.begin() + tensor_pos),
                     std::make_move_iterator(batch.tensors.begin() + tensor_pos + num_tensors));
    if (batch.ready && std::any_of(m.tensors.begin(), m.tensors.end(),
                                   [](const at::Tensor& t) { return !t.device().is_cpu(); })) {
      m.ready = batch.ready;
    }
    header_pos += num_header;
    tensor_pos += num_tensors;
    messages.push_back(std::move(m));
  }
  if (header_pos != static_cast<int64_t>(h.size()) ||
      tensor_pos != static_cast<int64_t>(batch.tensors.size())) {
    throw corrupt(fmt::format(FMT_STRING("{} header ints and {} tensors left over"),
                              static_cast<int64_t>(h.size()) - header_pos,
                              static_cast<int64_t>(batch.tensors.size()) - tensor_pos));
  }
  return messages;
}

// The body of the receiver thread of one peer: receive messages until END or abort(), appending
// them to the inbox. Owns a reference to the state: it may outlive the Transport after abort().
void receive_loop(const std::shared_ptr<TransportState>& state, Channel* channel) {
  TransportState& s = *state;
  Channel& c = *channel;
  std::exception_ptr error;
  try {
    // Device buffers are allocated, received into and copied to on a stream of this thread's
    // own (Note [Stream discipline]).
    const c10::DeviceGuard device_guard(s.device);  // a no-op for the CPU
    std::optional<c10::Stream> stream;
    if (!s.device.is_cpu()) {
      stream = c10::impl::VirtualGuardImpl(s.device.type()).getStreamFromGlobalPool(s.device);
    }
    // Under the guard of `stream` below: allocated and copied there.
    const auto land = [&](at::Tensor host, bool on_device) {
      return on_device && stream ? host.to(s.device) : host;
    };
    // The header of message #seq, posted before its wait (Note [Next header posted early]).
    const auto post_header = [&](int64_t seq) {
      return post_parts(
          s, c, {Part{at::empty({Transport::kHeaderSlots}, at::kLong), s.group.get(), false}},
          {fmt::format(FMT_STRING("the header of message #{}"), seq)});
    };
    Posted header = post_header(0);
    for (int64_t seq = 0;; ++seq) {
      // See Note [Idle receivers].
      if (!wait_parts(s, c, header, kMaxWait)) break;
      const at::Tensor wire = header.parts[0].bytes;
      Parsed parsed = parse_wire(s, c.peer, wire, seq);
      if (parsed.kind == kEnd) break;
      Message message{c.peer, std::move(parsed.header), {}};
      // A message with device tensors is allocated, received and landed on this thread's stream.
      bool device_parts = false;
      for (size_t i = 0; i < parsed.dtypes.size(); ++i) {
        device_parts = device_parts || parsed.device_bytes[i] || parsed.on_device[i];
      }
      std::optional<c10::StreamGuard> on_stream;
      if (stream && device_parts) on_stream.emplace(*stream);
      // Allocate every tensor, fill the inline ones, then receive the others' parts together.
      std::vector<Part> parts;
      std::vector<std::string> names;
      for (size_t i = 0; i < parsed.dtypes.size(); ++i) {
        const auto options = at::TensorOptions().dtype(parsed.dtypes[i]);
        at::Tensor tensor;
        if (parsed.device_bytes[i]) {
          // Straight into its buffer on this rank's device.
          if (s.device.is_cpu()) {
            throw error_for(s, c.peer,
                            fmt::format(FMT_STRING("tensor {} of message #{} from peer {} is a "
                                                   "device tensor for the payload group, and "
                                                   "this rank's Transport has no device"),
                                        i, seq, c.peer));
          }
          tensor = at::empty(parsed.sizes[i], options.device(s.device));
          parts.push_back(Part{as_bytes(tensor), s.payload_group(c.peer, s.rank), true});
        } else {
          tensor = at::empty(parsed.sizes[i], options);
          if (parsed.inline_slot[i] >= 0) {
            std::memcpy(tensor.data_ptr(), wire.data_ptr<int64_t>() + parsed.inline_slot[i],
                        tensor.nbytes());
          } else if (tensor.numel() > 0) {
            c10d::ProcessGroup* group =
                parsed.on_payload[i] ? s.payload_group(c.peer, s.rank) : s.group.get();
            parts.push_back(Part{as_bytes(tensor), group, false});
          }
        }
        if (parts.size() > names.size()) {
          names.push_back(fmt::format(FMT_STRING("tensor {} of message #{}"), i, seq));
        }
        message.tensors.push_back(std::move(tensor));
      }
      // The peer is sending this message now: its parts follow within the timeout. After a
      // stop only device parts are still received: see Note [Device payloads are always
      // matched].
      const Posted payload = post_parts(s, c, std::move(parts), std::move(names));
      header = post_header(seq + 1);
      if (!wait_parts(s, c, payload, clamp_wait(s.timeout))) break;
      for (size_t i = 0; i < message.tensors.size(); ++i) {
        if (!parsed.device_bytes[i]) {
          message.tensors[i] = land(std::move(message.tensors[i]), parsed.on_device[i]);
        }
      }
      if (on_stream) {
        message.ready = std::make_shared<c10::Event>(s.device.type());
        message.ready->record(*stream);
        on_stream.reset();
      }
      std::vector<Message> messages;
      if (parsed.kind == kBatch) {
        messages = split_batch(s, std::move(message), seq);
      } else {
        messages.push_back(std::move(message));
      }
      {
        std::lock_guard<std::mutex> lock(s.mutex);
        for (Message& m : messages) s.inbox.push_back(std::move(m));
      }
      s.cv.notify_all();
    }
  } catch (const TransportError&) {
    error = std::current_exception();
  } catch (...) {
    error = std::make_exception_ptr(
        error_for(s, c.peer,
                  fmt::format(FMT_STRING("receiving from peer {} failed: {}"), c.peer,
                              what(std::current_exception()))));
  }
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    c.open = false;
    c.done = true;
    if (error && !s.first_error) s.first_error = error;
  }
  s.cv.notify_all();
}

bool all_done(const TransportState& s) {
  return std::all_of(s.channels.begin(), s.channels.end(),
                     [](const auto& entry) { return entry.second->done; });
}

std::vector<int> open_peers(const TransportState& s) {
  std::vector<int> peers;
  for (const auto& [peer, channel] : s.channels) {
    if (channel->open) peers.push_back(peer);
  }
  return peers;
}

void abort_state(TransportState& s) noexcept {
  try {
    {
      std::lock_guard<std::mutex> lock(s.mutex);
      if (s.phase == Phase::kIdle || s.aborted) return;
      s.aborted = true;
      s.phase = Phase::kFailed;
      if (!s.first_error) {
        s.first_error = std::make_exception_ptr(TransportError(
            fmt::format(FMT_STRING("{}: aborted"), s.where()), std::vector<int>(s.peers)));
      }
    }
    s.cv.notify_all();
    // Wake every waiter. Work::abort() may be unsupported (it throws): then the receiver ends
    // when the backend gives up, and is detached below.
    for (const auto& [peer, c] : s.channels) {
      std::lock_guard<std::mutex> lock(c->work_mutex);
      c->stop = true;
      for (const auto& work : c->pending_recvs) {
        try {
          work->abort();
        } catch (...) {
        }
      }
      for (const auto& work : c->pending_sends) {
        try {
          work->abort();
        } catch (...) {
        }
      }
    }
    std::vector<bool> done;
    {
      std::unique_lock<std::mutex> lock(s.mutex);
      s.cv.wait_for(lock, clamp_wait(s.timeout), [&] { return all_done(s); });
      for (const auto& [peer, c] : s.channels) done.push_back(c->done);
    }
    std::lock_guard<std::mutex> lock(s.threads_mutex);
    size_t i = 0;
    for (const auto& [peer, c] : s.channels) {
      if (c->receiver.joinable()) {
        if (done[i]) {
          c->receiver.join();
        } else {
          c->receiver.detach();  // it holds the state; see Transport::abort()
        }
      }
      ++i;
    }
  } catch (...) {
    // Never throws (destructor path); nothing above is expected to.
  }
}

}  // namespace
}  // namespace internal

using internal::Channel;
using internal::Phase;
using internal::TransportState;

Transport::Transport(c10::intrusive_ptr<c10d::ProcessGroup> group, std::vector<int> peers,
                     std::chrono::milliseconds timeout, int tag,
                     std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> payload_groups,
                     c10::Device device) {
  SMP_CHECK(group, "Transport: group must not be null");
  const int rank = group->getRank();
  const int size = group->getSize();
  SMP_CHECK(payload_groups.empty() || payload_groups.size() == 2,
            "Transport: payload_groups must be empty or two groups (ascending, descending), got "
            "{}",
            payload_groups.size());
  for (const auto& payload : payload_groups) {
    SMP_CHECK(payload, "Transport: a payload group must not be null");
    SMP_CHECK(payload->getSize() == size && payload->getRank() == rank,
              "Transport: a payload group must have the ranks of the group (size {}, rank {}), "
              "got size {}, rank {}",
              size, rank, payload->getSize(), payload->getRank());
  }
  SMP_CHECK(timeout.count() > 0, "Transport: timeout must be > 0 ms, got {}", timeout.count());
  SMP_CHECK(tag >= 0, "Transport: tag must be >= 0, got {}", tag);
  auto state = std::make_shared<TransportState>();
  for (int peer : peers) {
    SMP_CHECK(peer >= 0 && peer < size, "Transport: peer {} is not a rank of the group (size {})",
              peer, size);
    SMP_CHECK(peer != rank,
              "Transport: peer {} is this rank; list only the other ranks it talks to", peer);
    SMP_CHECK(!state->channels.count(peer), "Transport: peer {} is listed twice in [{}]", peer,
              fmt::join(peers, ", "));
    state->channels.emplace(peer, std::make_unique<Channel>(peer));
  }
  state->group = std::move(group);
  state->payload_groups = std::move(payload_groups);
  state->device = device;
  state->rank = rank;
  state->peers = std::move(peers);
  state->timeout = timeout;
  state->tag = tag;
  state_ = std::move(state);
}

Transport::~Transport() { abort(); }

void Transport::start() {
  TransportState& s = *state_;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    SMP_CHECK(s.phase != Phase::kFailed,
              "{}: start() after a failure or abort(); create a new Transport (and do not reuse "
              "this group's channels on this tag)",
              s.where());
    SMP_CHECK(s.phase == Phase::kIdle,
              "{}: start() called twice; call finish() to end the step first", s.where());
    SMP_INTERNAL_ASSERT(s.inbox.empty(), "finish() left messages in the inbox");
    s.first_error = nullptr;
    for (const auto& [peer, c] : s.channels) {
      c->open = true;
      c->done = false;
    }
    s.phase = Phase::kRunning;
  }
  for (const auto& [peer, c] : s.channels) {
    {
      std::lock_guard<std::mutex> lock(c->send_mutex);
      c->send_seq = 0;
      c->send_broken = false;
    }
    std::lock_guard<std::mutex> lock(c->work_mutex);
    c->stop = false;
  }
  try {
    std::lock_guard<std::mutex> lock(s.threads_mutex);
    for (const auto& [peer, c] : s.channels) {
      c->receiver = std::thread(internal::receive_loop, state_, c.get());
    }
  } catch (...) {
    {
      // The receivers that did not start will never report: mark them done.
      std::lock_guard<std::mutex> lock(s.threads_mutex);
      std::lock_guard<std::mutex> state_lock(s.mutex);
      for (const auto& [peer, c] : s.channels) {
        if (!c->receiver.joinable()) {
          c->open = false;
          c->done = true;
        }
      }
    }
    internal::abort_state(s);
    throw;
  }
}

namespace internal {
namespace {

// Wire entries the tensors' metadata takes (dtype, ndim, sizes each; see Note [Wire header]).
int64_t metadata_slots(const std::vector<at::Tensor>& tensors) {
  int64_t used = 0;
  for (const at::Tensor& tensor : tensors) used += 2 + (tensor.defined() ? tensor.dim() : 0);
  return used;
}

}  // namespace
}  // namespace internal

int64_t Transport::header_capacity(const std::vector<at::Tensor>& tensors) {
  return kHeaderSlots - internal::kFixedSlots - internal::metadata_slots(tensors);
}

namespace internal {
namespace {

// Checks the state and `peer` before a send; returns the peer's channel.
Channel& sending_channel(TransportState& s, int peer, const char* call) {
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    SMP_CHECK(s.phase == Phase::kRunning, "{}: {} needs an open step: {}", s.where(), call,
              s.phase == Phase::kIdle        ? "call start() first"
              : s.phase == Phase::kFinishing ? "finish() has begun"
                                             : "the transport failed or was aborted");
  }
  Channel* channel = s.channel(peer);
  SMP_CHECK(channel, "{}: {} to peer {}, which is not one of its peers [{}]", s.where(), call, peer,
            fmt::join(s.peers, ", "));
  return *channel;
}

// Checks one message before anything leaves: a half-sent message would break the channel.
// `which` names it in errors ("" for send(), "message 2 of 3: " for send_batch()).
void check_message(const TransportState& s, int peer, const std::vector<int64_t>& header,
                   const std::vector<at::Tensor>& tensors, const char* call,
                   const std::string& which) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    SMP_CHECK(t.defined(), "{}: {} to peer {}: {}tensor {} is undefined", s.where(), call, peer,
              which, i);
    SMP_CHECK(t.layout() == at::kStrided,
              "{}: {} to peer {}: {}tensor {} (shape {}, dtype {}) has layout {}; only dense "
              "tensors are supported, call .to_dense() first",
              s.where(), call, peer, which, i, shape_str(t.sizes()), c10::toString(t.scalar_type()),
              layout_name(t.layout()));
    SMP_CHECK(!t.is_meta(),
              "{}: {} to peer {}: {}tensor {} (shape {}, dtype {}) is on meta and has no data; "
              "send a CPU or device tensor",
              s.where(), call, peer, which, i, shape_str(t.sizes()),
              c10::toString(t.scalar_type()));
    SMP_CHECK(!c10::isQIntType(t.scalar_type()),
              "{}: {} to peer {}: {}tensor {} has quantized dtype {}, which is not supported",
              s.where(), call, peer, which, i, c10::toString(t.scalar_type()));
  }
  const int64_t capacity = Transport::header_capacity(tensors);
  SMP_CHECK(static_cast<int64_t>(header.size()) <= capacity,
            "{}: {} to peer {}: {}the message does not fit the {}-entry wire header: {} header "
            "ints, room for {} with {} tensors ({} entries of tensor metadata); send fewer tensors "
            "or a shorter header",
            s.where(), call, peer, which, Transport::kHeaderSlots, header.size(),
            std::max<int64_t>(capacity, 0), tensors.size(),
            Transport::kHeaderSlots - kFixedSlots - capacity);
}

// Encodes a message of `kind` (see Note [Wire header]): the wire header, with slot 2 (seq) still
// to fill under the channel's send lock, and the parts that follow it.
std::pair<at::Tensor, std::vector<Part>> encode(TransportState& s, int peer, int64_t kind,
                                                const std::vector<int64_t>& header,
                                                const std::vector<at::Tensor>& tensors) {
  at::Tensor wire = empty_wire();
  int64_t* w = wire.data_ptr<int64_t>();
  w[0] = kMagic;
  w[1] = kind;
  w[3] = static_cast<int64_t>(header.size());
  w[4] = static_cast<int64_t>(tensors.size());
  int64_t pos = kFixedSlots;
  std::vector<int64_t> dtype_slot;
  c10d::ProcessGroup* payload_group = s.payload_group(s.rank, peer);
  for (const at::Tensor& t : tensors) {
    dtype_slot.push_back(pos);
    w[pos++] = static_cast<int64_t>(t.scalar_type());
    w[pos++] = t.dim();
    for (int64_t size : t.sizes()) w[pos++] = size;
  }
  std::copy(header.begin(), header.end(), w + pos);
  pos += static_cast<int64_t>(header.size());
  // See Note [Payload routes].
  std::vector<Part> payloads;
  for (size_t i = 0; i < tensors.size(); ++i) {
    at::Tensor t = tensors[i].detach().resolve_conj().resolve_neg();
    const bool on_device = !t.device().is_cpu();
    if (on_device) w[dtype_slot[i]] += kOnDevice;
    if (t.numel() == 0) continue;
    if (on_device && moves_device_bytes(payload_group, t.device().type())) {
      w[dtype_slot[i]] += kOnPayload + kDeviceBytes;
      payloads.push_back({as_bytes(t.contiguous()), payload_group, true});
      continue;
    }
    at::Tensor bytes = as_bytes((on_device ? t.to(at::kCPU) : t).contiguous());
    const int64_t slots = slots_for(bytes.numel());
    if (pos + slots <= Transport::kHeaderSlots) {
      std::memcpy(w + pos, bytes.data_ptr(), bytes.numel());
      w[dtype_slot[i]] += kInline;
      pos += slots;
    } else if (payload_group && payload_group->hasBackendForDeviceType(c10::kCPU)) {
      w[dtype_slot[i]] += kOnPayload;
      payloads.push_back({std::move(bytes), payload_group, false});
    } else {
      payloads.push_back({std::move(bytes), s.group.get(), false});
    }
  }
  return {std::move(wire), std::move(payloads)};
}

}  // namespace
}  // namespace internal

void Transport::send(int peer, const std::vector<int64_t>& header,
                     const std::vector<at::Tensor>& tensors) {
  TransportState& s = *state_;
  internal::Channel& channel = internal::sending_channel(s, peer, "send()");
  internal::check_message(s, peer, header, tensors, "send()", "");
  auto [wire, payloads] = internal::encode(s, peer, internal::kData, header, tensors);
  internal::send_message(s, channel, wire, std::move(payloads), "message");
}

void Transport::send_batch(int peer, const std::vector<OutgoingMessage>& messages) {
  TransportState& s = *state_;
  internal::Channel& channel = internal::sending_channel(s, peer, "send_batch()");
  for (size_t i = 0; i < messages.size(); ++i) {
    internal::check_message(s, peer, messages[i].first, messages[i].second, "send_batch()",
                            fmt::format(FMT_STRING("message {} of {}: "), i, messages.size()));
  }
  // Greedily: each wire message takes as many of the next messages as fit its header (see Note
  // [Batches]); a message alone goes as send() sends it.
  size_t first = 0;
  while (first < messages.size()) {
    std::vector<int64_t> header{0};
    std::vector<int64_t> counts;
    std::vector<int64_t> ints;
    std::vector<at::Tensor> tensors;
    int64_t metadata = 0;  // wire entries of the tensors' metadata (see header_capacity)
    size_t end = first;
    for (; end < messages.size(); ++end) {
      const auto& [h, t] = messages[end];
      const int64_t more = internal::metadata_slots(t);
      const auto needed = static_cast<int64_t>(1 + counts.size() + 2 + ints.size() + h.size());
      if (end > first && needed > kHeaderSlots - internal::kFixedSlots - metadata - more) break;
      metadata += more;
      tensors.insert(tensors.end(), t.begin(), t.end());
      counts.push_back(static_cast<int64_t>(h.size()));
      counts.push_back(static_cast<int64_t>(t.size()));
      ints.insert(ints.end(), h.begin(), h.end());
    }
    const bool alone = end - first == 1;  // goes as send() sends it
    header[0] = static_cast<int64_t>(end - first);
    header.insert(header.end(), counts.begin(), counts.end());
    header.insert(header.end(), ints.begin(), ints.end());
    auto [wire, payloads] =
        alone ? internal::encode(s, peer, internal::kData, messages[first].first, tensors)
              : internal::encode(s, peer, internal::kBatch, header, tensors);
    internal::send_message(s, channel, wire, std::move(payloads), alone ? "message" : "batch");
    first = end;
  }
}

std::optional<Message> Transport::recv(std::chrono::milliseconds timeout) {
  TransportState& s = *state_;
  SMP_CHECK(timeout.count() >= 0, "{}: recv() timeout must be >= 0 ms, got {}", s.where(),
            timeout.count());
  std::unique_lock<std::mutex> lock(s.mutex);
  SMP_CHECK(s.phase != Phase::kIdle, "{}: recv() needs an open step: call start() first",
            s.where());
  auto ready = [&] { return s.first_error || !s.inbox.empty() || internal::open_peers(s).empty(); };
  if (!s.cv.wait_for(lock, internal::clamp_wait(timeout), ready)) {
    const std::vector<int> open = internal::open_peers(s);
    throw TransportError(fmt::format(FMT_STRING("{}: recv(): no message within {} ms; channels "
                                                "still open (no END yet) from peers [{}]"),
                                     s.where(), timeout.count(), fmt::join(open, ", ")),
                         open);
  }
  if (s.first_error) std::rethrow_exception(s.first_error);
  if (s.inbox.empty()) return std::nullopt;  // every peer has sent END
  Message message = std::move(s.inbox.front());
  s.inbox.pop_front();
  return message;
}

std::optional<Message> Transport::try_recv() {
  TransportState& s = *state_;
  std::lock_guard<std::mutex> lock(s.mutex);
  SMP_CHECK(s.phase != Phase::kIdle, "{}: try_recv() needs an open step: call start() first",
            s.where());
  if (s.first_error) std::rethrow_exception(s.first_error);
  if (s.inbox.empty()) return std::nullopt;
  Message message = std::move(s.inbox.front());
  s.inbox.pop_front();
  return message;
}

void Transport::finish(bool abort_on_failure) {
  TransportState& s = *state_;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    SMP_CHECK(s.phase != Phase::kIdle, "{}: finish() without start()", s.where());
    SMP_CHECK(s.phase == Phase::kRunning, "{}{}", s.where(),
              s.phase == Phase::kFinishing ? ": finish() called twice"
                                           : ": finish() after a failure or abort()");
    s.phase = Phase::kFinishing;
  }
  std::exception_ptr error;
  // 1. END to every peer, in ascending rank order (one deterministic order on every rank).
  std::vector<int> order = s.peers;
  std::sort(order.begin(), order.end());
  for (int peer : order) {
    at::Tensor wire = internal::empty_wire();
    int64_t* w = wire.data_ptr<int64_t>();
    w[0] = internal::kMagic;
    w[1] = internal::kEnd;
    try {
      internal::send_message(s, *s.channel(peer), wire, {}, "END");
    } catch (...) {
      if (!error) error = std::current_exception();
    }
  }
  // 2. Wait until every peer's END has arrived (its receiver then ends), within the timeout;
  //    not worth it after a failed END (the transport is aborted below anyway).
  {
    std::unique_lock<std::mutex> lock(s.mutex);
    const bool done = error || s.cv.wait_for(lock, internal::clamp_wait(s.timeout), [&] {
      return internal::all_done(s) || s.first_error;
    });
    if (!error && s.first_error) error = s.first_error;
    if (!error && !done) {
      std::vector<int> missing;
      for (const auto& [peer, c] : s.channels) {
        if (!c->done) missing.push_back(peer);
      }
      error = std::make_exception_ptr(TransportError(
          fmt::format(
              FMT_STRING(
                  "{}: finish(): no END from peers [{}] within {} ms; did they call finish()?"),
              s.where(), fmt::join(missing, ", "), s.timeout.count()),
          missing));
    }
    // 3. Every message of the step must have been delivered: leftovers are a protocol bug.
    if (!error && !s.inbox.empty()) {
      std::map<int, int> counts;
      for (const Message& m : s.inbox) ++counts[m.peer];
      std::vector<std::string> detail;
      std::vector<int> peers;
      for (const auto& [peer, count] : counts) {
        detail.push_back(fmt::format(FMT_STRING("{} from peer {}"), count, peer));
        peers.push_back(peer);
      }
      error = std::make_exception_ptr(TransportError(
          fmt::format(FMT_STRING("{}: finish(): {} received message(s) were never taken by recv() "
                                 "({}); every message of a step must be received in that step"),
                      s.where(), s.inbox.size(), fmt::join(detail, ", ")),
          peers));
      s.inbox.clear();
    }
  }
  if (error) {
    if (abort_on_failure) internal::abort_state(s);
    std::rethrow_exception(error);
  }
  {
    std::lock_guard<std::mutex> lock(s.threads_mutex);
    for (const auto& [peer, c] : s.channels) {
      if (c->receiver.joinable()) c->receiver.join();  // done: returns at once
    }
  }
  std::lock_guard<std::mutex> lock(s.mutex);
  s.phase = Phase::kIdle;
}

void Transport::abort() noexcept {
  if (state_) internal::abort_state(*state_);
}

int Transport::rank() const { return state_->rank; }
const std::vector<int>& Transport::peers() const { return state_->peers; }
int Transport::tag() const { return state_->tag; }
std::chrono::milliseconds Transport::timeout() const { return state_->timeout; }
c10::Device Transport::device() const { return state_->device; }

void Message::wait_ready() const {
  if (!ready) return;
  const c10::Device device(ready->device_type(), ready->device_index());
  const c10::impl::VirtualGuardImpl impl(device.type());
  const c10::Stream consumer = impl.getStream(device);
  ready->block(consumer);
  // Allocated on the receiver's stream, used from here on the consumer's: the caching allocator
  // reuses the memory only after the consumer's stream has passed its uses.
  for (const at::Tensor& t : tensors) {
    if (t.device() == device) impl.recordDataPtrOnStream(t.storage().data_ptr(), consumer);
  }
}

bool Transport::started() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->phase == Phase::kRunning || state_->phase == Phase::kFinishing;
}

}  // namespace smp::pytorch
