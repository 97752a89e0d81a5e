#pragma once
// kv_event_publisher: publishes KV events (vllm_format.hpp) as vLLM's ZmqEventPublisher
// does, so a router that reads vLLM's events reads ours: a ZMQ PUB socket sends multipart
// messages [topic, seq (8-byte big-endian int64: 0, 1, 2... one per batch), payload (msgpack
// EventBatch)]; an optional ROUTER socket replays the last buffer_steps batches from the
// sequence number a client asks for, then END_SEQ (-1). docs/kv-events.md: the protocol, our
// report of a replay gap, the drop policy, the statistics.
//
// offer() (the data path) never blocks and never waits on a subscriber: it moves the event
// into a bounded queue under a short mutex, or counts it dropped. One thread batches the
// queue, encodes, sends without waiting (a subscriber that falls behind loses messages at the
// PUB socket's high-water mark, in ZMQ), keeps the replay history, answers replays.
//
// Trust: the publisher binds exactly the endpoints it is given (tcp://127.0.0.1:5557,
// tcp://*:5557, ipc:///path; a port of * picks a free one, endpoint() tells it). Whoever can
// reach them learns which blocks the cache holds, token ids included: the configuration
// decides who can (the server keeps loopback unless told otherwise). Target
// kvtier::kv_events (cppzmq and libzmq).

#include <kvtier/config.hpp>
#include <kvtier/kv_events/msgpack_writer.hpp>
#include <kvtier/kv_events/vllm_format.hpp>

#include <sys/eventfd.h>
#include <unistd.h>
#include <zmq.hpp>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace kv_events {

/// The sequence number of the message that ends a replay (vLLM's END_SEQ).
inline constexpr std::int64_t replay_end_seq = -1;

struct kv_event_publisher_options {
  /// The PUB socket's endpoint, bound as given (see Trust above).
  std::string endpoint = "tcp://127.0.0.1:5557";
  /// The ROUTER replay socket's endpoint; empty: no replay.
  std::string replay_endpoint;
  /// The first frame of every message (vLLM's default: empty).
  std::string topic;
  event_form form = event_form::map;
  /// Written into every batch (vLLM's publisher always sets it).
  std::int64_t data_parallel_rank = 0;
  /// Batches kept for replay (vLLM's default: 10,000). 0: a replay only ever reports a gap.
  std::size_t buffer_steps = 10'000;
  /// And their payload bytes at most (batches of long prompts carry their token ids): the
  /// oldest go first. vLLM bounds batches only.
  std::size_t buffer_bytes = std::size_t{64} << 20;
  /// Events waiting for the thread; offer() drops beyond it. 65,536 holds 0.65 s of events
  /// at 100,000/s should the thread be held up that long, at ~300 bytes each plus their
  /// hashes and tokens.
  std::size_t max_queue = 65'536;
  /// Events in one batch at most; more waiting go out as several batches at once.
  std::size_t max_batch_events = 1'024;
  /// ZMQ_SNDHWM of the PUB socket: messages queued per subscriber before ZMQ drops.
  int send_hwm = 100'000;
  /// The thread publishes at most once per interval (batching what came meanwhile); it
  /// sleeps while nothing is queued. 0: as soon as an event comes.
  std::chrono::milliseconds flush_interval{10};
};

/// A snapshot of the publisher's counters (all since construction).
struct kv_event_publisher_stats {
  std::uint64_t events_offered = 0;         // offer() calls
  std::uint64_t events_published = 0;       // in batches ZMQ accepted
  std::uint64_t events_dropped = 0;         // queue full, stopped, or in a batch ZMQ refused
  std::uint64_t batches_published = 0;      // batches ZMQ accepted (seq counts every batch)
  std::uint64_t send_failures = 0;          // batches ZMQ refused (their events are dropped)
  std::uint64_t replay_requests = 0;        // well-formed replay requests answered
  std::uint64_t replay_gaps = 0;            // of those, asking for batches no longer held
  std::uint64_t replay_bad_requests = 0;    // malformed, ignored
  std::uint64_t replay_failures = 0;        // answers cut short (client gone or not reading)
  std::uint64_t replay_buffer_batches = 0;  // batches held for replay now
  std::uint64_t replay_buffer_bytes = 0;    // their payload bytes
};

