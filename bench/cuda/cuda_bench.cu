// kvtier_bench_cuda: the GPU copy path against plain DMA of the same bytes. Standard library
// + CUDA only (built by bench/cuda/check.sh on a GPU machine that has nothing else, and by
// the main build wherever nvcc is found).
//
// Per shape (block size 16, 256-token chunks, bf16):
//   8b   32 layers, 8 KV heads, head dim 128: 32 MiB chunk objects, 32 KiB block segments
//   05b  24 layers, 2 KV heads, head dim 64:   3 MiB chunk objects,  4 KiB block segments
// a paged KV cache on the device (random bytes), an L1 arena in host memory registered
// with host_registration (parallel cudaHostRegister, timed), and batches of 8 chunks whose
// blocks are random (a shuffled free list). One sample moves `batches` batches (~512 MiB for
// 8b, ~190 MiB for 05b) and is timed on the host from the first enqueue to the completion
// event. One repeat, interleaved:
//   memcpy_d2h        one cudaMemcpyAsync per batch, contiguous device buffer -> contiguous
//                     pinned slots (the physical limit: DMA of the same bytes)
//   gather_d2h        copy_engine staged store: gather kernel into the staging ring, DMA
//                     into the batch's L1 slots (scattered over the arena)
//   gather_zero_copy  copy_engine zero-copy store: one kernel writes the slots directly
//   memcpy_h2d, h2d_scatter, scatter_zero_copy: the same, the other way
// Ratios are medians over repeats of memcpy_time_i / op_time_i with the memcpy sample of the
// same repeat; GB/s lines are medians.
//
// Before timing, each shape checks both modes byte for byte against the CPU implementation
// (core/kv_transfer.hpp) on one batch with skip-first-n tokens: device region downloaded
// into a host mirror, CPU gather/scatter there, compare. A mismatch prints MISMATCH and the
// program exits 1. No device: prints FAILED and exits 1 (never a silent skip).
//
// Ends with RESULT lines: cuda_<op>_<shape>_gbps, cuda_<op>_vs_memcpy_<shape>, and the two
// headline figures cuda_gather_d2h_vs_memcpy and cuda_h2d_scatter_vs_memcpy (the lower of
// the two shapes: the target is >= 0.9 for both).
//
//   kvtier_bench_cuda [--repeats=N] [--shape=8b|05b] [--quick]

#include <kvtier/cuda/check.cuh>
#include <kvtier/cuda/copy_engine.cuh>
#include <kvtier/cuda/kv_transfer.cuh>
#include <kvtier/cuda/pinned.cuh>

#include <kvtier/core/buffer.hpp>
#include <kvtier/core/kv_layout.hpp>
#include <kvtier/core/kv_transfer.hpp>

#include <common/results.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <vector>

namespace kc = kvtier::cuda;
using kvtier::attention_kind;
using kvtier::chunk_layout;
using kvtier::dtype_kind;
using kvtier::gather_item;
using kvtier::paged_kv_layout;
using kvtier::scatter_item;

namespace {

[[noreturn]] void fatal(const std::string& what) {
  std::fprintf(stderr, "FAILED: %s\n", what.c_str());
  std::exit(1);
}

void must(cudaError_t e, const char* what) {
  if (e != cudaSuccess) fatal(std::string(what) + ": " + kc::make_error_code(e).message());
}

void must(const std::error_code& ec, const char* what) {
  if (ec) fatal(std::string(what) + ": " + ec.message());
}

/// Fills n bytes with a hash of their index (distinct everywhere).
template <int Salt>
__global__ void fill_kernel(std::uint64_t* p, std::size_t words, std::uint64_t seed) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < words;
       i += std::size_t{gridDim.x} * blockDim.x) {
    std::uint64_t z = seed + (i + Salt) * 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    p[i] = z ^ (z >> 31);
  }
}

