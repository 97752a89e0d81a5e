#pragma once
// Test support: a telemetry::logger whose lines land in a vector, to check what a component
// logged (and how often).

#include <kvtier/telemetry/logger.hpp>

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace kvtier::test {

struct captured_log {
  std::vector<std::string> lines;
  telemetry::logger log;

  explicit captured_log(telemetry::log_level level = telemetry::log_level::info)
      : log(level, "test", [this](telemetry::log_level, std::string_view l) { lines.emplace_back(l); }) {}
  captured_log(const captured_log&) = delete;  // the logger's sink points at this object
  captured_log& operator=(const captured_log&) = delete;

  /// Lines containing `needle`.
  [[nodiscard]] std::size_t count(std::string_view needle) const {
    std::size_t n = 0;
    for (const auto& l : lines) n += l.find(needle) != std::string::npos ? 1 : 0;
    return n;
  }
};

}  // namespace kvtier::test
