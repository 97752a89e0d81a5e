#pragma once
// logger: leveled, thread-safe logging with fmt. One line per call, written with a single
// write to the sink, so lines from different threads never interleave. log_throttle limits a
// recurring message (disk full, backend down) to once per interval, counting what it hid.

#include <kvtier/config.hpp>

#include <fmt/chrono.h>
#include <fmt/format.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace telemetry {

enum class log_level : std::uint8_t { trace, debug, info, warn, error, off };

[[nodiscard]] constexpr std::string_view to_string(log_level l) noexcept {
  switch (l) {
    case log_level::trace: return "trace";
    case log_level::debug: return "debug";
    case log_level::info: return "info";
    case log_level::warn: return "warn";
    case log_level::error: return "error";
    case log_level::off: return "off";
  }
  return "?";
}

/// Parses trace, debug, info, warn (or warning), error, off.
[[nodiscard]] constexpr std::optional<log_level> parse_log_level(std::string_view s) noexcept {
  if (s == "trace") return log_level::trace;
  if (s == "debug") return log_level::debug;
  if (s == "info") return log_level::info;
  if (s == "warn" || s == "warning") return log_level::warn;
  if (s == "error") return log_level::error;
  if (s == "off") return log_level::off;
  return std::nullopt;
}

class logger {
 public:
  /// Receives each formatted line (without the trailing newline).
  using sink_fn = std::function<void(log_level, std::string_view line)>;

  /// Writes to stderr.
  explicit logger(log_level level = log_level::info, std::string component = "kvtier")
      : logger(level, std::move(component), stderr_sink()) {}

  logger(log_level level, std::string component, sink_fn sink)
      : level_(level), component_(std::move(component)), sink_(std::move(sink)) {}

  [[nodiscard]] bool enabled(log_level l) const noexcept {
    return l != log_level::off && l >= level_.load(std::memory_order_relaxed);
  }
  void set_level(log_level l) noexcept { level_.store(l, std::memory_order_relaxed); }
  [[nodiscard]] log_level level() const noexcept { return level_.load(std::memory_order_relaxed); }

  template <class... Args>
  void log(log_level l, fmt::format_string<Args...> f, Args&&... args) {
    if (!enabled(l)) return;
    write(l, fmt::format(f, std::forward<Args>(args)...));
  }
  template <class... Args>
  void trace(fmt::format_string<Args...> f, Args&&... a) { log(log_level::trace, f, std::forward<Args>(a)...); }
  template <class... Args>
  void debug(fmt::format_string<Args...> f, Args&&... a) { log(log_level::debug, f, std::forward<Args>(a)...); }
  template <class... Args>
  void info(fmt::format_string<Args...> f, Args&&... a) { log(log_level::info, f, std::forward<Args>(a)...); }
  template <class... Args>
  void warn(fmt::format_string<Args...> f, Args&&... a) { log(log_level::warn, f, std::forward<Args>(a)...); }
  template <class... Args>
  void error(fmt::format_string<Args...> f, Args&&... a) { log(log_level::error, f, std::forward<Args>(a)...); }

  /// Formats "<UTC time> <level> <component>: <message>" and hands it to the sink.
  void write(log_level l, std::string_view message) {
    const auto now = std::chrono::time_point_cast<std::chrono::milliseconds>(std::chrono::system_clock::now());
    std::string line = fmt::format("{:%Y-%m-%dT%H:%M:%S}Z {:<5} {}: {}", now, to_string(l), component_, message);
    std::lock_guard g(sink_mutex_);
    sink_(l, line);
  }

  /// A sink that writes each line with one fwrite to stderr.
  [[nodiscard]] static sink_fn stderr_sink() {
    return [](log_level, std::string_view line) {
      std::string s(line);
      s += '\n';
      std::fwrite(s.data(), 1, s.size(), stderr);
    };
  }

 private:
  std::atomic<log_level> level_;
  std::string component_;
  std::mutex sink_mutex_;
  sink_fn sink_;
};

/// Lets a recurring message through at most `burst` times per interval (once by default);
/// counts the ones it held back, so the next message can say "(N more since)". A burst above
/// one keeps the first few occurrences visible one by one (each refused peer, say) while a
/// flood still makes only `burst` lines per interval. Thread-safe.
class log_throttle {
 public:
  explicit log_throttle(std::chrono::steady_clock::duration interval = std::chrono::seconds(10),
                        std::uint32_t burst = 1) noexcept
      : interval_(interval), burst_(burst == 0 ? 1 : burst) {}

  /// Returns how many were suppressed since the last one let through, when this one may be
  /// logged now; nullopt when it must be suppressed.
  std::optional<std::uint64_t> allow(std::chrono::steady_clock::time_point now = std::chrono::steady_clock::now()) {
    std::lock_guard g(mutex_);
    if (!window_start_ || now - *window_start_ >= interval_) {
      window_start_ = now;
      in_window_ = 0;
    }
    if (in_window_ >= burst_) {
      ++suppressed_;
      return std::nullopt;
    }
    ++in_window_;
    return std::exchange(suppressed_, 0);
  }

 private:
  std::mutex mutex_;
  std::chrono::steady_clock::duration interval_;
  std::uint32_t burst_;
  std::optional<std::chrono::steady_clock::time_point> window_start_;
  std::uint32_t in_window_ = 0;
  std::uint64_t suppressed_ = 0;
};

}  // namespace telemetry
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
