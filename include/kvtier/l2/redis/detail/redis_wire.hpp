#pragma once
// The Redis protocol pieces of the Redis backend, on top of hiredis: commands formatted by
// hiredis (redisFormatCommandArgv), replies parsed by a hiredis redisReader, plus the few
// things hiredis 0.14 does not do: the zero-copy framing of a SET whose value is a caller's
// buffer, and parsing of MOVED/ASK redirects, CLUSTER SLOTS and INFO fields.

#include <kvtier/config.hpp>

#include <hiredis.h>

#include <charconv>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace l2 {
namespace detail {

struct redis_reply_deleter {
  void operator()(redisReply* r) const noexcept {
    if (r != nullptr) freeReplyObject(r);
  }
};
/// A reply built by hiredis's default reply functions.
using redis_reply_ptr = std::unique_ptr<redisReply, redis_reply_deleter>;

[[nodiscard]] inline std::string_view redis_reply_text(const redisReply& r) noexcept {
  return r.str != nullptr ? std::string_view(r.str, r.len) : std::string_view{};
}

/// Formats one command (binary-safe arguments) with hiredis and appends it to `out`.
inline void redis_format_append(std::string& out, std::initializer_list<std::string_view> args) {
  std::vector<const char*> argv;
  std::vector<std::size_t> lens;
  argv.reserve(args.size());
  lens.reserve(args.size());
  for (auto a : args) {
    argv.push_back(a.data());
    lens.push_back(a.size());
  }
  char* cmd = nullptr;
  const int n = redisFormatCommandArgv(&cmd, static_cast<int>(argv.size()), argv.data(), lens.data());
  if (n < 0 || cmd == nullptr) throw std::bad_alloc();
  out.append(cmd, static_cast<std::size_t>(n));
  redisFreeCommand(cmd);
}

[[nodiscard]] inline std::string redis_format(std::initializer_list<std::string_view> args) {
  std::string s;
  redis_format_append(s, args);
  return s;
}

/// The RESP framing of `SET key <value> NX [EX ttl]` around a value of value_bytes that is
/// written from the caller's memory (no copy into a formatted command: a 3 MiB value would
/// otherwise be copied once more). head + value + tail is byte for byte what
/// redisFormatCommandArgv produces (the tests compare them).
struct redis_set_framing {
  std::string head;
  std::string tail;
};

[[nodiscard]] inline redis_set_framing redis_set_frame(std::string_view key, std::size_t value_bytes,
                                                       std::uint32_t ttl_seconds) {
  redis_set_framing f;
  const std::string ttl = std::to_string(ttl_seconds);
  f.head = ttl_seconds > 0 ? "*6\r\n" : "*4\r\n";
  f.head += "$3\r\nSET\r\n$";
  f.head += std::to_string(key.size());
  f.head += "\r\n";
  f.head += key;
  f.head += "\r\n$";
  f.head += std::to_string(value_bytes);
  f.head += "\r\n";
  f.tail = "\r\n$2\r\nNX\r\n";
  if (ttl_seconds > 0) {
    f.tail += "$2\r\nEX\r\n$";
    f.tail += std::to_string(ttl.size());
    f.tail += "\r\n";
    f.tail += ttl;
    f.tail += "\r\n";
  }
  return f;
}

/// One hiredis reply parser. The link feeds it only the bytes of generic replies and takes
/// back what it did not consume (unconsumed()) when an object reply comes next, so the
/// payload of a GET never passes through hiredis's buffer (see redis_link).
class redis_reader {
 public:
  redis_reader() : r_(make()) {}
  redis_reader(const redis_reader&) = delete;
  redis_reader& operator=(const redis_reader&) = delete;
  ~redis_reader() { redisReaderFree(r_); }

  /// False on a protocol error (the connection must be dropped).
  [[nodiscard]] bool feed(const char* p, std::size_t n) { return n == 0 || redisReaderFeed(r_, p, n) == REDIS_OK; }

  enum class status { reply, incomplete, error };
  /// The next complete reply, if any.
  [[nodiscard]] status next(redis_reply_ptr& out) {
    void* reply = nullptr;
    if (redisReaderGetReply(r_, &reply) != REDIS_OK) return status::error;
    if (reply == nullptr) return status::incomplete;
    out.reset(static_cast<redisReply*>(reply));
    return status::reply;
  }

  /// Bytes fed but not consumed by the replies taken so far (a partial reply).
  [[nodiscard]] std::string_view unconsumed() const noexcept {
    return r_->len > r_->pos ? std::string_view(r_->buf + r_->pos, r_->len - r_->pos) : std::string_view{};
  }
  /// Whether a reply is half parsed (its bytes are part of unconsumed()).
  [[nodiscard]] bool empty() const noexcept { return r_->len == r_->pos && r_->ridx == -1; }
  [[nodiscard]] std::string_view error() const noexcept { return r_->errstr; }

  /// Forgets everything fed (after unconsumed() was taken back).
  void reset() {
    redisReader* fresh = make();
    redisReaderFree(r_);
    r_ = fresh;
  }

