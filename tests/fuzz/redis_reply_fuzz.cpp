// Fuzz target: the Redis reply path, where kvtier interprets bytes a Redis server (or
// whatever listens at its address) sends back: the hiredis reader and kvtier's reply
// interpreters (l2/redis/detail/redis_wire.hpp: MOVED/ASK redirects, CLUSTER SLOTS, INFO fields,
// host:port), and redis_link's own parser of GET replies (l2/redis/detail/redis_link.hpp: the
// "$<n>" line, the 72-byte object header, the payload read straight into the caller's
// buffer, the CRLF; ASKING's "+OK"; the AUTH/SELECT handshake), driven over a real
// loopback TCP connection by a fake server that sends the fuzzer's bytes.
//
// Input: one byte of mode, then
//   even (wire): [1] how to cut the stream into feeds, then the stream for a redisReader.
//     Every reply is interpreted as the engine would (cluster slots, redirect, INFO,
//     endpoint); what those accept must be in range.
//   odd (link): [1] requests n = 1 + b % 8, bit 6: SELECT 3 first, bit 7: AUTH first;
//     [2] how to cut the server's bytes into sends; then per request two bytes:
//       kind: bit 0 object GET (else a generic command), bit 1 ASKING first, bits 2-4 the
//             destination size (object), bit 5 abandon the request after the first send;
//       form: what the fake server answers: 0 raw (u16 length + that many input bytes),
//             1 a well-formed reply built from the request (object: a valid object of the
//             expected key and size, payload from the input), 2 a reply with one defect
//             (bits 2-4: wrong key, wrong size, bad payload checksum, bad header checksum,
//             no CRLF, nil, -MOVED, short value), 3 raw;
//     and the rest of the input is appended to what the server sends.
//
// Oracle (link): every request not abandoned gets exactly one reply; the link reports its
// end exactly once; a generic reply is never an error reply; object_ok only for an object
// request; and when every reply was well formed (form 1 and nothing appended or
// abandoned), every request gets its reply: object_ok with exactly the payload sent.

#include <kvtier/l2/object_format.hpp>
#include <kvtier/l2/redis/detail/redis_link.hpp>
#include <kvtier/l2/redis/detail/redis_wire.hpp>

#include "fuzz_support.hpp"

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace {

namespace d = kvtier::l2::detail;
namespace asio = boost::asio;
using asio::ip::tcp;
using kvtier::chunk_key;
using kvtier::fuzz::fuzz_input;
using kvtier::fuzz::fuzz_rng;

// --- wire mode ---------------------------------------------------------------------------

// redis_parse_uint accepts exactly the decimal digits of a u64 (leading zeros allowed).
void check_uint(std::string_view s) {
  const auto v = d::redis_parse_uint(s);
  if (!v) return;
  std::string_view digits = s;
  while (digits.size() > 1 && digits.front() == '0') digits.remove_prefix(1);
  FUZZ_CHECK(std::to_string(*v) == digits, "redis_parse_uint accepted '" + std::string(s) + "'");
}

void interpret(const redisReply& r) {
  if (r.type == REDIS_REPLY_ARRAY) {
    if (const auto slots = d::redis_parse_cluster_slots(r, "10.0.0.1")) {
      for (const auto& s : *slots) {
        FUZZ_CHECK(s.first <= s.last && s.last < 16384, "CLUSTER SLOTS range out of bounds");
        FUZZ_CHECK(s.master.port != 0 && !s.master.host.empty(), "CLUSTER SLOTS master without host or port");
      }
    }
    for (std::size_t i = 0; i < r.elements; ++i) interpret(*r.element[i]);
    return;
  }
  const std::string_view text = d::redis_reply_text(r);
  if (const auto rd = d::redis_parse_redirect(text)) {
    FUZZ_CHECK(rd->slot < 16384 && rd->to.port != 0, "a redirect out of range");
    FUZZ_CHECK(text.starts_with(rd->ask ? "ASK " : "MOVED "), "a redirect from another kind of error");
  }
  if (const auto ep = d::redis_parse_endpoint(text)) FUZZ_CHECK(ep->port != 0, "an endpoint with port 0");
  (void)d::redis_info_field(text, "used_memory");
  (void)d::redis_info_field(text, "maxmemory");
  check_uint(text.substr(0, 24));
}

void wire_mode(fuzz_input& in) {
  const auto cut = in.take<std::uint8_t>();
  const auto stream = in.rest();
  d::redis_reader reader;
  fuzz_rng rng(cut);
  std::size_t at = 0;
  while (at < stream.size()) {
    const std::size_t n = cut == 0 ? stream.size() : std::min<std::size_t>(1 + rng.next() % cut, stream.size() - at);
    if (!reader.feed(reinterpret_cast<const char*>(stream.data() + at), n)) return;
    at += n;
    for (;;) {
      d::redis_reply_ptr reply;
      const auto st = reader.next(reply);
      if (st == d::redis_reader::status::error) {
        FUZZ_CHECK(!reader.error().empty(), "a reader error without a message");
        return;
      }
      if (st == d::redis_reader::status::incomplete) break;
      interpret(*reply);
    }
    FUZZ_CHECK(reader.unconsumed().size() <= at, "unconsumed() holds more than was fed");
  }
}

// --- link mode ---------------------------------------------------------------------------

constexpr std::array<std::size_t, 8> dst_sizes = {0, 1, 8, 71, 100, 4096, 4097, 20000};
const chunk_key expect_key{0xfeed, 1, 0, kvtier::hash128{42, 43}};

struct sink final : d::redis_reply_sink {
  struct got {
    int count = 0;
    d::redis_reply_event::status st{};
    int reply_type = -1;
  };
  std::vector<got> replies;
  void on_reply(std::size_t tag, d::redis_reply_event&& e) override {
    auto& g = replies.at(tag);
    ++g.count;
    g.st = e.st;
    g.reply_type = e.reply ? e.reply->type : -1;
    if (e.st == d::redis_reply_event::status::reply)
      FUZZ_CHECK(e.reply != nullptr, "a generic reply without its reply object");
  }
};

struct owner final : d::redis_link_owner {
  int ups = 0;
  int downs = 0;
  void on_link_up(d::redis_link&) override { ++ups; }
  void on_link_down(d::redis_link&, kvtier::error_code, std::string_view, bool, bool) override { ++downs; }
};

struct fake_server {
  asio::io_context io;
  tcp::acceptor acceptor{io, tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0)};
  std::uint16_t port = acceptor.local_endpoint().port();
};

