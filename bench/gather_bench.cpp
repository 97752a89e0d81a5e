// kvtier_bench_gather: bytes/s of gather_chunk and scatter_chunk (core/kv_transfer.hpp) next
// to a streaming copy and a memcpy of the same total bytes, with cold source and destination.
//
// Two shapes, block size 16, 256-token chunks, bf16:
//   8b    32 layers, 8 KV heads, head dim 128: 32 MiB chunks, 32 KiB block segments
//   05b   24 layers, 2 KV heads, head dim 64:   3 MiB chunks,  4 KiB block segments
// Per shape: a paged KV region and a pool of chunk objects, each at least 4x the last-level
// cache (sysfs cpu0/cache/index3/size, 32 MiB when absent), filled before timing. Every
// chunk is a random set of blocks (a long-running engine's free list is shuffled, so block
// ids are rarely consecutive). Each timed sweep copies `sweep` chunks; a global cursor
// rotates chunk objects and blocks through the whole working set, so a chunk's object and
// blocks were last touched one rotation (>= 4x LLC of traffic) ago. (The baselines read
// region slice c, whose blocks belong to random chunks: under 10% of it was touched by the
// last few copies.) One repeat runs memcpy, stream copy, gather, memcpy, stream copy,
// scatter; a ratio x_vs_memcpy is the median over repeats of x_i / memcpy_i (the memcpy of
// the same repeat just before x), x_vs_stream_copy likewise with the stream copy just
// before x. The memcpy copies one whole chunk (object_bytes) from the region into an object
// in one call (glibc's memcpy: at these sizes it stores through the cache). The stream copy
// (common/stream_copy.hpp: non-temporal AVX-512/AVX/SSE2 stores, 4 parts of the chunk side
// by side, one thread, as gather and scatter run on one thread) copies the same bytes in the
// direction of the op it stands beside: region slice -> object before a gather, object ->
// region slice before a scatter. It is the fastest single-core copy to cold memory we have.
//
// Every sweep is timed twice: wall clock (the RESULT lines without _cpu) and the thread's
// CPU time (CLOCK_THREAD_CPUTIME_ID: the _cpu_ ratios). On a machine shared with other jobs
// the wall clock also counts the time the thread waited for a CPU; the CPU-time ratios show
// whether a wall-clock ratio is that noise.
//
//   kvtier_bench_gather [--quick] [--repeats=N] [--huge-pages] [--explore[=<substrings>]]
//     --quick       5 repeats instead of 21 (--repeats sets any number)
//     --huge-pages  region and objects in transparent huge pages where the kernel grants
//                   them (madvise; the log says how many MiB it did): one TLB entry then
//                   covers 2 MiB, so a gather's random 4 KiB segments need few page walks
//     --explore     also measures the variants tried while optimising (docs/performance.md;
//                   =a,b: only those whose name contains a or b), each against the stream
//                   copy of the same direction just before it: the stream copy with 1-8
//                   parts, memcpy, rep movsb; gather and scatter one copy per segment (the
//                   first version), one streaming copy per run of consecutive ids, 1-8
//                   segments side by side, 0-8 prefetched lines, AVX2, memcpy, chunks
//                   whose block ids are consecutive, and the row path of layouts whose
//                   block segments are not contiguous (kv_strides): K|V packed per (token,
//                   head) as vLLM's GPU backends allocate (blocks, block_size, heads, 2 *
//                   head_dim), one copy per row; vLLM's CPU layout (blocks, heads, 2,
//                   block_size, head_dim), one copy per head's run of rows
//
// Ends with RESULT lines: <op>_<shape>_gbps (medians, op = memcpy, stream_copy, gather,
// scatter), <op>_vs_memcpy_<shape>, <op>_vs_stream_copy_<shape> and
// <op>_vs_stream_copy_cpu_<shape> (op = gather, scatter), stream_copy_vs_memcpy_<shape>.
#include <kvtier/core/buffer.hpp>
#include <kvtier/core/kv_transfer.hpp>

#include <sys/mman.h>
#include <time.h>

