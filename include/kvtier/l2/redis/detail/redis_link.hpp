#pragma once
// redis_link: one TCP connection to one Redis node, pipelined: requests written in order,
// replies matched in order; generic replies parsed by hiredis, a GET's object payload read
// from the socket straight into the caller's buffer once its header was checked; abandon()
// for a request whose operation gives up. docs/l2-redis.md, "One connection", holds the
// rules, the buffer guarantee, threads and lifetime.

#include <kvtier/config.hpp>
#include <kvtier/core/chunk_key.hpp>
#include <kvtier/error.hpp>
#include <kvtier/l2/object_format.hpp>
#include <kvtier/l2/redis/detail/redis_request.hpp>
#include <kvtier/l2/redis/detail/redis_wire.hpp>

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/as_tuple.hpp>
#include <boost/asio/awaitable.hpp>
#include <boost/asio/buffer.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/connect.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/error.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/write.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace l2 {
namespace detail {

class redis_link final : public std::enable_shared_from_this<redis_link>, private redis_reply_sink {
 public:
  enum class state : std::uint8_t { idle, connecting, ready, closed };

  redis_link(boost::asio::any_io_executor ex, redis_link_options o, redis_link_owner* owner)
      : ex_(std::move(ex)), options_(std::move(o)), owner_(owner), socket_(ex_), connect_timer_(ex_) {
    rbuf_.resize(read_chunk);
  }

  redis_link(const redis_link&) = delete;
  redis_link& operator=(const redis_link&) = delete;

  [[nodiscard]] state current() const noexcept { return state_; }
  [[nodiscard]] bool up() const noexcept { return state_ == state::ready && handshake_left_ == 0; }
  [[nodiscard]] std::size_t pending() const noexcept { return fifo_.size(); }
  /// Reply bytes expected from everything submitted and not answered yet (for choosing the
  /// least loaded connection).
  [[nodiscard]] std::size_t load() const noexcept { return inflight_bytes_ + queued_bytes_; }
  [[nodiscard]] const redis_endpoint& endpoint() const noexcept { return options_.endpoint; }

  /// Connects (in the background); requests may be submitted at once, they are written once
  /// connected. Call on the link's executor.
  void start() {
    if (state_ != state::idle) return;
    state_ = state::connecting;
    boost::asio::co_spawn(ex_, connect_and_read(shared_from_this()), boost::asio::detached);
  }

  /// Queues a request (written as soon as the connection allows). Returns it, for abandon().
  redis_request* submit(std::unique_ptr<redis_request> r) {
    redis_request* p = r.get();
    queued_bytes_ += r->reply_bytes;
    fifo_.push_back(std::move(r));
    if (state_ == state::ready) start_write();
    return p;
  }

  /// Detaches a request from its sink (docs/l2-redis.md, "One connection"). May close the connection.
  void abandon(redis_request* r) {
    auto it = std::find_if(fifo_.begin(), fifo_.end(), [r](const auto& p) { return p.get() == r; });
    if (it == fifo_.end()) return;
    r->sink = nullptr;
    if (r->state == redis_request::io::queued) {
      queued_bytes_ -= r->reply_bytes;
      fifo_.erase(it);
      return;
    }
    const bool writing_caller_memory = r->state == redis_request::io::writing && !r->payload.empty();
    if (writing_caller_memory || r->reading_dst) {
      close(make_error_code(errc::timeout), "an operation gave up while its buffer was in transfer");
      return;
    }
    r->dst = {};  // an object reply not yet begun is discarded when it comes
  }

  /// Closes the connection: every request still waiting is failed (status failed), the owner
  /// is told once. Safe to call in any state.
  void close(error_code ec, std::string_view why) {
    if (state_ == state::closed) return;
    const bool was_up = up();
    state_ = state::closed;
    boost::system::error_code ignored;
    socket_.close(ignored);
    connect_timer_.cancel();
    auto pending = std::move(fifo_);
    fifo_.clear();
    n_written_ = n_writing_ = 0;
    inflight_bytes_ = queued_bytes_ = 0;
    for (auto& r : pending) {
      if (r->sink == nullptr || r->sink == this) continue;
      redis_reply_event e;
      e.st = redis_reply_event::status::failed;
      e.text = std::string(why);
      r->sink->on_reply(r->tag, std::move(e));
    }
    if (owner_ != nullptr) owner_->on_link_down(*this, ec, why, was_up, handshake_failed_);
  }

