#pragma once
// mini_engine::engine: a stand-in for an inference engine that uses the kvtier connector as
// a real one would (vLLM's KV connector flow), for the demo, the fault-tolerance harness and
// the long-document QA driver.
//
//   - a paged KV cache in a kv_region per rank (world size 1 or 2, ranks in lockstep);
//   - continuous batching: each step admits requests, polls lookups, issues retrieves, runs
//     up to max_batch_tokens of prefill over the running requests, stores new full chunks,
//     and calls get_finished on every rank;
//   - a deterministic prefill (kv_model.hpp): KV bytes derive from the prefix, position, layer
//     and head, so every retrieved block is compared with recomputation, and every output
//     token (a hash over the last token's KV) is checked;
//   - a compute cost per token (default 50,000 tokens/s, a mid-size model on one GPU): a
//     step lasts at least its tokens / tokens_per_second (the CPU sleeps, as it would while
//     a GPU computes);
//   - quarantined blocks are never allocated; blocks of chunks that failed to load are
//     replaced by fresh ones and recomputed.
// Without a socket path it runs with no connector at all (the baseline of degraded mode).

#include "kv_model.hpp"

#include <kvtier/bus/event_bus.hpp>
#include <kvtier/core/kv_region.hpp>
#include <kvtier/core/token_hasher.hpp>
#include <kvtier/engine/connector.hpp>
#include <kvtier/telemetry/metrics_subscriber.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace mini_engine {

using clock = std::chrono::steady_clock;
using metrics_bus = kvtier::bus::basic_event_bus<kvtier::telemetry::metrics_subscriber>;
using connector_type = kvtier::engine::connector<metrics_bus>;

struct engine_config {
  kvtier::model_shape shape{24, 2, 64, kvtier::dtype_kind::bf16,
                            kvtier::attention_kind::mha};  ///< the whole model (all ranks)
  std::uint32_t block_size = 16;
  std::uint32_t num_blocks = 4096;  ///< per rank: 65,536 tokens (0.8 GB for the default shape)
  std::uint32_t chunk_tokens = 256;
  std::uint32_t world_size = 1;
  double tokens_per_second = 50'000;  ///< prefill compute cost
  /// Declare tokens_per_second to the cache server (connector_options::
  /// prefill_tokens_per_second): its lookups then offer from L2 only what loads faster than
  /// this engine computes it (docs/performance.md, "Load or recompute").
  bool declare_prefill_rate = false;
  std::uint32_t max_batch_tokens = 16384;
  std::uint32_t max_running = 4;
  /// Requests arrived (looked up, queued or running) at once; 0: no cap. A request past
  /// the cap has not arrived yet: its TTFT clock starts when it gets in (a client that
  /// keeps this many requests in flight, as LMCache's long-document QA benchmark does).
  std::uint32_t max_in_flight = 0;
  /// Retrieved KV checked against recomputation: every token (1), or every n-th token of
  /// each retrieve and its last (a sample that still catches a wrong block or chunk, at 1/n
  /// of the cost: checking costs as much as computing, which would hide what the cache saves).
  std::uint32_t verify_every = 1;
  std::string socket_path;                  ///< empty: no connector at all
  std::optional<std::uint32_t> server_uid;  ///< the server's uid (connector_options::server_uid)
  std::string model_name = "mini-engine";
  kvtier::engine::connector_timeouts timeouts{};
  std::chrono::milliseconds connect_wait{3000};  ///< wait_ready at start (0: do not wait)
};

struct request_spec {
  std::string id;
  std::vector<kvtier::token_id> tokens;
  std::uint32_t output_tokens = 1;
  double arrival_s = 0;  ///< offset from the run's start
};

struct request_report {
  std::string id;
  std::size_t prompt_tokens = 0;
  std::size_t hit_tokens = 0;        ///< tokens the connector said it had
  std::size_t retrieved_tokens = 0;  ///< tokens whose KV came from the cache and verified
  std::size_t computed_tokens = 0;
  double ttft_s = 0;
  double latency_s = 0;
  bool output_ok = false;
};

struct run_report {
  std::vector<request_report> requests;
  double duration_s = 0;
  std::size_t completed = 0;
  std::size_t wrong_outputs = 0;       ///< output tokens that did not match
  std::size_t corrupt_rows = 0;        ///< retrieved KV rows that did not match recomputation
  std::size_t duplicate_finished = 0;  ///< ids reported finished twice by a connector
  std::size_t load_error_blocks = 0;
  std::size_t tokens_total = 0;
  std::size_t tokens_from_cache = 0;
  std::uint64_t unhealthy_transitions = 0;

  [[nodiscard]] double throughput_tokens_per_s() const { return duration_s > 0 ? tokens_total / duration_s : 0; }
  [[nodiscard]] bool all_ok(std::size_t expected) const {
    return completed == expected && wrong_outputs == 0 && corrupt_rows == 0 && duplicate_finished == 0;
  }
  [[nodiscard]] nlohmann::json to_json() const;
};

