#pragma once
// kvtier_long_doc_qa --io-bound-dir: the end-to-end L2-hit figure (main.cpp's header comment
// says what is measured and why). Each trial is one *pair*: the disk's read bandwidth over
// the object files its query round loads, probed right before and right after the round
// (and memcpy's beside each), so the round is compared with the disk as it was then. The
// dev VM's disk read 1.2 to 3 GB/s from one probe to the next: a ratio of two medians taken
// at different moments (and into different buffers: probe_memory) said more about which state
// each drew than about kvtier. A pair whose two probes disagree by more than
// max_probe_disagreement is *split*: reported, never in the medians. Last in each pair, the
// disk and a copy of as many bytes run at once (read_with_copy_seconds): the overlapped bound
// as the machine delivers it, where a copy slows the disk (a VM).

#include <kvtier_program/disk_probe.hpp>
#include <kvtier_program/stats.hpp>
#include "../mini_engine/engine.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace long_doc_qa {

// The probes a pair is made of (kvtier_program/disk_probe.hpp).
using examples::disk_probe::disk_read_bandwidth;
using examples::disk_probe::memcpy_bandwidth;
using examples::disk_probe::probe_files;
using examples::disk_probe::probe_memory;
using examples::disk_probe::read_with_copy;
using examples::disk_probe::read_with_copy_seconds;
using examples::disk_probe::sched_delta;
using examples::disk_probe::sched_sample;
using examples::disk_probe::sched_sample_of;
using examples::disk_probe::sched_time;

/// The pairs of a run (one per trial): each query round between two probes of the disk and
/// of memcpy; the medians over the pairs whose disk probes agree, as RESULT lines.
class io_bound_series {
 public:
  /// Two headline probes of one pair that differ by more than this factor: the disk changed
  /// around the round, which of its states the round saw is unknown: a split pair.
  static constexpr double max_probe_disagreement = 1.5;
  /// Agreeing pairs a figure needs (fewer: a `# ` line says so; the figure is still printed).
  static constexpr std::size_t min_pairs = 7;

  /// Right before the query round of pair `pair`: memcpy of `request_bytes` (one request's
  /// bytes) in `piece`-byte calls, then the disk probes of the files the round loads (the
  /// newest `bytes` under dir/objects): into small reused buffers, then (last, right before
  /// the round: the headline) spread over one request's bytes of memory. Forward in even
  /// pairs, backward in odd ones; after_round reads the other way round. `server_pid` (the
  /// server's status "pid"; 0: unknown): its threads' CPU and run-queue time is sampled
  /// from the end of this call to the start of after_round.
  void before_round(std::size_t pair, const std::string& dir, std::size_t bytes, std::size_t request_bytes,
                    std::size_t piece, long server_pid) {
    pair_probe p;
    p.pair = pair;
    p.first_backward = pair % 2 == 1;
    p.piece = piece;
    p.request_bytes = request_bytes;
    files_ = std::make_unique<probe_files>(dir, bytes);
    if (!spread_ || spread_->region().size() < std::min(request_bytes, probe_memory::max_region))
      spread_ = std::make_unique<probe_memory>(request_bytes);
    p.probed_bytes = files_->bytes;
    p.huge_fraction = spread_->huge_fraction();
    p.memcpy_before = memcpy_bandwidth(request_bytes, piece);
    p.small_before = disk_read_bandwidth(*files_, p.first_backward);
    p.disk_before = disk_read_bandwidth(*files_, p.first_backward, 16, spread_->region());
    open_ = p;
    server_pid_ = server_pid;
    sched_before_ = sched_sample_of(server_pid_);
  }

