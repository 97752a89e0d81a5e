// The server's readers of the L2 backends' JSON objects (server/config/disk_backend_json.hpp,
// server/config/redis_options_json.hpp): every key read, every mistake refused with a message that
// names the key.
#include <kvtier/server/config/disk_backend_json.hpp>
#include <kvtier/server/config/redis_options_json.hpp>

#include <catch2/catch.hpp>

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <string>

// This file's names (its test binary is compiled in unity batches with the module's other files).
namespace file_backend_json_test {

using namespace kvtier;

TEST_CASE("the disk backend's JSON options parse with clear errors", "[server][disk]") {
  using nlohmann::json;
  const auto o = server::disk_backend_options_from_json(json::parse(R"({"type": "disk", "name": "nvme0",
      "path": "/mnt/x", "capacity_gb": 1.5, "o_direct": false, "io": "pread", "eviction": "fifo",
      "queue_depth": 32, "part_kib": 512, "sync": "none", "name_sync": "file"})"));
  CHECK(o.name == "nvme0");
  CHECK(o.path == "/mnt/x");
  CHECK(o.capacity_bytes == (std::uint64_t{3} << 29));
  CHECK_FALSE(o.o_direct);
  CHECK(o.io == io::file_io_choice::pread);
  CHECK(o.eviction == l2::disk_eviction::fifo);
  CHECK(o.queue_depth == 32);
  CHECK(o.part_bytes == 512 * 1024);
  CHECK(o.sync == l2::disk_sync::none);
  CHECK(o.name_sync == l2::disk_name_sync::file);
  const auto d = server::disk_backend_options_from_json(json::parse(R"({"path": "/p", "capacity_bytes": 4096})"));
  CHECK(d.capacity_bytes == 4096);
  CHECK(d.name_sync == l2::disk_name_sync::directory);
  CHECK(server::disk_backend_options_from_json(json::parse(R"({"path": "/p", "capacity_gb": 1, "name_sync": "auto"})"))
            .name_sync == l2::disk_name_sync::automatic);
  CHECK(d.sync == l2::disk_sync::data);
  CHECK(d.eviction == l2::disk_eviction::lru);
  CHECK(d.o_direct);
  auto fails = [](const char* text) {
    try {
      (void)server::disk_backend_options_from_json(json::parse(text));
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  CHECK_THAT(fails(R"({"capacity_gb": 1})"), Catch::Contains("'path' is missing"));
  CHECK_THAT(fails(R"({"path": "/p"})"), Catch::Contains("capacity is missing"));
  CHECK_THAT(fails(R"({"path": "/p", "capacity_gb": 1, "capacity_bytes": 5})"), Catch::Contains("keep one"));
  CHECK_THAT(fails(R"({"path": "/p", "capacity_gb": -1})"), Catch::Contains("'capacity_gb' must be"));
  // 1e30 GiB used to overflow the conversion to bytes (undefined behaviour; UBSan in the config
  // fuzz target: tests/fuzz/regressions/config/), then read as "less than one byte".
  CHECK_THAT(fails(R"({"path": "/p", "capacity_gb": 1e30})"), Catch::Contains("more than 1048576 (1 PiB)"));
  CHECK_THAT(fails(R"({"path": "/p", "capacity_gb": 1048577})"), Catch::Contains("more than 1048576 (1 PiB)"));
  CHECK(server::disk_backend_options_from_json(json::parse(R"({"path": "/p", "capacity_gb": 1048576})")).capacity_bytes ==
        std::uint64_t{1} << 50);
  CHECK_THAT(fails(R"({"path": "/p", "capacity_gb": 1, "io": "threads"})"), Catch::Contains("\"pread\""));
  CHECK_THAT(fails(R"({"path": "/p", "capacity_gb": 1, "eviction": "random"})"), Catch::Contains("'eviction'"));
  CHECK_THAT(fails(R"({"path": "/p", "capacity_gb": 1, "name_sync": "fsync"})"),
             Catch::Contains("'name_sync' is \"fsync\": use \"auto\", \"directory\" or \"file\""));
  CHECK_THAT(fails(R"({"path": "/p", "capacity_gb": 1, "o_direct": "yes"})"), Catch::Contains("true or false"));
  CHECK_THAT(fails(R"({"path": "/p", "capacity_gb": 1, "capacity": 3})"), Catch::Contains("unknown key 'capacity'"));
  CHECK_THAT(fails(R"({"type": "redis", "path": "/p", "capacity_gb": 1})"), Catch::Contains("'type'"));
  CHECK_THAT(fails(R"({"path": "/p", "capacity_gb": 1, "queue_depth": 0})"), Catch::Contains("out of range"));
  CHECK_THAT(fails(R"({"path": "/p", "capacity_gb": 1, "high_watermark": 0.5, "low_watermark": 0.8})"),
             Catch::Contains("exceeds"));
}

TEST_CASE("options are checked and read from JSON key for key, passwords never from the configuration",
          "[server][redis]") {
  auto o = server::redis_options_from_json(nlohmann::json::parse(R"({
      "type": "redis", "name": "shared", "nodes": ["10.0.0.1:7000", "10.0.0.2:7000"], "cluster": true,
      "key_prefix": "fleet", "connections_per_node": 8, "ttl_seconds": 3600, "username": "kv",
      "password_env": "KV_REDIS_PASSWORD", "connect_timeout_ms": 250, "reconnect_backoff_min_ms": 10,
      "reconnect_backoff_max_ms": 5000, "info_interval_ms": 2000, "log_interval_ms": 30000,
      "max_redirects": 3, "max_inflight_bytes_per_connection": 8388608})"));
  CHECK(o.name == "shared");
  CHECK(o.nodes.size() == 2);
  CHECK(o.cluster);
  CHECK(o.key_prefix == "fleet");
  CHECK(o.connections_per_node == 8);
  CHECK(o.ttl_seconds == 3600);
  CHECK(o.username == "kv");
  CHECK(o.password_env == "KV_REDIS_PASSWORD");
  CHECK(o.connect_timeout_ms == std::chrono::milliseconds(250));
  CHECK(o.reconnect_backoff_max_ms == std::chrono::milliseconds(5000));
  CHECK(o.info_interval_ms == std::chrono::milliseconds(2000));
  CHECK(o.max_redirects == 3);
  CHECK(o.max_inflight_bytes_per_connection == 8u << 20);
  auto throws_naming = [](const char* json, const char* what) {
    try {
      (void)server::redis_options_from_json(nlohmann::json::parse(json));
      return false;
    } catch (const std::invalid_argument& e) {
      return std::string(e.what()).find(what) != std::string::npos;
    }
  };
  CHECK(throws_naming(R"({"password": "hunter2"})", "password_file"));
  CHECK(throws_naming(R"({"colour": "red"})", "colour"));
  CHECK(throws_naming(R"({"type": "disk"})", "type"));
  CHECK(throws_naming(R"({"ttl_seconds": -1})", "ttl_seconds"));
  CHECK(throws_naming(R"({"cluster": "yes"})", "cluster"));
  CHECK(throws_naming(R"({"nodes": ["a:1", "b:2"]})", "nodes"));  // standalone takes one
  CHECK(throws_naming(R"({"nodes": ["no-port"]})", "nodes"));
  CHECK(throws_naming(R"({"connections_per_node": 0})", "connections_per_node"));
  CHECK(throws_naming(R"({"password_file": "/a", "password_env": "B"})", "not both"));
  CHECK(throws_naming(R"({"cluster": true, "database": 2})", "database"));
}

}  // namespace file_backend_json_test
