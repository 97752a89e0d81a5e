#pragma once
// registry: the named metrics of one process, grouped in families (one name, one type, one
// help text, fixed label names; one child per set of label values). Registration is for
// start-up and cold paths (it takes a mutex); the returned references stay valid for the
// registry's lifetime and are what hot paths update.
//
// Names follow Prometheus: [a-zA-Z_:][a-zA-Z0-9_:]*, label names [a-zA-Z_][a-zA-Z0-9_]*,
// counters end in `_total`. Misuse (a bad name, a name reused with another type, help text
// or label names) throws std::invalid_argument naming the metric.

#include <kvtier/config.hpp>
#include <kvtier/telemetry/counter.hpp>
#include <kvtier/telemetry/gauge.hpp>
#include <kvtier/telemetry/histogram.hpp>

#include <algorithm>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace telemetry {

/// Label names and values of one child, e.g. {{"backend", "disk"}}.
using label_pairs = std::vector<std::pair<std::string, std::string>>;

enum class metric_type { counter, gauge, histogram };

[[nodiscard]] constexpr std::string_view to_string(metric_type t) noexcept {
  switch (t) {
    case metric_type::counter: return "counter";
    case metric_type::gauge: return "gauge";
    case metric_type::histogram: return "histogram";
  }
  return "untyped";
}

/// The per-scrape refresh of a collector group: callback metrics that read one snapshot of a
/// component (a cache's status, a tier's usage) instead of asking the component each. A
/// scrape (for_each_family) calls refresh() once, before it reads any metric, for every hook
/// a callback holds; value() calls it before reading a callback that holds it. refresh()
/// runs under the registry's lock, as the callbacks do. A hook lives as long as a callback
/// holds it: registering its callbacks again (replacing them) drops it.
class scrape_hook {
 public:
  virtual ~scrape_hook() = default;
  virtual void refresh() = 0;
};

/// A collector group's snapshot: read() taken at construction and again at each refresh();
/// the group's callbacks read get(). Make one with make_scrape_snapshot and pass it to each
/// add_callback of the group.
template <class Read>
class scrape_snapshot final : public scrape_hook {
 public:
  using value_type = std::remove_cvref_t<std::invoke_result_t<Read&>>;
  explicit scrape_snapshot(Read read) : read_(std::move(read)), value_(read_()) {}
  void refresh() override { value_ = read_(); }
  [[nodiscard]] const value_type& get() const noexcept { return value_; }

 private:
  Read read_;
  value_type value_;
};

template <class Read>
[[nodiscard]] std::shared_ptr<scrape_snapshot<Read>> make_scrape_snapshot(Read read) {
  return std::make_shared<scrape_snapshot<Read>>(std::move(read));
}

/// One child of a family: exactly one of the pointers (or the callback) is set.
struct metric_child {
  std::vector<std::string> label_values;
  std::unique_ptr<counter> as_counter;
  std::unique_ptr<gauge> as_gauge;
  std::unique_ptr<histogram> as_histogram;
  std::function<double()> callback;   ///< read at scrape time (callback counters and gauges)
  std::shared_ptr<scrape_hook> hook;  ///< the callback's collector group, refreshed first (or null)
};

struct metric_family {
  std::string name;
  std::string help;
  metric_type type = metric_type::counter;
  std::vector<std::string> label_names;
  std::vector<metric_child> children;
};

class registry {
 public:
  registry() = default;
  registry(const registry&) = delete;
  registry& operator=(const registry&) = delete;

  counter& add_counter(std::string_view name, std::string_view help, const label_pairs& labels = {}) {
    std::lock_guard g(mutex_);
    metric_child& c = child(name, help, metric_type::counter, labels);
    if (!c.as_counter && !c.callback) c.as_counter = std::make_unique<counter>();
    if (!c.as_counter) throw misuse(name, "is already registered as a callback");
    return *c.as_counter;
  }

  gauge& add_gauge(std::string_view name, std::string_view help, const label_pairs& labels = {}) {
    std::lock_guard g(mutex_);
    metric_child& c = child(name, help, metric_type::gauge, labels);
    if (!c.as_gauge && !c.callback) c.as_gauge = std::make_unique<gauge>();
    if (!c.as_gauge) throw misuse(name, "is already registered as a callback");
    return *c.as_gauge;
  }

  histogram& add_histogram(std::string_view name, std::string_view help, std::vector<double> bounds,
                           const label_pairs& labels = {}) {
    std::lock_guard g(mutex_);
    metric_child& c = child(name, help, metric_type::histogram, labels);
    if (!c.as_histogram) c.as_histogram = std::make_unique<histogram>(std::move(bounds));
    else if (c.as_histogram->bounds() != bounds) throw misuse(name, "is already registered with other buckets");
    return *c.as_histogram;
  }

