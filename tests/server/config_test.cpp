// server_config and backend_factory: defaults, JSON in and out, and every refusal saying
// what to change (the program's flags map onto the same keys: process_test.cpp).
#include <kvtier/server/config/server_config.hpp>

#include <kvtier/server/make_cache.hpp>

#include <kvtier/pipeline/policies.hpp>
#include <kvtier/server/config/backend_factory.hpp>
#include <kvtier/server/config/runtime_policies.hpp>
#include <kvtier/server/config/server_config_json.hpp>

#include <catch2/catch.hpp>

#include <boost/asio/io_context.hpp>

#include <string>

using namespace kvtier;
using namespace kvtier::server;
using nlohmann::json;

namespace {

// The message of the config_error parse(j) throws ("" when it does not).
std::string refusal(const json& j) {
  try {
    (void)server_config::parse(j);
  } catch (const config_error& e) {
    return e.what();
  }
  return {};
}

}  // namespace

TEST_CASE("the embedded defaults are valid and match the documented values", "[server][config]") {
  const server_config c;
  CHECK_NOTHROW(c.validate());
  CHECK(c.chunk_tokens == 256);
  CHECK(c.l1_size_bytes == std::uint64_t{1} << 30);
  CHECK(c.l1_slot_bytes == std::uint64_t{4} << 20);
  CHECK(c.l1_slot_count() == 256);
  CHECK(c.eviction == eviction_kind::lru);
  CHECK(c.store_policy == store_kind::write_through);
  CHECK(c.prefetch_policy == prefetch_wait_kind::timeout);
  CHECK(c.prefetch_max_in_flight == 8);
  CHECK(c.prefetch_load_timeout_ms == 30000);
  CHECK(c.prefetch_probe_every == 8);
  CHECK(c.prefetch_probe_chunks == 1);
  CHECK(c.client_reap_timeout_s == 30.0 * config::timeout_scale);
  CHECK(c.l2_backends.empty());
  CHECK(c.l1_prefault);
  CHECK(c.l1_huge_pages);
  CHECK((c.socket_path.ends_with("/kvtier.sock")));
  CHECK(server_config::parse(json::object()) == c);
}

TEST_CASE("a configuration survives to_json and parse unchanged", "[server][config]") {
  const json in = {{"socket", "/run/kvtier/s.sock"},
                   {"chunk_size", 512},
                   {"l1_size_gb", 2},
                   {"l1_slot_bytes", 33554432},
                   {"eviction_policy", "s3fifo"},
                   {"eviction_watermark", 0.9},
                   {"eviction_target", 0.5},
                   {"l1_read_ttl_seconds", 60},
                   {"l2_backends", json::array({json{{"type", "memory"}, {"capacity_mb", 512}, {"latency_us", 20}}})},
                   {"l2_store_policy", "skip_l1"},
                   {"prefetch_policy", "best_effort"},
                   {"prefetch_max_in_flight", 4},
                   {"prefetch_load_timeout_ms", 7000},
                   {"prefetch_probe_every", 0},
                   {"prefetch_probe_chunks", 3},
                   {"log_level", "debug"},
                   {"client_reap_timeout", 2.5},
                   {"metrics_port", 9100},
                   {"l1_prefault", false},
                   {"l1_huge_pages", false}};
  const server_config c = server_config::parse(in);
  CHECK(c.l1_size_bytes == std::uint64_t{2} << 30);
  CHECK(c.l1_slot_count() == 64);
  CHECK(c.eviction == eviction_kind::s3fifo);
  CHECK(c.store_policy == store_kind::skip_l1);
  CHECK(c.log_level == telemetry::log_level::debug);
  CHECK(c.client_reap_timeout_s == 2.5);
  CHECK(c.metrics_port == 9100);
  CHECK_FALSE(c.l1_prefault);
  CHECK_FALSE(c.l1_huge_pages);
  // The prefetch's knobs reach the cache's options.
  const cache::cache_options o = cache_options_from(c);
  CHECK(o.prefetch.max_in_flight == 4);
  CHECK(o.prefetch.load_timeout == std::chrono::milliseconds(7000));
  CHECK(o.prefetch.probe_every == 0);
  CHECK(o.prefetch.probe_chunks == 3);
  CHECK(server_config::parse(c.to_json()) == c);
  CHECK_THROWS_WITH(server_config::parse(json{{"prefetch_load_timeout_ms", 0}}),
                    Catch::Contains("prefetch_load_timeout_ms"));
  // A flag's text (--l1-prefault off) reads as the boolean.
  CHECK_FALSE(server_config::parse(json{{"l1_prefault", "off"}}).l1_prefault);
  CHECK(server_config::parse(json{{"l1_prefault", "true"}}).l1_prefault);
  CHECK(server_config::parse(json{{"l1_size_mb", 1.5}, {"l1_slot_bytes", 4096}}).l1_size_bytes == 3 << 19);
}