fake_server& server() {
  static fake_server s;
  return s;
}

// A GET reply: "$<n>\r\n" + object (header + payload) + "\r\n", with an optional defect.
std::string object_reply(std::span<const std::byte> payload, unsigned defect, bool with_defect) {
  kvtier::l2::object_header h;
  h.key = expect_key;
  h.payload_bytes = payload.size();
  h.payload_checksum = kvtier::l2::payload_checksum(payload);
  if (with_defect && defect == 0) h.key.hash.lo ^= 1;  // another key's object
  if (with_defect && defect == 1) h.payload_bytes += 1;
  if (with_defect && defect == 2) h.payload_checksum ^= 1;
  const auto head = kvtier::l2::encode_header(h);
  std::string obj(reinterpret_cast<const char*>(head.data()), head.size());
  if (with_defect && defect == 3) obj[70] = static_cast<char>(obj[70] ^ 1);  // header checksum
  obj.append(reinterpret_cast<const char*>(payload.data()), payload.size());
  if (with_defect && defect == 5) return "$-1\r\n";
  if (with_defect && defect == 6) return "-MOVED 3999 127.0.0.1:6381\r\n";
  std::size_t claimed = obj.size();
  if (with_defect && defect == 7) claimed = obj.size() > 0 ? obj.size() - 1 : 0;  // value shorter than the object
  std::string s = "$" + std::to_string(claimed) + "\r\n" + obj;
  if (with_defect && defect == 7) s.pop_back();
  s += (with_defect && defect == 4) ? "\n\n" : "\r\n";
  return s;
}