  /// No more owner callbacks (the owner is being destroyed); the connection stays as it is
  /// and closes with the link.
  void forget_owner() noexcept { owner_ = nullptr; }

  /// The owner goes away: no more callbacks; the connection is closed.
  void detach_owner() {
    owner_ = nullptr;
    close(make_error_code(errc::shutting_down), "shutting down");
  }

 private:
  static constexpr std::size_t read_chunk = 256 * 1024;
  static constexpr std::size_t max_line = 64 * 1024;

  // --- connect -------------------------------------------------------------------------
  static boost::asio::awaitable<void> connect_and_read(std::shared_ptr<redis_link> self) {
    namespace asio = boost::asio;
    using asio::ip::tcp;
    auto& s = *self;
    s.resolver_.emplace(s.ex_);
    // The timer closes what is in progress; it captures only the link (never this frame),
    // and does nothing once the link left the connecting state.
    s.connect_timer_.expires_after(s.options_.connect_timeout);
    s.connect_timer_.async_wait([self](boost::system::error_code ec) {
      if (ec || self->state_ != state::connecting) return;
      self->connect_timed_out_ = true;
      if (self->resolver_) self->resolver_->cancel();
      boost::system::error_code ignored;
      self->socket_.close(ignored);
    });
    auto [rec, results] = co_await s.resolver_->async_resolve(
        s.options_.endpoint.host, std::to_string(s.options_.endpoint.port), asio::as_tuple(asio::use_awaitable));
    if (s.state_ != state::connecting) co_return;
    if (rec || s.connect_timed_out_) {
      s.connect_timer_.cancel();
      s.close(s.connect_timed_out_ ? make_error_code(errc::timeout) : rec,
              s.connect_timed_out_ ? "connect timed out (resolving)" : "cannot resolve " + s.options_.endpoint.host);
      co_return;
    }
    auto [cec, ep] = co_await asio::async_connect(s.socket_, results, asio::as_tuple(asio::use_awaitable));
    (void)ep;
    s.connect_timer_.cancel();
    if (s.state_ != state::connecting) co_return;
    if (cec || s.connect_timed_out_) {
      s.close(s.connect_timed_out_ ? make_error_code(errc::timeout) : cec,
              s.connect_timed_out_ ? std::string("connect timed out") : "connect: " + cec.message());
      co_return;
    }
    boost::system::error_code ignored;
    s.socket_.set_option(tcp::no_delay(true), ignored);
    s.state_ = state::ready;
    s.queue_handshake();
    if (s.handshake_left_ == 0 && s.owner_ != nullptr) s.owner_->on_link_up(s);
    s.start_write();
    co_await s.read_loop(self);
  }

  // AUTH and SELECT go first, ahead of anything queued while connecting.
  void queue_handshake() {
    std::vector<std::unique_ptr<redis_request>> hs;
    if (!options_.password.empty()) {
      auto r = std::make_unique<redis_request>();
      r->head = options_.username.empty() ? redis_format({"AUTH", options_.password})
                                          : redis_format({"AUTH", options_.username, options_.password});
      hs.push_back(std::move(r));
    }
    if (options_.database != 0) {
      auto r = std::make_unique<redis_request>();
      r->head = redis_format({"SELECT", std::to_string(options_.database)});
      hs.push_back(std::move(r));
    }
    handshake_left_ = hs.size();
    for (auto it = hs.rbegin(); it != hs.rend(); ++it) {
      (*it)->sink = this;
      fifo_.push_front(std::move(*it));
    }
  }

  void on_reply(std::size_t, redis_reply_event&& e) override {  // handshake replies
    if (e.st != redis_reply_event::status::reply) {
      handshake_failed_ = true;
      close(make_error_code(errc::backend_unavailable), "handshake refused: " + e.text);
      return;
    }
    if (--handshake_left_ == 0 && owner_ != nullptr) owner_->on_link_up(*this);
  }

  // --- write ---------------------------------------------------------------------------
  void start_write() {
    if (writing_ || state_ != state::ready) return;
    write_bufs_.clear();
    std::size_t k = 0;
    for (std::size_t i = n_written_ + n_writing_; i < fifo_.size(); ++i, ++k) {
      redis_request& r = *fifo_[i];
      if (r.reply_bytes > 0 && inflight_bytes_ > 0 && inflight_bytes_ + r.reply_bytes > options_.max_inflight_bytes)
        break;  // written when replies come back (deliver)
      inflight_bytes_ += r.reply_bytes;
      queued_bytes_ -= r.reply_bytes;
      r.state = redis_request::io::writing;
      write_bufs_.emplace_back(r.head.data(), r.head.size());
      if (r.has_object_header) write_bufs_.emplace_back(r.object_header.data(), r.object_header.size());
      if (!r.payload.empty()) write_bufs_.emplace_back(r.payload.data(), r.payload.size());
      if (!r.tail.empty()) write_bufs_.emplace_back(r.tail.data(), r.tail.size());
    }
    if (k == 0) return;
    n_writing_ += k;
    writing_ = true;
    boost::asio::async_write(
        socket_, write_bufs_,
        [self = shared_from_this()](boost::system::error_code ec, std::size_t) { self->on_written(ec); });
  }