 private:
  static redisReader* make() {
    redisReader* r = redisReaderCreate();
    if (r == nullptr) throw std::bad_alloc();
    return r;
  }
  redisReader* r_;
};

/// "host:port" (the last ':' separates, so "::1:6379" is host "::1").
struct redis_endpoint {
  std::string host;
  std::uint16_t port = 0;

  [[nodiscard]] std::string to_string() const { return host + ':' + std::to_string(port); }
  friend bool operator==(const redis_endpoint&, const redis_endpoint&) = default;
};

[[nodiscard]] inline std::optional<std::uint64_t> redis_parse_uint(std::string_view s) noexcept {
  std::uint64_t v = 0;
  const auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc{} || p != s.data() + s.size() || s.empty()) return std::nullopt;
  return v;
}

[[nodiscard]] inline std::optional<redis_endpoint> redis_parse_endpoint(std::string_view s) {
  const auto colon = s.rfind(':');
  if (colon == std::string_view::npos) return std::nullopt;
  const auto port = redis_parse_uint(s.substr(colon + 1));
  if (!port || *port == 0 || *port > 65535) return std::nullopt;
  return redis_endpoint{std::string(s.substr(0, colon)), static_cast<std::uint16_t>(*port)};
}

/// A cluster redirect: "MOVED <slot> <host>:<port>" or "ASK <slot> <host>:<port>". The host
/// may be empty (Redis 7 "unknown endpoint"): the caller substitutes the replying node's.
struct redis_redirect {
  bool ask = false;
  std::uint16_t slot = 0;
  redis_endpoint to;
};

[[nodiscard]] inline std::optional<redis_redirect> redis_parse_redirect(std::string_view error) {
  redis_redirect r;
  if (error.starts_with("MOVED ")) {
    error.remove_prefix(6);
  } else if (error.starts_with("ASK ")) {
    r.ask = true;
    error.remove_prefix(4);
  } else {
    return std::nullopt;
  }
  const auto sp = error.find(' ');
  if (sp == std::string_view::npos) return std::nullopt;
  const auto slot = redis_parse_uint(error.substr(0, sp));
  if (!slot || *slot >= 16384) return std::nullopt;
  r.slot = static_cast<std::uint16_t>(*slot);
  std::string_view ep = error.substr(sp + 1);
  const auto colon = ep.rfind(':');
  if (colon == std::string_view::npos) return std::nullopt;
  const auto port = redis_parse_uint(ep.substr(colon + 1));
  if (!port || *port == 0 || *port > 65535) return std::nullopt;
  r.to.host = std::string(ep.substr(0, colon));
  r.to.port = static_cast<std::uint16_t>(*port);
  return r;
}

/// The value of "field:<number>" in an INFO reply.
[[nodiscard]] inline std::optional<std::uint64_t> redis_info_field(std::string_view info, std::string_view field) {
  std::size_t at = 0;
  while (at < info.size()) {
    auto eol = info.find('\n', at);
    if (eol == std::string_view::npos) eol = info.size();
    std::string_view line = info.substr(at, eol - at);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.size() > field.size() && line.starts_with(field) && line[field.size()] == ':')
      return redis_parse_uint(line.substr(field.size() + 1));
    at = eol + 1;
  }
  return std::nullopt;
}

/// One slot range of CLUSTER SLOTS and its master.
struct redis_slot_range {
  std::uint16_t first = 0;
  std::uint16_t last = 0;
  redis_endpoint master;
};

/// Parses a CLUSTER SLOTS reply; an empty host (unknown endpoint) becomes `asked_host`.
/// nullopt when the reply does not have the documented shape.
[[nodiscard]] inline std::optional<std::vector<redis_slot_range>> redis_parse_cluster_slots(
    const redisReply& r, std::string_view asked_host) {
  if (r.type != REDIS_REPLY_ARRAY) return std::nullopt;
  std::vector<redis_slot_range> out;
  for (std::size_t i = 0; i < r.elements; ++i) {
    const redisReply* e = r.element[i];
    if (e == nullptr || e->type != REDIS_REPLY_ARRAY || e->elements < 3) return std::nullopt;
    const redisReply* a = e->element[0];
    const redisReply* b = e->element[1];
    const redisReply* m = e->element[2];
    if (a->type != REDIS_REPLY_INTEGER || b->type != REDIS_REPLY_INTEGER || m->type != REDIS_REPLY_ARRAY ||
        m->elements < 2 || m->element[0]->type != REDIS_REPLY_STRING || m->element[1]->type != REDIS_REPLY_INTEGER)
      return std::nullopt;
    if (a->integer < 0 || b->integer < a->integer || b->integer >= 16384) return std::nullopt;
    if (m->element[1]->integer <= 0 || m->element[1]->integer > 65535) return std::nullopt;
    redis_slot_range s;
    s.first = static_cast<std::uint16_t>(a->integer);
    s.last = static_cast<std::uint16_t>(b->integer);
    s.master.host = std::string(redis_reply_text(*m->element[0]));
    if (s.master.host.empty() || s.master.host == "?") s.master.host = std::string(asked_host);
    s.master.port = static_cast<std::uint16_t>(m->element[1]->integer);
    out.push_back(std::move(s));
  }
  return out;
}

}  // namespace detail
}  // namespace l2
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