TEST_CASE("metrics_port takes a port, 0 (off) or \"auto\" (any free port), and metrics_address an IP address",
          "[server][config]") {
  const server_config off = server_config::parse(json::object());
  CHECK_FALSE(off.metrics_enabled());
  CHECK(off.metrics_address == "127.0.0.1");
  const server_config fixed = server_config::parse(json{{"metrics_port", 9464}, {"metrics_address", "0.0.0.0"}});
  CHECK(fixed.metrics_enabled());
  CHECK(fixed.metrics_port == 9464);
  CHECK(server_config::parse(fixed.to_json()) == fixed);
  const server_config any = server_config::parse(json{{"metrics_port", "auto"}});
  CHECK(any.metrics_enabled());
  CHECK(any.metrics_any_port);
  CHECK(any.to_json()["metrics_port"] == "auto");
  CHECK(server_config::parse(any.to_json()) == any);
  CHECK_THROWS_WITH(server_config::parse(json{{"metrics_port", "any"}}),
                    Catch::Contains("metrics_port (\"any\"): must be an integer in 0..65535"));
  CHECK_THROWS_WITH(server_config::parse(json{{"metrics_port", 9464}, {"metrics_address", "localhost"}}),
                    Catch::Contains("metrics_address (\"localhost\"): must be an IPv4 or IPv6 address"));
}

