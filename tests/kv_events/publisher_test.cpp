// kv_events/publisher.hpp against real ZMQ peers: a SUB socket that reads the batches, a
// DEALER that asks for replays, a subscriber that never reads. Every publisher binds
// tcp://127.0.0.1:* (a free port, read back with endpoint()), so tests never share a port;
// every wait polls with a deadline.
#include <kvtier/kv_events/publisher.hpp>

#include "kv_events/msgpack_reader.hpp"

#include <unistd.h>
#include <catch2/catch.hpp>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <iterator>
#include <optional>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

// Under ThreadSanitizer (the TSan stage runs the [concurrency] tests): Debian's libzmq is not
// instrumented, and the message buffers its I/O thread hands over through its lock-free
// pipes look like races. A report with a frame in libzmq is suppressed; one within our
// code only (the publisher's queue, counters, stop) is not. TSan reads this hook at start.
extern "C" const char* __tsan_default_suppressions() { return "race:libzmq.so\n"; }

namespace file_publisher_test {

using namespace kvtier::kv_events;
using namespace std::chrono_literals;
using kvtier::test::msgpack_reader;
using kvtier::test::msgpack_value;

// Generous: the suite runs on loaded 2-core machines, and under sanitizers.
constexpr auto deadline = 30s;

template <class Pred>
bool eventually(Pred done, std::chrono::milliseconds within = deadline) {
  const auto end = std::chrono::steady_clock::now() + within;
  while (!done()) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(1ms);
  }
  return true;
}

kv_event_publisher_options test_options() {
  kv_event_publisher_options o;
  o.endpoint = "tcp://127.0.0.1:*";
  o.replay_endpoint = "tcp://127.0.0.1:*";
  o.flush_interval = 0ms;
  return o;
}

kv_event removed(std::uint64_t hash) { return block_removed{{hash}, std::string(medium_cpu), std::nullopt}; }

std::int64_t seq_of(const zmq::message_t& m) {
  REQUIRE(m.size() == 8);
  const auto* p = static_cast<const unsigned char*>(m.data());
  std::uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v = (v << 8) | p[i];
  return static_cast<std::int64_t>(v);
}

std::string seq_bytes(std::int64_t seq) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(static_cast<std::uint64_t>(seq) >> (56 - 8 * i));
  return out;
}

// The hashes of a payload's BlockRemoved events, in order, in either form.
std::vector<std::uint64_t> removed_hashes(const std::string& payload) {
  const msgpack_value batch = msgpack_reader::decode(payload);
  const bool map = batch.k == msgpack_value::kind::map;
  const msgpack_value& events = map ? batch.at("events") : batch[1];
  std::vector<std::uint64_t> out;
  for (const auto& ev : events.items) {
    const std::string& type = map ? ev.at("type").s : ev[0].s;
    if (type != "BlockRemoved") continue;
    for (const auto& h : (map ? ev.at("block_hashes") : ev[1]).items) out.push_back(h.u);
  }
  return out;
}

struct received_batch {
  std::string topic;
  std::int64_t seq = 0;
  std::string payload;
};

class subscriber {
 public:
  subscriber(zmq::context_t& ctx, const std::string& endpoint, const std::string& topic = "")
      : sock_(ctx, zmq::socket_type::sub) {
    sock_.set(zmq::sockopt::linger, 0);
    sock_.set(zmq::sockopt::rcvhwm, 0);  // no limit: this one reads everything
    sock_.connect(endpoint);
    sock_.set(zmq::sockopt::subscribe, topic);
  }

  std::optional<received_batch> next(std::chrono::milliseconds within) {
    sock_.set(zmq::sockopt::rcvtimeo, static_cast<int>(within.count()));
    std::vector<zmq::message_t> frames;
    if (!zmq::recv_multipart(sock_, std::back_inserter(frames))) return std::nullopt;
    REQUIRE(frames.size() == 3);
    return received_batch{frames[0].to_string(), seq_of(frames[1]), frames[2].to_string()};
  }

  // Offers AllBlocksCleared probes until one arrives (a SUB's subscription reaches the PUB
  // some time after it connects; what was published before is not delivered): the seq of
  // the first probe received.
  std::int64_t sync(kv_event_publisher& pub) {
    const auto end = std::chrono::steady_clock::now() + deadline;
    while (std::chrono::steady_clock::now() < end) {
      REQUIRE(pub.offer(all_blocks_cleared{}));
      if (auto b = next(20ms)) return b->seq;
    }
    FAIL("the subscriber never received a probe");
    return -1;
  }

