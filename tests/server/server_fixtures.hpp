#pragma once
// Shared by the server tests: a raw protocol client (protocol::connection driven
// synchronously, every wait bounded by a deadline), an engine-side KV region with byte
// patterns to check copies with, and a kvtier-server process launcher.
//
// Catch2 v2 assertions are not thread-safe: the members that use them say so (ok,
// refused, register_region, status, ping); the rest report failures by throwing
// std::runtime_error, so the multi-threaded test can use them from its threads.

#include <kvtier/core/kv_layout.hpp>
#include <kvtier/core/kv_region.hpp>
#include <kvtier/core/token_hasher.hpp>
#include <kvtier/protocol/codec.hpp>
#include <kvtier/protocol/connection.hpp>
#include <kvtier/protocol/messages.hpp>
#include <kvtier/protocol/unix_socket.hpp>

#include <catch2/catch.hpp>

#include "support/asio.hpp"
#include "support/process.hpp"

#include <kvtier_program/process.hpp>

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <nlohmann/json.hpp>

#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fcntl.h>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <variant>
#include <vector>

namespace kvtier::test {

namespace p = protocol;
namespace asio = boost::asio;

/// Generous: a wait that takes this long means the server is broken, not slow.
inline constexpr auto server_deadline = std::chrono::seconds(30) * config::timeout_scale;

/// The model of most tests: 2 layers, 2 KV heads, head dim 16, bf16: 64 bytes per token
/// and plane, a 16-token chunk object is 4 KiB (one L1 slot of the test servers).
inline model_shape small_model() { return model_shape{2, 2, 16, dtype_kind::bf16, attention_kind::mha}; }
inline constexpr std::uint32_t test_chunk_tokens = 16;
inline constexpr std::uint32_t test_block_size = 4;
inline constexpr std::uint32_t blocks_per_chunk = test_chunk_tokens / test_block_size;

/// Chunk hashes as a connector would compute them for `chunks` chunks of a prompt `seed`.
inline std::vector<hash128> chunk_hashes(std::uint32_t seed, std::size_t chunks) {
  std::vector<token_id> tokens(chunks * test_chunk_tokens);
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<token_id>(seed * 100003u + i);
  return token_hasher(test_chunk_tokens).chunk_hashes(tokens);
}

/// An engine worker's KV region (a sealed memfd) with helpers to write and read blocks.
struct engine_region {
  paged_kv_layout layout;
  kv_region region;

  explicit engine_region(model_shape m = small_model(), std::uint32_t block_size = test_block_size,
                         std::uint32_t num_blocks = 64, kv_layout_kind order = kv_layout_kind::nhd)
      : layout{m, block_size, num_blocks, order} {
    auto r = kv_region::create(layout);
    if (!r) throw std::runtime_error("kv_region::create: " + r.error().message());
    region = std::move(*r);
  }
  /// A region of any layout (explicit kv_strides included). The token-wise helpers below
  /// assume a token's rows are adjacent (dense layouts); strided ones are read by row.
  explicit engine_region(const paged_kv_layout& l) : layout(l) {
    auto r = kv_region::create(layout);
    if (!r) throw std::runtime_error("kv_region::create: " + r.error().message());
    region = std::move(*r);
  }

  /// The bytes of token `t` of block `b`, over every layer and plane.
  std::byte* token(std::uint32_t layer, std::uint32_t plane, std::uint32_t b, std::uint32_t t) const {
    return region.layers()[layer] + layout.offset_in_layer(plane, b, t);
  }