  void on_written(boost::system::error_code ec) {
    writing_ = false;
    if (state_ != state::ready) return;
    if (ec) {
      close(ec, "write: " + ec.message());
      return;
    }
    // Replies may already have popped some of the requests of this write (their bytes were
    // all sent, or Redis could not have answered): the rest start at n_written_.
    for (std::size_t i = n_written_; i < n_written_ + n_writing_; ++i) fifo_[i]->state = redis_request::io::written;
    n_written_ += n_writing_;
    n_writing_ = 0;
    start_write();
  }

  // --- read ----------------------------------------------------------------------------
  enum class step : std::uint8_t { need_more, direct, fatal, delivered };

  boost::asio::awaitable<void> read_loop(std::shared_ptr<redis_link> self) {
    namespace asio = boost::asio;
    while (state_ == state::ready) {
      const step s = parse();
      if (state_ != state::ready) co_return;  // a sink closed the link
      if (s == step::fatal) {
        close(make_error_code(errc::protocol_error), "protocol error: " + fatal_);
        co_return;
      }
      if (s == step::direct) {
        redis_request& r = *fifo_.front();
        const auto want = asio::buffer(r.dst.data() + obj_.done, r.dst.size() - obj_.done);
        r.reading_dst = true;
        auto [ec, n] = co_await asio::async_read(socket_, want, asio::as_tuple(asio::use_awaitable));
        if (state_ != state::ready) co_return;  // closed (abandoned mid-read): r is gone
        r.reading_dst = false;
        if (ec) {
          close(ec, ec == asio::error::eof ? std::string("connection closed by the server") : "read: " + ec.message());
          co_return;
        }
        obj_.done += n;
        continue;
      }
      // need_more: compact, then read into the buffer.
      if (rbegin_ > 0 && rbegin_ == rend_) rbegin_ = rend_ = 0;
      if (rend_ == rbuf_.size()) {
        if (rbegin_ > 0) {
          std::memmove(rbuf_.data(), rbuf_.data() + rbegin_, rend_ - rbegin_);
          rend_ -= rbegin_;
          rbegin_ = 0;
        } else {
          rbuf_.resize(rbuf_.size() * 2);  // a line longer than the buffer (bounded by max_line)
        }
      }
      auto [ec, n] = co_await socket_.async_read_some(asio::buffer(rbuf_.data() + rend_, rbuf_.size() - rend_),
                                                      asio::as_tuple(asio::use_awaitable));
      if (state_ != state::ready) co_return;
      if (ec) {
        close(ec, ec == asio::error::eof ? std::string("connection closed by the server") : "read: " + ec.message());
        co_return;
      }
      rend_ += n;
    }
    (void)self;
  }

  [[nodiscard]] std::string_view buffered() const noexcept { return {rbuf_.data() + rbegin_, rend_ - rbegin_}; }

  // Takes one CRLF-terminated line out of the buffer (without the CRLF).
  bool take_line(std::string& line) {
    const auto b = buffered();
    const auto eol = b.find("\r\n");
    if (eol == std::string_view::npos) {
      if (b.size() > max_line) fatal_ = "reply line too long";
      return false;
    }
    line.assign(b.data(), eol);
    rbegin_ += eol + 2;
    return true;
  }

  // Gives hiredis's unconsumed bytes back to the front of our buffer.
  void reclaim_from_reader() {
    const auto u = reader_.unconsumed();
    if (u.empty()) {
      if (!reader_.empty()) reader_.reset();
      return;
    }
    std::string keep(u);
    reader_.reset();
    const std::string_view rest = buffered();
    std::string merged = keep + std::string(rest);
    if (rbuf_.size() < merged.size()) rbuf_.resize(merged.size());
    std::memcpy(rbuf_.data(), merged.data(), merged.size());
    rbegin_ = 0;
    rend_ = merged.size();
  }

