// kvtier-server: the kvtier cache server. Engines connect over a Unix socket (one
// connection per worker), register their paged KV cache as shared memory, and look up,
// retrieve and store chunks; the server keeps them in L1 (CPU memory) and its L2 backends.
// docs/server.md is the manual.
//
//   kvtier-server [--config FILE] [--socket PATH] [--l1-size-gb N] [--l2-backend JSON]... [...]
//
// Every flag has a JSON key of the same name (dashes as underscores) for --config files;
// flags override the file. A bad value exits 2 with one line "kvtier-server: <what>
// (<value>): <what to change>" (the value cut to a short excerpt), whatever the input: a
// directory or a device as --config, JSON nested deeper than 32, sizes beyond the machine,
// a disk directory another user could write; never a signal. A failure to start (socket in
// use, metrics port taken, disk directory held by another process, L1 not allocatable)
// exits 1 with one line. Every check comes before any start-up work (server.hpp,
// "Start-up"), so a refused start prints its line and nothing else. SIGTERM or SIGINT shut
// down in order and exit 0.
#include <kvtier/server/config/disk_backend_type.hpp>
#include <kvtier/server/config/server_config.hpp>
#include <kvtier/server/server.hpp>
#if KVTIER_SERVER_WITH_REDIS
#include <kvtier/server/config/redis_backend_type.hpp>
#endif
#if KVTIER_SERVER_WITH_KV_EVENTS
#include <kvtier/kv_events/zmq_transport.hpp>
#endif

#include <kvtier_program/server_instance.hpp>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <sys/resource.h>
#include <sys/stat.h>

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <new>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

