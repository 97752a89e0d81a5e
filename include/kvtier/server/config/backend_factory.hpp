#pragma once
// backend_factory: builds the server's L2 backends from JSON descriptions, one per
// --l2-backend flag (LMCache's repeatable --l2-adapter) or per element of "l2_backends":
//
//   {"type": "memory", "name": "mem", "capacity_mb": 4096, "bandwidth_gbps": 2, "latency_us": 50}
//
// Every backend type registers its JSON "type" with one parse function. parse() validates
// the whole description (unknown keys included) at configuration time and returns a
// backend_spec whose create() builds the backend later, on the server's executor, so a bad
// description stops the program before anything starts, with a message that says what to
// change (server_config_json.hpp). A type may add check(): what create() would refuse that
// can be seen without building anything (a directory's trust), run with the server's other
// start-up checks.
//
// builtin() has "memory" (l2/memory_backend.hpp, with its bandwidth and latency model): it
// needs nothing beyond kvtier::kvtier. The other shipped types live in their own headers,
// because they link more: "disk" (server/config/disk_backend_type.hpp, kvtier::uring) and "redis"
// (server/config/redis_backend_type.hpp, kvtier::redis, i.e. hiredis). The kvtier-server program
// registers all three. A program with its own backend type builds its own factory:
// `auto f = backend_factory::builtin_copy(); f.add_type(...)`.

#include <kvtier/config.hpp>
#include <kvtier/l2/any_backend.hpp>
#include <kvtier/l2/memory_backend.hpp>
#include <kvtier/server/config/server_config_json.hpp>
#include <kvtier/telemetry/logger.hpp>
#include <kvtier/telemetry/registry.hpp>

#include <boost/asio/any_io_executor.hpp>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace server {

/// What a backend is built with.
struct backend_context {
  /// The server's I/O executor: completions (timers, io_uring, sockets) resume here.
  boost::asio::any_io_executor executor;
  /// The server's logger (backends may log their own setup).
  telemetry::logger* log = nullptr;
  /// The server's metrics registry: a backend type with its own series (kvtier_l2_disk_*,
  /// kvtier_l2_redis_*) registers their collectors (telemetry/collectors.hpp) here. May be
  /// null (no metrics).
  telemetry::registry* metrics = nullptr;
};

/// A validated backend description, ready to build.
struct backend_spec {
  std::string type;         ///< the JSON "type"
  std::string name;         ///< unique among the server's backends (metrics label, status)
  std::string description;  ///< one line for the start-up message, e.g. "memory, 1024 MiB"
  /// Builds the backend; `name` is the final (unique) name above.
  std::function<l2::any_backend(const backend_context&, const std::string& name)> create;
  /// The backend's start-up checks that need no work (a disk directory: whose it is, who may
  /// write it, whether another process holds it), run with the final name before the server
  /// binds anything or builds any backend, so a refusal is the only line a refused start
  /// prints (server/server.hpp, "Start-up"). Throws config_error for a configuration to change
  /// (the program exits 2), std::runtime_error for what stops this start (exit 1); create()
  /// makes the same checks again. Empty: none.
  std::function<void(const std::string& name)> check;
};

class backend_factory {
 public:
  /// Parses one description of this type. `r` reads the object (its "type" and "name" are
  /// already read); the function reads its own keys, throws config_error for a bad value,
  /// and returns the spec (type and name are filled in by the factory). r.finish() is called
  /// by the factory afterwards, so unknown keys are refused for every type.
  using parse_fn = std::function<backend_spec(json_object_reader& r)>;

  /// Registers a type (replaces one of the same name). `summary` lists its keys for --help.
  void add_type(std::string type, std::string summary, parse_fn parse) {
    types_[std::move(type)] = entry{std::move(summary), std::move(parse)};
  }

  [[nodiscard]] bool has_type(std::string_view type) const { return types_.find(type) != types_.end(); }

  /// The registered types, sorted.
  [[nodiscard]] std::vector<std::string> types() const {
    std::vector<std::string> v;
    for (const auto& [t, e] : types_) v.push_back(t);
    return v;
  }

  /// "type: summary" lines, for --help.
  [[nodiscard]] std::string help() const {
    std::string s;
    for (const auto& [t, e] : types_) s += "  " + t + ": " + e.summary + "\n";
    return s;
  }

  /// Parses the description of backend number `index` (for messages). Throws config_error.
  [[nodiscard]] backend_spec parse(const nlohmann::json& j, std::size_t index) const {
    json_object_reader r(j, "l2_backends[" + std::to_string(index) + "].", "l2 backend");
    const nlohmann::json* type = r.raw("type");
    std::vector<std::string> names = types();
    std::vector<std::string_view> views(names.begin(), names.end());
    const std::string known = "known types: " + json_object_reader::join(views);
    if (!type) throw config_error(r.prefix() + "type", "missing", "give the backend's \"type\"; " + known);
    if (!type->is_string()) throw r.error("type", *type, "must be a string; " + known);
    auto it = types_.find(type->get<std::string>());
    if (it == types_.end())
      throw r.error("type", *type,
                    "this build has no such backend type; " + known +
                        " (a program registers disk and redis with add_disk_backend_type / add_redis_backend_type, see docs/server.md)");
    auto name = r.string("name");
    if (name && (name->empty() || name->size() > 64))
      throw r.error("name", nlohmann::json(*name), "must be 1..64 characters");
    backend_spec spec = it->second.parse(r);
    r.finish();
    spec.type = it->first;
    spec.name = name ? *name : it->first;
    return spec;
  }