  zmq::socket_t sock_;
};

struct replay_answer {
  std::vector<std::int64_t> seqs;
  std::vector<std::string> payloads;
  std::string end_payload;
};

// Asks for a replay from `since` as vLLM's clients do (a DEALER sending the empty delimiter,
// or, with delimited false, a DEALER that does not) and reads until END_SEQ.
replay_answer replay(zmq::context_t& ctx, const std::string& endpoint, std::int64_t since, bool delimited = true) {
  zmq::socket_t dealer(ctx, zmq::socket_type::dealer);
  dealer.set(zmq::sockopt::linger, 0);
  dealer.set(zmq::sockopt::rcvtimeo, static_cast<int>(std::chrono::milliseconds(deadline).count()));
  dealer.connect(endpoint);
  if (delimited) dealer.send(zmq::message_t(), zmq::send_flags::sndmore);
  dealer.send(zmq::buffer(seq_bytes(since)), zmq::send_flags::none);
  replay_answer out;
  for (;;) {
    std::vector<zmq::message_t> frames;
    REQUIRE(zmq::recv_multipart(dealer, std::back_inserter(frames)));
    REQUIRE(frames.size() == (delimited ? 3U : 2U));
    if (delimited) CHECK(frames[0].size() == 0);
    const std::int64_t seq = seq_of(frames[frames.size() - 2]);
    if (seq == replay_end_seq) {
      out.end_payload = frames.back().to_string();
      return out;
    }
    out.seqs.push_back(seq);
    out.payloads.push_back(frames.back().to_string());
  }
}

// Offers one event and waits until it went out alone: one batch each.
void publish_alone(kv_event_publisher& pub, std::uint64_t hash) {
  const auto before = pub.stats().batches_published;
  REQUIRE(pub.offer(removed(hash)));
  REQUIRE(eventually([&] { return pub.stats().batches_published == before + 1; }));
}

TEST_CASE("a subscriber receives every event in order, in batches numbered one after another from 0",
          "[kv_events][publisher]") {
  zmq::context_t ctx;
  kv_event_publisher pub(test_options());
  subscriber sub(ctx, pub.endpoint());
  std::int64_t last_seq = sub.sync(pub);

  constexpr std::uint64_t n = 200;
  for (std::uint64_t i = 0; i < n; ++i) REQUIRE(pub.offer(removed(i)));
  std::vector<std::uint64_t> hashes;
  while (hashes.size() < n) {
    auto b = sub.next(std::chrono::duration_cast<std::chrono::milliseconds>(deadline));
    REQUIRE(b.has_value());
    CHECK(b->topic.empty());
    CHECK(b->seq == last_seq + 1);  // probes still in flight come first, numbered too
    last_seq = b->seq;
    for (auto h : removed_hashes(b->payload)) hashes.push_back(h);
  }
  std::vector<std::uint64_t> expected(n);
  for (std::uint64_t i = 0; i < n; ++i) expected[i] = i;
  CHECK(hashes == expected);

  // The numbering began at 0: the replay holds every batch, 0 to the last one.
  const replay_answer all = replay(ctx, pub.replay_endpoint(), 0);
  REQUIRE_FALSE(all.seqs.empty());
  CHECK(all.seqs.front() == 0);
  CHECK(all.seqs.back() == last_seq);
  CHECK(all.seqs.size() == static_cast<std::size_t>(last_seq + 1));
  CHECK(all.end_payload.empty());

  const auto s = pub.stats();
  CHECK(s.events_dropped == 0);
  CHECK(s.events_published == s.events_offered);
  CHECK(s.batches_published == static_cast<std::uint64_t>(last_seq + 1));
  CHECK(s.send_failures == 0);
}