namespace {

using kvtier::server::config_error;
using nlohmann::json;

enum class kind { number, text };

/// The largest --config file read (a configuration is a few KiB).
constexpr std::uintmax_t max_config_file_bytes = std::uintmax_t{16} << 20;

// One flag and the JSON key it sets.
struct flag {
  const char* name;  // CLI11 spelling, e.g. "--chunk-size"
  const char* key;   // JSON key, e.g. "chunk_size"
  kind type;
  const char* help;
  std::string value;  // as given
};

// A value given on the command line as JSON: numbers become numbers; anything else stays
// text, so that the configuration reader refuses it with its own message; text that is not
// UTF-8 is refused (server/config/server_config_json.hpp).
json flag_value(const flag& f) { return kvtier::server::flag_value(f.name, f.value, f.type == kind::number); }

json read_json_file(const std::string& path) {
  struct ::stat st {};
  if (::stat(path.c_str(), &st) != 0)
    throw config_error(
        "--config", path,
        std::string("cannot open the file (") + std::strerror(errno) + "): check the path and its permissions");
  if (!S_ISREG(st.st_mode))
    throw config_error(
        "--config", path,
        S_ISDIR(st.st_mode) ? "is a directory: give the JSON file in it" : "is not a regular file: give a JSON file");
  if (static_cast<std::uintmax_t>(st.st_size) > max_config_file_bytes)
    throw config_error("--config", path, "is larger than 16 MiB: a configuration is a few KiB; check the path");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw config_error("--config", path, "cannot open the file: check the path and its permissions");
  std::string text;
  text.resize(static_cast<std::size_t>(st.st_size));
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  if (in.bad()) throw config_error("--config", path, "cannot read the file: check the path and its permissions");
  text.resize(static_cast<std::size_t>(in.gcount()));
  return kvtier::server::parse_config_text(text, "--config", path);
}

// Open files: one per client connection (and per disk shard directory); the soft limit is
// often 1024, below max_connections. Raised to the hard limit.
void raise_open_file_limit() {
  ::rlimit r{};
  if (::getrlimit(RLIMIT_NOFILE, &r) != 0 || r.rlim_cur >= r.rlim_max) return;
  r.rlim_cur = r.rlim_max;
  (void)::setrlimit(RLIMIT_NOFILE, &r);
}

// Every backend type this program ships: memory (builtin), disk and, where hiredis was
// found at build time, redis.
const kvtier::server::backend_factory& program_backends() {
  static const kvtier::server::backend_factory factory = [] {
    auto f = kvtier::server::backend_factory::builtin_copy();
    kvtier::server::add_disk_backend_type(f);
#if KVTIER_SERVER_WITH_REDIS
    kvtier::server::add_redis_backend_type(f);
#endif
    return f;
  }();
  return factory;
}

int bad_config(const std::string& message) {
  std::fprintf(stderr, "kvtier-server: %s\n", message.c_str());
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  namespace srv = kvtier::server;
  const json defaults = srv::server_config{}.to_json();
  auto default_of = [&](const char* key) { return defaults.contains(key) ? defaults[key].dump() : std::string(); };

  std::vector<flag> flags = {
      {"--socket", "socket", kind::text, "Unix socket path", {}},
      {"--socket-mode", "socket_mode", kind::text, "the socket file's mode, octal (0660: its group may reach it)", {}},
      {"--allowed-uids",
       "allowed_uids",
       kind::text,
       "users served besides this one and root: uids or names, comma-separated",
       {}},
      {"--allowed-gids", "allowed_gids", kind::text, "members of these groups are served too: gids or names", {}},
      {"--max-connections", "max_connections", kind::number, "open client connections, all users", {}},
      {"--max-connections-per-uid", "max_connections_per_uid", kind::number, "open connections of one user", {}},
      {"--max-lookup-keys",
       "max_lookup_keys",
       kind::number,
       "chunk keys all open lookups may hold (auto: 4 x per client)",
       {}},
      {"--max-lookup-keys-per-client",
       "max_lookup_keys_per_client",
       kind::number,
       "chunk keys one connection's open lookups may hold (auto: max(2^20, 64 per L1 slot))",
       {}},
      {"--chunk-size", "chunk_size", kind::number, "tokens per chunk (engines must hash with the same)", {}},
      {"--l1-size-gb", "l1_size_gb", kind::number, "L1 (CPU memory) size in GiB (default 1)", {}},
      {"--l1-size-mb", "l1_size_mb", kind::number, "L1 size in MiB (instead of --l1-size-gb)", {}},
      {"--l1-slot-bytes",
       "l1_slot_bytes",
       kind::number,
       "bytes of one L1 slot = the largest chunk object (0.5B model: 3 MiB, 8B: 32 MiB)",
       {}},
      {"--eviction-policy", "eviction_policy", kind::text, "lru, s3fifo, arc or noop", {}},
      {"--eviction-watermark", "eviction_watermark", kind::number, "share of L1 slots at which eviction starts", {}},
      {"--eviction-target", "eviction_target", kind::number, "share of L1 slots eviction frees down to", {}},
      {"--l1-write-ttl-seconds", "l1_write_ttl_seconds", kind::number, "TTL of expiring L1 write locks", {}},
      {"--l1-read-ttl-seconds", "l1_read_ttl_seconds", kind::number, "TTL of a lookup's L1 read locks", {}},
      {"--l1-prefault",
       "l1_prefault",
       kind::text,
       "true (default): fault L1 in behind the first requests, then register it for io_uring fixed-buffer reads; "
       "false: pages on first use",
       {}},
      {"--l1-huge-pages",
       "l1_huge_pages",
       kind::text,
       "true (default): madvise(MADV_HUGEPAGE) on L1 before it is faulted in (2 MiB pages where the kernel's "
       "transparent huge pages allow); false: the kernel's default pages",
       {}},
      {"--lookup-ttl-seconds", "lookup_ttl_seconds", kind::number, "forget lookups never released after this long", {}},
      {"--l2-store-policy", "l2_store_policy", kind::text, "write_through or skip_l1", {}},
      {"--prefetch-policy", "prefetch_policy", kind::text, "best_effort, wait_complete or timeout", {}},
      {"--prefetch-timeout-base-ms", "prefetch_timeout_base_ms", kind::number, "timeout policy: base wait", {}},
      {"--prefetch-timeout-per-1k-tokens-ms",
       "prefetch_timeout_per_1k_tokens_ms",
       kind::number,
       "timeout policy: wait added per 1024 tokens",
       {}},
      {"--prefetch-timeout-cap-ms",
       "prefetch_timeout_cap_ms",
       kind::number,
       "timeout and wait_complete policies: longest wait",
       {}},
      {"--prefetch-max-in-flight",
       "prefetch_max_in_flight",
       kind::number,
       "prefetch requests past admission at once",
       {}},
      {"--prefetch-load-timeout-ms",
       "prefetch_load_timeout_ms",
       kind::number,
       "deadline of one L2 load task (also the load budget engines' retrieves follow)",
       {}},
      {"--prefetch-probe-every",
       "prefetch_probe_every",
       kind::number,
       "load-or-recompute gate: one declining lookup in N loads probe chunks (0 = never)",
       {}},
      {"--prefetch-probe-chunks",
       "prefetch_probe_chunks",
       kind::number,
       "load-or-recompute gate: chunks a probing lookup loads",
       {}},
      {"--worker-threads",
       "worker_threads",
       kind::number,
       "threads of the worker pool: the copies between engine regions and L1, a region's mapping and prefault "
       "(0: half the cores, 1 to 8)",
       {}},
      {"--copy-threads", "copy_threads", kind::number, "the old name of --worker-threads", {}},
      {"--log-level", "log_level", kind::text, "trace, debug, info, warn, error or off", {}},
      {"--client-reap-timeout",
       "client_reap_timeout",
       kind::number,
       "seconds of silence after which a client is reaped (pings keep it alive)",
       {}},
      {"--max-lookups-per-client", "max_lookups_per_client", kind::number, "open lookups one connection may hold", {}},
      {"--shutdown-timeout", "shutdown_timeout", kind::number, "seconds to wait for in-flight L2 work at exit", {}},
      {"--metrics-port",
       "metrics_port",
       kind::number,
       "HTTP port of /metrics, /healthz and /status (0 = off, auto = any free port, named in the startup line)",
       {}},
      {"--metrics-address", "metrics_address", kind::text, "address the HTTP endpoint binds (loopback by default)", {}},
  };

  CLI::App app{"kvtier-server: the kvtier cache server (docs/server.md)", "kvtier-server"};
  app.set_version_flag("--version", kvtier::version_string);
  app.get_formatter()->column_width(44);
  std::string config_file;
  std::vector<std::string> backends;
  bool print_config = false;
  app.add_option("--config", config_file, "JSON configuration file (keys = flag names with underscores)");
  for (auto& f : flags) {
    std::string help = f.help;
    if (const std::string d = default_of(f.key); !d.empty()) help += " [" + d + "]";
    app.add_option(f.name, f.value, help)->type_name(f.type == kind::number ? "NUMBER" : "TEXT");
  }
  app.add_option("--l2-backend,--l2-adapter", backends,
                 "an L2 backend as JSON, repeatable, e.g. '{\"type\":\"memory\",\"capacity_gb\":8}'; types:\n" +
                     program_backends().help())
      ->type_name("JSON")
      // One JSON value per flag: CLI11 would otherwise take "[...]" for a list of values and
      // split it, recursively (100,000 nested arrays overflowed its stack).
      ->allow_extra_args(false);
  std::string kv_events_json;
  app.add_option("--kv-events", kv_events_json,
                 "publish KV events for routers: the \"kv_events\" object as JSON, e.g. "
                 "'{\"endpoint\":\"tcp://127.0.0.1:5557\",\"replay_endpoint\":\"tcp://127.0.0.1:5558\"}' "
                 "(docs/kv-events.md)" +
                     std::string(KVTIER_SERVER_WITH_KV_EVENTS ? "" : "; this build has no libzmq: refused"))
      ->type_name("JSON")
      ->allow_extra_args(false);
  app.add_flag("--print-config", print_config, "print the effective configuration as JSON and exit");

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    return bad_config(std::string(e.what()) + ": run kvtier-server --help for the flags");
  }

