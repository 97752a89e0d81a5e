#pragma once
// l2::disk_backend_options from the server's JSON configuration (one entry of its
// "l2_backends" list; the server's disk backend type, disk_backend_type.hpp, reads it here,
// so l2/ needs no JSON library):
//
//   {"type": "disk", "name": "nvme0", "path": "/mnt/nvme/kvtier", "capacity_gb": 512,
//    "o_direct": true, "io": "auto", "eviction": "lru"}
//
// The keys and their defaults: docs/l2-disk.md ("Options and JSON keys"), docs/server.md
// ("L2 backends"); their ranges below. Unknown keys are errors (a typo must not silently
// fall back to a default); every error is a std::invalid_argument that names the key and
// what to write instead.

#include <kvtier/config.hpp>
#include <kvtier/io/probe.hpp>
#include <kvtier/l2/disk/disk_backend.hpp>

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace server {

namespace detail {

[[noreturn]] inline void json_fail(const std::string& what) {
  throw std::invalid_argument("disk backend configuration: " + what);
}

/// A JSON value (or key) for a message: cut to ~80 bytes, with its size when cut.
inline std::string json_excerpt(const std::string& text) {
  if (text.size() <= 80) return text;
  return text.substr(0, 60) + "... (" + std::to_string(text.size()) + " bytes)";
}
inline std::string json_excerpt(const nlohmann::json& v) {
  return json_excerpt(v.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
}

inline const nlohmann::json* json_find(const nlohmann::json& j, const char* key) {
  auto it = j.find(key);
  return it == j.end() ? nullptr : &*it;
}

inline bool json_bool(const nlohmann::json& v, const char* key) {
  if (!v.is_boolean()) json_fail(std::string("'") + key + "' must be true or false, got " + json_excerpt(v));
  return v.get<bool>();
}

inline std::string json_string(const nlohmann::json& v, const char* key) {
  if (!v.is_string()) json_fail(std::string("'") + key + "' must be a string, got " + json_excerpt(v));
  return v.get<std::string>();
}

inline std::uint64_t json_uint(const nlohmann::json& v, const char* key, std::uint64_t lo, std::uint64_t hi) {
  if (!v.is_number_integer() || (v.is_number_integer() && !v.is_number_unsigned() && v.get<std::int64_t>() < 0))
    json_fail(std::string("'") + key + "' must be a non-negative integer, got " + json_excerpt(v));
  const auto x = v.get<std::uint64_t>();
  if (x < lo || x > hi)
    json_fail(std::string("'") + key + "' = " + std::to_string(x) + " is out of range [" + std::to_string(lo) + ", " +
              std::to_string(hi) + "]");
  return x;
}

inline double json_fraction(const nlohmann::json& v, const char* key) {
  if (!v.is_number()) json_fail(std::string("'") + key + "' must be a number, got " + json_excerpt(v));
  const double x = v.get<double>();
  if (!(x > 0 && x <= 1)) json_fail(std::string("'") + key + "' = " + json_excerpt(v) + " must be in (0, 1]");
  return x;
}

}  // namespace detail

namespace detail {

/// Refuses a key the disk backend does not read (a typo must not fall back to a default).
inline void check_disk_keys(const nlohmann::json& j) {
  static constexpr std::string_view known[] = {
      "type",        "name",        "path",        "capacity_gb",   "capacity_bytes", "o_direct",
      "io",          "eviction",    "high_watermark", "low_watermark", "queue_depth", "part_kib",
      "pread_threads", "sync",      "name_sync",   "preallocate", "verify_on_start"};
  for (const auto& [k, v] : j.items()) {
    bool ok = false;
    for (auto n : known) ok = ok || k == n;
    if (!ok) {
      std::string list;
      for (auto n : known) list += std::string(list.empty() ? "" : ", ") + std::string(n);
      json_fail("unknown key '" + json_excerpt(k) + "' (known: " + list + ")");
    }
  }
}

/// The capacity: exactly one of capacity_gb (GiB, may be fractional) and capacity_bytes.
[[nodiscard]] inline std::uint64_t disk_capacity_from_json(const nlohmann::json& j) {
  const auto* gb = json_find(j, "capacity_gb");
  const auto* bytes = json_find(j, "capacity_bytes");
  if ((gb == nullptr) == (bytes == nullptr))
    json_fail(gb == nullptr ? "the capacity is missing: set 'capacity_gb' (GiB) or 'capacity_bytes'"
                            : "both 'capacity_gb' and 'capacity_bytes' are set: keep one");
  if (gb == nullptr) return json_uint(*bytes, "capacity_bytes", 1, UINT64_MAX);
  // 2^20 GiB (1 PiB) and more is a typo, and past 2^34 GiB the bytes would not fit 64 bits.
  constexpr double max_gb = double(std::uint64_t{1} << 20);
  if (!gb->is_number() || !(gb->get<double>() > 0) || !std::isfinite(gb->get<double>()))
    json_fail("'capacity_gb' must be a number > 0, got " + json_excerpt(*gb));
  if (gb->get<double>() > max_gb)
    json_fail("'capacity_gb' = " + json_excerpt(*gb) + " is more than 1048576 (1 PiB): give the GiB the tier may use");
  const auto out = static_cast<std::uint64_t>(gb->get<double>() * static_cast<double>(std::uint64_t{1} << 30));
  if (out == 0) json_fail("'capacity_gb' = " + json_excerpt(*gb) + " is less than one byte");
  return out;
}

/// The keys that choose how it reads and writes, and what it evicts: io, eviction.
inline void disk_choices_from_json(const nlohmann::json& j, l2::disk_backend_options& out) {
  using l2::disk_eviction;
  if (const auto* v = json_find(j, "io")) {
    const auto s = json_string(*v, "io");
    const auto c = io::parse_file_io_choice(s);
    if (!c || s.empty()) json_fail("'io' is \"" + json_excerpt(s) + "\": use \"auto\", \"uring\" or \"pread\"");
    out.io = *c;
  }
  if (const auto* v = json_find(j, "eviction")) {
    const auto s = json_string(*v, "eviction");
    if (s == "lru") out.eviction = disk_eviction::lru;
    else if (s == "fifo") out.eviction = disk_eviction::fifo;
    else if (s == "none") out.eviction = disk_eviction::none;
    else
      json_fail("'eviction' is \"" + json_excerpt(s) + "\": use \"lru\", \"fifo\" or \"none\"");
  }
}

}  // namespace detail

/// The options one JSON entry describes; throws std::invalid_argument naming the bad key.
[[nodiscard]] inline l2::disk_backend_options disk_backend_options_from_json(const nlohmann::json& j) {
  using detail::json_excerpt;
  using detail::json_fail;
  if (!j.is_object()) json_fail("expected an object, got " + json_excerpt(j));
  detail::check_disk_keys(j);
  l2::disk_backend_options out;
  if (const auto* v = detail::json_find(j, "type")) {
    if (detail::json_string(*v, "type") != "disk")
      json_fail("'type' is " + json_excerpt(*v) + ": this parser reads \"disk\" backends only");
  }
  if (const auto* v = detail::json_find(j, "name")) out.name = detail::json_string(*v, "name");
  if (out.name.empty()) json_fail("'name' is empty");
  const auto* path = detail::json_find(j, "path");
  if (path == nullptr) json_fail("'path' is missing: the directory of the disk tier, e.g. \"/mnt/nvme/kvtier\"");
  out.path = detail::json_string(*path, "path");
  if (out.path.empty()) json_fail("'path' is empty");
  out.capacity_bytes = detail::disk_capacity_from_json(j);

  if (const auto* v = detail::json_find(j, "o_direct")) out.o_direct = detail::json_bool(*v, "o_direct");
  detail::disk_choices_from_json(j, out);
  if (const auto* v = detail::json_find(j, "high_watermark")) out.high_watermark = detail::json_fraction(*v, "high_watermark");
  if (const auto* v = detail::json_find(j, "low_watermark")) out.low_watermark = detail::json_fraction(*v, "low_watermark");
  if (out.low_watermark > out.high_watermark)
    json_fail("'low_watermark' (" + std::to_string(out.low_watermark) + ") exceeds 'high_watermark' (" +
              std::to_string(out.high_watermark) + ")");
  if (const auto* v = detail::json_find(j, "queue_depth"))
    out.queue_depth = static_cast<unsigned>(detail::json_uint(*v, "queue_depth", 1, 256));
  if (const auto* v = detail::json_find(j, "part_kib"))
    out.part_bytes = static_cast<std::size_t>(detail::json_uint(*v, "part_kib", 4, 64 * 1024)) * 1024;
  if (const auto* v = detail::json_find(j, "pread_threads"))
    out.pread_threads = static_cast<unsigned>(detail::json_uint(*v, "pread_threads", 1, 64));
  if (const auto* v = detail::json_find(j, "sync")) {
    const auto s = detail::json_string(*v, "sync");
    if (s == "data") out.sync = l2::disk_sync::data;
    else if (s == "none") out.sync = l2::disk_sync::none;
    else
      json_fail("'sync' is \"" + json_excerpt(s) + "\": use \"data\" or \"none\"");
  }
  if (const auto* v = detail::json_find(j, "name_sync")) {
    const auto s = detail::json_string(*v, "name_sync");
    if (s == "auto") out.name_sync = l2::disk_name_sync::automatic;
    else if (s == "directory") out.name_sync = l2::disk_name_sync::directory;
    else if (s == "file") out.name_sync = l2::disk_name_sync::file;
    else
      json_fail("'name_sync' is \"" + json_excerpt(s) + "\": use \"auto\", \"directory\" or \"file\"");
  }
  if (const auto* v = detail::json_find(j, "preallocate")) out.preallocate = detail::json_bool(*v, "preallocate");
  if (const auto* v = detail::json_find(j, "verify_on_start"))
    out.verify_on_start = detail::json_bool(*v, "verify_on_start");
  out.validate();
  return out;
}

}  // namespace server
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