namespace detail {

// An eventfd the data path writes to wake the publisher thread, which polls it beside the
// replay socket (zmq_poll takes plain file descriptors).
class wake_signal {
 public:
  wake_signal() : fd_(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {
    if (fd_ < 0) throw std::system_error(errno, std::generic_category(), "kv_event_publisher: eventfd");
  }
  wake_signal(const wake_signal&) = delete;
  wake_signal& operator=(const wake_signal&) = delete;
  ~wake_signal() { ::close(fd_); }

  [[nodiscard]] int fd() const noexcept { return fd_; }
  void notify() const noexcept {
    const std::uint64_t one = 1;
    [[maybe_unused]] const auto n = ::write(fd_, &one, sizeof one);  // never blocks, cannot fill
  }
  void clear() const noexcept {
    std::uint64_t count = 0;
    [[maybe_unused]] const auto n = ::read(fd_, &count, sizeof count);
  }

 private:
  int fd_;
};

inline void put_seq(char (&out)[8], std::int64_t seq) noexcept {
  const auto v = static_cast<std::uint64_t>(seq);
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(v >> (56 - 8 * i));
}

inline std::int64_t get_seq(const void* data) noexcept {
  const auto* p = static_cast<const unsigned char*>(data);
  std::uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v = (v << 8) | p[i];
  return static_cast<std::int64_t>(v);
}

// Binds, or throws naming the endpoint and what to change.
inline std::string bind_socket(zmq::socket_t& s, const std::string& endpoint, std::string_view what) {
  try {
    s.bind(endpoint);
  } catch (const zmq::error_t& e) {
    throw std::system_error(e.num(), std::generic_category(),
                            "kv_event_publisher: cannot bind the " + std::string(what) + " socket to '" + endpoint +
                                "' (a tcp://host:port with a free port, tcp://host:* for any, or ipc:///path)");
  }
  return s.get(zmq::sockopt::last_endpoint);
}

// The payload of the END_SEQ message that ends a replay with a gap: the batches from
// requested_seq to first_seq - 1 are no longer held. vLLM's clients read no END payload.
inline std::string replay_gap_payload(std::int64_t requested_seq, std::int64_t first_seq) {
  std::string out;
  msgpack_writer w(out);
  w.map_header(3);
  w.str("type");
  w.str("ReplayGap");
  w.str("requested_seq");
  w.signed_int(requested_seq);
  w.str("first_seq");
  w.signed_int(first_seq);
  return out;
}

}  // namespace detail

/// See the top of this file. Not copyable or movable; the destructor stops it.
class kv_event_publisher {
 public:
  /// Binds the sockets and starts the thread. Throws std::system_error naming the endpoint
  /// when one cannot be bound (malformed, address in use), std::invalid_argument on options
  /// that cannot work.
  explicit kv_event_publisher(kv_event_publisher_options options)
      : options_(checked(std::move(options))), pub_(context_, zmq::socket_type::pub) {
    pub_.set(zmq::sockopt::linger, 0);
    pub_.set(zmq::sockopt::sndhwm, options_.send_hwm);
    endpoint_ = detail::bind_socket(pub_, options_.endpoint, "PUB");
    if (!options_.replay_endpoint.empty()) {
      replay_ = zmq::socket_t(context_, zmq::socket_type::router);
      replay_.set(zmq::sockopt::linger, 0);
      // A whole replay fits in the client's queue; beyond it (a client asking again without
      // reading) the send fails instead of ZMQ dropping a message in the middle silently.
      replay_.set(zmq::sockopt::sndhwm, static_cast<int>(std::min<std::size_t>(options_.buffer_steps + 2, INT_MAX)));
      replay_.set(zmq::sockopt::router_mandatory, true);
      replay_.set(zmq::sockopt::maxmsgsize, std::int64_t{4096});  // a request is 8 bytes
      replay_endpoint_ = detail::bind_socket(replay_, options_.replay_endpoint, "ROUTER replay");
    }
    // Room for one batch up front; both grow (once) to the most ever queued, max_queue at most.
    queue_.reserve(std::min(options_.max_queue, options_.max_batch_events));
    taken_.reserve(queue_.capacity());
    thread_ = std::thread([this] { run(); });
  }