TEST_CASE("a replay answers every held batch since a sequence number, then END_SEQ with an empty payload",
          "[kv_events][publisher]") {
  zmq::context_t ctx;
  kv_event_publisher pub(test_options());
  for (std::uint64_t i = 0; i < 5; ++i) publish_alone(pub, 100 + i);

  const replay_answer from2 = replay(ctx, pub.replay_endpoint(), 2);
  CHECK(from2.seqs == std::vector<std::int64_t>{2, 3, 4});
  REQUIRE(from2.payloads.size() == 3);
  CHECK(removed_hashes(from2.payloads[0]) == std::vector<std::uint64_t>{102});
  CHECK(removed_hashes(from2.payloads[2]) == std::vector<std::uint64_t>{104});
  CHECK(from2.end_payload.empty());

  // Nothing newer: only END_SEQ, and no gap.
  const replay_answer from5 = replay(ctx, pub.replay_endpoint(), 5);
  CHECK(from5.seqs.empty());
  CHECK(from5.end_payload.empty());

  // A DEALER that sends no empty delimiter is answered without one.
  const replay_answer bare = replay(ctx, pub.replay_endpoint(), 0, false);
  CHECK(bare.seqs == std::vector<std::int64_t>{0, 1, 2, 3, 4});

  const auto s = pub.stats();
  CHECK(s.replay_requests == 3);
  CHECK(s.replay_gaps == 0);
  CHECK(s.replay_buffer_batches == 5);
  std::uint64_t bytes = 0;
  for (const auto& p : bare.payloads) bytes += p.size();
  CHECK(s.replay_buffer_bytes == bytes);
}

TEST_CASE("a replay from before the oldest batch held reports the gap in END_SEQ's payload", "[kv_events][publisher]") {
  zmq::context_t ctx;
  auto o = test_options();
  o.buffer_steps = 3;
  kv_event_publisher pub(o);
  for (std::uint64_t i = 0; i < 6; ++i) publish_alone(pub, i);
  CHECK(pub.stats().replay_buffer_batches == 3);

  const replay_answer a = replay(ctx, pub.replay_endpoint(), 1);
  CHECK(a.seqs == std::vector<std::int64_t>{3, 4, 5});  // a vLLM client sees the jump from 1 to 3
  const msgpack_value gap = msgpack_reader::decode(a.end_payload);
  CHECK(gap.keys() == std::vector<std::string>{"type", "requested_seq", "first_seq"});
  CHECK(gap.at("type").s == "ReplayGap");
  CHECK(gap.at("requested_seq").integer() == 1);
  CHECK(gap.at("first_seq").integer() == 3);
  CHECK(pub.stats().replay_gaps == 1);

  // From the oldest held on, no gap.
  CHECK(replay(ctx, pub.replay_endpoint(), 3).end_payload.empty());
  CHECK(pub.stats().replay_gaps == 1);
}

TEST_CASE("the replay history is bounded by its bytes too: the oldest batches go first", "[kv_events][publisher]") {
  zmq::context_t ctx;
  kv_event_publisher probe(test_options());
  publish_alone(probe, 0);
  const std::uint64_t one_batch = probe.stats().replay_buffer_bytes;  // every batch below has this size
  REQUIRE(one_batch > 0);

  auto o = test_options();
  o.buffer_bytes = 2 * one_batch + one_batch / 2;  // room for two
  kv_event_publisher pub(o);
  for (std::uint64_t i = 0; i < 5; ++i) publish_alone(pub, 10 + i);
  CHECK(pub.stats().replay_buffer_batches == 2);
  CHECK(pub.stats().replay_buffer_bytes == 2 * one_batch);
  const replay_answer a = replay(ctx, pub.replay_endpoint(), 0);
  CHECK(a.seqs == std::vector<std::int64_t>{3, 4});
  CHECK(msgpack_reader::decode(a.end_payload).at("first_seq").integer() == 3);
}

TEST_CASE("with no replay history every replay of a published batch is a gap up to the next batch",
          "[kv_events][publisher]") {
  zmq::context_t ctx;
  auto o = test_options();
  o.buffer_steps = 0;
  kv_event_publisher pub(o);
  publish_alone(pub, 1);
  publish_alone(pub, 2);
  const replay_answer a = replay(ctx, pub.replay_endpoint(), 0);
  CHECK(a.seqs.empty());
  const msgpack_value gap = msgpack_reader::decode(a.end_payload);
  CHECK(gap.at("requested_seq").integer() == 0);
  CHECK(gap.at("first_seq").integer() == 2);
  CHECK(pub.stats().replay_buffer_bytes == 0);
}