  void deliver(redis_reply_event&& e) {
    std::unique_ptr<redis_request> r = std::move(fifo_.front());
    fifo_.pop_front();
    if (n_written_ > 0)
      --n_written_;
    else if (n_writing_ > 0)
      --n_writing_;
    inflight_bytes_ -= r->reply_bytes;
    obj_ = {};                              // (only meaningful after an object reply)
    if (r->reply_bytes > 0) start_write();  // room for what waited behind the budget
    if (r->sink != nullptr) r->sink->on_reply(r->tag, std::move(e));
  }

  // Parses and delivers every complete reply in the buffer.
  step parse() {
    fatal_.clear();
    while (state_ == state::ready) {
      if (fifo_.empty() || fifo_.front()->state == redis_request::io::queued) {
        if (!buffered().empty() || !reader_.unconsumed().empty()) {
          fatal_ = "a reply without a request";
          return step::fatal;
        }
        return step::need_more;
      }
      redis_request& r = *fifo_.front();
      if (r.asking) {  // ASKING's "+OK" (or an error, which the command's reply will repeat)
        reclaim_from_reader();
        std::string line;
        if (!take_line(line)) return fatal_.empty() ? step::need_more : step::fatal;
        if (line.empty() || (line[0] != '+' && line[0] != '-')) {
          fatal_ = "unexpected reply to ASKING";
          return step::fatal;
        }
        r.asking = false;
        continue;
      }
      if (r.kind == redis_reply_kind::generic) {
        const auto b = buffered();
        if (!reader_.feed(b.data(), b.size())) {
          fatal_ = std::string(reader_.error());
          return step::fatal;
        }
        rbegin_ = rend_ = 0;
        redis_reply_ptr reply;
        const auto st = reader_.next(reply);
        if (st == redis_reader::status::error) {
          fatal_ = std::string(reader_.error());
          return step::fatal;
        }
        if (st == redis_reader::status::incomplete) return step::need_more;
        redis_reply_event e;
        if (reply->type == REDIS_REPLY_ERROR) {
          e.st = redis_reply_event::status::error;
          e.text = std::string(redis_reply_text(*reply));
        } else {
          e.st = redis_reply_event::status::reply;
          e.reply = std::move(reply);
        }
        deliver(std::move(e));
        continue;
      }
      reclaim_from_reader();
      const step s = parse_object(r);  // r may be gone when it answers delivered
      if (!fatal_.empty()) return step::fatal;
      if (s != step::delivered) return s;
    }
    return step::need_more;
  }

  enum class object_phase : std::uint8_t { line, header, payload, discard, crlf };
  struct object_progress {
    object_phase phase = object_phase::line;
    std::uint64_t value_bytes = 0;
    std::size_t header_got = 0;
    std::array<std::byte, object_header_bytes> header{};
    std::uint64_t payload_checksum = 0;
    std::size_t done = 0;  ///< payload bytes landed in dst
    std::uint64_t discard_left = 0;
    redis_reply_event::status verdict = redis_reply_event::status::object_corrupt;
  };

  // Advances the object reply at the head; `delivered` once it went to its sink. Each phase
  // answers a step to return, or nullopt when it moved to the next phase.
  step parse_object(redis_request& r) {
    for (;;) {
      std::optional<step> s;
      switch (obj_.phase) {
        case object_phase::line:
          s = parse_object_line();
          break;
        case object_phase::header:
          s = parse_object_header(r);
          break;
        case object_phase::payload:
          s = take_object_payload(r);
          break;
        case object_phase::discard:
          s = discard_object_bytes();
          break;
        case object_phase::crlf:
          return finish_object(r);
      }
      if (s) return *s;
    }
  }

  // The bulk string's length line: an error, nil, or the value's length.
  std::optional<step> parse_object_line() {
    using status = redis_reply_event::status;
    std::string line;
    if (!take_line(line)) return step::need_more;
    if (!line.empty() && line[0] == '-') {
      redis_reply_event e;
      e.st = status::error;
      e.text = line.substr(1);
      deliver(std::move(e));
      return step::delivered;
    }
    if (line == "$-1") {
      redis_reply_event e;
      e.st = status::object_nil;
      deliver(std::move(e));
      return step::delivered;
    }
    const auto n =
        line.size() > 1 && line[0] == '$' ? redis_parse_uint(std::string_view(line).substr(1)) : std::nullopt;
    if (!n) {
      fatal_ = "unexpected reply to GET: " + line.substr(0, 32);
      return step::fatal;
    }
    obj_.value_bytes = *n;
    if (*n < object_header_bytes) {
      obj_.verdict = status::object_corrupt;
      obj_.discard_left = *n;
      obj_.phase = object_phase::discard;
    } else {
      obj_.phase = object_phase::header;
    }
    return std::nullopt;
  }