  kv_event_publisher(const kv_event_publisher&) = delete;
  kv_event_publisher& operator=(const kv_event_publisher&) = delete;
  ~kv_event_publisher() { stop(); }

  /// Queues an event for the next batch; never blocks. False (and counted in
  /// events_dropped) when the queue is full or the publisher stopped.
  bool offer(kv_event ev) noexcept {
    events_offered_.fetch_add(1, std::memory_order_relaxed);
    bool wake = false;
    {
      std::lock_guard lock(mutex_);
      if (stopping_ || queue_.size() >= options_.max_queue) return drop(1);
      wake = queue_.empty();
      try {
        queue_.push_back(std::move(ev));  // allocates only while the capacity grows to its peak
      } catch (...) {
        return drop(1);
      }
    }
    if (wake) wake_.notify();  // once per batch: later offers find the queue non-empty
    return true;
  }

  /// Publishes what is queued, stops the thread and closes the sockets (linger 0).
  /// Idempotent; offer() drops afterwards.
  void stop() noexcept {
    std::call_once(stop_once_, [this] {
      {
        std::lock_guard lock(mutex_);
        stopping_ = true;
      }
      wake_.notify();
      if (thread_.joinable()) thread_.join();
      pub_.close();
      if (replay_) replay_.close();
    });
  }

  /// The endpoints as bound (ZMQ_LAST_ENDPOINT: a port of * resolved); replay: empty if none.
  [[nodiscard]] const std::string& endpoint() const noexcept { return endpoint_; }
  [[nodiscard]] const std::string& replay_endpoint() const noexcept { return replay_endpoint_; }
  [[nodiscard]] const kv_event_publisher_options& options() const noexcept { return options_; }

  [[nodiscard]] kv_event_publisher_stats stats() const noexcept {
    constexpr auto r = std::memory_order_relaxed;
    // Acquire: whoever sees a batch counted sees the replay history that holds it.
    const std::uint64_t batches = batches_published_.load(std::memory_order_acquire);
    return {events_offered_.load(r),        events_published_.load(r),    events_dropped_.load(r),
            batches,     send_failures_.load(r),       replay_requests_.load(r),
            replay_gaps_.load(r),           replay_bad_requests_.load(r), replay_failures_.load(r),
            replay_buffer_batches_.load(r), replay_buffer_bytes_.load(r)};
  }

 private:
  static kv_event_publisher_options checked(kv_event_publisher_options o) {
    if (o.max_queue == 0 || o.max_batch_events == 0 || o.send_hwm < 0 || o.flush_interval.count() < 0) {
      throw std::invalid_argument(
          "kv_event_publisher: max_queue and max_batch_events must be at least 1, send_hwm and "
          "flush_interval not negative");
    }
    return o;
  }

  bool drop(std::uint64_t n) noexcept {
    events_dropped_.fetch_add(n, std::memory_order_relaxed);
    return false;
  }

