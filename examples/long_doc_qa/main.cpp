// kvtier_long_doc_qa: the long-document QA workload (LMCache's long_doc_qa benchmark) on the
// mini engine, through the connector, against a running kvtier-server.
//
//   kvtier_long_doc_qa --socket /tmp/kvtier.sock --documents 8 --tokens 10000
//   kvtier_long_doc_qa --socket S --l2-mode --model tiny --json out.json     (the CI gate)
//
// N documents of L tokens (distinct first tokens: no document is a prefix of another) are
// sent once in a warmup round, which fills the cache, then again in a query round:
//   --mode tile         d0 d1 .. dN-1, repeated --repeat-count times
//   --mode interleave   d0 d0 .. d1 d1 ..  (each document --repeat-count times in a row)
//   --mode random       the tile order shuffled (--seed)
//   --hit-miss-ratio H:M  after every H warm documents, M new ones (misses) join the round.
// At most --max-inflight requests are in flight; a request's TTFT runs from when it got in.
// Each round reports TTFT mean, p50, p99 and its time, as text (stderr) and as JSON
// (--json FILE, "-" for stdout); the last line is `RESULT query_ttft_vs_warmup=<ratio>` (the
// median over --trials of query mean TTFT / warmup mean TTFT; below 1 means the cache helps).
//
// --l2-mode: the server must run with --eviction-policy noop --l2-store-policy skip_l1 and
// an L2 backend, so the warmup writes through to L2 and leaves L1 empty; the driver waits
// until it is (every store landed), and the query round can only be served by prefetch from
// L2. The JSON then says how many keys the query round needed from L2
// (expect.l2_prefetch_loaded_keys): what kvtier_l2_prefetch_loaded_keys_total must read
// (tests/l2_telemetry_gate.sh checks it). Exact with --repeat-count 1 (a document queried
// twice may be served the second time by the first one's prefetch).
//
// --io-bound-dir DIR (with --l2-mode; DIR = the server's disk backend path): the end-to-end
// L2-hit figure, one *pair* per trial. Right before the query round: memcpy bandwidth (the
// bytes of one request, copied in chunk-sized memcpy calls over a working set of up to
// 2 x 256 MiB, pre-touched), then the disk's read bandwidth over the object files the round
// loads (the warmup just stored them: the newest files under DIR/objects, as many bytes as the
// round's documents; O_DIRECT, 1 MiB reads, 16 in flight: the depth the disk backend uses;
// one io_uring reading into registered memory, as the server reads into its registered L1,
// else 16 threads), twice: into small reused buffers (the earlier probe), then into a region
// of one request's bytes in huge pages (the headline: where a read lands changes its speed by
// up to 1.5x on the dev VM, kvtier_program/disk_probe.hpp's probe_memory says why). Right after the round (once
// the server is idle): the same files again, read the other way round (even pairs: forward
// before, backward after; odd pairs the reverse), then memcpy again. Per pair:
//   kvtier_s  = mean over query requests of (TTFT - computed tokens / --tokens-per-second)
//   bytes     = mean over query requests of retrieved tokens x bytes per token
//   disk_s    = bytes / mean of the two headline probes' bandwidths; copy_s likewise (memcpy)
//   ratios    kvtier_s / disk_s, / max(disk_s, copy_s) (the overlap bound), / (disk_s + copy_s)
//   together  the same reads while a memcpy of as many bytes runs beside them, until both end
//             (twice, both directions, after the round's last probe): the overlap bound as the
//             machine delivers it; on the dev VM a copy in the guest slows its virtual disk.
//             RESULT l2_hit_ttft_vs_together_bound, l2_hit_together_bound_s,
//             l2_hit_disk_read_with_copy_gbps (io_uring only)
// A pair whose two headline probes differ by more than 1.5x is *split* (the disk changed
// around the round: the dev VM's throughput drifts by minutes) and kept out of the medians: `# split pair` lines name
// them. RESULT l2_hit_ttft_vs_disk_time<--result-suffix> is the median over the agreeing pairs, with its spread (_p25,
// _p75, _min, _max) and the counts (l2_hit_pairs, l2_hit_pairs_split); a `# ` line says when fewer than 7 pairs agree.
// Use
// --max-inflight 1 so a TTFT holds no queueing. The server's loads are O_DIRECT too
// (l2::disk_backend): the probe before a round warms no page cache the round could use. Each
// pair also says the server's CPU time per request and its time waiting for a CPU
// (/proc/PID/task/*/schedstat, PID from the server's status).
//
// Retrieved KV is checked against recomputation on every --verify-every'th token (default 16,
// one per block): checking costs the mini engine as much as computing, so checking every
// token would charge the query round what the cache saves.
//
// Exit status: 0 when every request completed with correct output (and, in L2 mode, the
// query round got every warm chunk from the cache), 1 otherwise, 2 on bad arguments or a
// server that cannot run the workload.
//
// The parts: options.hpp (the command line, the engine's configuration fitted to the
// server), rounds.hpp (query order, TTFT summaries, waiting for the server to go idle),
// io_bound.hpp (the --io-bound-dir pairs) over kvtier_program/disk_probe.hpp (what a pair measures); here,
// one trial and the report.
#include <kvtier_program/stats.hpp>
#include "../mini_engine/engine.hpp"
#include "../mini_engine/workload.hpp"
#include "io_bound.hpp"
#include "options.hpp"
#include "rounds.hpp"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <exception>
#include <fstream>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