  /// Fills block b with a pattern of `seed` (every byte depends on seed, layer, plane, token).
  void fill_block(std::uint32_t b, std::uint32_t seed) const {
    const std::size_t tb = layout.model.token_plane_bytes();
    for (std::uint32_t l = 0; l < layout.model.num_layers; ++l)
      for (std::uint32_t pl = 0; pl < layout.model.planes(); ++pl)
        for (std::uint32_t t = 0; t < layout.block_size; ++t) {
          std::byte* p = token(l, pl, b, t);
          for (std::size_t i = 0; i < tb; ++i)
            p[i] = static_cast<std::byte>((seed * 131 + l * 31 + pl * 17 + t * 7 + i) & 0xff);
        }
  }
  void fill_blocks(std::span<const std::uint32_t> blocks, std::uint32_t seed) const {
    for (std::size_t i = 0; i < blocks.size(); ++i) fill_block(blocks[i], seed + static_cast<std::uint32_t>(i));
  }
  void zero_block(std::uint32_t b, std::uint8_t value = 0) const {
    for (std::uint32_t l = 0; l < layout.model.num_layers; ++l)
      for (std::uint32_t pl = 0; pl < layout.model.planes(); ++pl)
        std::memset(token(l, pl, b, 0), value, layout.segment_bytes());
  }
  /// Token t of block a equals token t of block b (every layer and plane).
  bool same_token(std::uint32_t a, std::uint32_t b, std::uint32_t t, const engine_region* other = nullptr) const {
    const engine_region& o = other ? *other : *this;
    for (std::uint32_t l = 0; l < layout.model.num_layers; ++l)
      for (std::uint32_t pl = 0; pl < layout.model.planes(); ++pl)
        if (std::memcmp(token(l, pl, a, t), o.token(l, pl, b, t), layout.model.token_plane_bytes()) != 0) return false;
    return true;
  }
  /// Every byte of token t of block b is `value`.
  bool token_is(std::uint32_t b, std::uint32_t t, std::uint8_t value) const {
    for (std::uint32_t l = 0; l < layout.model.num_layers; ++l)
      for (std::uint32_t pl = 0; pl < layout.model.planes(); ++pl) {
        const std::byte* q = token(l, pl, b, t);
        for (std::size_t i = 0; i < layout.model.token_plane_bytes(); ++i)
          if (q[i] != static_cast<std::byte>(value)) return false;
      }
    return true;
  }

  std::vector<std::uint64_t> generations(std::span<const std::uint32_t> blocks) const {
    std::vector<std::uint64_t> g;
    for (auto b : blocks) g.push_back(region.generation(b));
    return g;
  }

  p::register_kv_request registration(std::uint16_t rank = 0, std::uint16_t world_size = 1,
                                      std::string model = "test/model",
                                      std::uint32_t chunk_tokens = test_chunk_tokens) const {
    p::register_kv_request r;
    r.instance_id = static_cast<std::uint64_t>(::getpid());
    r.rank = rank;
    r.world_size = world_size;
    r.model_name = std::move(model);
    r.model = layout.model;
    r.block_size = layout.block_size;
    r.num_blocks = layout.num_blocks;
    r.chunk_tokens = chunk_tokens;
    r.region_bytes = region.bytes();
    r.layout_kind = layout.kind();
    r.strides = layout.strides;
    return r;
  }
};

/// Block ids first, first+1, ... (n of them).
inline std::vector<std::uint32_t> block_range(std::uint32_t first, std::size_t n) {
  std::vector<std::uint32_t> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = first + static_cast<std::uint32_t>(i);
  return v;
}

/// A protocol client on its own io_context, used synchronously from the test thread.
class raw_client {
 public:
  explicit raw_client(const std::string& path) : conn_(connect(io_, path)) {}

  /// Sends `req` (with `fd` beside it when >= 0) and returns the reply (checked to carry
  /// the request's call id). Throws std::runtime_error when no reply comes. No Catch2.
  template <class Req>
  p::message call(const Req& req, int fd = -1) {
    const std::uint64_t id = next_call_++;
    if (const error_code ec = send(id, req, fd))
      throw std::runtime_error(std::string("sending ") + std::string(p::name(Req::type)) + ": " + ec.message());
    auto [rec, f] = read_frame();
    if (rec)
      throw std::runtime_error(std::string("reading the reply to ") + std::string(p::name(Req::type)) + ": " +
                               rec.message());
    if (f.header.call_id != id) throw std::runtime_error("a reply with another call id");
    auto m = p::decode_message(f);
    if (!m) throw std::runtime_error("an undecodable reply: " + m.error().reason);
    return std::move(*m);
  }