void link_mode(fuzz_input& in) {
  auto& srv = server();
  const auto head = in.take<std::uint8_t>();
  const auto cut = in.take<std::uint8_t>();
  const std::size_t n = 1 + head % 8;
  const bool auth = head & 0x80, select = head & 0x40;

  struct planned {
    bool object = false, asking = false, abandon = false;
    std::size_t dst = 0;
    std::vector<std::byte> payload;  ///< what a well-formed object reply sends
    std::vector<std::byte> buffer;   ///< the destination
  };
  std::vector<planned> reqs(n);
  std::string stream;
  bool clean = true;
  if (auth) stream += "+OK\r\n";
  if (select) stream += "+OK\r\n";
  for (auto& r : reqs) {
    const auto kind = in.take<std::uint8_t>();
    const auto form = in.take<std::uint8_t>();
    r.object = kind & 1;
    r.asking = kind & 2;
    r.abandon = kind & 32;
    r.dst = r.object ? dst_sizes[(kind >> 2) & 7] : 0;
    r.buffer.assign(r.dst, std::byte{0});
    clean = clean && !r.abandon;
    switch (form & 3) {
      case 1:
      case 2: {
        const bool defect = (form & 3) == 2;
        clean = clean && !defect;
        if (r.asking) stream += "+OK\r\n";
        if (r.object) {
          const auto bytes = in.take_bytes(r.dst);
          r.payload.assign(bytes.begin(), bytes.end());
          r.payload.resize(r.dst, std::byte{0x5a});
          stream += object_reply(r.payload, (form >> 2) & 7, defect);
        } else {
          stream += defect ? "-ERR defect\r\n" : ":1\r\n";
        }
        break;
      }
      default: {
        clean = false;
        const auto len = in.take<std::uint16_t>();
        const auto raw = in.take_bytes(len);
        stream.append(reinterpret_cast<const char*>(raw.data()), raw.size());
      }
    }
  }
  const auto tail = in.rest();
  if (!tail.empty()) clean = false;
  stream.append(reinterpret_cast<const char*>(tail.data()), tail.size());

  d::redis_link_options o;
  o.endpoint = {"127.0.0.1", srv.port};
  o.max_inflight_bytes = std::size_t{1} << 30;
  if (auth) o.password = "pw";
  if (select) o.database = 3;
  owner own;
  sink snk;
  snk.replies.resize(n);
  auto link = std::make_shared<d::redis_link>(srv.io.get_executor(), o, &own);
  std::vector<d::redis_request*> submitted;
  for (std::size_t i = 0; i < n; ++i) {
    auto r = std::make_unique<d::redis_request>();
    r->asking = reqs[i].asking;
    r->head = (reqs[i].asking ? d::redis_format({"ASKING"}) : std::string()) +
              d::redis_format({reqs[i].object ? "GET" : "EXISTS", "k"});
    r->kind = reqs[i].object ? d::redis_reply_kind::object : d::redis_reply_kind::generic;
    r->dst = std::span<std::byte>(reqs[i].buffer);
    r->expect = expect_key;
    r->reply_bytes = reqs[i].dst;
    r->sink = &snk;
    r->tag = i;
    submitted.push_back(link->submit(std::move(r)));
  }

  tcp::socket peer(srv.io);
  bool accepted = false;
  srv.acceptor.async_accept(peer, [&](boost::system::error_code ec) {
    FUZZ_CHECK(!ec, "accept failed: " + ec.message());
    accepted = true;
  });
  link->start();
  while (!accepted) srv.io.run_one();
  srv.io.restart();
  auto drain = [&] {
    while (srv.io.poll() > 0) {
    }
    srv.io.restart();
  };
  drain();  // connected, requests written

  fuzz_rng rng(cut);
  std::size_t at = 0;
  bool first = true;
  while (at < stream.size() && link->current() != d::redis_link::state::closed) {
    const std::size_t len =
        cut == 0 ? stream.size() : std::min<std::size_t>(1 + rng.next() % (16 * std::size_t{cut}), stream.size() - at);
    boost::system::error_code ec;
    asio::write(peer, asio::buffer(stream.data() + at, len), ec);
    if (ec) break;  // the link closed its end
    at += len;
    drain();
    if (first) {
      first = false;
      for (std::size_t i = 0; i < n; ++i)
        if (reqs[i].abandon) link->abandon(submitted[i]);
      drain();
    }
  }
  boost::system::error_code ignored;
  peer.shutdown(tcp::socket::shutdown_send, ignored);
  while (link->current() != d::redis_link::state::closed) srv.io.run_one();
  srv.io.restart();
  peer.close(ignored);
  drain();  // the link's coroutines finish

  FUZZ_CHECK(own.downs == 1, "the link reported its end " + std::to_string(own.downs) + " times");
  for (std::size_t i = 0; i < n; ++i) {
    const auto& g = snk.replies[i];
    if (reqs[i].abandon) {
      FUZZ_CHECK(g.count <= 1, "an abandoned request got two replies");
      continue;
    }
    FUZZ_CHECK(g.count == 1, "request " + std::to_string(i) + " got " + std::to_string(g.count) + " replies");
    using st = d::redis_reply_event::status;
    if (g.st == st::reply) FUZZ_CHECK(g.reply_type != REDIS_REPLY_ERROR, "an error reply delivered as a reply");
    if (g.st == st::object_ok || g.st == st::object_nil || g.st == st::object_corrupt || g.st == st::object_size)
      FUZZ_CHECK(reqs[i].object, "an object verdict for a generic request");
    if (g.st == st::reply) FUZZ_CHECK(!reqs[i].object, "a generic reply for an object request");
    if (clean) {
      if (reqs[i].object) {
        const bool want_ok = reqs[i].dst != 0;  // an empty destination takes no payload
        FUZZ_CHECK(g.st == (want_ok ? st::object_ok : st::object_size),
                   "a well-formed object reply got status " + std::to_string(static_cast<int>(g.st)));
        FUZZ_CHECK(reqs[i].buffer == reqs[i].payload, "object_ok with other bytes than the server sent");
      } else {
        FUZZ_CHECK(g.st == st::reply && g.reply_type == REDIS_REPLY_INTEGER, "a well-formed :1 reply got lost");
      }
    }
  }
  FUZZ_CHECK(!clean || own.ups == 1, "the handshake failed on well-formed replies");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz_input in(data, size);
  const auto mode = in.take<std::uint8_t>();
  if (mode % 2 == 0)
    wire_mode(in);
  else
    link_mode(in);
  return 0;
}