TEST_CASE("a malformed replay request is counted and ignored; the next one is answered", "[kv_events][publisher]") {
  zmq::context_t ctx;
  kv_event_publisher pub(test_options());
  publish_alone(pub, 7);
  zmq::socket_t dealer(ctx, zmq::socket_type::dealer);
  dealer.set(zmq::sockopt::linger, 0);
  dealer.connect(pub.replay_endpoint());
  dealer.send(zmq::message_t(), zmq::send_flags::sndmore);
  dealer.send(zmq::str_buffer("abc"), zmq::send_flags::none);  // not 8 bytes
  REQUIRE(eventually([&] { return pub.stats().replay_bad_requests == 1; }));
  CHECK(pub.stats().replay_requests == 0);
  CHECK(replay(ctx, pub.replay_endpoint(), 0).seqs == std::vector<std::int64_t>{0});
}

TEST_CASE("ipc endpoints, a topic and the array form reach a subscriber of that topic", "[kv_events][publisher]") {
  zmq::context_t ctx;
  auto o = test_options();
  const std::string path = "/tmp/kvtier-kv-events-test-" + std::to_string(::getpid()) + ".sock";
  o.endpoint = "ipc://" + path;
  o.replay_endpoint.clear();
  o.topic = "kvtier@node1";
  o.form = event_form::array;
  kv_event_publisher pub(o);
  CHECK(pub.endpoint() == o.endpoint);
  CHECK(pub.replay_endpoint().empty());
  subscriber sub(ctx, pub.endpoint(), "kvtier@");
  sub.sync(pub);
  REQUIRE(pub.offer(removed(42)));
  for (;;) {
    auto b = sub.next(std::chrono::duration_cast<std::chrono::milliseconds>(deadline));
    REQUIRE(b.has_value());
    CHECK(b->topic == "kvtier@node1");
    const msgpack_value batch = msgpack_reader::decode(b->payload);
    REQUIRE(batch.k == msgpack_value::kind::array);
    CHECK(batch[2].integer() == 0);  // data_parallel_rank
    if (removed_hashes(b->payload) == std::vector<std::uint64_t>{42}) break;
  }
  pub.stop();
  ::unlink(path.c_str());
}

TEST_CASE("a port of * is resolved: endpoint() names the port bound", "[kv_events][publisher]") {
  kv_event_publisher pub(test_options());
  for (const std::string& e : {pub.endpoint(), pub.replay_endpoint()}) {
    CHECK(e.rfind("tcp://127.0.0.1:", 0) == 0);
    const std::string port = e.substr(std::string("tcp://127.0.0.1:").size());
    CHECK(std::stoi(port) > 0);
  }
  CHECK(pub.endpoint() != pub.replay_endpoint());
}

TEST_CASE("an endpoint that cannot be bound throws, naming it", "[kv_events][publisher]") {
  kv_event_publisher first(test_options());
  auto o = test_options();
  o.endpoint = first.endpoint();  // in use
  try {
    kv_event_publisher second(o);
    FAIL("binding a port in use did not throw");
  } catch (const std::system_error& e) {
    CHECK_THAT(e.what(), Catch::Contains(first.endpoint()) && Catch::Contains("PUB"));
    CHECK(e.code().value() == EADDRINUSE);
  }
  o = test_options();
  o.replay_endpoint = "nonsense";
  try {
    kv_event_publisher bad(o);
    FAIL("a malformed endpoint did not throw");
  } catch (const std::system_error& e) {
    CHECK_THAT(e.what(), Catch::Contains("'nonsense'") && Catch::Contains("ROUTER replay"));
  }
  o = test_options();
  o.max_queue = 0;
  CHECK_THROWS_AS(kv_event_publisher(o), std::invalid_argument);
}

TEST_CASE("a full queue drops the offer and counts it, without waiting", "[kv_events][publisher]") {
  auto o = test_options();
  o.max_queue = 16;
  o.flush_interval = std::chrono::hours(1);  // after the first batch, nothing leaves until stop()
  kv_event_publisher pub(o);
  publish_alone(pub, 0);  // the first batch leaves at once; the next waits an hour
  std::size_t accepted = 0;
  for (std::uint64_t i = 1; i <= 100; ++i) accepted += pub.offer(removed(i)) ? 1 : 0;
  CHECK(accepted == 16);
  auto s = pub.stats();
  CHECK(s.events_offered == 101);
  CHECK(s.events_dropped == 84);
  CHECK(s.events_published == 1);

  // stop() does not wait for the interval: it publishes the 16 queued and returns.
  const auto t0 = std::chrono::steady_clock::now();
  pub.stop();
  CHECK(std::chrono::steady_clock::now() - t0 < 10s);
  s = pub.stats();
  CHECK(s.events_published == 17);
  CHECK(s.batches_published == 2);
  CHECK_FALSE(pub.offer(removed(1000)));  // stopped
  s = pub.stats();
  CHECK(s.events_dropped == 85);
  CHECK(s.events_offered == s.events_published + s.events_dropped);
  pub.stop();  // again: nothing
}