TEST_CASE("kv_events: off when absent, loopback or ipc unless allow_remote, every key checked", "[server][config]") {
  CHECK_FALSE(server_config::parse(json::object()).kv_events.enabled);
  CHECK_FALSE(server_config::parse(json::object()).to_json().contains("kv_events"));
  const server_config on = server_config::parse(json{{"kv_events", json::object()}});
  CHECK(on.kv_events.enabled);
  CHECK(on.kv_events.endpoint == "tcp://127.0.0.1:5557");
  CHECK(on.kv_events.form == "map");
  CHECK(server_config::parse(on.to_json()) == on);
  const server_config full = server_config::parse(json{{"kv_events",
                                                        {{"endpoint", "ipc:///tmp/kvtier-events"},
                                                         {"replay_endpoint", "tcp://[::1]:5558"},
                                                         {"topic", "kv"},
                                                         {"form", "array"},
                                                         {"tiers", {"l1"}},
                                                         {"medium_names", {{"l1", "CPU_PINNED"}}},
                                                         {"buffer_steps", 10},
                                                         {"description_bytes", 1 << 20},
                                                         {"data_parallel_rank", 2}}}});
  CHECK(full.kv_events.tiers == std::vector<std::string>{"l1"});
  CHECK(full.kv_events.medium_names.at("l1") == "CPU_PINNED");
  CHECK(full.kv_events.data_parallel_rank == 2);
  CHECK(server_config::parse(full.to_json()) == full);
  CHECK_FALSE(server_config::parse(json{{"kv_events", nullptr}}).kv_events.enabled);
  CHECK_THROWS_WITH(server_config::parse(json{{"kv_events", {{"endpoint", "tcp://0.0.0.0:5557"}}}}),
                    Catch::Contains("kv_events.endpoint (\"tcp://0.0.0.0:5557\"): is reachable from other machines"));
  CHECK_THROWS_WITH(server_config::parse(json{{"kv_events", {{"replay_endpoint", "tcp://10.0.0.1:5558"}}}}),
                    Catch::Contains("kv_events.replay_endpoint"));
  CHECK(server_config::parse(json{{"kv_events", {{"endpoint", "tcp://0.0.0.0:5557"}, {"allow_remote", true}}}})
            .kv_events.allow_remote);
  CHECK_THROWS_WITH(server_config::parse(json{{"kv_events", {{"form", "tuple"}}}}),
                    Catch::Contains("kv_events.form (\"tuple\"): must be one of map, array, array_batch"));
  CHECK_THROWS_WITH(server_config::parse(json{{"kv_events", {{"topics", "x"}}}}),
                    Catch::Contains("unknown key kv_events.topics"));
  CHECK_THROWS_WITH(server_config::parse(json{{"kv_events", {{"medium_names", {{"l1", ""}}}}}}),
                    Catch::Contains("kv_events.medium_names"));
  CHECK_THROWS_WITH(server_config::parse(json{{"kv_events", {{"endpoint", "tcp://127.0.0.1:1"}, {"replay_endpoint", "tcp://127.0.0.1:1"}}}}),
                    Catch::Contains("must differ from kv_events.endpoint"));
}

TEST_CASE("worker_threads sizes the worker pool, and copy_threads, its old name, is still read", "[server][config]") {
  CHECK(server_config::parse(json{{"worker_threads", 3}}).worker_threads == 3);
  CHECK(server_config::parse(json{{"copy_threads", 2}}).worker_threads == 2);
  CHECK(server_config::parse(json{{"copy_threads", 2}}).worker_thread_count() == 2);
  CHECK(server_config::parse(json::object()).to_json().contains("worker_threads"));
  CHECK_FALSE(server_config::parse(json::object()).to_json().contains("copy_threads"));
  CHECK(refusal(json{{"copy_threads", 2}, {"worker_threads", 2}}).find("old name of worker_threads") !=
        std::string::npos);
  CHECK(refusal(json{{"copy_threads", 1000}}).find("copy_threads") != std::string::npos);
}

TEST_CASE("a bad configuration is refused naming the key, the value and what to change", "[server][config]") {
  CHECK(refusal({{"chunk_sise", 256}}).starts_with("unknown key chunk_sise (256): remove it or check its spelling"));
  CHECK(refusal({{"chunk_size", 0}}) ==
        "chunk_size (0): must be an integer in 1..65536, a multiple of the engine's "
        "block size, e.g. 256");
  CHECK(refusal({{"chunk_size", -3}}).starts_with("chunk_size (-3): must be an integer"));
  CHECK(refusal({{"chunk_size", "256"}}).starts_with("chunk_size (\"256\"): must be an integer"));
  CHECK(refusal({{"eviction_policy", "LRU"}}) == "eviction_policy (\"LRU\"): must be one of lru, s3fifo, arc, noop");
  CHECK(refusal({{"eviction_target", 0.9}})
            .starts_with("eviction_target (0.9): must be >= 0 and below "
                         "eviction_watermark (0.8)"));
  CHECK(refusal({{"l1_size_mb", 1}}).find("raise --l1-size-mb/--l1-size-gb or lower --l1-slot-bytes") !=
        std::string::npos);
  CHECK(refusal({{"l1_size_mb", 64}, {"l1_size_gb", 1}}).starts_with("l1_size (given more than once)"));
  CHECK(refusal({{"l2_backends", json::object()}}).starts_with("l2_backends ({}): must be an array"));
  CHECK(refusal({{"log_level", "verbose"}}).starts_with("log_level (\"verbose\"): must be one of trace"));
  CHECK(refusal({{"l1_prefault", "maybe"}}) == "l1_prefault (\"maybe\"): must be true or false");
  CHECK(refusal({{"l1_prefault", 1}}) == "l1_prefault (1): must be true or false");
  CHECK(refusal({{"l1_huge_pages", "sometimes"}}) == "l1_huge_pages (\"sometimes\"): must be true or false");
  CHECK(refusal({{"socket", std::string(120, 'x')}}).find("shorter than 108 bytes") != std::string::npos);
  CHECK(refusal(json::array()).starts_with("configuration ([]): must be a JSON object"));
}