  /// Right after the query round `qrep` (not empty) of the pair before_round opened (the
  /// server idle): the disk probes in the other direction (spread first, then small), then
  /// memcpy; prints the pair's line and returns its JSON.
  nlohmann::json after_round(const mini_engine::run_report& qrep, double tokens_per_second, std::size_t token_bytes) {
    if (!open_ || !files_) throw std::logic_error("io_bound_series::after_round without before_round");
    const sched_time sched = sched_delta(sched_before_, sched_sample_of(server_pid_));
    pair_probe p = *open_;
    open_.reset();
    p.disk_after = disk_read_bandwidth(*files_, !p.first_backward, 16, spread_->region());
    p.small_after = disk_read_bandwidth(*files_, !p.first_backward);
    p.memcpy_after = memcpy_bandwidth(p.request_bytes, p.piece);
    // Last, both directions: run before the round, the together probe changed the headline
    // probe right after it (faster reads in 2 of 3 alternating runs), so it runs where the
    // next pair's warmup round separates it from any headline probe.
    p.together_a = read_with_copy_seconds(*files_, !p.first_backward, spread_->region(), p.piece);
    p.together_b = read_with_copy_seconds(*files_, p.first_backward, spread_->region(), p.piece);
    files_.reset();
    double kv_s = 0, bytes = 0;
    for (const auto& r : qrep.requests) {
      kv_s += r.ttft_s - (tokens_per_second > 0 ? static_cast<double>(r.computed_tokens) / tokens_per_second : 0);
      bytes += static_cast<double>(r.retrieved_tokens * token_bytes);
    }
    const double nreq = static_cast<double>(qrep.requests.size());
    p.kvtier_s = kv_s / nreq;
    p.bytes = bytes / nreq;
    p.server_cpu_s = sched.cpu_s / nreq;
    p.server_wait_s = sched.wait_s / nreq;
    const double lo = std::min(p.disk_before, p.disk_after), hi = std::max(p.disk_before, p.disk_after);
    p.disagreement = lo > 0 ? hi / lo : 0;
    p.agree = lo > 0 && p.disagreement <= max_probe_disagreement;
    // The disk's bandwidth during the round: the mean of the two probes' (the stricter of
    // the two means: it gives the shorter disk time).
    p.disk_bps = (p.disk_before + p.disk_after) / 2;
    p.small_bps = (p.small_before + p.small_after) / 2;
    p.memcpy_bps = (p.memcpy_before + p.memcpy_after) / 2;
    p.disk_s = p.bytes / p.disk_bps;
    p.small_s = p.bytes / p.small_bps;
    p.copy_s = p.bytes / p.memcpy_bps;
    p.serial_s = p.disk_s + p.copy_s;            // the old figure: nothing overlapped
    p.overlap_s = std::max(p.disk_s, p.copy_s);  // the copy of one chunk overlaps the read of the next
    // The disk and the copy measured together (read_with_copy_seconds), as rates over the
    // probed bytes like the others, then per request.
    const auto rate = [&](double s) { return s > 0 ? static_cast<double>(p.probed_bytes) / s : 0.0; };
    p.read_with_copy_bps = (rate(p.together_a.read_s) + rate(p.together_b.read_s)) / 2;
    p.together_bps = (rate(p.together_a.both_s) + rate(p.together_b.both_s)) / 2;
    p.together_s = p.together_bps > 0 ? p.bytes / p.together_bps : 0;
    std::fprintf(stderr,
                 "pair %zu: %.1f MiB per request; kvtier %.4f s; disk %.2f GB/s before (%s), %.2f after (%s)%s "
                 "(%.0f%% huge pages) -> "
                 "%.4f s (small buffers: %.2f | %.2f GB/s); memcpy %.2f | %.2f GB/s; vs disk %.3f (small buffers "
                 "%.3f), vs max(disk, copy) %.3f, vs disk + copy %.3f; disk with a copy beside it %.2f GB/s, both "
                 "%.4f s -> vs together %.3f; server CPU %.1f ms per request, %.1f ms waiting for a CPU\n",
                 p.pair, p.bytes / 1048576, p.kvtier_s, p.disk_before / 1e9, p.first_backward ? "backward" : "forward",
                 p.disk_after / 1e9, p.first_backward ? "forward" : "backward",
                 p.agree ? "" : " SPLIT: the probes disagree, not in the medians", p.huge_fraction * 100, p.disk_s,
                 p.small_before / 1e9, p.small_after / 1e9, p.memcpy_before / 1e9, p.memcpy_after / 1e9, ratio_disk(p),
                 ratio_small(p), ratio_overlap(p), ratio_serial(p), p.read_with_copy_bps / 1e9, p.together_s,
                 ratio_together(p), p.server_cpu_s * 1e3, p.server_wait_s * 1e3);
    pairs_.push_back(p);
    return to_json(p);
  }

