#pragma once
// gauge: a value that goes up and down (bytes used, requests in flight). One atomic double:
// gauges are set from few places, so sharding would cost scrapes more than it saves writers.
// For values another component already tracks, prefer a callback gauge in the registry,
// which reads the value at scrape time and costs the hot path nothing.

#include <kvtier/config.hpp>

#include <atomic>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace telemetry {

class gauge {
 public:
  gauge() = default;
  gauge(const gauge&) = delete;
  gauge& operator=(const gauge&) = delete;

  void set(double v) noexcept { value_.store(v, std::memory_order_relaxed); }
  void add(double d) noexcept { value_.fetch_add(d, std::memory_order_relaxed); }
  void sub(double d) noexcept { value_.fetch_sub(d, std::memory_order_relaxed); }
  [[nodiscard]] double value() const noexcept { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

}  // namespace telemetry
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
