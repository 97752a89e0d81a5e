#pragma once
// io_engine: the file I/O engine of a process, chosen at run time. Holds a uring_context
// where io_uring works, else a pread_pool (io/probe.hpp decides; KVTIER_IO_BACKEND
// overrides), and forwards every file_io operation to it. The engine lives inside the
// object (a std::variant), and forwarding passes the caller's handler through unchanged,
// so an op costs one branch more than calling the engine directly and allocates nothing
// of its own.
//
// It says what it chose: one log line (info for io_uring or a forced choice, warn for a
// fallback), kind(), and its shared io_stats (shared_stats(): they outlive the engine), from
// which telemetry::collect_io makes the kvtier_io_* metrics of docs/io.md.
//
// Threading and contracts are those of the engine it holds (uring_context.hpp: one
// executor, cancellation contract; pread_pool.hpp).

#include <kvtier/config.hpp>
#include <kvtier/error.hpp>
#include <kvtier/io/concepts.hpp>
#include <kvtier/io/detail/file_ops.hpp>
#include <kvtier/io/pread_pool.hpp>
#include <kvtier/io/probe.hpp>
#include <kvtier/io/stats.hpp>
#include <kvtier/io/uring_context.hpp>
#include <kvtier/telemetry/logger.hpp>

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/async_result.hpp>

#include <exception>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <variant>

namespace kvtier::inline KVTIER_ABI_TAG::io {

struct io_engine_options {
  /// automatic: KVTIER_IO_BACKEND, else the probe. uring: fail where io_uring is refused.
  engine_choice engine = engine_choice::automatic;
  uring_options uring{};
  pread_pool_options pool{};
};

class io_engine {
 private:
  // Defined first: g++ deduces their return type only once it has seen their bodies.
  template <class F>
  decltype(auto) visit(F&& f) {
    if (auto* u = std::get_if<uring_context>(&engine_)) return f(*u);
    return f(std::get<pread_pool>(engine_));
  }
  template <class F>
  decltype(auto) visit(F&& f) const {
    if (const auto* u = std::get_if<uring_context>(&engine_)) return f(*u);
    return f(std::get<pread_pool>(engine_));
  }

 public:
  using executor_type = boost::asio::any_io_executor;

  /// Chooses and starts the engine. Throws std::runtime_error when io_uring is required but
  /// refused, std::invalid_argument on a bad KVTIER_IO_BACKEND or bad options.
  explicit io_engine(executor_type ex, io_engine_options opts = {}, telemetry::logger* log = nullptr)
      : selection_(select_engine(opts.engine)) {
    if (selection_.kind == engine_kind::uring) {
      try {
        engine_.emplace<uring_context>(ex, opts.uring, log);
      } catch (const std::exception& e) {
        if (selection_.requested == engine_choice::uring) throw;
        selection_.kind = engine_kind::pread;
        selection_.reason = std::string("io_uring set-up failed after a good probe: ") + e.what();
      }
    }
    if (selection_.kind == engine_kind::pread) engine_.emplace<pread_pool>(ex, opts.pool, log);
    report(log, opts);
  }

  io_engine(const io_engine&) = delete;
  io_engine& operator=(const io_engine&) = delete;

  [[nodiscard]] executor_type get_executor() const noexcept {
    return visit([](const auto& e) { return e.get_executor(); });
  }
  [[nodiscard]] engine_kind kind() const noexcept { return selection_.kind; }
  /// What was asked for, what the probe said, and why this engine runs.
  [[nodiscard]] const engine_selection& selection() const noexcept { return selection_; }

  /// The engine itself, for what only it offers (nullptr when the other one runs).
  [[nodiscard]] uring_context* uring() noexcept { return std::get_if<uring_context>(&engine_); }
  [[nodiscard]] pread_pool* pool() noexcept { return std::get_if<pread_pool>(&engine_); }

  // --- file_io: see concepts.hpp ----------------------------------------------------------

