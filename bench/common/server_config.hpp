#pragma once
// The in-process server the server benchmarks measure: a socket in `dir`, an L1 that holds
// exactly one request of `chunks` objects of `object_bytes` (plus two spare slots) and never
// evicts below it (watermark 1.0), warnings only in the log.

#include <kvtier/core/buffer.hpp>
#include <kvtier/server/config/server_config.hpp>

#include <cstddef>
#include <cstdint>
#include <filesystem>

namespace kvtier::bench {

[[nodiscard]] inline server::server_config one_request_server_config(const std::filesystem::path& dir,
                                                                     std::uint32_t chunk_tokens,
                                                                     std::size_t object_bytes, std::size_t chunks) {
  server::server_config cfg;
  cfg.socket_path = (dir / "s.sock").string();
  cfg.chunk_tokens = chunk_tokens;
  cfg.l1_slot_bytes = align_up(object_bytes);
  cfg.l1_size_bytes = (chunks + 2) * cfg.l1_slot_bytes;
  cfg.eviction_watermark = 1.0;
  cfg.eviction_target = 0.9;
  cfg.log_level = telemetry::log_level::warn;
  return cfg;
}

}  // namespace kvtier::bench