class engine {
 public:
  explicit engine(engine_config cfg) : cfg_(std::move(cfg)) {
    if (cfg_.world_size == 0 || cfg_.world_size > 2 || cfg_.shape.num_kv_heads % cfg_.world_size != 0)
      throw std::invalid_argument("mini_engine: world size must be 1 or 2 and divide the KV heads");
    if (cfg_.chunk_tokens % cfg_.block_size != 0)
      throw std::invalid_argument("mini_engine: chunk_tokens must be a multiple of block_size");
    kvtier::model_shape per_rank = cfg_.shape;
    per_rank.num_kv_heads /= cfg_.world_size;
    const kvtier::paged_kv_layout layout{per_rank, cfg_.block_size, cfg_.num_blocks};
    for (std::uint32_t r = 0; r < cfg_.world_size; ++r) {
      auto reg = kvtier::kv_region::create(layout);
      if (!reg) throw std::runtime_error("mini_engine: cannot create the KV region: " + reg.error().message());
      ranks_.push_back(std::make_unique<rank_state>(std::move(*reg), shard{per_rank, r, cfg_.world_size}));
    }
    if (!cfg_.socket_path.empty()) {
      for (auto& rs : ranks_) {
        kvtier::engine::connector_options o;
        o.socket_path = cfg_.socket_path;
        o.rank = static_cast<std::uint16_t>(rs->shard_.rank);
        o.world_size = static_cast<std::uint16_t>(cfg_.world_size);
        o.model_name = cfg_.model_name;
        o.chunk_tokens = cfg_.chunk_tokens;
        o.server_uid = cfg_.server_uid;
        o.timeouts = cfg_.timeouts;
        if (cfg_.declare_prefill_rate && cfg_.tokens_per_second > 0)
          o.prefill_tokens_per_second = static_cast<std::uint64_t>(cfg_.tokens_per_second);
        rs->conn = std::make_unique<connector_type>(o, rs->region, rs->events);
      }
      if (cfg_.connect_wait.count() > 0)
        for (auto& rs : ranks_)
          if (!rs->conn->wait_ready(cfg_.connect_wait))
            std::fprintf(stderr, "mini_engine: rank %u is not connected to the cache server (serving without it): %s\n",
                         rs->shard_.rank, rs->conn->last_error().c_str());
    }
    for (std::uint32_t b = 0; b < cfg_.num_blocks; ++b) free_.push_back(b);
  }

  engine(const engine&) = delete;
  engine& operator=(const engine&) = delete;

  [[nodiscard]] const engine_config& config() const noexcept { return cfg_; }
  [[nodiscard]] bool has_connector() const noexcept { return ranks_[0]->conn != nullptr; }
  [[nodiscard]] bool healthy() const { return has_connector() && ranks_[0]->conn->healthy(); }
  /// The metrics of rank r's connector (its bus feeds this registry).
  [[nodiscard]] const kvtier::telemetry::registry& metrics(std::uint32_t r = 0) const { return ranks_[r]->reg; }

  /// Stops a running run() at the next step (from another thread); run() returns what
  /// completed so far.
  void cancel() noexcept { cancelled_.store(true); }

  /// Runs the requests to completion (or cancel()) and reports.
  run_report run(std::vector<request_spec> specs);

 private:
  struct rank_state {
    rank_state(kvtier::kv_region r, shard s)
        : region(std::move(r)), shard_(s), events(kvtier::telemetry::metrics_subscriber{reg}) {}
    kvtier::kv_region region;
    shard shard_;
    kvtier::telemetry::registry reg;
    metrics_bus events;
    std::unique_ptr<connector_type> conn;
    std::set<std::string> recv_seen;  ///< ids reported finished receiving (duplicate check)
    std::set<std::string> send_seen;  ///< ids reported finished sending (duplicate check)
  };

  enum class phase { waiting, lookup, allocate, retrieving, prefill, storing, done };

  struct request {
    request_spec spec;
    std::vector<std::uint64_t> hashes;  ///< token-level prefix hashes
    std::vector<std::uint32_t> blocks;
    phase ph = phase::waiting;
    clock::time_point arrival{};
    std::size_t hit_tokens = 0;
    std::size_t retrieved_tokens = 0;
    std::size_t computed = 0;          ///< tokens whose KV is in the blocks
    std::size_t retrieve_pending = 0;  ///< ranks whose retrieve has not finished
    std::size_t send_pending = 0;      ///< ranks that have not reported finished sending
    bool finished_by_engine = false;
    bool reported = false;  ///< passed to get_finished
    request_report report;
  };

  static constexpr std::uint32_t no_block = UINT32_MAX;  ///< a block to allocate before use

  std::uint32_t allocate_block();
  bool allocate(request& r);
  bool ensure_blocks(request& r, std::size_t first_token, std::size_t last_token);
  void release_blocks(request& r);
  void start_retrieve(request& r);
  void finish_retrieve(request& r);
  void prefill_step(std::vector<request*>& running, run_report& rep);
  void complete(request& r, run_report& rep);

  engine_config cfg_;
  std::vector<std::unique_ptr<rank_state>> ranks_;
  std::deque<std::uint32_t> free_;
  std::vector<std::uint32_t> held_;  ///< freed blocks that were quarantined: not allocatable yet
  std::atomic<bool> cancelled_{false};
  std::size_t verify_rows_ = 0;          ///< retrieved rows that did not match recomputation (this run)
  std::size_t pending_errors_ = 0;       ///< load error blocks (this run)
  std::set<std::uint32_t> load_errors_;  ///< every rank's load-error blocks not yet claimed by their request
};

}  // namespace mini_engine

#include "engine_impl.hpp"