void fill_device(std::byte* p, std::size_t bytes, std::uint64_t seed) {
  fill_kernel<0><<<1024, 256>>>(reinterpret_cast<std::uint64_t*>(p), bytes / 8, seed);
  must(cudaGetLastError(), "fill kernel");
  must(cudaDeviceSynchronize(), "fill sync");
}

void fill_host(std::span<std::byte> b, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (std::size_t i = 0; i + 8 <= b.size(); i += 8) {
    const std::uint64_t v = rng();
    std::memcpy(b.data() + i, &v, 8);
  }
}

struct shape_case {
  const char* name;
  paged_kv_layout layout;
};

struct series {
  std::vector<double> seconds;
  void add(double s) { seconds.push_back(s); }
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

struct options {
  int repeats = 21;
  std::string only;
};

struct shape_results {
  double gather_vs_memcpy = 0;
  double scatter_vs_memcpy = 0;
};

shape_results run_shape(const shape_case& sc, const options& opt) {
  const paged_kv_layout& layout = sc.layout;
  const chunk_layout chunk{layout.model, 256};
  const std::uint32_t per = chunk.chunk_tokens / layout.block_size;
  const std::size_t ob = chunk.object_bytes();  // a multiple of 4 KiB for both shapes
  const std::size_t batch = 8;
  // Enough samples per timing to dwarf the ~10-20 us of host synchronisation.
  const std::size_t batches = ob >= (std::size_t{16} << 20) ? 2 : 8;
  const std::size_t groups = batches;  // each batch of a sample has its own blocks and slots

  std::printf(
      "\nshape %s: %u layers, %u KV heads, head dim %u, chunk %zu KiB, segment %zu KiB, %u blocks, "
      "%zu batches of %zu chunks per sample (%zu MiB)\n",
      sc.name, layout.model.num_layers, layout.model.num_kv_heads, layout.model.head_dim, ob >> 10,
      layout.segment_bytes() >> 10, layout.num_blocks, batches, batch, (batches * batch * ob) >> 20);

  // The paged KV cache on the device: one allocation, layers back to back.
  void* region_v = nullptr;
  must(cudaMalloc(&region_v, layout.total_bytes()), "cudaMalloc region");
  auto* region = static_cast<std::byte*>(region_v);
  fill_device(region, layout.total_bytes(), 1);
  std::vector<std::byte*> layers;
  for (std::uint32_t l = 0; l < layout.model.num_layers; ++l) layers.push_back(region + l * layout.layer_bytes());
  std::error_code ec;
  kc::layer_table table = kc::layer_table::upload(layers, ec);
  must(ec, "layer_table::upload");
  const kc::paged_kv_view view{layout, table.view()};

  // The L1 arena, registered in parallel: `groups` groups of `batch` slots for the copies,
  // plus a contiguous run per group for the memcpy baseline.
  kvtier::aligned_buffer arena(2 * groups * batch * ob);
  kc::registration_options ro;
  ro.piece_alignment = ob;
  ro.log = [](std::string_view m) { std::printf("%.*s\n", static_cast<int>(m.size()), m.data()); };
  kc::host_registration reg = kc::host_registration::register_range(arena.span(), ro, ec);
  must(ec, "host_registration::register_range");
  std::byte* slots = arena.data();                             // copy_engine objects
  std::byte* contiguous = arena.data() + groups * batch * ob;  // memcpy baseline
  void* dev_contig_v = nullptr;
  must(cudaMalloc(&dev_contig_v, groups * batch * ob), "cudaMalloc baseline");
  auto* dev_contig = static_cast<std::byte*>(dev_contig_v);
  fill_device(dev_contig, groups * batch * ob, 2);

  // Blocks: a shuffled free list; slots: shuffled within the arena.
  std::mt19937_64 rng(42);
  std::vector<std::uint32_t> free_list(layout.num_blocks);
  std::iota(free_list.begin(), free_list.end(), 0u);
  std::shuffle(free_list.begin(), free_list.end(), rng);
  if (groups * batch * per > free_list.size()) fatal("too few blocks for the working set");
  std::vector<std::size_t> slot_order(groups * batch);
  std::iota(slot_order.begin(), slot_order.end(), std::size_t{0});
  std::shuffle(slot_order.begin(), slot_order.end(), rng);
  std::vector<std::vector<std::uint32_t>> ids(groups * batch);
  for (std::size_t c = 0; c < ids.size(); ++c)
    ids[c].assign(free_list.begin() + c * per, free_list.begin() + (c + 1) * per);
  auto gather_batch = [&](std::size_t g, std::span<const std::uint32_t> skips = {}) {
    std::vector<gather_item> v;
    for (std::size_t i = 0; i < batch; ++i) {
      const std::size_t c = g * batch + i;
      v.push_back({ids[c], slots + slot_order[c] * ob, skips.empty() ? 0u : skips[i]});
    }
    return v;
  };
  auto scatter_batch = [&](std::size_t g, std::span<const std::uint32_t> skips = {}) {
    std::vector<scatter_item> v;
    for (std::size_t i = 0; i < batch; ++i) {
      const std::size_t c = g * batch + i;
      v.push_back({ids[c], slots + slot_order[c] * ob, skips.empty() ? 0u : skips[i]});
    }
    return v;
  };

  kc::copy_engine staged = kc::copy_engine::create(view, chunk, {kc::copy_mode::staged, 3, -1}, ec);
  must(ec, "copy_engine (staged)");
  kc::copy_engine zero_copy = kc::copy_engine::create(view, chunk, {kc::copy_mode::zero_copy, 0, -1}, ec);
  const bool have_zero_copy = !ec;
  if (!have_zero_copy) std::printf("zero-copy unavailable here (%s): not measured\n", ec.message().c_str());
  cudaStream_t base_stream = nullptr;
  must(cudaStreamCreateWithFlags(&base_stream, cudaStreamNonBlocking), "stream");
  cudaEvent_t done = nullptr;
  must(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "event");

  // ---- correctness on this shape, both modes, with skip-first-n ----
  {
    const std::vector<std::uint32_t> skips = {0, 1, 15, 16, 17, 100, 255, 256};
    std::vector<std::byte> mirror(layout.total_bytes());
    must(cudaMemcpy(mirror.data(), region, mirror.size(), cudaMemcpyDeviceToHost), "download region");
    std::vector<std::byte*> host_layers;
    for (std::uint32_t l = 0; l < layout.model.num_layers; ++l)
      host_layers.push_back(mirror.data() + l * layout.layer_bytes());
    const kvtier::paged_kv_view host_view{layout, host_layers};
    std::vector<std::byte> expect(batch * ob);
    for (kc::copy_engine* e : {&staged, &zero_copy}) {
      if (e->empty()) continue;
      const char* mode = e->mode() == kc::copy_mode::staged ? "staged" : "zero-copy";
      // Store: slots pre-filled, skipped bytes must stay.
      fill_host(arena.span().first(groups * batch * ob), 7);
      const auto items = gather_batch(0, skips);
      std::vector<gather_item> ref_items = items;
      for (std::size_t i = 0; i < batch; ++i) {
        std::memcpy(expect.data() + i * ob, items[i].object, ob);
        ref_items[i].object = expect.data() + i * ob;
      }
      must(kvtier::gather_chunks(host_view, chunk, ref_items), "CPU gather");
      must(e->store(items, nullptr, done), "store");
      must(cudaEventSynchronize(done), "store sync");
      for (std::size_t i = 0; i < batch; ++i)
        if (std::memcmp(items[i].object, expect.data() + i * ob, ob) != 0) {
          std::printf("MISMATCH: %s store, shape %s, chunk %zu (skip %u) differs from the CPU gather\n", mode, sc.name,
                      i, skips[i]);
          std::exit(1);
        }
      // Retrieve: new object bytes into the blocks, CPU scatter on the mirror, compare all.
      fill_host(arena.span().first(groups * batch * ob), 8);
      const auto sitems = scatter_batch(1, skips);
      must(kvtier::scatter_chunks(host_view, chunk, sitems), "CPU scatter");
      must(e->retrieve(sitems, nullptr, done), "retrieve");
      must(cudaEventSynchronize(done), "retrieve sync");
      std::vector<std::byte> now(layout.total_bytes());
      must(cudaMemcpy(now.data(), region, now.size(), cudaMemcpyDeviceToHost), "download region");
      if (now != mirror) {
        std::printf("MISMATCH: %s retrieve, shape %s: the paged cache differs from the CPU scatter\n", mode, sc.name);
        std::exit(1);
      }
      std::printf("correctness %s: store and retrieve of %zu chunks (skips 0..256) == CPU, byte for byte\n", mode,
                  batch);
    }
  }

  // ---- bandwidth ----
  const double sample_bytes = static_cast<double>(batches * batch * ob);
  auto time_memcpy = [&](cudaMemcpyKind kind) {
    const auto t0 = std::chrono::steady_clock::now();
    for (std::size_t g = 0; g < batches; ++g) {
      std::byte* h = contiguous + g * batch * ob;
      std::byte* d = dev_contig + g * batch * ob;
      if (kind == cudaMemcpyDeviceToHost)
        must(cudaMemcpyAsync(h, d, batch * ob, kind, base_stream), "memcpy d2h");
      else
        must(cudaMemcpyAsync(d, h, batch * ob, kind, base_stream), "memcpy h2d");
    }
    must(cudaStreamSynchronize(base_stream), "memcpy sync");
    return seconds_since(t0);
  };
  auto time_store = [&](kc::copy_engine& e) {
    const auto t0 = std::chrono::steady_clock::now();
    for (std::size_t g = 0; g < batches; ++g)
      must(e.store(gather_batch(g), nullptr, g + 1 == batches ? done : nullptr), "store");
    must(cudaEventSynchronize(done), "store sync");
    return seconds_since(t0);
  };
  auto time_retrieve = [&](kc::copy_engine& e) {
    const auto t0 = std::chrono::steady_clock::now();
    for (std::size_t g = 0; g < batches; ++g)
      must(e.retrieve(scatter_batch(g), nullptr, g + 1 == batches ? done : nullptr), "retrieve");
    must(cudaEventSynchronize(done), "retrieve sync");
    return seconds_since(t0);
  };

  series m_d2h, g_d2h, g_zc, m_h2d, s_h2d, s_zc;
  for (int r = -1; r < opt.repeats; ++r) {  // r == -1: warm-up, not recorded
    const double a = time_memcpy(cudaMemcpyDeviceToHost);
    const double b = time_store(staged);
    const double c = have_zero_copy ? time_store(zero_copy) : 0;
    const double d = time_memcpy(cudaMemcpyHostToDevice);
    const double e = time_retrieve(staged);
    const double f = have_zero_copy ? time_retrieve(zero_copy) : 0;
    if (r < 0) continue;
    m_d2h.add(a), g_d2h.add(b), g_zc.add(c), m_h2d.add(d), s_h2d.add(e), s_zc.add(f);
  }

  auto gbps = [&](const series& s) {
    std::vector<double> v;
    for (double t : s.seconds) v.push_back(sample_bytes / t / 1e9);
    return kvtier::bench::median(v);
  };
  // a_vs_b on throughput = b_time / a_time, per repeat.
  auto ratio = [&](const series& op, const series& base) {
    return kvtier::bench::median_ratio(base.seconds, op.seconds);
  };

  const std::string n = sc.name;
  shape_results out;
  out.gather_vs_memcpy = ratio(g_d2h, m_d2h);
  out.scatter_vs_memcpy = ratio(s_h2d, m_h2d);
  kvtier::bench::print_result("cuda_memcpy_d2h_" + n + "_gbps", gbps(m_d2h));
  kvtier::bench::print_result("cuda_gather_d2h_" + n + "_gbps", gbps(g_d2h));
  kvtier::bench::print_result("cuda_memcpy_h2d_" + n + "_gbps", gbps(m_h2d));
  kvtier::bench::print_result("cuda_h2d_scatter_" + n + "_gbps", gbps(s_h2d));
  kvtier::bench::print_result("cuda_gather_d2h_vs_memcpy_" + n, out.gather_vs_memcpy);
  kvtier::bench::print_result("cuda_h2d_scatter_vs_memcpy_" + n, out.scatter_vs_memcpy);
  if (have_zero_copy) {
    kvtier::bench::print_result("cuda_gather_zero_copy_" + n + "_gbps", gbps(g_zc));
    kvtier::bench::print_result("cuda_scatter_zero_copy_" + n + "_gbps", gbps(s_zc));
    kvtier::bench::print_result("cuda_gather_zero_copy_vs_memcpy_" + n, ratio(g_zc, m_d2h));
    kvtier::bench::print_result("cuda_scatter_zero_copy_vs_memcpy_" + n, ratio(s_zc, m_h2d));
  }
  kvtier::bench::print_result(
      "cuda_host_register_" + n + "_gibps",
      static_cast<double>(reg.stats().bytes) / double(1u << 30) / std::max(reg.stats().seconds, 1e-9));

  must(cudaEventDestroy(done), "event destroy");
  must(cudaStreamDestroy(base_stream), "stream destroy");
  staged = {};
  zero_copy = {};
  table = {};
  must(reg.unregister(), "unregister");
  must(cudaFree(dev_contig), "cudaFree");
  must(cudaFree(region), "cudaFree");
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  options opt;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    if (a.rfind("--repeats=", 0) == 0)
      opt.repeats = std::max(1, std::atoi(argv[i] + 10));
    else if (a == "--quick")
      opt.repeats = 5;
    else if (a.rfind("--shape=", 0) == 0)
      opt.only = std::string(a.substr(8));
    else
      fatal("unknown argument " + std::string(a) + " (use --repeats=N, --quick, --shape=8b|05b)");
  }
  const kc::device_probe probe = kc::probe_devices();
  if (!probe.usable())
    fatal("no usable CUDA device (cudaGetDeviceCount: " +
          (probe.error ? probe.error.message() : std::string("0 devices")) + "): this benchmark needs a GPU");
  must(cudaSetDevice(0), "cudaSetDevice");
  cudaDeviceProp prop{};
  must(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  std::printf("device 0: %s, %zu GiB, %d SMs; %u host threads; %d repeats\n", prop.name, prop.totalGlobalMem >> 30,
              prop.multiProcessorCount, std::thread::hardware_concurrency(), opt.repeats);

  // 8b: 1024 blocks (2 GiB of KV); 05b: 4096 blocks (768 MiB).
  const shape_case shapes[] = {
      {"8b", {{32, 8, 128, dtype_kind::bf16, attention_kind::mha}, 16, 1024}},
      {"05b", {{24, 2, 64, dtype_kind::bf16, attention_kind::mha}, 16, 4096}},
  };
  double gather = 1e300, scatter = 1e300;
  bool any = false;
  for (const shape_case& sc : shapes) {
    if (!opt.only.empty() && opt.only != sc.name) continue;
    const shape_results r = run_shape(sc, opt);
    gather = std::min(gather, r.gather_vs_memcpy);
    scatter = std::min(scatter, r.scatter_vs_memcpy);
    any = true;
  }
  if (!any) fatal("no shape named " + opt.only);
  std::printf("\n");
  kvtier::bench::print_result("cuda_gather_d2h_vs_memcpy", gather);
  kvtier::bench::print_result("cuda_h2d_scatter_vs_memcpy", scatter);
  return 0;
}