  template <class Token>
  auto async_read(int fd, std::span<std::byte> buffer, std::uint64_t offset, Token&& token) {
    return forward<detail::returns_size::signature>(
        token, [](auto& e, auto&& h, int f, std::span<std::byte> b, std::uint64_t o) { e.async_read(f, b, o, std::move(h)); },
        fd, buffer, offset);
  }
  template <class Token>
  auto async_write(int fd, std::span<const std::byte> buffer, std::uint64_t offset, Token&& token) {
    return forward<detail::returns_size::signature>(
        token,
        [](auto& e, auto&& h, int f, std::span<const std::byte> b, std::uint64_t o) { e.async_write(f, b, o, std::move(h)); },
        fd, buffer, offset);
  }
  template <class Token>
  auto async_readv(int fd, std::span<const ::iovec> iov, std::uint64_t offset, Token&& token) {
    return forward<detail::returns_size::signature>(
        token, [](auto& e, auto&& h, int f, std::span<const ::iovec> v, std::uint64_t o) { e.async_readv(f, v, o, std::move(h)); },
        fd, iov, offset);
  }
  template <class Token>
  auto async_writev(int fd, std::span<const ::iovec> iov, std::uint64_t offset, Token&& token) {
    return forward<detail::returns_size::signature>(
        token, [](auto& e, auto&& h, int f, std::span<const ::iovec> v, std::uint64_t o) { e.async_writev(f, v, o, std::move(h)); },
        fd, iov, offset);
  }
  template <class Token>
  auto async_fsync(int fd, Token&& token) {
    return forward<detail::returns_nothing::signature>(
        token, [](auto& e, auto&& h, int f) { e.async_fsync(f, std::move(h)); }, fd);
  }
  template <class Token>
  auto async_fdatasync(int fd, Token&& token) {
    return forward<detail::returns_nothing::signature>(
        token, [](auto& e, auto&& h, int f) { e.async_fdatasync(f, std::move(h)); }, fd);
  }
  template <class Token>
  auto async_openat(int dirfd, const char* path, int flags, ::mode_t mode, Token&& token) {
    return forward<detail::returns_fd::signature>(
        token, [](auto& e, auto&& h, int d, const char* p, int fl, ::mode_t m) { e.async_openat(d, p, fl, m, std::move(h)); },
        dirfd, path, flags, mode);
  }
  template <class Token>
  auto async_close(int fd, Token&& token) {
    return forward<detail::returns_nothing::signature>(
        token, [](auto& e, auto&& h, int f) { e.async_close(f, std::move(h)); }, fd);
  }
  template <class Token>
  auto async_renameat(int old_dirfd, const char* old_path, int new_dirfd, const char* new_path, unsigned flags,
                      Token&& token) {
    return forward<detail::returns_nothing::signature>(
        token,
        [](auto& e, auto&& h, int od, const char* op, int nd, const char* np, unsigned fl) {
          e.async_renameat(od, op, nd, np, fl, std::move(h));
        },
        old_dirfd, old_path, new_dirfd, new_path, flags);
  }
  template <class Token>
  auto async_unlinkat(int dirfd, const char* path, int flags, Token&& token) {
    return forward<detail::returns_nothing::signature>(
        token, [](auto& e, auto&& h, int d, const char* p, int fl) { e.async_unlinkat(d, p, fl, std::move(h)); }, dirfd,
        path, flags);
  }

  error_code register_buffers(std::span<const buffer_region> regions) {
    return visit([&](auto& e) { return e.register_buffers(regions); });
  }
  [[nodiscard]] bool fixed_buffers_active() const noexcept {
    return visit([](const auto& e) { return e.fixed_buffers_active(); });
  }
  void shutdown() {
    visit([](auto& e) { e.shutdown(); });
  }
  [[nodiscard]] std::size_t in_flight() const noexcept {
    return visit([](const auto& e) { return e.in_flight(); });
  }
  [[nodiscard]] const io_stats& stats() const noexcept { return *shared_stats(); }
  [[nodiscard]] std::shared_ptr<const io_stats> shared_stats() const noexcept {
    return visit([](const auto& e) { return e.shared_stats(); });
  }

 private:
  /// Hands the caller's completion handler, unchanged, to the engine in use.
  template <class Call>
  struct initiate_forward {
    io_engine* self;
    Call call;
    using executor_type = io_engine::executor_type;
    [[nodiscard]] executor_type get_executor() const noexcept { return self->get_executor(); }
    template <class Handler, class... Args>
    void operator()(Handler&& handler, Args&&... args) const {
      self->visit([&](auto& e) { call(e, std::forward<Handler>(handler), std::forward<Args>(args)...); });
    }
  };

  template <class Signature, class Token, class Call, class... Args>
  auto forward(Token& token, Call call, Args&&... args) {
    return boost::asio::async_initiate<Token, Signature>(initiate_forward<Call>{this, call}, token,
                                                         std::forward<Args>(args)...);
  }

  void report(telemetry::logger* log, const io_engine_options& opts) const {
    if (log == nullptr) return;
    if (selection_.kind == engine_kind::uring) {
      log->info("file I/O on io_uring ({})", selection_.reason);
    } else if (selection_.requested == engine_choice::pread) {
      log->info("file I/O on the pread thread pool ({} threads): {}", opts.pool.threads, selection_.reason);
    } else {
      log->warn("file I/O falls back to the pread thread pool ({} threads): {}", opts.pool.threads, selection_.reason);
    }
  }

  engine_selection selection_;
  std::variant<std::monostate, uring_context, pread_pool> engine_;
};

static_assert(file_io<io_engine>);

}  // namespace kvtier::inline KVTIER_ABI_TAG::io
