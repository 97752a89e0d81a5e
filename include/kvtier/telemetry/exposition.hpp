#pragma once
// Prometheus text exposition format 0.0.4 (what /metrics serves): HELP and TYPE lines per
// family, label values and help text escaped, histograms as cumulative _bucket series with
// le="+Inf", plus _sum and _count. `promtool check metrics` accepts the output (tested).

#include <kvtier/config.hpp>
#include <kvtier/telemetry/registry.hpp>

#include <charconv>
#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace telemetry {

/// The Content-Type of the text format.
inline constexpr std::string_view prometheus_content_type = "text/plain; version=0.0.4; charset=utf-8";

namespace detail {

inline void append_escaped(std::string& out, std::string_view s, bool quote_escapes) {
  for (const char c : s) {
    if (c == '\\') out += "\\\\";
    else if (c == '\n') out += "\\n";
    else if (c == '"' && quote_escapes) out += "\\\"";
    else out += c;
  }
}

inline void append_number(std::string& out, double v) {
  if (std::isnan(v)) { out += "NaN"; return; }
  if (std::isinf(v)) { out += v > 0 ? "+Inf" : "-Inf"; return; }
  char buf[32];
  auto r = std::to_chars(buf, buf + sizeof buf, v);
  out.append(buf, r.ptr);
}

inline void append_number(std::string& out, std::uint64_t v) {
  char buf[24];
  auto r = std::to_chars(buf, buf + sizeof buf, v);
  out.append(buf, r.ptr);
}

// {a="x",b="y"} plus an optional extra label (le for buckets); nothing when there are none.
inline void append_labels(std::string& out, const metric_family& fam, const metric_child& c,
                          std::string_view extra_name = {}, std::string_view extra_value = {}) {
  if (fam.label_names.empty() && extra_name.empty()) return;
  out += '{';
  bool first = true;
  for (std::size_t i = 0; i < fam.label_names.size(); ++i) {
    if (!first) out += ',';
    first = false;
    out += fam.label_names[i];
    out += "=\"";
    append_escaped(out, c.label_values[i], true);
    out += '"';
  }
  if (!extra_name.empty()) {
    if (!first) out += ',';
    out += extra_name;
    out += "=\"";
    out += extra_value;
    out += '"';
  }
  out += '}';
}

}  // namespace detail

/// Appends the exposition of every family of `reg` to `out`.
inline void append_prometheus_text(const registry& reg, std::string& out) {
  reg.for_each_family([&out](const metric_family& fam) {
    if (fam.children.empty()) return;
    out += "# HELP ";
    out += fam.name;
    out += ' ';
    detail::append_escaped(out, fam.help, false);
    out += "\n# TYPE ";
    out += fam.name;
    out += ' ';
    out += to_string(fam.type);
    out += '\n';
    for (const auto& c : fam.children) {
      if (c.as_histogram) {
        const auto snap = c.as_histogram->snapshot();
        std::uint64_t cumulative = 0;
        for (std::size_t b = 0; b <= snap.bounds.size(); ++b) {
          cumulative += snap.counts[b];
          std::string le;
          if (b < snap.bounds.size()) detail::append_number(le, snap.bounds[b]);
          else le = "+Inf";
          out += fam.name;
          out += "_bucket";
          detail::append_labels(out, fam, c, "le", le);
          out += ' ';
          detail::append_number(out, cumulative);
          out += '\n';
        }
        out += fam.name;
        out += "_sum";
        detail::append_labels(out, fam, c);
        out += ' ';
        detail::append_number(out, snap.sum);
        out += '\n';
        out += fam.name;
        out += "_count";
        detail::append_labels(out, fam, c);
        out += ' ';
        detail::append_number(out, cumulative);
        out += '\n';
        continue;
      }
      out += fam.name;
      detail::append_labels(out, fam, c);
      out += ' ';
      if (c.as_counter) detail::append_number(out, c.as_counter->value());
      else if (c.as_gauge) detail::append_number(out, c.as_gauge->value());
      else if (c.callback) detail::append_number(out, c.callback());
      else detail::append_number(out, 0.0);
      out += '\n';
    }
  });
}

/// The exposition of every family of `reg`.
[[nodiscard]] inline std::string prometheus_text(const registry& reg) {
  std::string out;
  append_prometheus_text(reg, out);
  return out;
}

}  // namespace telemetry
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