  /// Parses every description and makes default names unique ("memory", "memory-1", ...).
  /// Two explicit equal names are an error. Throws config_error.
  [[nodiscard]] std::vector<backend_spec> parse_all(std::span<const nlohmann::json> list) const {
    std::vector<backend_spec> specs;
    std::set<std::string> explicit_names;
    for (std::size_t i = 0; i < list.size(); ++i) {
      specs.push_back(parse(list[i], i));
      if (list[i].contains("name") && !explicit_names.insert(specs.back().name).second)
        throw config_error("l2_backends[" + std::to_string(i) + "].name", "\"" + specs.back().name + "\"",
                           "two backends share this name: give each a different \"name\"");
    }
    std::set<std::string> used = explicit_names;
    for (std::size_t i = 0; i < list.size(); ++i) {
      if (list[i].contains("name")) continue;
      std::string n = specs[i].name;
      for (std::size_t k = 1; used.contains(n); ++k) n = specs[i].name + "-" + std::to_string(k);
      specs[i].name = n;
      used.insert(n);
    }
    return specs;
  }

  /// The factory with every type this build ships. Shared, immutable.
  [[nodiscard]] static const backend_factory& builtin() {
    static const backend_factory f = make_builtin();
    return f;
  }

  /// A copy of builtin() to add a program's own types to.
  [[nodiscard]] static backend_factory builtin_copy() { return builtin(); }

 private:
  struct entry {
    std::string summary;
    parse_fn parse;
  };

  static backend_factory make_builtin();

  std::map<std::string, entry, std::less<>> types_;
};

/// Bytes of memory this machine has (0 when unknown).
[[nodiscard]] inline std::uint64_t machine_memory_bytes() noexcept {
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long page = ::sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<std::uint64_t>(pages) * static_cast<std::uint64_t>(page) : 0;
}

/// Reads a size given as one of <base>_gb, <base>_mb or <base>_bytes (at most one).
inline std::optional<std::uint64_t> read_size(json_object_reader& r, std::string_view base) {
  const std::string gb = std::string(base) + "_gb", mb = std::string(base) + "_mb", by = std::string(base) + "_bytes";
  const int given = int{r.has(gb)} + int{r.has(mb)} + int{r.has(by)};
  if (given > 1)
    throw config_error(r.prefix() + std::string(base), "given more than once",
                       "use only one of " + gb + ", " + mb + " and " + by);
  constexpr double max_gb = 1 << 20;  // 1 PiB: anything above is a typo
  if (auto v = r.number(gb, 0, max_gb)) return static_cast<std::uint64_t>(*v * double(1ULL << 30));
  if (auto v = r.number(mb, 0, max_gb * 1024)) return static_cast<std::uint64_t>(*v * double(1ULL << 20));
  if (auto v = r.integer(by, 0, std::uint64_t{1} << 50)) return *v;
  return std::nullopt;
}

/// Registers "memory": l2::memory_backend. Keys: capacity_gb | capacity_mb | capacity_bytes
/// (default 1 GiB), bandwidth_gbps (GB/s of the modelled channel, 0 = memcpy speed, default
/// 0), latency_us (added once per operation, default 0).
inline void add_memory_backend_type(backend_factory& f) {
  f.add_type("memory",
             "in-process memory with a bandwidth/latency model; keys: name, capacity_gb|capacity_mb|capacity_bytes "
             "(1 GiB), bandwidth_gbps (0 = unlimited), latency_us (0)",
             [](json_object_reader& r) {
               l2::memory_backend_options o;
               if (auto c = read_size(r, "capacity")) {
                 if (*c == 0)
                   throw config_error(r.prefix() + "capacity", "0", "a memory backend needs a capacity above 0");
                 o.capacity_bytes = *c;
               }
               if (const std::uint64_t ram = machine_memory_bytes(); ram != 0 && o.capacity_bytes > ram)
                 throw config_error(r.prefix() + "capacity", std::to_string(o.capacity_bytes >> 20) + " MiB",
                                    "is more than this machine's memory (" + std::to_string(ram >> 20) +
                                        " MiB): a memory backend lives in the server's RAM; lower capacity_gb/"
                                        "capacity_mb/capacity_bytes");
               if (auto b = r.number("bandwidth_gbps", 0, 1e6, "0 for no bandwidth model"))
                 o.bandwidth_bytes_per_second = *b * 1e9;
               if (auto l = r.number("latency_us", 0, 60e6))
                 o.latency = std::chrono::nanoseconds(static_cast<std::int64_t>(*l * 1e3));
               backend_spec s;
               std::string desc = "memory, " + std::to_string(o.capacity_bytes >> 20) + " MiB";
               if (o.bandwidth_bytes_per_second > 0)
                 desc += ", " + json_object_reader::format(o.bandwidth_bytes_per_second / 1e9) + " GB/s";
               if (o.latency.count() > 0)
                 desc += ", " + json_object_reader::format(static_cast<double>(o.latency.count()) / 1e3) + " us";
               s.description = std::move(desc);
               s.create = [o](const backend_context& ctx, const std::string& name) {
                 l2::memory_backend_options named = o;
                 named.name = name;
                 return l2::any_backend(std::make_shared<l2::memory_backend>(ctx.executor, std::move(named)));
               };
               return s;
             });
}

inline backend_factory backend_factory::make_builtin() {
  backend_factory f;
  add_memory_backend_type(f);
  return f;
}

}  // namespace server
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
