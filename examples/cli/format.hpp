#pragma once
// What the `kvtier` program prints: sizes and durations for people, and aligned text tables.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace kvtier_cli {

/// "0 B", "512 B", "4.0 KiB", "1.5 GiB".
inline std::string human_bytes(std::uint64_t b) {
  static constexpr const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  if (b < 1024) return std::to_string(b) + " B";
  double v = static_cast<double>(b);
  std::size_t u = 0;
  while (v >= 1024 && u + 1 < std::size(units)) {
    v /= 1024;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f %s", v, units[u]);
  return buf;
}

/// "42s", "3m07s", "2h05m", "3d04h".
inline std::string human_seconds(double s) {
  const auto t = static_cast<std::uint64_t>(s < 0 ? 0 : s);
  char buf[32];
  if (t < 60)
    std::snprintf(buf, sizeof buf, "%llus", static_cast<unsigned long long>(t));
  else if (t < 3600)
    std::snprintf(buf, sizeof buf, "%llum%02llus", static_cast<unsigned long long>(t / 60),
                  static_cast<unsigned long long>(t % 60));
  else if (t < 86400)
    std::snprintf(buf, sizeof buf, "%lluh%02llum", static_cast<unsigned long long>(t / 3600),
                  static_cast<unsigned long long>(t % 3600 / 60));
  else
    std::snprintf(buf, sizeof buf, "%llud%02lluh", static_cast<unsigned long long>(t / 86400),
                  static_cast<unsigned long long>(t % 86400 / 3600));
  return buf;
}

/// A text table: a header row, then rows; columns padded to their widest cell, two spaces
/// apart; columns marked numeric are right-aligned.
class table {
 public:
  explicit table(std::vector<std::string> header, std::vector<bool> numeric = {})
      : header_(std::move(header)), numeric_(std::move(numeric)) {
    numeric_.resize(header_.size(), false);
  }

  void add(std::vector<std::string> row) {
    row.resize(header_.size());
    rows_.push_back(std::move(row));
  }
  [[nodiscard]] bool empty() const noexcept { return rows_.empty(); }

  [[nodiscard]] std::string str() const {
    std::vector<std::size_t> width(header_.size());
    for (std::size_t c = 0; c < header_.size(); ++c) width[c] = header_[c].size();
    for (const auto& r : rows_)
      for (std::size_t c = 0; c < r.size(); ++c) width[c] = std::max(width[c], r[c].size());
    std::string out;
    auto line = [&](const std::vector<std::string>& r) {
      std::string l;
      for (std::size_t c = 0; c < r.size(); ++c) {
        const std::string pad(width[c] - r[c].size(), ' ');
        if (c != 0) l += "  ";
        l += numeric_[c] ? pad + r[c] : r[c] + (c + 1 == r.size() ? std::string() : pad);
      }
      while (!l.empty() && l.back() == ' ') l.pop_back();
      out += l + "\n";
    };
    line(header_);
    for (const auto& r : rows_) line(r);
    return out;
  }

 private:
  std::vector<std::string> header_;
  std::vector<bool> numeric_;
  std::vector<std::vector<std::string>> rows_;
};

}  // namespace kvtier_cli