#include <common/results.hpp>
#include <common/stream_copy.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <vector>

namespace {

using namespace kvtier;
using clock_type = std::chrono::steady_clock;

std::size_t llc_bytes() {
  std::ifstream f("/sys/devices/system/cpu/cpu0/cache/index3/size");
  std::string s;
  if (!(f >> s) || s.empty()) return std::size_t{32} << 20;
  std::size_t mult = 1;
  if (s.back() == 'K')
    mult = 1024, s.pop_back();
  else if (s.back() == 'M')
    mult = std::size_t{1} << 20, s.pop_back();
  else if (s.back() == 'G')
    mult = std::size_t{1} << 30, s.pop_back();
  try {
    const std::size_t v = std::stoull(s) * mult;
    return v ? v : std::size_t{32} << 20;
  } catch (...) {
    return std::size_t{32} << 20;
  }
}

struct shape_case {
  const char* name;
  model_shape model;
};

/// Asks for transparent huge pages (2 MiB) on the 2 MiB-aligned interior of `b` (THP in
/// "madvise" mode gives them only where asked). Before the first touch.
void advise_huge_pages(aligned_buffer& b) {
  constexpr std::uintptr_t huge = std::uintptr_t{1} << 21;
  const auto begin = reinterpret_cast<std::uintptr_t>(b.data());
  const std::uintptr_t first = (begin + huge - 1) & ~(huge - 1);
  const std::uintptr_t last = (begin + b.size()) & ~(huge - 1);
  if (last > first && ::madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE) != 0)
    std::perror("madvise(MADV_HUGEPAGE)");
}

/// This process's anonymous memory in transparent huge pages, in MiB (smaps_rollup).
std::size_t anon_huge_mib() {
  std::ifstream f("/proc/self/smaps_rollup");
  std::string key;
  std::size_t kib = 0;
  while (f >> key)
    if (key == "AnonHugePages:" && (f >> kib)) return kib >> 10;
  return 0;
}

/// How a fixture's paged region lays out its blocks.
enum class region_layout {
  dense,       ///< NHD [2][blocks][block_size][heads][head_dim]: whole segments
  gpu_packed,  ///< (blocks, block_size, heads, 2 * head_dim): K|V per (token, head), the row path
  cpu_packed,  ///< (blocks, heads, 2, block_size, head_dim), HND: the row path, a head's rows at once
};

/// The strides of `kind` for layout `l` (dense: none).
kv_strides strides_of(region_layout kind, const paged_kv_layout& l) {
  const std::uint64_t row = l.head_row_bytes(), heads = l.model.num_kv_heads, bs = l.block_size;
  kv_strides s{};
  if (kind == region_layout::gpu_packed) s = {0, row, bs * heads * 2 * row, heads * 2 * row, 2 * row};
  if (kind == region_layout::cpu_packed) s = {0, bs * row, heads * 2 * bs * row, row, 2 * bs * row};
  if (kind != region_layout::dense) s.layer = s.block * l.num_blocks;
  return s;
}