TEST_CASE("the backend factory parses memory backends and refuses unknown types and keys", "[server][config]") {
  const backend_factory& f = backend_factory::builtin();
  CHECK(f.types() == std::vector<std::string>{"memory"});
  const json list = json::array({json{{"type", "memory"}, {"capacity_gb", 1}, {"bandwidth_gbps", 2.5}},
                                 json{{"type", "memory"}}, json{{"type", "memory"}, {"name", "memory-1"}}});
  const auto specs = f.parse_all(std::vector<json>(list.begin(), list.end()));
  REQUIRE(specs.size() == 3);
  CHECK(specs[0].name == "memory");
  CHECK(specs[1].name == "memory-2");  // memory-1 is taken by the explicit name
  CHECK(specs[2].name == "memory-1");
  CHECK(specs[0].description == "memory, 1024 MiB, 2.5 GB/s");

  boost::asio::io_context io;
  l2::any_backend b = specs[0].create(backend_context{io.get_executor(), nullptr}, specs[0].name);
  CHECK(b.name() == "memory");
  CHECK(b.usage().bytes_capacity == std::uint64_t{1} << 30);

  auto refused = [&](const json& j) {
    try {
      (void)f.parse(j, 0);
    } catch (const config_error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  CHECK(refused({{"type", "disk"}})
            .starts_with("l2_backends[0].type (\"disk\"): this build has no such backend type; "
                         "known types: memory"));
  CHECK(refused({{"capacity_gb", 1}}).starts_with("l2_backends[0].type (missing): give the backend's \"type\""));
  CHECK(refused({{"type", "memory"}, {"capacity_gib", 1}}).starts_with("unknown key l2_backends[0].capacity_gib (1)"));
  CHECK(refused({{"type", "memory"}, {"capacity_mb", 0}}).starts_with("l2_backends[0].capacity (0)"));
  CHECK(refused({{"type", "memory"}, {"latency_us", -1}})
            .starts_with("l2_backends[0].latency_us (-1): must be a number"));
  CHECK(refused(json{{"type", "memory"}}).empty());
  const json dup = json::array({json{{"type", "memory"}, {"name", "a"}}, json{{"type", "memory"}, {"name", "a"}}});
  CHECK_THROWS_AS(f.parse_all(std::vector<json>(dup.begin(), dup.end())), config_error);

  // A program adds its own type.
  backend_factory mine = backend_factory::builtin_copy();
  mine.add_type("null", "nothing", [](json_object_reader&) { return backend_spec{}; });
  CHECK(mine.has_type("null"));
  CHECK_FALSE(f.has_type("null"));
}

TEST_CASE("the run-time prefetch wait policy answers as the three shipped ones", "[server][config]") {
  runtime_wait_policy w;
  const pipeline::timeout_wait t;
  CHECK(w.wait_budget(10'000) == t.wait_budget(10'000));
  CHECK(w.wait_budget(1'000'000) == t.wait_budget(1'000'000));
  w.kind = prefetch_wait_kind::best_effort;
  CHECK(w.wait_budget(10'000) == pipeline::best_effort{}.wait_budget(10'000));
  w.kind = prefetch_wait_kind::wait_complete;
  CHECK(w.wait_budget(10) == w.cap);
  runtime_store_policy s{false};
  CHECK_FALSE(s.keep_in_l1());
  std::vector<bitmap> targets;
  const std::vector<chunk_key> keys(3);
  s.select_targets(keys, 2, targets);
  REQUIRE(targets.size() == 2);
  CHECK(targets[1].count() == 3);
}

TEST_CASE("who may connect and the budgets are configurable, with defaults sized from L1", "[server][config]") {
  const server_config d;
  CHECK(d.socket_mode == 0600);
  CHECK(d.allowed_uids.empty());
  CHECK(d.lookup_keys_per_client() == std::uint64_t{1} << 20);  // 256 slots x 64 < one maximal lookup
  CHECK(d.lookup_keys_total() == std::uint64_t{4} << 20);
  server_config big;
  big.l1_size_bytes = std::uint64_t{64} << 30;  // 16384 slots of 4 MiB
  CHECK(big.lookup_keys_per_client() == 16384 * 64);
  CHECK(big.lookup_keys_total() == 4 * 16384 * 64);

  const json in = {{"socket_mode", "0660"},
                   {"allowed_uids", json::array({4242, "root"})},
                   {"allowed_gids", "4343,0"},
                   {"max_connections", 64},
                   {"max_connections_per_uid", 8},
                   {"max_lookup_keys", 3000000},
                   {"max_lookup_keys_per_client", "auto"}};
  const server_config c = server_config::parse(in);
  CHECK(c.socket_mode == 0660);
  CHECK(c.allowed_uids == std::vector<std::uint32_t>{4242, 0});
  CHECK(c.allowed_gids == std::vector<std::uint32_t>{4343, 0});
  CHECK(c.max_connections == 64);
  CHECK(c.max_connections_per_uid == 8);
  CHECK(c.lookup_keys_total() == 3000000);
  CHECK(c.lookup_keys_per_client() == std::uint64_t{1} << 20);
  CHECK(server_config::parse(c.to_json()) == c);
  CHECK(c.to_json()["socket_mode"] == "0660");
  CHECK(c.to_json()["max_lookup_keys_per_client"] == "auto");

  CHECK_THAT(refusal({{"socket_mode", "0066"}}), Catch::Contains("socket_mode (\"0066\"): must be an octal mode"));
  CHECK_THAT(refusal({{"socket_mode", "rw"}}), Catch::Contains("socket_mode"));
  CHECK_THAT(refusal({{"allowed_uids", json::array({"no-such-user-here"})}}),
             Catch::Contains("allowed_uids (\"no-such-user-here\"): no such user"));
  CHECK_THAT(refusal({{"allowed_gids", json::array({-1})}}), Catch::Contains("allowed_gids (-1)"));
  CHECK_THAT(refusal({{"max_connections", 0}}), Catch::Contains("max_connections (0)"));
  CHECK_THAT(refusal({{"max_connections", 4}, {"max_connections_per_uid", 8}}),
             Catch::Contains("max_connections_per_uid (8): must not exceed max_connections (4)"));
  CHECK_THAT(refusal({{"max_lookup_keys", 100}}),
             Catch::Contains("max_lookup_keys (100): must be at least max_lookup_keys_per_client"));
}

TEST_CASE("sizes beyond the machine's memory are refused before anything is allocated", "[server][config]") {
  CHECK_THAT(refusal({{"l1_size_gb", 1 << 19}}), Catch::Contains("is more than this machine's memory"));
  CHECK_THROWS_WITH(
      backend_factory::builtin().parse(json{{"type", "memory"}, {"capacity_gb", 1 << 19}}, 0),
      Catch::Contains("l2_backends[0].capacity") && Catch::Contains("is more than this machine's memory"));
}

TEST_CASE("configuration text nested too deep is refused while it is parsed", "[server][config]") {
  auto nested = [](std::size_t depth) { return std::string(depth, '[') + std::string(depth, ']'); };
  CHECK(parse_config_text("{\"a\": " + nested(30) + "}", "--config", "f.json").is_object());
  for (const std::size_t depth : {33, 1000, 100000}) {
    try {
      (void)parse_config_text("{\"l2_backends\": " + nested(depth) + "}", "--config", "f.json");
      FAIL("accepted " << depth << " nested arrays");
    } catch (const config_error& e) {
      CHECK(e.option() == "--config");
      CHECK_THAT(e.fix(), Catch::Contains("nested more than 32 deep"));
    }
  }
  CHECK_THROWS_AS(parse_config_text("{\"a\": ", "--config", "f.json"), config_error);
}

TEST_CASE("a refused value is quoted as a short excerpt", "[server][config]") {
  const std::string huge(100000, 'x');
  const std::string r = refusal({{"eviction_policy", huge}});
  CHECK(r.size() < 300);
  CHECK_THAT(r, Catch::Contains("eviction_policy (\"xxxx") && Catch::Contains("(100002 bytes)"));
  const std::string k = refusal({{huge, 1}});
  CHECK(k.size() < 1000);
  CHECK_THAT(k, Catch::Contains("unknown key xxx"));
  CHECK(config_error("a", huge, "fix").value().size() <= max_value_excerpt);
  CHECK(excerpt("short") == "short");
}

TEST_CASE("a configuration file's text that is not JSON is a config_error, whatever the parser throws",
          "[server][config]") {
  // The config fuzz target found 1e400: nlohmann::json reports a number beyond a double's
  // range as out_of_range, which kvtier-server used to let escape (abort).
  auto refusal_of = [](std::string_view text) -> std::string {
    try {
      (void)parse_config_text(text, "--config", "c.json");
    } catch (const config_error& e) {
      return e.what();
    }
    return {};
  };
  CHECK_THAT(refusal_of(R"({"chunk_size": 1e400})"),
             Catch::StartsWith("--config (c.json): not valid JSON") && Catch::Contains("number overflow"));
  CHECK_THAT(refusal_of(R"({"chunk_size": )"), Catch::StartsWith("--config (c.json): not valid JSON"));
  CHECK_THAT(refusal_of(""), Catch::StartsWith("--config (c.json): not valid JSON"));
  CHECK(parse_config_text(R"({"chunk_size": 1e300})", "--config", "c.json")["chunk_size"].get<double>() == 1e300);
  CHECK(server_config::parse(parse_config_text(R"({"chunk_size": 64})", "--config", "c.json")).chunk_tokens == 64);
}

TEST_CASE("a flag's value becomes a JSON number or string, and text that is not UTF-8 is refused",
          "[server][config]") {
  CHECK(flag_value("--chunk-size", "256", true) == json(256));
  CHECK(flag_value("--chunk-size", "lots", true) == json("lots"));  // the reader refuses it later
  CHECK(flag_value("--socket", "256", false) == json("256"));
  CHECK(flag_value("--chunk-size", "1e400", true) == json("1e400"));
  // Found while extending the config fuzz target to flags: a JSON string must be UTF-8, and
  // kvtier-server used to abort (json::type_error 316) on the first message echoing one.
  try {
    (void)flag_value("--eviction-policy", "\xff", false);
    FAIL("no error");
  } catch (const config_error& e) {
    CHECK(e.option() == "--eviction-policy");
    CHECK(e.value() == "\"\xef\xbf\xbd\"");  // U+FFFD for the invalid byte
    CHECK(e.fix() == "must be UTF-8 text");
  }
  CHECK_THROWS_AS(flag_value("--socket", "/tmp/\xc3(.sock", false), config_error);
  CHECK(flag_value("--socket", "/tmp/caf\xc3\xa9.sock", false) == json("/tmp/caf\xc3\xa9.sock"));
}