  [[nodiscard]] bool empty() const noexcept { return pairs_.empty(); }

  /// The summary for the JSON report: counts, the medians and spread over agreeing pairs,
  /// the split pairs' ratios.
  [[nodiscard]] nlohmann::json summary() const {
    const auto ok = agreeing();
    nlohmann::json split = nlohmann::json::array();
    for (const auto& p : pairs_)
      if (!p.agree)
        split.push_back({{"pair", p.pair}, {"ttft_vs_disk_time", ratio_disk(p)}, {"disagreement", p.disagreement}});
    return {{"pairs", ok.size()},
            {"pairs_split", pairs_.size() - ok.size()},
            {"max_probe_disagreement", max_probe_disagreement},
            {"ttft_vs_disk_time", median_of(ok, &ratio_disk)},
            {"ttft_vs_disk_time_p25", quantile_of(ok, &ratio_disk, 0.25)},
            {"ttft_vs_disk_time_p75", quantile_of(ok, &ratio_disk, 0.75)},
            {"ttft_vs_disk_time_min", quantile_of(ok, &ratio_disk, 0)},
            {"ttft_vs_disk_time_max", quantile_of(ok, &ratio_disk, 1)},
            {"ttft_vs_disk_time_small_buffers", median_of(ok, &ratio_small)},
            {"ttft_vs_overlap_bound", median_of(ok, &ratio_overlap)},
            {"ttft_vs_io_bound", median_of(ok, &ratio_serial)},
            {"ttft_vs_together_bound", median_of(ok, &ratio_together)},
            {"split", split}};
  }