  /// call() that must succeed with Req's response; throws otherwise. No Catch2.
  template <class Req>
  typename Req::response_type expect(const Req& req, int fd = -1) {
    p::message m = call(req, fd);
    if (auto* e = std::get_if<p::error_response>(&m))
      throw std::runtime_error(std::string(p::name(Req::type)) + " refused: " + e->message);
    return std::get<typename Req::response_type>(m);
  }

  /// call() that must succeed with Req's response (Catch2).
  template <class Req>
  typename Req::response_type ok(const Req& req, int fd = -1) {
    p::message m = call(req, fd);
    if (auto* e = std::get_if<p::error_response>(&m)) FAIL(p::name(Req::type) << " refused: " << e->message);
    REQUIRE(std::holds_alternative<typename Req::response_type>(m));
    return std::get<typename Req::response_type>(m);
  }

  /// call() that must be refused; returns the error (Catch2).
  template <class Req>
  p::error_response refused(const Req& req, int fd = -1) {
    p::message m = call(req, fd);
    REQUIRE(std::holds_alternative<p::error_response>(m));
    return std::get<p::error_response>(m);
  }

  p::register_kv_response register_region(const engine_region& r, std::uint16_t rank = 0, std::uint16_t ws = 1) {
    return expect(r.registration(rank, ws), r.region.fd());
  }

  nlohmann::json status() { return nlohmann::json::parse(expect(p::status_request{}).json); }

  std::uint64_t ping() { return expect(p::ping_request{42}).boot_token; }

  template <class Req>
  error_code send(std::uint64_t call_id, const Req& req, int fd = -1) {
    return run_sync(io_, [&]() -> asio::awaitable<error_code> {
      if (fd >= 0) {
        auto [ec] = co_await conn_.async_send(call_id, req, fd, asio::as_tuple(asio::use_awaitable));
        co_return ec;
      }
      auto [ec] = co_await conn_.async_send(call_id, req, asio::as_tuple(asio::use_awaitable));
      co_return ec;
    }());
  }

  /// Writes raw bytes (any frame, or garbage).
  error_code send_bytes(std::vector<std::byte> bytes, int fd = -1) {
    return run_sync(io_, [&]() -> asio::awaitable<error_code> {
      auto [ec] = co_await conn_.async_write_frame(std::move(bytes), fd, asio::as_tuple(asio::use_awaitable));
      co_return ec;
    }());
  }

  /// Reads one frame (or the error that ended the stream); throws std::runtime_error when
  /// nothing comes before server_deadline. No Catch2.
  std::tuple<error_code, p::frame> read_frame() {
    auto timed_out = std::make_shared<bool>(false);
    asio::steady_timer timer(io_, server_deadline);
    timer.async_wait([timed_out, c = &conn_](error_code ec) {
      if (ec) return;
      *timed_out = true;
      c->close();
    });
    auto r = run_sync(io_, [&]() -> asio::awaitable<std::tuple<error_code, p::frame>> {
      auto [ec, f] = co_await conn_.async_read_frame(asio::as_tuple(asio::use_awaitable));
      co_return std::tuple<error_code, p::frame>(ec, std::move(f));
    }());
    timer.cancel();
    if (*timed_out) throw std::runtime_error("no frame from the server within the deadline");
    return r;
  }

  /// Reads until the server closes the connection; returns the frames that came first and
  /// the error that ended the stream (eof, or connection_reset when the server closed with
  /// our bytes unread). No Catch2.
  std::pair<std::vector<p::message>, error_code> read_until_closed() {
    std::vector<p::message> got;
    for (;;) {
      auto [ec, f] = read_frame();
      if (ec) return {std::move(got), ec};
      auto m = p::decode_message(f);
      if (!m) throw std::runtime_error("an undecodable frame: " + m.error().reason);
      got.push_back(std::move(*m));
    }
  }

  /// Half-closes: the server reads EOF after what was sent.
  void shutdown_write() { ::shutdown(conn_.socket().native_handle(), SHUT_WR); }