  srv::server_config config;
  std::map<std::string, std::string> flag_of_key;  // JSON key -> flag, for messages
  try {
    json j = config_file.empty() ? json::object() : read_json_file(config_file);
    if (!j.is_object()) throw config_error("--config", config_file, "the file must hold one JSON object");
    std::vector<std::string> size_flags;
    for (const char* n : {"--l1-size-gb", "--l1-size-mb"})
      if (app.count(n) != 0) size_flags.push_back(n);
    if (size_flags.size() > 1)
      throw config_error(size_flags[0] + " and " + size_flags[1], "both given",
                         "give the L1 size once: --l1-size-gb or --l1-size-mb");
    if (app.count("--worker-threads") != 0 && app.count("--copy-threads") != 0)
      throw config_error("--worker-threads and --copy-threads", "both given",
                         "--copy-threads is the old name of --worker-threads: give --worker-threads only");
    for (const auto& f : flags) {
      if (app.count(f.name) == 0) continue;
      if (std::string(f.key).starts_with("l1_size_"))
        for (const char* k : {"l1_size_gb", "l1_size_mb", "l1_size_bytes"}) j.erase(k);
      if (std::string_view(f.key) == "worker_threads" || std::string_view(f.key) == "copy_threads")
        for (const char* k : {"worker_threads", "copy_threads"}) j.erase(k);  // the flag overrides either key
      j[f.key] = flag_value(f);
      flag_of_key[f.key] = f.name;
    }
    if (!backends.empty()) {
      json list = json::array();
      for (std::size_t i = 0; i < backends.size(); ++i) {
        json b;
        try {
          b = kvtier::server::parse_config_text(backends[i], "--l2-backend", "'" + backends[i] + "'");
        } catch (const config_error& e) {
          if (!e.fix().starts_with("not valid JSON")) throw;
          throw config_error(e.option(), e.value(),
                             e.fix() + ": write it as '{\"type\": \"memory\", \"capacity_gb\": 8}'");
        }
        list.push_back(std::move(b));
        flag_of_key["l2_backends[" + std::to_string(i) + "]"] = "--l2-backend #" + std::to_string(i + 1);
      }
      j["l2_backends"] = std::move(list);
    }
    if (!kv_events_json.empty()) {
      j["kv_events"] = kvtier::server::parse_config_text(kv_events_json, "--kv-events", "'" + kv_events_json + "'");
      flag_of_key["kv_events"] = "--kv-events";
    }
    config = srv::server_config::parse(j, program_backends());
  } catch (const config_error& e) {
    // Name the flag when the value came from one.
    std::string what = e.option();
    std::string prefix;
    if (what.starts_with("unknown key ")) {
      prefix = "unknown key ";
      what.erase(0, prefix.size());
    }
    for (const auto& [key, name] : flag_of_key)
      if (what == key || what.starts_with(key + ".")) {
        what = name + what.substr(key.size());
        break;
      }
    return bad_config(prefix + what + " (" + e.value() + "): " + e.fix());
  } catch (const std::bad_alloc&) {
    return bad_config("the configuration is too large to read: check --config and the --l2-backend flags");
  } catch (const std::exception& e) {
    return bad_config(std::string("the configuration cannot be read: ") + kvtier::server::excerpt(e.what(), 300));
  }