  /// A counter or gauge whose value is read from `fn` at scrape time (fn runs under the
  /// registry's lock: it must be cheap, thread-safe and must not register metrics).
  /// With `hook`, fn belongs to that collector group: it reads what the hook's refresh()
  /// took for this scrape (see scrape_hook). Registering the same child again replaces the
  /// callback and its hook.
  void add_callback(std::string_view name, std::string_view help, metric_type type, const label_pairs& labels,
                    std::function<double()> fn, std::shared_ptr<scrape_hook> hook = nullptr) {
    if (type == metric_type::histogram) throw misuse(name, "callbacks are counters or gauges");
    std::lock_guard g(mutex_);
    metric_child& c = child(name, help, type, labels);
    if (c.as_counter || c.as_gauge) throw misuse(name, "is already registered as a stored metric");
    c.callback = std::move(fn);
    c.hook = std::move(hook);
  }

  /// Calls f(const metric_family&) for every family, in registration order, under the lock
  /// (a scrape): first refreshes every collector group once (scrape_hook).
  template <class F>
  void for_each_family(F&& f) const {
    std::lock_guard g(mutex_);
    refresh_hooks();
    for (const auto& fam : families_) f(*fam);
  }

  /// The current value of a counter or gauge child (histograms: their count), or nullopt.
  /// For tests and status pages.
  [[nodiscard]] std::optional<double> value(std::string_view name, const label_pairs& labels = {}) const {
    std::lock_guard g(mutex_);
    for (const auto& fam : families_) {
      if (fam->name != name) continue;
      for (const auto& c : fam->children) {
        if (!labels_match(*fam, c, labels)) continue;
        if (c.as_counter) return static_cast<double>(c.as_counter->value());
        if (c.as_gauge) return c.as_gauge->value();
        if (c.as_histogram) return static_cast<double>(c.as_histogram->snapshot().count());
        if (c.callback) {
          if (c.hook) c.hook->refresh();
          return c.callback();
        }
      }
    }
    return std::nullopt;
  }

  [[nodiscard]] static bool valid_metric_name(std::string_view n) noexcept {
    if (n.empty()) return false;
    for (std::size_t i = 0; i < n.size(); ++i) {
      const char c = n[i];
      const bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':';
      if (!alpha && !(i > 0 && c >= '0' && c <= '9')) return false;
    }
    return true;
  }
  [[nodiscard]] static bool valid_label_name(std::string_view n) noexcept {
    if (n.empty() || n.starts_with("__")) return false;
    for (std::size_t i = 0; i < n.size(); ++i) {
      const char c = n[i];
      const bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
      if (!alpha && !(i > 0 && c >= '0' && c <= '9')) return false;
    }
    return true;
  }

 private:
  static std::invalid_argument misuse(std::string_view name, std::string_view what) {
    return std::invalid_argument("kvtier::telemetry::registry: metric '" + std::string(name) + "' " +
                                 std::string(what));
  }

  // Each hook once, however many callbacks hold it.
  void refresh_hooks() const {
    std::vector<scrape_hook*> done;
    for (const auto& fam : families_)
      for (const auto& c : fam->children)
        if (c.hook && std::find(done.begin(), done.end(), c.hook.get()) == done.end()) {
          c.hook->refresh();
          done.push_back(c.hook.get());
        }
  }

  static bool labels_match(const metric_family& fam, const metric_child& c, const label_pairs& labels) {
    if (labels.size() != fam.label_names.size()) return false;
    for (std::size_t i = 0; i < labels.size(); ++i)
      if (labels[i].first != fam.label_names[i] || labels[i].second != c.label_values[i]) return false;
    return true;
  }

  metric_child& child(std::string_view name, std::string_view help, metric_type type, const label_pairs& labels) {
    if (!valid_metric_name(name)) throw misuse(name, "is not a valid Prometheus metric name");
    if (type == metric_type::counter && !name.ends_with("_total")) throw misuse(name, "is a counter: end it in _total");
    if (type != metric_type::counter && name.ends_with("_total")) throw misuse(name, "ends in _total but is not a counter");
    for (const auto& [k, v] : labels) {
      if (!valid_label_name(k)) throw misuse(name, "has an invalid label name '" + k + "'");
      if (type == metric_type::histogram && k == "le") throw misuse(name, "uses the reserved label 'le'");
    }
    metric_family* fam = nullptr;
    for (auto& f : families_)
      if (f->name == name) fam = f.get();
    if (fam == nullptr) {
      auto f = std::make_unique<metric_family>();
      f->name = std::string(name);
      f->help = std::string(help);
      f->type = type;
      for (const auto& [k, v] : labels) f->label_names.push_back(k);
      fam = f.get();
      families_.push_back(std::move(f));
    } else {
      if (fam->type != type) throw misuse(name, "is already registered as a " + std::string(to_string(fam->type)));
      if (fam->help != help) throw misuse(name, "is already registered with another help text");
      bool same_names = fam->label_names.size() == labels.size();
      for (std::size_t i = 0; same_names && i < labels.size(); ++i) same_names = fam->label_names[i] == labels[i].first;
      if (!same_names) throw misuse(name, "is already registered with other label names");
    }
    for (auto& c : fam->children)
      if (labels_match(*fam, c, labels)) return c;
    metric_child c;
    for (const auto& [k, v] : labels) c.label_values.push_back(v);
    fam->children.push_back(std::move(c));
    return fam->children.back();
  }

  mutable std::mutex mutex_;
  std::vector<std::unique_ptr<metric_family>> families_;
};

}  // namespace telemetry
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