  /// The RESULT lines (names end in `suffix`): medians over the agreeing pairs, the spread of
  /// the headline ratio (p25, p75, min, max) and the pair counts; `# ` lines for the split
  /// pairs and for too few agreeing ones. With `recompute_ratios` (L2 mode: the query round
  /// was served from L2, the warmup computed the same documents) also l2_hit_vs_recompute.
  void print_results(const std::string& suffix, const std::vector<double>* recompute_ratios) const {
    using kvtier::program::median;
    const char* sfx = suffix.c_str();
    const auto ok = agreeing();
    std::printf("RESULT l2_hit_pairs%s=%zu\n", sfx, ok.size());
    std::printf("RESULT l2_hit_pairs_split%s=%zu\n", sfx, pairs_.size() - ok.size());
    for (const auto& p : pairs_)
      if (!p.agree)
        std::printf(
            "# l2_hit%s: split pair %zu: disk %.2f GB/s before, %.2f after (%.2fx apart); vs disk %.3f, not "
            "in the medians\n",
            sfx, p.pair, p.disk_before / 1e9, p.disk_after / 1e9, p.disagreement, ratio_disk(p));
    if (ok.size() < min_pairs)
      std::printf(
          "# l2_hit%s: only %zu of %zu pairs have disk probes within %.1fx of each other (%zu wanted): the "
          "l2_hit figures below rest on fewer pairs%s\n",
          sfx, ok.size(), pairs_.size(), max_probe_disagreement, min_pairs,
          ok.empty() ? "; with none, they are not printed" : "");
    if (!ok.empty()) {
      std::printf("RESULT l2_hit_kvtier_s%s=%.6f\n", sfx, median_of(ok, &pair_probe::kvtier_s));
      std::printf("RESULT l2_hit_io_bound_s%s=%.6f\n", sfx, median_of(ok, &pair_probe::serial_s));
      std::printf("RESULT l2_hit_disk_read_gbps%s=%.4f\n", sfx, median_of(ok, &pair_probe::disk_bps) / 1e9);
      std::printf("RESULT l2_hit_disk_read_small_buffers_gbps%s=%.4f\n", sfx,
                  median_of(ok, &pair_probe::small_bps) / 1e9);
      std::printf("RESULT l2_hit_memcpy_gbps%s=%.4f\n", sfx, median_of(ok, &pair_probe::memcpy_bps) / 1e9);
      std::printf("RESULT l2_hit_bytes_per_request%s=%.1f\n", sfx, median_of(ok, &pair_probe::bytes));
      std::printf("RESULT l2_hit_ttft_vs_io_bound%s=%.6f\n", sfx, median_of(ok, &ratio_serial));
      std::printf("RESULT l2_hit_disk_time_s%s=%.6f\n", sfx, median_of(ok, &pair_probe::disk_s));
      std::printf("RESULT l2_hit_copy_time_s%s=%.6f\n", sfx, median_of(ok, &pair_probe::copy_s));
      std::printf("RESULT l2_hit_overlap_bound_s%s=%.6f\n", sfx, median_of(ok, &pair_probe::overlap_s));
      std::printf("RESULT l2_hit_ttft_vs_overlap_bound%s=%.6f\n", sfx, median_of(ok, &ratio_overlap));
      if (median_of(ok, &pair_probe::together_s) > 0) {  // io_uring: the together probe ran
        std::printf("RESULT l2_hit_disk_read_with_copy_gbps%s=%.4f\n", sfx,
                    median_of(ok, &pair_probe::read_with_copy_bps) / 1e9);
        std::printf("RESULT l2_hit_together_bound_s%s=%.6f\n", sfx, median_of(ok, &pair_probe::together_s));
        std::printf("RESULT l2_hit_ttft_vs_together_bound%s=%.6f\n", sfx, median_of(ok, &ratio_together));
      }
      std::printf("RESULT l2_hit_ttft_vs_disk_time%s=%.6f\n", sfx, median_of(ok, &ratio_disk));
      std::printf("RESULT l2_hit_ttft_vs_disk_time%s_p25=%.6f\n", sfx, quantile_of(ok, &ratio_disk, 0.25));
      std::printf("RESULT l2_hit_ttft_vs_disk_time%s_p75=%.6f\n", sfx, quantile_of(ok, &ratio_disk, 0.75));
      std::printf("RESULT l2_hit_ttft_vs_disk_time%s_min=%.6f\n", sfx, quantile_of(ok, &ratio_disk, 0));
      std::printf("RESULT l2_hit_ttft_vs_disk_time%s_max=%.6f\n", sfx, quantile_of(ok, &ratio_disk, 1));
      std::printf("RESULT l2_hit_ttft_vs_disk_time_small_buffers%s=%.6f\n", sfx, median_of(ok, &ratio_small));
      std::printf("RESULT l2_hit_server_cpu_s%s=%.6f\n", sfx, median_of(ok, &pair_probe::server_cpu_s));
      std::printf("RESULT l2_hit_server_cpu_wait_s%s=%.6f\n", sfx, median_of(ok, &pair_probe::server_wait_s));
    }
    if (recompute_ratios) std::printf("RESULT l2_hit_vs_recompute%s=%.6f\n", sfx, median(*recompute_ratios));
  }

 private:
  struct pair_probe {
    std::size_t pair = 0;
    bool first_backward = false;  ///< the probes before the round read backward (those after: forward)
    std::size_t piece = 0, request_bytes = 0, probed_bytes = 0;
    double memcpy_before = 0, memcpy_after = 0;
    double disk_before = 0, disk_after = 0;      ///< into memory spread over one request's bytes (the headline)
    double small_before = 0, small_after = 0;    ///< into small reused buffers
    double kvtier_s = 0, bytes = 0;              ///< means over the round's requests
    double server_cpu_s = 0, server_wait_s = 0;  ///< per request: the server's CPU time, and its wait for a CPU
    double disagreement = 0;                     ///< the faster spread probe / the slower
    double huge_fraction = 0;                    ///< of the spread probes' memory
    bool agree = false;
    double disk_bps = 0, small_bps = 0, memcpy_bps = 0;
    double disk_s = 0, small_s = 0, copy_s = 0, serial_s = 0, overlap_s = 0;
    /// The disk and a copy at once, both after the round (the after pass's direction, then the
    /// other); zeros where io_uring is refused.
    read_with_copy together_a, together_b;
    double read_with_copy_bps = 0, together_bps = 0, together_s = 0;
  };