/// One shape's working set: paged region, object pool, block lists.
class fixture {
 public:
  fixture(const model_shape& m, std::size_t ws_bytes, std::uint32_t block_size, std::uint32_t chunk_tokens,
          bool consecutive_ids, bool huge_pages, region_layout kind = region_layout::dense)
      : chunk_{m, chunk_tokens} {
    const std::size_t obj = chunk_.object_bytes();
    num_chunks_ = (ws_bytes + obj - 1) / obj;
    const std::uint32_t per_chunk = chunk_tokens / block_size;
    layout_ = paged_kv_layout{m, block_size, static_cast<std::uint32_t>(num_chunks_ * per_chunk),
                              kind == region_layout::cpu_packed ? kv_layout_kind::hnd : kv_layout_kind::nhd};
    layout_.strides = strides_of(kind, layout_);
    if (const std::string e = layout_.validation_error(); !e.empty()) {
      std::fprintf(stderr, "bad layout: %s\n", e.c_str());
      std::exit(1);
    }
    region_ = aligned_buffer(layout_.total_bytes());
    objects_ = aligned_buffer(num_chunks_ * obj);
    if (huge_pages) {
      advise_huge_pages(region_);
      advise_huge_pages(objects_);
    }
    // Touch everything before timing (page faults are not what we measure).
    std::memset(region_.data(), 0x5a, region_.size());
    std::memset(objects_.data(), 0xa5, objects_.size());
    const std::size_t layer_stride = layout_.effective_strides().layer;
    for (std::uint32_t l = 0; l < m.num_layers; ++l) layers_.push_back(region_.data() + l * layer_stride);
    std::vector<std::uint32_t> all(layout_.num_blocks);
    std::iota(all.begin(), all.end(), 0u);
    if (!consecutive_ids) std::shuffle(all.begin(), all.end(), std::mt19937_64{42});
    for (std::size_t c = 0; c < num_chunks_; ++c)
      blocks_.emplace_back(all.begin() + c * per_chunk, all.begin() + (c + 1) * per_chunk);
  }

  [[nodiscard]] paged_kv_view view() const { return {layout_, layers_}; }
  [[nodiscard]] const chunk_layout& chunk() const { return chunk_; }
  [[nodiscard]] std::size_t num_chunks() const { return num_chunks_; }
  [[nodiscard]] std::size_t working_set() const { return region_.size() + objects_.size(); }

  /// The next chunk in rotation: its blocks, its object, the region bytes a memcpy reads.
  struct slot {
    std::span<const std::uint32_t> blocks;
    std::byte* object;
    std::byte* region_slice;
  };
  slot next() {
    const std::size_t c = cursor_++ % num_chunks_;
    return {blocks_[c], objects_.data() + c * chunk_.object_bytes(), region_.data() + c * chunk_.object_bytes()};
  }

 private:
  chunk_layout chunk_;
  paged_kv_layout layout_;
  std::size_t num_chunks_ = 0;
  aligned_buffer region_;
  aligned_buffer objects_;
  std::vector<std::byte*> layers_;
  std::vector<std::vector<std::uint32_t>> blocks_;
  std::size_t cursor_ = 0;
};

/// One way to copy a chunk, timed over a sweep.
using chunk_op = std::function<void(fixture&, const fixture::slot&)>;

void check(std::error_code ec) {
  if (ec) {
    std::fprintf(stderr, "transfer failed: %s\n", ec.message().c_str());
    std::exit(1);
  }
}

double thread_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

/// GB/s of one sweep, by the wall clock and by the thread's CPU time.
struct rate {
  double wall;
  double cpu;
};

/// Runs `op` over `sweep` chunks.
rate run_sweep(fixture& f, std::size_t sweep, const chunk_op& op) {
  const auto t0 = clock_type::now();
  const double c0 = thread_cpu_seconds();
  for (std::size_t i = 0; i < sweep; ++i) op(f, f.next());
  const double c = thread_cpu_seconds() - c0;
  const double s = std::chrono::duration<double>(clock_type::now() - t0).count();
  const double bytes = static_cast<double>(sweep * f.chunk().object_bytes());
  return {bytes / s / 1e9, bytes / c / 1e9};
}

/// The rates of one op over the repeats.
struct series {
  std::vector<double> wall, cpu;
  void add(rate r) { wall.push_back(r.wall), cpu.push_back(r.cpu); }
};

chunk_op stream_in(int streams) {  // as a gather: region -> object
  return [streams](fixture& f, const fixture::slot& s) {
    bench::stream_copy(s.object, s.region_slice, f.chunk().object_bytes(), streams);
  };
}
chunk_op stream_out(int streams) {  // as a scatter: object -> region
  return [streams](fixture& f, const fixture::slot& s) {
    bench::stream_copy(s.region_slice, s.object, f.chunk().object_bytes(), streams);
  };
}
const chunk_op op_memcpy = [](fixture& f, const fixture::slot& s) {
  std::memcpy(s.object, s.region_slice, f.chunk().object_bytes());
};
const chunk_op op_gather = [](fixture& f, const fixture::slot& s) {
  check(gather_chunk(f.view(), s.blocks, f.chunk(), s.object));
};
const chunk_op op_scatter = [](fixture& f, const fixture::slot& s) {
  check(scatter_chunk(f.view(), s.blocks, f.chunk(), s.object));
};