  // The thread: sleeps until an event or a replay request comes, publishes at most once per
  // flush_interval, publishes what is left and ends when stop() asks.
  void run() noexcept {
    zmq_pollitem_t items[2] = {{nullptr, wake_.fd(), ZMQ_POLLIN, 0}, {replay_.handle(), 0, ZMQ_POLLIN, 0}};
    const int nitems = replay_ ? 2 : 1;
    using clock = std::chrono::steady_clock;
    auto next_flush = clock::now();
    bool due = false;  // events (or the stop) are waiting
    for (;;) {
      long timeout = -1;
      if (due) {
        const auto left = std::chrono::ceil<std::chrono::milliseconds>(next_flush - clock::now());
        timeout = std::max<long>(0, static_cast<long>(left.count()));
      }
      if (::zmq_poll(items, nitems, timeout) < 0) {
        if (zmq_errno() == EINTR) continue;
        return;  // cannot happen: the context outlives the thread, the items are valid
      }
      if (nitems == 2 && (items[1].revents & ZMQ_POLLIN)) serve_replays();
      if (items[0].revents & ZMQ_POLLIN) {
        wake_.clear();
        due = true;
      }
      if (due && (clock::now() >= next_flush || stop_requested())) {
        due = false;
        next_flush = clock::now() + options_.flush_interval;
        if (publish_queued()) return;
      }
    }
  }

  [[nodiscard]] bool stop_requested() {
    std::lock_guard lock(mutex_);
    return stopping_;
  }

  // Takes the whole queue (swapping vectors: both keep their capacity), publishes it in
  // batches of at most max_batch_events. True when stop() asked.
  bool publish_queued() noexcept {
    bool stopping = false;
    {
      std::lock_guard lock(mutex_);
      taken_.swap(queue_);
      stopping = stopping_;
    }
    const std::span<const kv_event> all(taken_);
    for (std::size_t i = 0; i < all.size(); i += options_.max_batch_events) {
      publish_batch(all.subspan(i, std::min(options_.max_batch_events, all.size() - i)));
    }
    taken_.clear();
    return stopping;
  }

  void publish_batch(std::span<const kv_event> events) noexcept {
    std::string payload;
    try {
      const double ts = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
      msgpack_writer w(payload);
      write_batch(w, ts, events, options_.data_parallel_rank, options_.form);
    } catch (...) {  // allocation failure while encoding: the batch is lost, counted
      drop(events.size());
      return;
    }
    const std::int64_t seq = next_seq_++;
    const bool sent = send(seq, payload);
    // A replay still has the batch where the send failed. Where remembering it fails (no
    // memory), a replay skips it. Remembered before it is counted: whoever sees the count
    // sees the history that holds it.
    try {
      remember(seq, std::move(payload));
    } catch (...) {
    }
    if (sent) {
      events_published_.fetch_add(events.size(), std::memory_order_relaxed);
      batches_published_.fetch_add(1, std::memory_order_release);
    } else {
      send_failures_.fetch_add(1, std::memory_order_relaxed);
      drop(events.size());
    }
  }

  // [topic, seq, payload], never waiting: PUB drops at a subscriber's high-water mark itself.
  bool send(std::int64_t seq, const std::string& payload) noexcept {
    char seq_bytes[8];
    detail::put_seq(seq_bytes, seq);
    try {
      constexpr auto more = zmq::send_flags::sndmore | zmq::send_flags::dontwait;
      return pub_.send(zmq::buffer(options_.topic), more) && pub_.send(zmq::buffer(seq_bytes), more) &&
             pub_.send(zmq::buffer(payload), zmq::send_flags::dontwait);
    } catch (const zmq::error_t&) {
      return false;
    }
  }

  void remember(std::int64_t seq, std::string payload) {
    const std::size_t bytes = payload.size();
    if (options_.buffer_steps == 0 || bytes > options_.buffer_bytes) return;
    while (!history_.empty() &&
           (history_.size() == options_.buffer_steps || history_bytes_ + bytes > options_.buffer_bytes)) {
      history_bytes_ -= history_.front().second.size();
      history_.pop_front();
    }
    history_.emplace_back(seq, std::move(payload));
    history_bytes_ += bytes;
    replay_buffer_batches_.store(history_.size(), std::memory_order_relaxed);
    replay_buffer_bytes_.store(history_bytes_, std::memory_order_relaxed);
  }

