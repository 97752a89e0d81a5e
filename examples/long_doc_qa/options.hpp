#pragma once
// kvtier_long_doc_qa: the command line, and the mini engine's configuration for it against the
// server that will run the workload (main.cpp's header comment describes the flags).

#include <kvtier/protocol/unix_socket.hpp>
#include <kvtier_program/process.hpp>
#include "../mini_engine/engine.hpp"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <cstdio>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace long_doc_qa {

struct driver_options {
  std::string socket = kvtier::protocol::default_socket_path();
  std::size_t documents = 8, tokens = 10'000, repeat_count = 1, trials = 1;
  std::uint32_t max_inflight = 4, output_tokens = 1, world_size = 1;
  std::string mode = "tile", hit_miss = "", model = "0.5b", json_path;
  std::uint32_t layers = 0, kv_heads = 0, head_dim = 0;
  std::uint32_t chunk_size = 0;
  double tokens_per_second = 50'000;
  std::uint32_t num_blocks = 0;
  std::uint64_t seed = 42;
  std::uint32_t verify_every = 16;
  bool l2_mode = false;
  bool declare_prefill_rate = false;
  double drain_timeout_s = 120;
  std::string io_bound_dir, result_suffix;
};

inline void add_cli_options(CLI::App& app, driver_options& o) {
  app.add_option("--socket", o.socket, "The kvtier-server socket")->capture_default_str();
  app.add_option("--documents", o.documents, "Documents (N)")->capture_default_str()->check(CLI::Range(1, 100000));
  app.add_option("--tokens", o.tokens, "Tokens per document (L)")->capture_default_str()->check(CLI::Range(2, 1000000));
  app.add_option("--mode,--repeat-mode", o.mode, "Query round order: tile, interleave or random")
      ->capture_default_str()
      ->check(CLI::IsMember({"tile", "interleave", "random"}));
  app.add_option("--repeat-count", o.repeat_count, "Times each warm document is queried")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  app.add_option("--hit-miss-ratio", o.hit_miss, "H:M: after every H warm documents, M new ones (default: hits only)");
  app.add_option("--max-inflight", o.max_inflight, "Requests in flight at once")
      ->capture_default_str()
      ->check(CLI::Range(1, 4096));
  app.add_option("--output-tokens", o.output_tokens, "Output tokens per request")->capture_default_str();
  app.add_option("--model", o.model, "KV shape: tiny, 0.5b or 8b (--layers/--kv-heads/--head-dim override)")
      ->capture_default_str()
      ->check(CLI::IsMember({"tiny", "0.5b", "8b"}));
  app.add_option("--layers", o.layers, "Model layers (overrides --model)");
  app.add_option("--kv-heads", o.kv_heads, "KV heads, all ranks (overrides --model)");
  app.add_option("--head-dim", o.head_dim, "Head dimension (overrides --model)");
  app.add_option("--world-size", o.world_size, "Tensor-parallel ranks (1 or 2)")
      ->capture_default_str()
      ->check(CLI::Range(1, 2));
  app.add_option("--chunk-size", o.chunk_size, "Tokens per chunk (default: the server's)");
  app.add_option("--tokens-per-second", o.tokens_per_second, "Prefill compute cost (0: free)")->capture_default_str();
  app.add_option("--num-blocks", o.num_blocks, "KV blocks per rank (default: enough for --max-inflight requests)");
  app.add_option("--verify-every", o.verify_every,
                 "Check every n-th retrieved token against recomputation (1: all; checking costs as much as computing)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--seed", o.seed, "Document and order seed")->capture_default_str();
  app.add_option("--trials", o.trials, "Warmup + query pairs on fresh documents (RESULT: the median ratio)")
      ->capture_default_str()
      ->check(CLI::Range(1, 100));
  app.add_flag("--l2-mode", o.l2_mode, "Query round served from L2 only (server: noop eviction, skip_l1 store)");
  app.add_flag("--declare-prefill-rate", o.declare_prefill_rate,
               "The engine declares --tokens-per-second to the server: lookups offer from L2 only what loads faster "
               "than it computes (the load-or-recompute gate); in --l2-mode the query round may then compute "
               "chunks the gate declined");
  app.add_option("--drain-timeout", o.drain_timeout_s, "Seconds to wait for the server's stores to land")
      ->capture_default_str();
  app.add_option("--io-bound-dir", o.io_bound_dir,
                 "With --l2-mode: the disk backend's path; each trial's L2-hit TTFT against the disk read time of "
                 "its bytes, probed right before and right after its query round (RESULT "
                 "l2_hit_ttft_vs_disk_time: the median over pairs whose probes agree within 1.5x)");
  app.add_option("--result-suffix", o.result_suffix, "Appended to the l2_hit_* RESULT names (e.g. _05b)");
  app.add_option("--json", o.json_path, "Write the JSON report here (\"-\": stdout)");
}