TEST_CASE("a subscriber that never reads stalls neither offer() nor the publisher's thread",
          "[kv_events][publisher][concurrency]") {
  zmq::context_t ctx;
  auto o = test_options();
  o.send_hwm = 1;
  o.max_queue = 32;
  o.max_batch_events = 4;
  kv_event_publisher pub(o);
  zmq::socket_t deaf(ctx, zmq::socket_type::sub);  // connected and subscribed, never read
  deaf.set(zmq::sockopt::linger, 0);
  deaf.set(zmq::sockopt::rcvhwm, 1);
  deaf.set(zmq::sockopt::rcvbuf, 4096);
  deaf.connect(pub.endpoint());
  deaf.set(zmq::sockopt::subscribe, "");

  // ~16 KiB of token ids per event: the socket buffers fill after a few batches.
  block_stored big;
  big.block_hashes = {std::uint64_t{1}};
  big.token_ids.assign(4096, 7);
  big.block_size = 4096;
  auto handled = [&] {
    const auto s = pub.stats();
    return s.events_published + s.events_dropped == s.events_offered;
  };

  // At a pace the thread keeps up with, every batch is handed to ZMQ (~8 MiB, far beyond
  // what the deaf subscriber's queues and socket buffers hold): ZMQ drops for that
  // subscriber, the thread never waits on it.
  constexpr int paced = 500;
  for (int i = 0; i < paced; ++i) {
    REQUIRE(pub.offer(big));
    REQUIRE(eventually(handled));
  }
  CHECK(pub.stats().events_published == paced);
  CHECK(pub.stats().send_failures == 0);

  // Faster than it: offer() drops at the full queue and counts, and still never waits.
  constexpr int flood = 3000;
  for (int i = 0; i < flood; ++i) pub.offer(big);
  REQUIRE(eventually(handled));
  const auto s = pub.stats();
  CHECK(s.events_offered == paced + flood);
  CHECK(s.events_published > paced);
  CHECK(s.events_dropped > 0);
  const auto t0 = std::chrono::steady_clock::now();
  pub.stop();
  CHECK(std::chrono::steady_clock::now() - t0 < 10s);
}

TEST_CASE("events offered from several threads at once all arrive, each thread's in its order",
          "[kv_events][publisher][concurrency]") {
  zmq::context_t ctx;
  auto o = test_options();
  o.send_hwm = 0;  // no limit: nothing may be lost in this test
  o.flush_interval = 1ms;
  kv_event_publisher pub(o);
  subscriber sub(ctx, pub.endpoint());
  std::int64_t last_seq = sub.sync(pub);

  constexpr int threads = 4;
  constexpr std::uint64_t per_thread = 2000;
  std::vector<std::thread> offerers;
  for (int t = 0; t < threads; ++t) {
    offerers.emplace_back([&pub, t] {
      for (std::uint64_t i = 0; i < per_thread; ++i) pub.offer(removed((std::uint64_t(t) << 32) | i));
    });
  }
  std::vector<std::uint64_t> next_of(threads, 0);
  std::uint64_t received = 0;
  bool in_order = true;
  while (received < threads * per_thread) {
    auto b = sub.next(std::chrono::duration_cast<std::chrono::milliseconds>(deadline));
    REQUIRE(b.has_value());
    if (b->seq != last_seq + 1) in_order = false;
    last_seq = b->seq;
    for (auto h : removed_hashes(b->payload)) {
      const auto t = h >> 32;
      if ((h & 0xffffffffU) != next_of[t]) in_order = false;
      ++next_of[t];
      ++received;
    }
  }
  for (auto& th : offerers) th.join();
  CHECK(in_order);
  CHECK(received == threads * per_thread);
  const auto s = pub.stats();
  CHECK(s.events_dropped == 0);
}

}  // namespace file_publisher_test
