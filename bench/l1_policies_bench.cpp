// kvtier_bench_l1_policies: hit ratio and speed of each L1 eviction policy on synthetic traces,
// driven through a real l1::tier the way the cache server drives it.
//
// Each request is a sequence of chunk keys (one key for the Zipf traces). As LMCache's
// submit_prefetch_task does: reserve_read the whole sequence, count the leading hits (what an
// engine can use), finish_read every success, then store the keys from the first miss on
// (reserve_write mode new, finish_write). hit_ratio = leading hits / keys requested.
//
// Traces (deterministic seeds):
//   zipf_08      1,000,000 requests over 100,000 keys, Zipf alpha 0.8
//   zipf_10      the same with alpha 1.0
//   scan_zipf    Zipf 1.0 over 100,000 keys, and every 100,000 requests a scan of 20,000
//                keys used once (a batch job sweeping documents): 800,000 + 160,000 requests
//   long_doc_qa  30,000 questions on 2,000 documents (Zipf 0.8 popularity); a request is a
//                2-chunk system prompt shared by all, the document's 30 chunks, and 2 chunks
//                of question used once: 34 keys per request
// Cache: 10% of the reused keys (10,000 objects; 6,400 for long_doc_qa), 4 KiB slots.
// Eviction: watermark 1.0, target capacity - 16 objects, so every policy uses the whole
// capacity and evicts in small batches (the tier's defaults, 0.8 / 0.7, are measured on
// scan_zipf as `_default_watermark`).
//
// Figures per policy and trace: hit_ratio (deterministic) and mops = millions of requested
// keys handled per second, the median of 3 repeats interleaved across policies.
//
//   kvtier_bench_l1_policies [--quick]
#include <kvtier/l1/policy/arc.hpp>
#include <kvtier/l1/policy/lru.hpp>
#include <kvtier/l1/policy/noop.hpp>
#include <kvtier/l1/policy/s3fifo.hpp>
#include <kvtier/l1/tier.hpp>

#include <common/results.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

namespace {

using namespace kvtier;

struct trace {
  std::string name;
  std::vector<std::uint64_t> keys;         // all requests, concatenated
  std::vector<std::uint32_t> request_end;  // end offset of each request in `keys`
  std::size_t cache_objects = 0;
  double watermark = 1.0;
  double target = 0.0;  // 0: capacity - 16 objects
};

// Inverse-CDF sampling of Zipf(alpha) over ranks 0..n-1.
class zipf {
 public:
  zipf(std::size_t n, double alpha) : cdf_(n) {
    double sum = 0;
    for (std::size_t i = 0; i < n; ++i) cdf_[i] = (sum += 1.0 / std::pow(static_cast<double>(i + 1), alpha));
    for (auto& c : cdf_) c /= sum;
  }
  std::size_t operator()(std::mt19937_64& rng) const {
    const double u = static_cast<double>(rng() >> 11) * 0x1.0p-53;
    return static_cast<std::size_t>(std::lower_bound(cdf_.begin(), cdf_.end(), u) - cdf_.begin());
  }