  // The object's header: its payload goes to r.dst when it names r's key and fits, else is discarded.
  std::optional<step> parse_object_header(const redis_request& r) {
    using status = redis_reply_event::status;
    const auto b = buffered();
    const std::size_t take = std::min(b.size(), object_header_bytes - obj_.header_got);
    std::memcpy(obj_.header.data() + obj_.header_got, b.data(), take);
    obj_.header_got += take;
    rbegin_ += take;
    if (obj_.header_got < object_header_bytes) return step::need_more;
    const std::uint64_t payload = obj_.value_bytes - object_header_bytes;
    const auto h = decode_header(obj_.header);
    if (!h || h->key != r.expect || h->payload_bytes != payload) {
      obj_.verdict = status::object_corrupt;  // torn, foreign or another key's object
    } else if (r.dst.empty() || payload != r.dst.size()) {
      obj_.verdict = status::object_size;  // (or abandoned: nobody reads the verdict)
    } else {
      obj_.verdict = status::object_ok;
      obj_.payload_checksum = h->payload_checksum;
      obj_.phase = object_phase::payload;
      return std::nullopt;
    }
    obj_.discard_left = payload;
    obj_.phase = object_phase::discard;
    return std::nullopt;
  }

  // The payload, copied into r.dst as it arrives (`direct`: the rest can be read straight there).
  std::optional<step> take_object_payload(const redis_request& r) {
    if (r.dst.empty()) {  // abandoned between two reads: drop the rest
      obj_.discard_left = obj_.value_bytes - object_header_bytes - obj_.done;
      obj_.phase = object_phase::discard;
      return std::nullopt;
    }
    const auto b = buffered();
    const std::size_t take = std::min(b.size(), r.dst.size() - obj_.done);
    std::memcpy(r.dst.data() + obj_.done, b.data(), take);
    obj_.done += take;
    rbegin_ += take;
    if (obj_.done < r.dst.size()) return step::direct;
    obj_.phase = object_phase::crlf;
    return std::nullopt;
  }

  std::optional<step> discard_object_bytes() {
    const auto b = buffered();
    const std::size_t take = static_cast<std::size_t>(std::min<std::uint64_t>(b.size(), obj_.discard_left));
    obj_.discard_left -= take;
    rbegin_ += take;
    if (obj_.discard_left > 0) return step::need_more;
    obj_.phase = object_phase::crlf;
    return std::nullopt;
  }

  // The CRLF after the value; delivers the verdict (the payload's checksum checked last).
  step finish_object(const redis_request& r) {
    using status = redis_reply_event::status;
    const auto b = buffered();
    if (b.size() < 2) return step::need_more;
    if (b[0] != '\r' || b[1] != '\n') {
      fatal_ = "bulk reply not terminated by CRLF";
      return step::fatal;
    }
    rbegin_ += 2;
    redis_reply_event e;
    e.st = obj_.verdict;
    if (e.st == status::object_ok && payload_checksum(r.dst) != obj_.payload_checksum) e.st = status::object_corrupt;
    deliver(std::move(e));
    return step::delivered;
  }

  boost::asio::any_io_executor ex_;
  redis_link_options options_;
  redis_link_owner* owner_;
  boost::asio::ip::tcp::socket socket_;
  boost::asio::steady_timer connect_timer_;
  std::optional<boost::asio::ip::tcp::resolver> resolver_;
  bool connect_timed_out_ = false;
  state state_ = state::idle;
  std::size_t handshake_left_ = 0;
  bool handshake_failed_ = false;

  // FIFO of requests: [written...][writing...][queued...]; replies pop the front.
  std::deque<std::unique_ptr<redis_request>> fifo_;
  std::size_t n_written_ = 0;
  std::size_t n_writing_ = 0;
  bool writing_ = false;
  std::vector<boost::asio::const_buffer> write_bufs_;
  std::size_t inflight_bytes_ = 0;  ///< reply_bytes of written (or writing) requests
  std::size_t queued_bytes_ = 0;    ///< reply_bytes of queued requests

  std::vector<char> rbuf_;
  std::size_t rbegin_ = 0;
  std::size_t rend_ = 0;
  redis_reader reader_;
  object_progress obj_;
  std::string fatal_;
};

}  // namespace detail
}  // namespace l2
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