/// --hit-miss-ratio H:M: after every H warm documents, M new ones (0:0 when not given).
struct hit_miss_mix {
  std::size_t hits_per_group = 0, misses_per_group = 0;
};

/// The mix `text` asks for (empty: hits only); nullopt, after saying why on stderr, when it is
/// not H:M with H >= 1.
inline std::optional<hit_miss_mix> parse_hit_miss(const std::string& text) {
  hit_miss_mix m;
  if (text.empty()) return m;
  const auto colon = text.find(':');
  try {
    if (colon == std::string::npos) throw std::invalid_argument("no colon");
    m.hits_per_group = std::stoul(text.substr(0, colon));
    m.misses_per_group = std::stoul(text.substr(colon + 1));
    if (m.hits_per_group == 0) throw std::invalid_argument("zero hits");
  } catch (const std::exception&) {
    std::fprintf(stderr, "kvtier_long_doc_qa: --hit-miss-ratio (%s): write it as H:M with H >= 1, e.g. 3:1\n",
                 text.c_str());
    return std::nullopt;
  }
  return m;
}

struct shape_preset {
  const char* name;
  kvtier::model_shape shape;
  const char* what;
};

// KV geometry of real models (bf16): bytes per 256-token chunk in brackets.
inline const std::vector<shape_preset>& presets() {
  static const std::vector<shape_preset> p = {
      {"tiny",
       {4, 2, 64, kvtier::dtype_kind::bf16, kvtier::attention_kind::mha},
       "4 layers, 2 KV heads, head dim 64 (0.5 MiB)"},
      {"0.5b",
       {24, 2, 64, kvtier::dtype_kind::bf16, kvtier::attention_kind::mha},
       "Qwen2.5-0.5B: 24 layers, 2 KV heads, head dim 64 (3 MiB)"},
      {"8b",
       {32, 8, 128, kvtier::dtype_kind::bf16, kvtier::attention_kind::mha},
       "Llama-3.1-8B: 32 layers, 8 KV heads, head dim 128 (32 MiB)"},
  };
  return p;
}

/// The mini engine's configuration for the workload, before the server is asked.
inline mini_engine::engine_config engine_config_for(const driver_options& o) {
  mini_engine::engine_config cfg;
  for (const auto& p : presets())
    if (o.model == p.name) cfg.shape = p.shape;
  if (o.layers) cfg.shape.num_layers = o.layers;
  if (o.kv_heads) cfg.shape.num_kv_heads = o.kv_heads;
  if (o.head_dim) cfg.shape.head_dim = o.head_dim;
  cfg.world_size = o.world_size;
  cfg.tokens_per_second = o.tokens_per_second;
  cfg.declare_prefill_rate = o.declare_prefill_rate;
  cfg.max_running = o.max_inflight;
  cfg.max_in_flight = o.max_inflight;
  cfg.verify_every = o.verify_every;
  cfg.socket_path = o.socket;
  cfg.model_name = "long-doc-qa/" + o.model;
  return cfg;
}