  p::connection& connection() noexcept { return conn_; }

 private:
  static p::connection connect(asio::io_context& io, const std::string& path) {
    auto s = p::connect_unix(io.get_executor(), path);
    if (!s) throw std::runtime_error("connect " + path + ": " + s.error().message());
    return p::connection(std::move(*s));
  }

  asio::io_context io_;
  p::connection conn_;
  std::uint64_t next_call_ = 1;
};

/// Reads from `c` until the server closes the connection: true when it ended with EOF (or a
/// reset: the server closed with our bytes unread). No Catch2.
inline bool closed_or_reset(raw_client& c) {
  auto [got, ec] = c.read_until_closed();
  return ec == asio::error::eof || ec == asio::error::connection_reset;
}

/// Asks `c` for the status until pred(status) holds; fails after server_deadline. (The
/// reaping it waits for happens on the server's thread; each status is a round trip.)
template <class Pred>
nlohmann::json wait_for_status(raw_client& c, Pred pred) {
  const auto deadline = std::chrono::steady_clock::now() + server_deadline;
  for (;;) {
    nlohmann::json s = c.status();
    if (pred(s)) return s;
    REQUIRE(std::chrono::steady_clock::now() < deadline);
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

/// A kvtier-server process (examples/common/kvtier_program/process.hpp: posix_spawn, stdout and stderr in
/// files of `dir`) with Catch2 checks and the tests' deadline; killed when destroyed.
class server_process {
 public:
  server_process(const std::string& binary, std::vector<std::string> args, const std::filesystem::path& dir,
                 const std::string& tag = "server")
      : proc_(binary, std::move(args), dir, tag) {}

  /// Waits until `socket_path` accepts connections (the server is up). Fails the test when
  /// the process exits first or the deadline passes.
  void wait_listening(const std::string& socket_path) {
    asio::io_context io;
    const auto deadline = std::chrono::steady_clock::now() + server_deadline;
    for (;;) {
      if (auto s = p::connect_unix(io.get_executor(), socket_path)) return;
      if (!proc_.running())
        FAIL("kvtier-server exited before listening: " << describe(proc_.wait_exit({}).value_or(0)) << "\n"
                                                       << output());
      if (std::chrono::steady_clock::now() > deadline) FAIL("kvtier-server did not listen in time\n" << output());
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }

  /// Sends `sig` and waits for the exit; returns the wait status.
  int stop(int sig = SIGTERM) {
    REQUIRE(proc_.pid() > 0);
    proc_.signal(sig);
    return wait_exit();
  }

  /// Waits for the process to exit (fails after the deadline); returns the wait status.
  int wait_exit() {
    const auto st = proc_.wait_exit(std::chrono::duration_cast<std::chrono::milliseconds>(server_deadline));
    if (!st) FAIL("kvtier-server did not exit in time\n" << output());
    return *st;
  }

  /// The wait status when the process has exited, else nullopt (does not wait).
  std::optional<int> try_exit() {
    if (proc_.running()) return std::nullopt;
    return proc_.wait_exit({});
  }

  [[nodiscard]] pid_t pid() const noexcept { return proc_.pid(); }

  [[nodiscard]] std::string output() const { return "stdout:\n" + stdout_text() + "stderr:\n" + stderr_text(); }
  [[nodiscard]] std::string stdout_text() const { return proc_.stdout_text(); }
  [[nodiscard]] std::string stderr_text() const { return proc_.stderr_text(); }

  static std::string describe(int st) { return examples::child_process::describe(st); }

 private:
  examples::child_process proc_;
};

/// A store of `blocks` (with their current generations) under `hashes`.
inline p::store_request store_req(const engine_region& r, std::vector<hash128> hashes,
                                  std::vector<std::uint32_t> blocks, std::uint16_t rank = 0, std::string key = "req-1",
                                  std::string salt = {}) {
  p::store_request s;
  s.request_key = std::move(key);
  s.cache_salt = std::move(salt);
  s.rank = rank;
  s.chunk_hashes = std::move(hashes);
  s.block_generations = r.generations(blocks);
  s.block_ids = std::move(blocks);
  return s;
}

/// A retrieve of `hashes` into `blocks`.
inline p::retrieve_request retrieve_req(std::vector<hash128> hashes, std::vector<std::uint32_t> blocks,
                                        std::uint32_t skip = 0, std::uint16_t rank = 0, std::string key = "req-1",
                                        std::string salt = {}) {
  p::retrieve_request r;
  r.request_key = std::move(key);
  r.cache_salt = std::move(salt);
  r.rank = rank;
  r.chunk_hashes = std::move(hashes);
  r.block_ids = std::move(blocks);
  r.skip_tokens = skip;
  return r;
}

/// lookup + query_prefetch until done (Catch2; fails after server_deadline).
inline p::query_prefetch_response lookup_done(raw_client& c, std::uint64_t model_id, const std::vector<hash128>& hashes,
                                              std::uint16_t ws = 1, const std::string& key = "req-1",
                                              const std::string& salt = {}) {
  c.ok(p::lookup_request{key, model_id, ws, hashes, salt});
  const auto deadline = std::chrono::steady_clock::now() + server_deadline;
  for (;;) {
    auto q = c.ok(p::query_prefetch_request{key});
    if (q.state == p::prefetch_state::done) return q;
    REQUIRE(q.state == p::prefetch_state::pending);
    REQUIRE(std::chrono::steady_clock::now() < deadline);
  }
}

/// Stores `chunks` chunks of prompt `seed` from blocks `first`.. of `r` (filled with a
/// pattern of `seed` first), under the request salt `salt`, and waits until the server's
/// store pipeline is idle, i.e. the chunks went through to every L2 backend (Catch2). Returns
/// the chunk hashes.
inline std::vector<hash128> store_through(raw_client& c, const engine_region& r, std::uint32_t seed,
                                          std::size_t chunks, const std::string& salt = {},
                                          std::uint32_t first = 0) {
  const auto hashes = chunk_hashes(seed, chunks);
  const auto blocks = block_range(first, chunks * blocks_per_chunk);
  r.fill_blocks(blocks, seed);
  const auto st = c.ok(store_req(r, hashes, blocks, 0, "store-" + std::to_string(seed), salt));
  REQUIRE(st.stored == chunks);
  wait_for_status(
      c, [](const nlohmann::json& s) { return s["store"]["pending_keys"] == 0 && s["store"]["inflight_tasks"] == 0; });
  return hashes;
}

/// Retrieves `hashes` into blocks `first`.. of `r` and checks every token equals the one
/// stored from blocks 0.. of `source` (Catch2).
inline void retrieve_and_compare(raw_client& c, const engine_region& r, const std::vector<hash128>& hashes,
                                 std::uint32_t first, const engine_region& source, const std::string& key) {
  const auto blocks = block_range(first, hashes.size() * blocks_per_chunk);
  for (auto b : blocks) r.zero_block(b, 0xEE);
  REQUIRE(c.ok(retrieve_req(hashes, blocks, 0, 0, key)).retrieved_chunks == hashes.size());
  for (std::uint32_t i = 0; i < blocks.size(); ++i)
    for (std::uint32_t t = 0; t < test_block_size; ++t) REQUIRE(r.same_token(blocks[i], i, t, &source));
}

/// The value of the series `name` (with its labels, exactly as exposed) in a Prometheus
/// exposition; nullopt when absent.
inline std::optional<double> metric_value(const std::string& exposition, const std::string& series) {
  std::istringstream in(exposition);
  std::string line;
  while (std::getline(in, line))
    if (line.starts_with(series + " ")) return std::stod(line.substr(series.size() + 1));
  return std::nullopt;
}

/// The permission bits of `p` itself (lstat: a symlink is not followed).
inline ::mode_t mode_of(const std::filesystem::path& p) {
  struct ::stat st {};
  REQUIRE(::lstat(p.c_str(), &st) == 0);
  return st.st_mode & 07777;
}

}  // namespace kvtier::test