  // Every request waiting on the ROUTER: [client id, "", start seq] from a REQ or a DEALER
  // that sends the empty delimiter as vLLM's clients do, or [client id, start seq] from a
  // DEALER that does not; the answer carries the same envelope.
  void serve_replays() noexcept {
    try {
      for (;;) {
        std::vector<zmq::message_t> frames;
        for (bool more = true; more;) {
          zmq::message_t m;
          if (!replay_.recv(m, zmq::recv_flags::dontwait)) return;  // none waiting
          more = m.more();
          if (frames.size() < 4) frames.push_back(std::move(m));
        }
        const bool delimited = frames.size() == 3 && frames[1].size() == 0;
        if (!(delimited || frames.size() == 2) || frames.back().size() != 8) {
          replay_bad_requests_.fetch_add(1, std::memory_order_relaxed);
          continue;
        }
        answer_replay(frames[0].to_string(), delimited, detail::get_seq(frames.back().data()));
      }
    } catch (const zmq::error_t&) {
      replay_failures_.fetch_add(1, std::memory_order_relaxed);
    }
  }

  // Every held batch with seq >= start, then END_SEQ; its payload reports a gap when start
  // is older than the oldest batch held (vLLM's END payload is empty, and so is ours
  // without a gap). A negative start asks for everything held.
  void answer_replay(const std::string& client, bool delimited, std::int64_t start) {
    replay_requests_.fetch_add(1, std::memory_order_relaxed);
    start = std::max<std::int64_t>(start, 0);
    const std::int64_t first_held = history_.empty() ? next_seq_ : history_.front().first;
    for (const auto& [seq, payload] : history_) {
      if (seq >= start && !send_reply(client, delimited, seq, payload)) {
        replay_failures_.fetch_add(1, std::memory_order_relaxed);
        return;
      }
    }
    std::string end_payload;
    if (start < first_held) {
      replay_gaps_.fetch_add(1, std::memory_order_relaxed);
      end_payload = detail::replay_gap_payload(start, first_held);
    }
    if (!send_reply(client, delimited, replay_end_seq, end_payload)) {
      replay_failures_.fetch_add(1, std::memory_order_relaxed);
    }
  }

  // False where the client is gone or its queue is full (router_mandatory: the ROUTER says
  // so instead of dropping).
  bool send_reply(const std::string& client, bool delimited, std::int64_t seq, const std::string& payload) {
    char seq_bytes[8];
    detail::put_seq(seq_bytes, seq);
    constexpr auto more = zmq::send_flags::sndmore | zmq::send_flags::dontwait;
    try {
      if (!replay_.send(zmq::buffer(client), more)) return false;
      if (delimited && !replay_.send(zmq::message_t(), more)) return false;
      return replay_.send(zmq::buffer(seq_bytes), more) &&
             replay_.send(zmq::buffer(payload), zmq::send_flags::dontwait);
    } catch (const zmq::error_t&) {  // EHOSTUNREACH: the client left
      return false;
    }
  }

  kv_event_publisher_options options_;
  zmq::context_t context_{1};
  zmq::socket_t pub_;
  zmq::socket_t replay_;  // no socket where there is no replay endpoint
  std::string endpoint_;
  std::string replay_endpoint_;
  detail::wake_signal wake_;

  std::mutex mutex_;  // guards queue_ and stopping_; held for a push or a swap
  std::vector<kv_event> queue_;
  bool stopping_ = false;

  // The thread's own.
  std::vector<kv_event> taken_;
  std::int64_t next_seq_ = 0;
  std::deque<std::pair<std::int64_t, std::string>> history_;  // (seq, payload), oldest first
  std::size_t history_bytes_ = 0;

  // Relaxed counters: written by offer() (offered, dropped) and the thread, read by stats().
  std::atomic<std::uint64_t> events_offered_{0}, events_published_{0}, events_dropped_{0};
  std::atomic<std::uint64_t> batches_published_{0}, send_failures_{0};
  std::atomic<std::uint64_t> replay_requests_{0}, replay_gaps_{0}, replay_bad_requests_{0}, replay_failures_{0};
  std::atomic<std::uint64_t> replay_buffer_batches_{0}, replay_buffer_bytes_{0};

  std::once_flag stop_once_;
  std::thread thread_;  // last: started once everything it uses exists
};

}  // namespace kv_events
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