/// What the server's status fixes for the workload.
struct workload_shape {
  mini_engine::engine_config cfg;  ///< with the server's chunk size and the blocks the rounds need
  std::size_t shard_bytes = 0;     ///< bytes of one chunk shard (one rank's share of a chunk)
  std::size_t full_chunks = 0;     ///< whole chunks per document
  long server_pid = 0;             ///< the server's process (its status's "pid"; 0: not given)
};

/// Fits `cfg` to the server on o.socket: its chunk size, a slot for one chunk shard, and in
/// L2 mode its policies. nullopt, after saying what to change on stderr, when no server
/// answers or it cannot run the workload.
inline std::optional<workload_shape> fit_to_server(const driver_options& o, mini_engine::engine_config cfg) {
  // The server decides the chunk size and must have room for one chunk shard per slot.
  const auto status = examples::server_status(o.socket);
  if (!status || status->is_discarded()) {
    std::fprintf(stderr, "kvtier_long_doc_qa: no kvtier-server answers on %s: start one (kvtier-server --socket %s)\n",
                 o.socket.c_str(), o.socket.c_str());
    return std::nullopt;
  }
  const std::uint32_t server_chunk = (*status)["chunk_tokens"].get<std::uint32_t>();
  if (o.chunk_size != 0 && o.chunk_size != server_chunk) {
    std::fprintf(stderr, "kvtier_long_doc_qa: --chunk-size %u but the server hashes %u-token chunks: drop the flag\n",
                 o.chunk_size, server_chunk);
    return std::nullopt;
  }
  cfg.chunk_tokens = server_chunk;
  if (cfg.chunk_tokens % cfg.block_size != 0) cfg.block_size = 1;
  const std::size_t shard_bytes = cfg.shape.token_bytes() / o.world_size * cfg.chunk_tokens;
  const std::size_t slot_bytes = (*status)["l1"]["slot_bytes"].get<std::size_t>();
  if (shard_bytes > slot_bytes) {
    std::fprintf(stderr,
                 "kvtier_long_doc_qa: one chunk of this model is %zu bytes per rank but the server's L1 slots hold "
                 "%zu: start kvtier-server with --l1-slot-bytes %zu or more\n",
                 shard_bytes, slot_bytes, shard_bytes);
    return std::nullopt;
  }
  if (o.l2_mode) {
    const bool noop = (*status)["eviction_policy"] == "noop";
    const bool skip = (*status)["store_policy"] == "skip_l1";
    if (!noop || !skip || (*status)["backends"].empty()) {
      std::fprintf(stderr,
                   "kvtier_long_doc_qa: --l2-mode needs a server with --eviction-policy noop --l2-store-policy skip_l1 "
                   "and an --l2-backend (this one: eviction %s, store %s, %zu backends)\n",
                   (*status)["eviction_policy"].get<std::string>().c_str(),
                   (*status)["store_policy"].get<std::string>().c_str(), (*status)["backends"].size());
      return std::nullopt;
    }
  }
  if (!o.io_bound_dir.empty() && !o.l2_mode) {
    std::fprintf(stderr, "kvtier_long_doc_qa: --io-bound-dir needs --l2-mode\n");
    return std::nullopt;
  }
  const std::size_t per_request_blocks = (o.tokens + o.output_tokens + cfg.block_size - 1) / cfg.block_size;
  cfg.num_blocks =
      o.num_blocks ? o.num_blocks : static_cast<std::uint32_t>(per_request_blocks * (o.max_inflight + 1) + 16);
  const long pid = status->contains("pid") && (*status)["pid"].is_number_integer() ? (*status)["pid"].get<long>() : 0;
  return workload_shape{cfg, shard_bytes, o.tokens / cfg.chunk_tokens, pid};
}

}  // namespace long_doc_qa