// ---- variants tried while optimising (--explore) ----------------------------------------

/// The first version: one memcpy per segment, offsets recomputed per segment from the
/// layout helpers (no hoisting, no run merging).
template <bool Gather>
void naive_copy(fixture& f, const fixture::slot& s) {
  const paged_kv_view v = f.view();
  const chunk_layout& c = f.chunk();
  const std::size_t seg = v.layout.segment_bytes();
  for (std::uint32_t l = 0; l < c.model.num_layers; ++l)
    for (std::uint32_t p = 0; p < c.model.planes(); ++p)
      for (std::uint32_t i = 0; i < s.blocks.size(); ++i) {
        std::byte* paged = v.layers[l] + v.layout.offset_in_layer(p, s.blocks[i]);
        std::byte* obj = s.object + c.offset(l, p, i * v.layout.block_size);
        if constexpr (Gather)
          std::memcpy(obj, paged, seg);
        else
          std::memcpy(paged, obj, seg);
      }
}

template <bool Gather>
chunk_op with_plan(detail::copy_plan plan) {
  return [plan](fixture& f, const fixture::slot& s) {
    if constexpr (Gather)
      detail::copy_chunk<true>(f.view(), s.blocks, f.chunk(), s.object, 0, plan);
    else
      detail::copy_chunk<false>(f.view(), s.blocks, f.chunk(), static_cast<const std::byte*>(s.object), 0, plan);
    detail::store_fence();
  };
}

void rep_movsb(std::byte* dst, const std::byte* src, std::size_t n) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __asm__ volatile("rep movsb" : "+D"(dst), "+S"(src), "+c"(n) : : "memory");
#else
  std::memcpy(dst, src, n);
#endif
}

struct variant {
  std::string name;
  chunk_op op;
  bool gather;               ///< compared with the stream copy region -> object, else object -> region
  bool consecutive = false;  ///< run on a fixture whose chunks have consecutive block ids
  region_layout layout = region_layout::dense;  ///< the fixture's region layout
};

std::vector<variant> explore_variants() {
  std::vector<variant> vars;
  const auto kernels = detail::available_copies();
  const detail::copy_kernel& memcpy_kernel = kernels[0];
  for (int streams : {1, 2, 4, 8})
    vars.push_back({"stream_copy_" + std::to_string(streams) + "_parts", stream_in(streams), true});
  vars.push_back({"glibc_memcpy", op_memcpy, true});
  vars.push_back(
      {"rep_movsb",
       [](fixture& f, const fixture::slot& s) { rep_movsb(s.object, s.region_slice, f.chunk().object_bytes()); },
       true});
  for (int dir = 0; dir < 2; ++dir) {
    const bool gather = dir == 0;
    const std::string d = gather ? "gather" : "scatter";
    auto plan_op = [&](detail::copy_plan plan) { return gather ? with_plan<true>(plan) : with_plan<false>(plan); };
    vars.push_back({d + "_naive_memcpy", gather ? chunk_op(naive_copy<true>) : chunk_op(naive_copy<false>), gather});
    vars.push_back({d + "_memcpy_per_run", plan_op({&memcpy_kernel, 0, gather ? 8u : 0u}), gather});
    for (std::size_t k = 1; k < kernels.size(); ++k) {
      const std::string n = d + "_" + kernels[k].name;
      const bool best = k == 1;
      const std::size_t default_lines = gather ? detail::gather_prefetch_lines : detail::scatter_prefetch_lines;
      // Streams 0: one streaming copy per run of consecutive ids (the previous version).
      for (std::size_t streams : {0u, 1u, 2u, 4u, 8u}) {
        if (!best && streams != 0 && streams != detail::transfer_copy_streams) continue;
        for (std::size_t lines : {0u, 1u, 2u, 4u, 8u}) {
          if (!gather && lines > 1) continue;  // scatter: at most the page of the next destinations
          if (!best && lines != default_lines) continue;
          if (gather && streams != detail::transfer_copy_streams && lines != 0 && lines != 2 && lines != 8) continue;
          vars.push_back({n + "_streams" + std::to_string(streams) + "_prefetch" + std::to_string(lines),
                          plan_op({&kernels[k], streams, lines}), gather});
        }
      }
    }
    vars.push_back({d + "_consecutive_ids", gather ? op_gather : op_scatter, gather, true});
    vars.push_back({d + "_gpu_packed_rows", gather ? op_gather : op_scatter, gather, false, region_layout::gpu_packed});
    vars.push_back({d + "_cpu_packed_rows", gather ? op_gather : op_scatter, gather, false, region_layout::cpu_packed});
  }
  return vars;
}