  if (print_config) {
    std::printf("%s\n", config.to_json().dump(2).c_str());
    return 0;
  }

  std::signal(SIGPIPE, SIG_IGN);  // writes use MSG_NOSIGNAL; this covers anything else
  raise_open_file_limit();
  try {
    srv::server_options options;
    options.handle_signals = true;
#if KVTIER_SERVER_WITH_KV_EVENTS
    options.kv_event_transport = [](const srv::kv_events_config& k) -> std::unique_ptr<kvtier::kv_events::kv_event_transport> {
      kvtier::kv_events::kv_event_publisher_options o;
      o.endpoint = k.endpoint;
      o.replay_endpoint = k.replay_endpoint;
      o.topic = k.topic;
      o.form = *kvtier::kv_events::parse_event_form(k.form);
      o.data_parallel_rank = k.data_parallel_rank;
      o.buffer_steps = k.buffer_steps;
      o.buffer_bytes = k.buffer_bytes;
      o.send_hwm = static_cast<int>(k.send_hwm);
      return std::make_unique<kvtier::kv_events::zmq_transport>(std::move(o));
    };
#endif
    // Through kvtier_server_instance: the server's code is compiled once per build, shared
    // with the tests (kvtier_program/server_instance.hpp).
    auto server = kvtier::program::make_server(config, options, program_backends());
    kvtier::program::start_server(*server);
    std::printf("%s\n", server->startup_line().c_str());
    std::fflush(stdout);
    return kvtier::program::run_server(*server);
  } catch (const config_error& e) {
    return bad_config(e.what());
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "kvtier-server: cannot allocate L1 (%llu bytes): lower --l1-size-gb or free memory\n",
                 static_cast<unsigned long long>(config.l1_size_bytes));
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvtier-server: %s\n", e.what());
    return 1;
  }
}
