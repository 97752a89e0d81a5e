#pragma once
// any_file_io: the file I/O of a process, chosen at run time: a uring_context where io_uring
// works, else a pread_pool (io/probe.hpp decides; KVTIER_IO_BACKEND overrides). Like
// l2::any_backend, a closed choice behind one type: the implementation lives inside the
// object (a std::variant), and each file_io operation (detail/file_io_operations.hpp) hands
// its description and the caller's handler, unchanged, to the one that runs, so an op costs
// one branch more than calling it directly and allocates nothing of its own.
//
// It says what it chose: one log line (info for io_uring or a forced choice, warn for a
// fallback), kind(), and its shared io_stats (shared_stats(): they outlive it), from which
// telemetry::collect_io makes the kvtier_io_* metrics of docs/io.md.
//
// Threading and contracts are those of the implementation it holds (uring_context.hpp: one
// executor, cancellation contract; pread_pool.hpp).

#include <kvtier/config.hpp>
#include <kvtier/error.hpp>
#include <kvtier/io/concepts.hpp>
#include <kvtier/io/detail/file_io_operations.hpp>
#include <kvtier/io/pread_pool.hpp>
#include <kvtier/io/probe.hpp>
#include <kvtier/io/stats.hpp>
#include <kvtier/io/uring_context.hpp>
#include <kvtier/telemetry/logger.hpp>

#include <boost/asio/any_io_executor.hpp>

#include <exception>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <variant>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace io {

struct any_file_io_options {
  /// automatic: KVTIER_IO_BACKEND, else the probe. uring: fail where io_uring is refused.
  file_io_choice choice = file_io_choice::automatic;
  uring_options uring{};
  pread_pool_options pool{};
};

class any_file_io : public detail::file_io_operations<any_file_io> {
 private:
  // Defined first: g++ deduces their return type only once it has seen their bodies.
  template <class F>
  decltype(auto) visit(F&& f) {
    if (auto* u = std::get_if<uring_context>(&impl_)) return f(*u);
    return f(std::get<pread_pool>(impl_));
  }
  template <class F>
  decltype(auto) visit(F&& f) const {
    if (const auto* u = std::get_if<uring_context>(&impl_)) return f(*u);
    return f(std::get<pread_pool>(impl_));
  }

 public:
  using executor_type = boost::asio::any_io_executor;

  /// Chooses and starts the implementation. Throws std::runtime_error when io_uring is
  /// required but refused, std::invalid_argument on a bad KVTIER_IO_BACKEND or bad options.
  explicit any_file_io(executor_type ex, any_file_io_options opts = {}, telemetry::logger* log = nullptr)
      : selection_(select_file_io(opts.choice)) {
    if (selection_.kind == file_io_kind::uring) {
      try {
        impl_.emplace<uring_context>(ex, opts.uring, log);
      } catch (const std::exception& e) {
        if (selection_.requested == file_io_choice::uring) throw;
        selection_.kind = file_io_kind::pread;
        selection_.reason = std::string("io_uring set-up failed after a good probe: ") + e.what();
      }
    }
    if (selection_.kind == file_io_kind::pread) impl_.emplace<pread_pool>(ex, opts.pool, log);
    report(log, opts);
  }

  any_file_io(const any_file_io&) = delete;
  any_file_io& operator=(const any_file_io&) = delete;

  [[nodiscard]] executor_type get_executor() const noexcept {
    return visit([](const auto& e) { return e.get_executor(); });
  }
  [[nodiscard]] file_io_kind kind() const noexcept { return selection_.kind; }
  /// What was asked for, what the probe said, and why this implementation runs.
  [[nodiscard]] const file_io_selection& selection() const noexcept { return selection_; }

  /// The implementation itself, for what only it offers (nullptr when the other one runs).
  [[nodiscard]] uring_context* uring() noexcept { return std::get_if<uring_context>(&impl_); }
  [[nodiscard]] pread_pool* pool() noexcept { return std::get_if<pread_pool>(&impl_); }

  // --- file_io (the ten async_ operations come from detail/file_io_operations.hpp) --------

  error_code register_buffers(std::span<const buffer_region> regions) {
    return visit([&](auto& e) { return e.register_buffers(regions); });
  }
  /// One more region next to those add_buffers() registered (uring_context::add_buffers).
  error_code add_buffers(buffer_region region) {
    return visit([&](auto& e) { return e.add_buffers(region); });
  }
  [[nodiscard]] bool fixed_buffers_active() const noexcept {
    return visit([](const auto& e) { return e.fixed_buffers_active(); });
  }
  void shutdown() {
    visit([](auto& e) { e.shutdown(); });
  }
  /// uring_context::submit_now where io_uring runs; the pread pool starts each op at once.
  void submit_now() {
    if (auto* u = uring()) u->submit_now();
  }
  [[nodiscard]] std::size_t in_flight() const noexcept {
    return visit([](const auto& e) { return e.in_flight(); });
  }
  [[nodiscard]] const io_stats& stats() const noexcept { return *shared_stats(); }
  [[nodiscard]] std::shared_ptr<const io_stats> shared_stats() const noexcept {
    return visit([](const auto& e) { return e.shared_stats(); });
  }

 private:
  friend class detail::file_io_operations<any_file_io>;

  /// Hands the op and the caller's handler, unchanged, to the implementation in use.
  template <class Handler, class Desc>
  void submit(Handler&& handler, const Desc& desc) {
    if (auto* u = std::get_if<uring_context>(&impl_)) u->submit(std::forward<Handler>(handler), desc);
    else std::get<pread_pool>(impl_).submit(std::forward<Handler>(handler), desc);
  }

  void report(telemetry::logger* log, const any_file_io_options& opts) const {
    if (log == nullptr) return;
    if (selection_.kind == file_io_kind::uring) {
      log->info("file I/O on io_uring ({})", selection_.reason);
    } else if (selection_.requested == file_io_choice::pread) {
      log->info("file I/O on the pread thread pool ({} threads): {}", opts.pool.threads, selection_.reason);
    } else {
      log->warn("file I/O falls back to the pread thread pool ({} threads): {}", opts.pool.threads, selection_.reason);
    }
  }

  file_io_selection selection_;
  std::variant<std::monostate, uring_context, pread_pool> impl_;
};

static_assert(file_io<any_file_io>);

}  // namespace io
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