void run_shape(const shape_case& sc, std::size_t ws, int repeats, bool explore, const std::string& only,
               bool huge_pages) {
  fixture f(sc.model, ws, 16, 256, false, huge_pages);
  const std::size_t obj = f.chunk().object_bytes();
  // ~256 MiB per sweep: 8 chunks of 32 MiB, 85 of 3 MiB; tens of ms at 10 GB/s.
  const std::size_t sweep = std::max<std::size_t>(1, (std::size_t{256} << 20) / obj);
  std::printf(
      "shape %s: chunk %zu KiB, segment %zu KiB, %zu chunks in rotation, working set %zu MiB, "
      "%zu chunks per sweep, %d repeats, %zu MiB in huge pages\n",
      sc.name, obj >> 10, f.view().layout.segment_bytes() >> 10, f.num_chunks(), f.working_set() >> 20, sweep, repeats,
      anon_huge_mib());
  const chunk_op op_stream_in = stream_in(bench::stream_copy_default_streams);
  const chunk_op op_stream_out = stream_out(bench::stream_copy_default_streams);
  // Warm up code paths and the CPU probe.
  for (const chunk_op* op : {&op_memcpy, &op_stream_in, &op_stream_out, &op_gather, &op_scatter}) run_sweep(f, 2, *op);

  series mg, sg, g, ms, ss, s;
  for (int r = 0; r < repeats; ++r) {
    mg.add(run_sweep(f, sweep, op_memcpy));
    sg.add(run_sweep(f, sweep, op_stream_in));
    g.add(run_sweep(f, sweep, op_gather));
    ms.add(run_sweep(f, sweep, op_memcpy));
    ss.add(run_sweep(f, sweep, op_stream_out));
    s.add(run_sweep(f, sweep, op_scatter));
  }
  std::vector<double> m = mg.wall, st = sg.wall;
  m.insert(m.end(), ms.wall.begin(), ms.wall.end());
  st.insert(st.end(), ss.wall.begin(), ss.wall.end());
  const std::string n = sc.name;
  bench::print_result("memcpy_" + n + "_gbps", bench::median(m));
  bench::print_result("stream_copy_" + n + "_gbps", bench::median(st));
  bench::print_result("gather_" + n + "_gbps", bench::median(g.wall));
  bench::print_result("scatter_" + n + "_gbps", bench::median(s.wall));
  bench::print_result("gather_vs_memcpy_" + n, bench::median_ratio(g.wall, mg.wall));
  bench::print_result("scatter_vs_memcpy_" + n, bench::median_ratio(s.wall, ms.wall));
  bench::print_result("gather_vs_stream_copy_" + n, bench::median_ratio(g.wall, sg.wall));
  bench::print_result("scatter_vs_stream_copy_" + n, bench::median_ratio(s.wall, ss.wall));
  bench::print_result("gather_vs_stream_copy_cpu_" + n, bench::median_ratio(g.cpu, sg.cpu));
  bench::print_result("scatter_vs_stream_copy_cpu_" + n, bench::median_ratio(s.cpu, ss.cpu));
  bench::print_result("stream_copy_vs_memcpy_" + n, bench::median_ratio(sg.wall, mg.wall));

  if (!explore) return;
  std::vector<variant> vars = explore_variants();
  std::erase_if(vars, [&](const variant& v) {
    for (std::size_t b = 0;;) {  // `only` is a comma-separated list of substrings
      const std::size_t e = std::min(only.find(',', b), only.size());
      if (v.name.find(only.substr(b, e - b)) != std::string::npos) return false;
      if (e == only.size()) return true;
      b = e + 1;
    }
  });
  // The other fixtures only when a variant runs on them (each is another working set).
  auto wanted = [&](auto pred) { return std::any_of(vars.begin(), vars.end(), pred); };
  std::optional<fixture> fc, fg, fcpu;
  if (wanted([](const variant& v) { return v.consecutive; })) fc.emplace(sc.model, ws, 16, 256, true, huge_pages);
  if (wanted([](const variant& v) { return v.layout == region_layout::gpu_packed; }))
    fg.emplace(sc.model, ws, 16, 256, false, huge_pages, region_layout::gpu_packed);
  if (wanted([](const variant& v) { return v.layout == region_layout::cpu_packed; }))
    fcpu.emplace(sc.model, ws, 16, 256, false, huge_pages, region_layout::cpu_packed);
  std::vector<series> vr(vars.size()), vb(vars.size());
  for (int r = 0; r < repeats; ++r)
    for (std::size_t k = 0; k < vars.size(); ++k) {
      fixture& ff = vars[k].consecutive                         ? *fc
                    : vars[k].layout == region_layout::gpu_packed ? *fg
                    : vars[k].layout == region_layout::cpu_packed ? *fcpu
                                                                  : f;
      vb[k].add(run_sweep(ff, sweep, vars[k].gather ? op_stream_in : op_stream_out));
      vr[k].add(run_sweep(ff, sweep, vars[k].op));
    }
  std::printf("  %-44s %9s %9s %7s %7s  (ratio: median of variant_i / stream copy_i, same direction)\n", "variant",
              "GB/s", "stream", "ratio", "cpu");
  for (std::size_t k = 0; k < vars.size(); ++k)
    std::printf("  %-44s %9.2f %9.2f %7.3f %7.3f\n", vars[k].name.c_str(), bench::median(vr[k].wall),
                bench::median(vb[k].wall), bench::median_ratio(vr[k].wall, vb[k].wall),
                bench::median_ratio(vr[k].cpu, vb[k].cpu));
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false, explore = false, huge_pages = false;
  int repeats = 21;
  std::string only;  // --explore=<a,b,...>: only the variants whose name contains one of them
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick")
      quick = true;
    else if (a == "--explore")
      explore = true;
    else if (a == "--huge-pages")
      huge_pages = true;
    else if (a.starts_with("--explore="))
      explore = true, only = a.substr(10);
    else if (a.starts_with("--repeats="))
      repeats = std::max(1, std::atoi(a.c_str() + 10));
    else {
      std::fprintf(stderr, "usage: %s [--quick] [--repeats=N] [--huge-pages] [--explore[=<substring>,...]]\n", argv[0]);
      return 2;
    }
  }
  if (quick) repeats = 5;
  const std::size_t llc = llc_bytes();
  const std::size_t ws = 4 * llc;  // per buffer: the region, and the object pool
  const detail::copy_kernel* k = detail::streaming_copy();
  std::printf(
      "LLC %zu MiB; region and object pool each >= %zu MiB; stream copy: %s stores, %d parts, 1 thread; "
      "gather/scatter: %s\n",
      llc >> 20, ws >> 20, bench::stream_copy_kind(), bench::stream_copy_default_streams, k ? k->name : "memcpy");
  const shape_case shapes[] = {
      {"8b", {32, 8, 128, dtype_kind::bf16, attention_kind::mha}},
      {"05b", {24, 2, 64, dtype_kind::bf16, attention_kind::mha}},
  };
  for (const auto& sc : shapes) run_shape(sc, ws, repeats, explore, only, huge_pages);
}
