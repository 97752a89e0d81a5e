#pragma once
// One field of /proc/meminfo, for benchmarks that size or wait on the machine's memory
// (kvtier_bench_server_start: MemAvailable; kvtier_bench_l2_disk: HugePages_Free). Each line
// is "Key:  value [kB]"; some carry no unit (the HugePages_ counts), so a line is read as a
// key and a number and the rest of it skipped.

#include <cstdint>
#include <fstream>
#include <optional>
#include <string>
#include <string_view>

namespace kvtier::bench {

/// The number on /proc/meminfo's line `key` (with its colon: "MemAvailable:"), as printed
/// (kB for sizes, a count for HugePages_*), or nullopt when there is no such line.
inline std::optional<std::uint64_t> meminfo_field(std::string_view key) {
  std::ifstream in("/proc/meminfo");
  std::string name;
  std::uint64_t value = 0;
  while (in >> name >> value) {
    if (name == key) return value;
    in.ignore(256, '\n');
  }
  return std::nullopt;
}

}  // namespace kvtier::bench