 private:
  std::vector<double> cdf_;
};

trace zipf_trace(std::string name, double alpha, std::size_t requests) {
  trace t{std::move(name), {}, {}, 10'000};
  const zipf z(100'000, alpha);
  std::mt19937_64 rng(0x2023);
  for (std::size_t i = 0; i < requests; ++i) {
    t.keys.push_back(z(rng));
    t.request_end.push_back(static_cast<std::uint32_t>(t.keys.size()));
  }
  return t;
}

trace scan_zipf_trace(std::size_t rounds) {
  trace t{"scan_zipf", {}, {}, 10'000};
  const zipf z(100'000, 1.0);
  std::mt19937_64 rng(0x5ca9);
  std::uint64_t next_scan_key = 1'000'000;
  for (std::size_t r = 0; r < rounds; ++r) {
    for (std::size_t i = 0; i < 100'000; ++i) {
      t.keys.push_back(z(rng));
      t.request_end.push_back(static_cast<std::uint32_t>(t.keys.size()));
    }
    for (std::size_t i = 0; i < 20'000; ++i) {
      t.keys.push_back(next_scan_key++);
      t.request_end.push_back(static_cast<std::uint32_t>(t.keys.size()));
    }
  }
  return t;
}

trace long_doc_qa_trace(std::size_t questions) {
  trace t{"long_doc_qa", {}, {}, 6'400};
  constexpr std::size_t docs = 2'000, doc_chunks = 30;
  const zipf z(docs, 0.8);
  std::mt19937_64 rng(0xd0c5);
  std::uint64_t next_question_key = 10'000'000;
  for (std::size_t q = 0; q < questions; ++q) {
    const std::size_t d = z(rng);
    t.keys.push_back(0);  // the shared system prompt
    t.keys.push_back(1);
    for (std::size_t c = 0; c < doc_chunks; ++c) t.keys.push_back(100 + d * doc_chunks + c);
    t.keys.push_back(next_question_key++);
    t.keys.push_back(next_question_key++);
    t.request_end.push_back(static_cast<std::uint32_t>(t.keys.size()));
  }
  return t;
}

chunk_key key_of(std::uint64_t id) { return chunk_key{42, 1, 0, {id * 0x9e3779b97f4a7c15ULL, id}}; }

struct outcome {
  double hit_ratio = 0;
  double mops = 0;
};

template <class Policy>
outcome run(const trace& t) {
  l1::tier_options o;
  o.slot_bytes = 4096;
  o.slot_count = t.cache_objects;
  o.eviction_watermark = t.watermark;
  o.eviction_target =
      t.target > 0 ? t.target : static_cast<double>(t.cache_objects - 16) / static_cast<double>(t.cache_objects);
  l1::tier<Policy> tier(o);

  std::vector<chunk_key> keys(t.keys.size());
  std::transform(t.keys.begin(), t.keys.end(), keys.begin(), key_of);
  std::vector<l1::status> st;
  std::vector<chunk_key> hit_keys;
  l1::write_options wo;
  wo.lock = l1::lock_lifetime::pinned;
  std::uint64_t hits = 0;

  const auto start = std::chrono::steady_clock::now();
  std::uint32_t begin = 0;
  for (const std::uint32_t end : t.request_end) {
    const std::span<const chunk_key> req(keys.data() + begin, end - begin);
    begin = end;
    st.resize(req.size());
    tier.reserve_read(req, 0, l1::lock_lifetime::pinned, st);
    std::size_t prefix = 0;
    while (prefix < req.size() && st[prefix] == l1::status::success) ++prefix;
    hits += prefix;
    hit_keys.clear();
    for (std::size_t i = 0; i < req.size(); ++i)
      if (st[i] == l1::status::success) hit_keys.push_back(req[i]);
    if (!hit_keys.empty()) {
      st.resize(hit_keys.size());
      tier.finish_read(hit_keys, 0, l1::lock_lifetime::pinned, st);
    }
    if (prefix < req.size()) {
      const auto store = req.subspan(prefix);
      st.resize(store.size());
      if (tier.reserve_write(store, 64, wo, st) > 0) {
        hit_keys.clear();
        for (std::size_t i = 0; i < store.size(); ++i)
          if (st[i] == l1::status::success) hit_keys.push_back(store[i]);
        st.resize(hit_keys.size());
        tier.finish_write(hit_keys, st);
      }
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return {static_cast<double>(hits) / static_cast<double>(t.keys.size()),
          static_cast<double>(t.keys.size()) / seconds / 1e6};
}

struct policy_entry {
  const char* name;
  outcome (*run)(const trace&);
};

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  const std::size_t scale = quick ? 10 : 1;
  std::vector<trace> traces;
  traces.push_back(zipf_trace("zipf_08", 0.8, 1'000'000 / scale));
  traces.push_back(zipf_trace("zipf_10", 1.0, 1'000'000 / scale));
  traces.push_back(scan_zipf_trace(8 / (quick ? 4 : 1)));
  traces.push_back(long_doc_qa_trace(30'000 / scale));
  trace defaults = traces[2];
  defaults.name = "scan_zipf_default_watermark";
  defaults.watermark = 0.8;
  defaults.target = 0.7;
  traces.push_back(std::move(defaults));

  const policy_entry policies[] = {
      {"lru", &run<l1::lru>}, {"s3fifo", &run<l1::s3fifo>}, {"arc", &run<l1::arc>}, {"noop", &run<l1::noop>}};
  constexpr int repeats = 3;

  std::map<std::string, double> hit_ratio;
  std::map<std::string, std::vector<double>> mops;
  for (const auto& t : traces) {
    for (int r = 0; r < repeats; ++r) {
      for (const auto& p : policies) {  // interleaved: p1, p2, ..., p1, p2, ...
        const outcome o = p.run(t);
        const std::string id = std::string(p.name) + "_" + t.name;
        if (r > 0 && o.hit_ratio != hit_ratio[id])
          std::fprintf(stderr, "warning: %s is not deterministic\n", id.c_str());
        hit_ratio[id] = o.hit_ratio;
        mops[id].push_back(o.mops);
      }
    }
    std::printf("%-28s (%zu keys, cache %zu):", t.name.c_str(), t.keys.size(), t.cache_objects);
    for (const auto& p : policies) {
      const std::string id = std::string(p.name) + "_" + t.name;
      std::printf("  %s %.4f @ %.2f Mkeys/s", p.name, hit_ratio[id], bench::median(mops[id]));
    }
    std::printf("\n");
  }
  for (const auto& t : traces)
    for (const auto& p : policies) {
      const std::string id = std::string(p.name) + "_" + t.name;
      bench::print_result(id + "_hit_ratio", hit_ratio[id]);
      bench::print_result(id + "_mops", bench::median(mops[id]));
    }
  return 0;
}