namespace {

using long_doc_qa::json;

/// What the server's counters must read once idle, summed over trials (keys = chunk shards),
/// and each trial's query/warmup TTFT ratio.
struct trial_totals {
  std::size_t stored_chunks = 0, needed_from_l2 = 0, query_hit_requests = 0, query_miss_requests = 0;
  std::size_t warm_retrieved_chunks = 0;
  std::vector<double> ratios;
};

/// The run: the options, the workload fitted to the server, and the engine that sends it.
struct qa_run {
  const long_doc_qa::driver_options& o;
  const long_doc_qa::hit_miss_mix& mix;
  const long_doc_qa::workload_shape& shape;
  mini_engine::engine& eng;
  std::chrono::seconds drain_timeout;
  long server_pid = 0;  ///< from the server's status (0: unknown): the io-bound pairs sample its CPU time
};

json config_json(const qa_run& run) {
  const auto& o = run.o;
  const auto& cfg = run.shape.cfg;
  return {{"documents", o.documents},
          {"tokens", o.tokens},
          {"mode", o.mode},
          {"repeat_count", o.repeat_count},
          {"hit_miss_ratio", o.hit_miss},
          {"max_inflight", o.max_inflight},
          {"output_tokens", o.output_tokens},
          {"model", o.model},
          {"layers", cfg.shape.num_layers},
          {"kv_heads", cfg.shape.num_kv_heads},
          {"head_dim", cfg.shape.head_dim},
          {"token_bytes", cfg.shape.token_bytes()},
          {"world_size", o.world_size},
          {"chunk_tokens", cfg.chunk_tokens},
          {"tokens_per_second", o.tokens_per_second},
          {"l2_mode", o.l2_mode},
          {"declare_prefill_rate", o.declare_prefill_rate},
          {"trials", o.trials},
          {"seed", o.seed},
          {"verify_every", o.verify_every}};
}

/// One trial's report, and whether both its rounds completed with correct output.
struct trial_result {
  json report;
  bool ok = false;
};

/// Trial t: a warmup round over fresh documents, a wait for the stores to land, the query
/// round (with the misses of the hit:miss mix), a wait for the server to go idle. Adds to
/// `totals` and `io`; nullopt when the server did not drain in time (said on stderr).
std::optional<trial_result> run_trial(const qa_run& run, std::size_t t, trial_totals& totals,
                                      long_doc_qa::io_bound_series& io) {
  const auto& o = run.o;
  const auto& cfg = run.shape.cfg;
  const std::size_t full_chunks = run.shape.full_chunks;
  const std::uint64_t trial_seed = o.seed + 1'000'003ULL * t;
  // Warm documents first, then the misses: distinct first tokens across both (and trials).
  const std::size_t misses = run.mix.misses_per_group ? (o.repeat_count * o.documents + run.mix.hits_per_group - 1) /
                                                            run.mix.hits_per_group * run.mix.misses_per_group
                                                      : 0;
  auto all_docs = mini_engine::make_documents(o.documents + misses, o.tokens, trial_seed);
  for (auto& d : all_docs) d[0] += static_cast<kvtier::token_id>(t * 100'000);  // distinct across trials
  const std::vector<std::vector<kvtier::token_id>> warm(all_docs.begin(),
                                                        all_docs.begin() + static_cast<std::ptrdiff_t>(o.documents));
  const std::string tag = "t" + std::to_string(t);

  // Warmup: every document once.
  auto wrep = run.eng.run(mini_engine::round_of(warm, tag + "-warmup", o.output_tokens));
  auto wsum = long_doc_qa::summarize("warmup", wrep, o.documents);
  totals.stored_chunks += o.documents * full_chunks;
  // The stores land in L1 then L2 in the background: wait for them (L2 mode: and for L1
  // to have dropped every chunk, so that the query round can only hit L2).
  const auto drained = long_doc_qa::wait_status(o.socket, run.drain_timeout, [&](const json& s) {
    return long_doc_qa::store_idle(s) && (!o.l2_mode || s["l1"]["objects"] == 0);
  });
  if (!drained) {
    std::fprintf(stderr, "kvtier_long_doc_qa: the server's stores did not drain within %.0f s (--drain-timeout)\n",
                 o.drain_timeout_s);
    return std::nullopt;
  }

  // Query round.
  std::vector<mini_engine::request_spec> specs;
  std::size_t next_miss = o.documents, since_miss = 0, n = 0;
  for (std::size_t d : long_doc_qa::query_order(o.documents, o.repeat_count, o.mode, trial_seed)) {
    specs.push_back({tag + "-query-" + std::to_string(n++), warm[d], o.output_tokens, 0});
    ++totals.query_hit_requests;
    totals.needed_from_l2 += full_chunks;
    if (run.mix.misses_per_group && ++since_miss == run.mix.hits_per_group) {
      since_miss = 0;
      for (std::size_t m = 0; m < run.mix.misses_per_group && next_miss < all_docs.size(); ++m) {
        specs.push_back({tag + "-query-" + std::to_string(n++), all_docs[next_miss++], o.output_tokens, 0});
        ++totals.query_miss_requests;
        totals.stored_chunks += full_chunks;
      }
    }
  }
  const std::size_t query_requests = specs.size();
  // Chunks the engine takes from the cache: it computes at least the last token itself.
  const std::size_t usable = (o.tokens - 1) / cfg.chunk_tokens;
  // The pair's first probes, right before the round: the files the warmup just stored (every
  // chunk the round loads, once), memcpy of one request's bytes.
  const bool probing = !o.io_bound_dir.empty();
  if (probing)
    io.before_round(t, o.io_bound_dir, o.documents * usable * cfg.chunk_tokens * cfg.shape.token_bytes(),
                    full_chunks * run.shape.shard_bytes, run.shape.shard_bytes, run.server_pid);
  auto qrep = run.eng.run(std::move(specs));
  auto qsum = long_doc_qa::summarize("query", qrep, query_requests);
  std::size_t warm_hits = 0;
  for (const auto& r : qrep.requests) totals.warm_retrieved_chunks += r.retrieved_tokens / cfg.chunk_tokens;
  for (const auto& r : qrep.requests) warm_hits += r.retrieved_tokens >= usable * cfg.chunk_tokens ? 1 : 0;
  if (!long_doc_qa::wait_status(o.socket, run.drain_timeout, long_doc_qa::store_idle)) {
    std::fprintf(stderr, "kvtier_long_doc_qa: the server did not go idle within %.0f s (--drain-timeout)\n",
                 o.drain_timeout_s);
    return std::nullopt;
  }
  wsum.print();
  qsum.print();
  // The pair's second probes, right after the round (the server idle: nothing of it competes).
  json io_json = nullptr;
  if (probing && !qrep.requests.empty()) io_json = io.after_round(qrep, o.tokens_per_second, cfg.shape.token_bytes());
  const double ratio = wsum.ttft.mean > 0 ? qsum.ttft.mean / wsum.ttft.mean : 0;
  totals.ratios.push_back(ratio);
  return trial_result{{{"warmup", wsum.to_json()},
                       {"query", qsum.to_json()},
                       {"query_ttft_vs_warmup", ratio},
                       {"query_requests_fully_served", warm_hits},
                       {"io_bound", io_json}},
                      wsum.ok && qsum.ok};
}

/// Keys (chunk shards) the counters of a fresh server must read once idle.
json expectations(const qa_run& run, const trial_totals& totals) {
  const std::size_t shards = run.o.world_size;
  return {
      {"l2_store_keys", totals.stored_chunks * shards},
      {"l1_write_keys_min", totals.stored_chunks * shards},
      // With a declared prefill rate the gate decides what loads: no exact count to expect.
      {"l2_prefetch_loaded_keys",
       run.o.l2_mode && !run.o.declare_prefill_rate ? json(totals.needed_from_l2 * shards) : json(nullptr)},
      {"query_hit_requests", totals.query_hit_requests},
      {"query_miss_requests", totals.query_miss_requests},
      {"query_chunks_needed", totals.needed_from_l2},
      {"query_chunks_retrieved", totals.warm_retrieved_chunks},
  };
}

/// Every trial, then the report (JSON, RESULT lines); the exit status.
int run_workload(const qa_run& run) {
  const auto& o = run.o;
  const auto& cfg = run.shape.cfg;
  std::fprintf(stderr,
               "long_doc_qa: %zu documents x %zu tokens (%zu full chunks of %u), mode %s x%zu%s, %u in flight, "
               "model %s (%zu bytes/token), %s\n",
               o.documents, o.tokens, run.shape.full_chunks, cfg.chunk_tokens, o.mode.c_str(), o.repeat_count,
               o.hit_miss.empty() ? "" : (", hit:miss " + o.hit_miss).c_str(), o.max_inflight, o.model.c_str(),
               cfg.shape.token_bytes(), o.l2_mode ? "L2 mode (query round from L2 only)" : "L1 + L2");

  json report;
  report["config"] = config_json(run);
  report["trials"] = json::array();
  trial_totals totals;
  long_doc_qa::io_bound_series io;
  // The server faults L1 in (and registers it) behind its first requests: the first trial
  // would time that start-up work too (a 2 GiB L1 took 0.9 s in 4 KiB pages, 5.8 s in huge
  // pages on the dev VM). Every trial runs once it has ended.
  if (!long_doc_qa::wait_status(o.socket, run.drain_timeout, long_doc_qa::l1_settled)) {
    std::fprintf(stderr, "kvtier_long_doc_qa: the server's L1 prefault did not end within %.0f s (--drain-timeout)\n",
                 o.drain_timeout_s);
    return 1;
  }
  bool ok = true;
  for (std::size_t t = 0; t < o.trials; ++t) {
    auto trial = run_trial(run, t, totals, io);
    if (!trial) return 1;
    ok = ok && trial->ok;
    report["trials"].push_back(std::move(trial->report));
  }

  report["expect"] = expectations(run, totals);
  const double result = kvtier::program::median(totals.ratios);
  report["query_ttft_vs_warmup"] = result;
  if (!io.empty()) report["l2_hit_pairs"] = io.summary();
  // L2 mode: every warm query must have been served whole from L2 (unless the engine declared
  // its prefill rate: then the gate may decline chunks, which the engine computes).
  const std::size_t usable = (o.tokens - 1) / cfg.chunk_tokens;
  if (o.l2_mode && o.declare_prefill_rate)
    std::fprintf(stderr, "long_doc_qa: L2 mode, declared prefill rate: %zu of %zu warm chunks loaded from L2\n",
                 totals.warm_retrieved_chunks, totals.query_hit_requests * usable);
  else if (o.l2_mode && totals.warm_retrieved_chunks != totals.query_hit_requests * usable) {
    std::fprintf(stderr,
                 "kvtier_long_doc_qa: L2 mode: the query round retrieved %zu chunks, expected %zu (%zu warm requests "
                 "x %zu chunks)\n",
                 totals.warm_retrieved_chunks, totals.query_hit_requests * usable, totals.query_hit_requests, usable);
    ok = false;
  }
  report["ok"] = ok;
  if (o.json_path == "-")
    std::cout << report.dump(2) << "\n";
  else if (!o.json_path.empty())
    std::ofstream(o.json_path) << report.dump(2) << "\n";
  if (!io.empty()) io.print_results(o.result_suffix, o.l2_mode ? &totals.ratios : nullptr);
  std::printf("RESULT query_ttft_vs_warmup=%.6f\n", result);
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"kvtier long-document QA: warmup and query rounds over long documents, TTFT per round"};
  long_doc_qa::driver_options o;
  long_doc_qa::add_cli_options(app, o);
  CLI11_PARSE(app, argc, argv);

  const auto mix = long_doc_qa::parse_hit_miss(o.hit_miss);
  if (!mix) return 2;
  const auto shape = long_doc_qa::fit_to_server(o, long_doc_qa::engine_config_for(o));
  if (!shape) return 2;
  const auto drain_timeout = std::chrono::seconds(static_cast<std::int64_t>(std::ceil(o.drain_timeout_s)));

  try {
    mini_engine::engine eng(shape->cfg);
    if (!eng.healthy()) {
      std::fprintf(stderr, "kvtier_long_doc_qa: the connector could not register with the server on %s\n",
                   o.socket.c_str());
      return 2;
    }
    return run_workload(qa_run{o, *mix, *shape, eng, drain_timeout, shape->server_pid});
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvtier_long_doc_qa: %s\n", e.what());
    return 2;
  }
}