  static double ratio_disk(const pair_probe& p) { return p.kvtier_s / p.disk_s; }
  static double ratio_small(const pair_probe& p) { return p.kvtier_s / p.small_s; }
  static double ratio_overlap(const pair_probe& p) { return p.kvtier_s / p.overlap_s; }
  static double ratio_serial(const pair_probe& p) { return p.kvtier_s / p.serial_s; }
  static double ratio_together(const pair_probe& p) { return p.together_s > 0 ? p.kvtier_s / p.together_s : 0; }

  [[nodiscard]] std::vector<const pair_probe*> agreeing() const {
    std::vector<const pair_probe*> out;
    for (const auto& p : pairs_)
      if (p.agree) out.push_back(&p);
    return out;
  }
  template <class F>
  static std::vector<double> values(const std::vector<const pair_probe*>& ps, F f) {
    std::vector<double> v;
    for (const auto* p : ps) v.push_back(std::invoke(f, *p));
    return v;
  }
  template <class F>
  static double median_of(const std::vector<const pair_probe*>& ps, F f) {
    return kvtier::program::median(values(ps, f));
  }
  template <class F>
  static double quantile_of(const std::vector<const pair_probe*>& ps, F f, double q) {
    return kvtier::program::percentile(values(ps, f), q);
  }

  static nlohmann::json to_json(const pair_probe& p) {
    return {{"bytes_per_request", p.bytes},
            {"kvtier_s", p.kvtier_s},
            {"disk_read_gbps", p.disk_bps / 1e9},
            {"disk_read_gbps_before", p.disk_before / 1e9},
            {"disk_read_gbps_after", p.disk_after / 1e9},
            {"disk_read_small_buffers_gbps_before", p.small_before / 1e9},
            {"disk_read_small_buffers_gbps_after", p.small_after / 1e9},
            {"probe_before", p.first_backward ? "backward" : "forward"},
            {"probed_bytes", p.probed_bytes},
            {"probe_memory_huge_pages", p.huge_fraction},
            {"probe_disagreement", p.disagreement},
            {"probes_agree", p.agree},
            {"memcpy_gbps", p.memcpy_bps / 1e9},
            {"memcpy_gbps_before", p.memcpy_before / 1e9},
            {"memcpy_gbps_after", p.memcpy_after / 1e9},
            {"disk_time_s", p.disk_s},
            {"disk_time_small_buffers_s", p.small_s},
            {"copy_time_s", p.copy_s},
            {"overlap_bound_s", p.overlap_s},
            {"io_bound_s", p.serial_s},
            {"disk_read_with_copy_gbps", p.read_with_copy_bps / 1e9},
            {"together_bound_s", p.together_s},
            {"ttft_vs_together_bound", ratio_together(p)},
            {"ttft_vs_disk_time", ratio_disk(p)},
            {"ttft_vs_disk_time_small_buffers", ratio_small(p)},
            {"ttft_vs_overlap_bound", ratio_overlap(p)},
            {"ratio", ratio_serial(p)},
            {"server_cpu_s_per_request", p.server_cpu_s},
            {"server_cpu_wait_s_per_request", p.server_wait_s}};
  }

  std::optional<pair_probe> open_;        ///< the pair between before_round and after_round
  std::unique_ptr<probe_files> files_;    ///< its files, open from before_round to after_round
  std::unique_ptr<probe_memory> spread_;  ///< the spread probes' memory (kept across pairs)
  long server_pid_ = 0;
  sched_sample sched_before_;  ///< the server's threads at the end of before_round
  std::vector<pair_probe> pairs_;
};

}  // namespace long_doc_qa
