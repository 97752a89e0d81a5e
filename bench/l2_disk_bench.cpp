// l2_disk_bench: the disk L2 backend against fio on the same file system, same block size
// (the backend's part size, 1 MiB) and same queue depth (the backend's parts in flight, 16).
//
// Loads: N objects stored once by the backend; each repeat runs, interleaved,
//   fio   ioengine=io_uring, fixedbufs=1, direct=1, rw=read, bs=1M, iodepth=16 over THE SAME
//         object files (file_service_type=sequential: one file after the other, like our key
//         order); fixedbufs: registered buffers, as ours (L1 registered, READ_FIXED);
//   ours  tiered_cache lookups of `batch` keys at a time (the prefetch_controller loads them
//         from the disk backend into L1 slots, checksums verified), one lookup after the
//         other, each released once answered; bytes loaded / wall time of the phase;
//   ours through the pread fallback (io = pread, pread_threads = the queue depth).
// Stores: each repeat, fio rw=write (new files, fsync_on_close=1, fixedbufs=1) and our backend storing N
//   objects in batches of `store_batch` (64, the store pipeline's batch; --store-batch) and at
//   most half the in-flight bound (pipeline::task_keys: 32 keys of 32 MiB), submitted as the
//   store pipeline submits them (batches in flight up to its 2 GiB bound,
//   --store-inflight-gib: two batches of 32 MiB objects, ten of 3 MiB ones), into a fresh
//   directory, from memory registered with the backend as the server registers L1
//   (WRITE_FIXED). Our backend writes 8 keys at once across the batches in flight (its
//   store lanes, depth / 2), each through its own pipeline (temporary file, 2 O_DIRECT
//   writes in flight, rename, fdatasync), and fsyncs each batch's touched directories once
//   (--name-sync file or auto: an fsync of each object instead, where that commits the rename). fio's
//   store job does the same: 8 jobs (numjobs, each its own files) of iodepth 2, so the same
//   16 writes and up to 8 fsyncs are in flight, each job's fsync at a file's close
//   overlapping the other jobs' writes (--fio-store-jobs 1: one job of iodepth 16 whose
//   fsyncs come one after the other, the pre-issue-17 baseline).
// fio's own iodepth histogram (the share of its submissions issued at each depth) is printed
//   for both jobs; RESULT fio_read_depth_full_pct (the share at the job's full depth, 16-31)
//   shows whether fio keeps its queue full across file boundaries.
// For 32 MiB objects (a 256-token chunk of Llama-3.1-8B) and 3 MiB objects.
// Each ratio is the median of the per-repeat ratios (bench/common/results.hpp).
//
// The files are freshly written before they are read (by the backend, in this run) on
// whatever disk DIR is on: on a VM the host may still cache them, so a load figure is the
// virtual disk's speed for recent files, not necessarily the device's.
//
// Usage: kvtier_bench_l2_disk [--dir DIR] [--gib X] [--repeats N] [--quick] [--fio PATH]
//                             [--fio-store-jobs N] [--store-batch N] [--store-inflight-gib X]
//                             [--huge-pages] [--name-sync auto|directory|file] [--lookup-keys N]
//                             [--lookups-in-flight N] [--only loads|stores] [--sizes MIB[,MIB...]]
//   --only: one phase (loads: the load set is still stored first, untimed; the last --only
//   counts); --sizes: distinct object sizes in MiB (default 32,3; 32 names the plain RESULTs,
//   another size n adds _<n>m).
//   --huge-pages: stores from memory and loads into an L1 in transparent huge pages (as the
//   server's L1 is, by default; the L1 faulted in before the clock starts) against fio
//   writing from and reading into hugetlb pages (iomem=shmhuge; it needs free ones:
//   /proc/sys/vm/nr_hugepages): RESULT names end in _huge. Both gain from it (fio's stores
//   about 1.5x on this VM), so the default compares 4 KiB pages on both sides.
//   --lookup-keys: keys per lookup of the loads (default 8); the next lookup starts when one
//   has loaded, so the disk's queue drains between lookups.
//   --lookups-in-flight N: up to N lookups loading at once (1..8; default 1), as the server's
//   prefetches of several requests overlap: the load RESULTs are then l2_load_vs_fio_inflight<N>
//   and l2_load_vs_fio_3m_inflight<N> (a throughput against fio's; the default figures are
//   one request's load at a time).
//   DIR defaults to $KVTIER_BENCH_DIR, else ./l2-disk-bench (it must not be tmpfs for the
//   figures to mean anything); X GiB per measurement (default 2); --quick: 0.25 GiB, 2 repeats.
#include <kvtier/cache/tiered_cache.hpp>
#include <kvtier/core/buffer.hpp>
#include <kvtier/l2/disk/disk_backend.hpp>
#include <kvtier/pipeline/store_controller.hpp>
#include <kvtier/server/l1_residency.hpp>

#include <common/meminfo.hpp>
#include <common/results.hpp>

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <fstream>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace {

namespace asio = boost::asio;
namespace fs = std::filesystem;
using namespace kvtier;
using clock_type = std::chrono::steady_clock;

struct bench_config {
  fs::path dir;
  double gib = 2.0;
  int repeats = 5;
  std::string fio = "fio";
  unsigned depth = 16;
  std::size_t part = std::size_t{1} << 20;
  std::size_t batch = 8;  ///< keys per lookup (loads)
  /// Lookups loading at once (--lookups-in-flight): 1, one after the other (the default: the
  /// disk's queue drains between lookups); more, a new one whenever one has loaded, as the
  /// server's prefetches of several requests overlap (prefetch_max_in_flight).
  std::size_t lookups_in_flight = 1;
  /// Keys per store: the store pipeline's batch (pipeline::store_options::max_batch_keys).
  std::size_t store_batch = pipeline::store_options{}.max_batch_keys;
  /// Bytes of store batches in flight at once: the store pipeline's bound
  /// (pipeline::store_options::max_inflight_bytes; --store-inflight-gib).
  std::uint64_t store_inflight_bytes = pipeline::store_options{}.max_inflight_bytes;
  unsigned fio_store_jobs = 0;  ///< fio store jobs (concurrent fsyncs); 0: the backend's store lanes
  /// --huge-pages: the store sources in transparent huge pages (the server's L1 default) and
  /// fio's store buffers in hugetlb pages (iomem=shmhuge); store figures get a _huge suffix.
  bool huge_pages = false;
  /// How the backend makes names durable (docs/l2-disk.md, "Durability"); --name-sync.
  l2::disk_name_sync name_sync = l2::disk_backend_options{}.name_sync;
  /// The backend writes depth / 2 keys at once, 2 writes each (disk_backend::store_lanes):
  /// as many fsyncs in flight as fio's jobs.
  [[nodiscard]] unsigned store_jobs() const { return fio_store_jobs ? fio_store_jobs : std::max(1U, depth / 2); }
  /// --only loads|stores: one phase (the other's figures are not printed); both by default.
  bool loads = true, stores = true;
  /// --sizes: the object sizes to measure, in MiB (default 32 and 3).
  std::vector<std::size_t> sizes_mib{32, 3};
};

/// fio's iodepth histogram of one job ("1", "2", ... ">=64" -> percent of submissions).
struct fio_run {
  double bytes_per_s = 0;
  nlohmann::json depths;
};

chunk_key key_of(std::size_t object_bytes, std::uint64_t i) {
  return chunk_key{0xbe7c, 1, 0, hash128{i, object_bytes}};
}

double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

/// Runs fio on a job file; returns the (group's) bandwidth in bytes per second and the
/// iodepth histogram.
fio_run run_fio(const bench_config& cfg, const fs::path& jobfile, bool write) {
  const std::string cmd = shell_quote(cfg.fio) + " --output-format=json " + shell_quote(jobfile.string());
  std::FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) throw std::runtime_error("cannot run " + cmd);
  std::string out;
  char buf[65536];
  std::size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int status = ::pclose(p);
  if (status != 0) throw std::runtime_error("fio failed (status " + std::to_string(status) + "): " + cmd);
  // fio may print notes before the JSON document.
  const auto start = out.find('{');
  if (start == std::string::npos) throw std::runtime_error("fio printed no JSON: " + out);
  const auto j = nlohmann::json::parse(out.substr(start));
  const auto& jobj = j.at("jobs").at(0);  // group_reporting: one entry for all the jobs
  const auto& job = jobj.at(write ? "write" : "read");
  const double bytes = job.at("io_bytes").get<double>();
  const double ms = job.at("runtime").get<double>();
  if (bytes <= 0 || ms <= 0) throw std::runtime_error("fio moved nothing: " + cmd);
  return {bytes / (ms / 1000.0), jobj.value("iodepth_level", nlohmann::json::object())};
}

/// fio's histogram bucket that holds depth d ("1", "2", "4", ..., "32", ">=64").
std::string depth_bucket(unsigned d) {
  if (d >= 64) return ">=64";
  unsigned b = 1;
  while (b * 2 <= d) b *= 2;
  return std::to_string(b);
}

double depth_pct(const nlohmann::json& depths, unsigned d) {
  const auto it = depths.find(depth_bucket(d));
  return it != depths.end() && it->is_number() ? it->get<double>() : 0.0;
}

std::string depth_text(const nlohmann::json& depths) {
  std::string t;
  for (const char* k : {"1", "2", "4", "8", "16", "32", ">=64"}) {
    const auto it = depths.find(k);
    if (it == depths.end() || !it->is_number()) continue;
    char b[48];
    std::snprintf(b, sizeof b, "%s%s=%.1f%%", t.empty() ? "" : " ", k, it->get<double>());
    t += b;
  }
  return t;
}

l2::disk_backend_options backend_options(const bench_config& cfg, const fs::path& dir, std::size_t object_bytes,
                                         std::size_t n, io::file_io_choice choice) {
  l2::disk_backend_options o;
  o.name = "disk";
  o.path = dir;
  o.capacity_bytes = static_cast<std::uint64_t>(n + 16) * (object_bytes + (1 << 20));
  o.io = choice;
  o.queue_depth = cfg.depth;
  o.part_bytes = cfg.part;
  o.pread_threads = cfg.depth;
  o.name_sync = cfg.name_sync;
  return o;
}

/// Keys per store batch, as the store pipeline sizes its tasks: cfg.store_batch keys, at most
/// half of cfg.store_inflight_bytes.
std::size_t store_batch_keys(const bench_config& cfg, std::size_t object_bytes) {
  pipeline::store_options o;
  o.max_batch_keys = cfg.store_batch;
  o.max_inflight_bytes = cfg.store_inflight_bytes;
  return pipeline::task_keys(o, object_bytes);
}

/// Whether the stores fsynced directories (kvtier_l2_disk_directory_fsync): -1 until one ran.
int store_directory_fsync = -1;

/// Stores n objects in batches as the store pipeline submits them (pipeline::task_keys:
/// cfg.store_batch keys, at most half of cfg.store_inflight_bytes): a batch starts while the
/// batches in flight hold at most cfg.store_inflight_bytes with it (or when none is in flight);
/// returns bytes per second.
double ours_store(const bench_config& cfg, const fs::path& dir, std::size_t object_bytes, std::size_t n,
                  aligned_buffer& sources) {
  asio::io_context io;
  l2::disk_backend b(io.get_executor(), backend_options(cfg, dir, object_bytes, n, io::file_io_choice::automatic));
  const int directory_fsync = b.stats().directory_fsync.load() ? 1 : 0;
  if (store_directory_fsync < 0)
    std::printf("  stores make names durable by %s\n", directory_fsync
                                                           ? "fdatasync and directory fsyncs (name_sync directory)"
                                                           : "each object's fsync (name_sync file)");
  store_directory_fsync = directory_fsync;
  // The sources stand for L1 slots, which the server registers (WRITE_FIXED; fio: fixedbufs).
  (void)b.register_buffers(std::span<std::byte>(sources.data(), sources.size()));
  const std::size_t source_count = sources.size() / object_bytes;
  std::size_t ok = 0;
  std::size_t next = 0;
  std::uint64_t inflight = 0;
  const std::size_t per_batch = store_batch_keys(cfg, object_bytes);
  std::function<void()> launch = [&] {
    while (next < n) {
      const std::size_t m = std::min(per_batch, n - next);
      const std::uint64_t bytes = std::uint64_t{m} * object_bytes;
      if (inflight > 0 && inflight + bytes > cfg.store_inflight_bytes) return;
      auto keys = std::make_shared<std::vector<chunk_key>>();
      auto src = std::make_shared<std::vector<std::span<const std::byte>>>();
      for (std::size_t i = 0; i < m; ++i) {
        keys->push_back(key_of(object_bytes, next + i));
        src->emplace_back(sources.data() + (i % source_count) * object_bytes, object_bytes);
      }
      next += m;
      inflight += bytes;
      b.async_store(*keys, *src, l2::clock::now() + std::chrono::minutes(5),
                    [&, keys, src, bytes](error_code, l2::batch_result res) {
                      ok += res.count(l2::key_outcome::ok);
                      inflight -= bytes;
                      launch();
                    });
    }
  };
  const auto t0 = clock_type::now();
  launch();
  io.run();
  const double s = seconds_since(t0);
  if (ok != n) throw std::runtime_error("stored " + std::to_string(ok) + " of " + std::to_string(n) + " objects");
  return static_cast<double>(n * object_bytes) / s;
}

/// Loads n objects through tiered_cache lookups of cfg.batch keys, cfg.lookups_in_flight at
/// once; returns bytes per second.
double ours_load(const bench_config& cfg, const fs::path& dir, std::size_t object_bytes, std::size_t n,
                 io::file_io_choice choice, bool* used_uring = nullptr) {
  asio::io_context io;
  auto disk = std::make_shared<l2::disk_backend>(io.get_executor(), backend_options(cfg, dir, object_bytes, n, choice));
  if (used_uring != nullptr) *used_uring = disk->file_io_kind() == io::file_io_kind::uring;
  if (disk->usage().objects != n) throw std::runtime_error("the load set lacks objects");
  bus::null_bus events;
  cache::cache_options o;
  o.l1.slot_bytes = object_bytes;
  o.l1.slot_count = 2 * cfg.batch * cfg.lookups_in_flight;
  cache::tiered_cache<> c(io.get_executor(), o, events, std::vector<l2::any_backend>{l2::any_backend(disk)});
  if (cfg.huge_pages) {
    // As the server's L1 by default (l1_huge_pages, l1_prefault): 2 MiB pages, faulted in
    // before the clock starts, so that a 1 MiB read lands in one physically contiguous piece.
    const std::span<std::byte> arena = c.l1().arena();
    const std::string huge = server::advise_l1_huge_pages(arena);
    if (huge != "asked") throw std::runtime_error("--huge-pages: madvise(MADV_HUGEPAGE) of L1 " + huge);
    std::memset(arena.data(), 0, arena.size());
  }
  // As the server does: in pieces cut on huge-page boundaries (a piece with the arena's
  // unaligned head in 4 KiB pages is not coalesced, and its 1 MiB reads split in two); the
  // kernel may refuse.
  (void)c.register_l1();
  std::size_t loaded = 0;
  std::size_t next = 0;
  std::size_t in_flight = 0;
  std::vector<cache::tiered_cache<>::lookup_id> answered;  // released by the loop, outside the completion
  auto start_one = [&] {
    const std::size_t m = std::min(cfg.batch, n - next);
    std::vector<chunk_key> keys;
    for (std::size_t i = 0; i < m; ++i) keys.push_back(key_of(object_bytes, next + i));
    next += m;
    cache::lookup_request r;
    r.keys = keys;
    r.object_bytes = object_bytes;
    r.chunk_tokens = 256;
    const auto id = c.start_lookup(r);
    ++in_flight;
    c.async_wait_loaded(id, [&, id](error_code, cache::lookup_status st) {
      loaded += st.chunks;
      answered.push_back(id);
    });
  };
  const auto t0 = clock_type::now();
  io.restart();
  while (next < n || in_flight > 0) {
    while (next < n && in_flight < cfg.lookups_in_flight) start_one();
    if (io.run_one() == 0) throw std::runtime_error("a lookup never answered");
    for (const auto id : std::exchange(answered, {})) {
      c.release_all(id);
      --in_flight;
    }
  }
  const double s = seconds_since(t0);
  if (loaded != n) throw std::runtime_error("loaded " + std::to_string(loaded) + " of " + std::to_string(n) + " objects");
  bool idle = false;  // the store pipeline's loop keeps the io_context busy: run until idle
  asio::co_spawn(io, c.wait_idle(), [&](std::exception_ptr) { idle = true; });
  while (!idle)
    if (io.run_one() == 0) break;
  return static_cast<double>(n * object_bytes) / s;
}

/// fio reads every file under the backend's objects/ directory (opendir): the same files,
/// whole (the 4 KiB header block included, 0.01% of a 32 MiB object).
fs::path write_read_job(const bench_config& cfg, const fs::path& at, const fs::path& set) {
  std::ofstream j(at);
  j << "[global]\nioengine=io_uring\nfixedbufs=1\ndirect=1\nrw=read\nbs=" << cfg.part << "\niodepth=" << cfg.depth
    << (cfg.huge_pages ? "\niomem=shmhuge" : "")
    << "\nnumjobs=1\nfile_service_type=sequential\n[read]\nopendir=" << (set / "objects").string() << "\n";
  return at;
}

/// `jobs` jobs of iodepth depth / jobs each (the same writes in flight in all), each
/// writing its own n / jobs new files with an fsync at each file's close: up to `jobs`
/// fsyncs in flight at once.
fs::path write_write_job(const bench_config& cfg, const fs::path& at, const fs::path& dir, std::size_t object_bytes,
                         std::size_t n) {
  const unsigned jobs = cfg.store_jobs();
  const unsigned depth = std::max(1u, cfg.depth / jobs);
  const std::size_t per_job = std::max<std::size_t>(1, (n + jobs - 1) / jobs);
  std::ofstream j(at);
  j << "[global]\nioengine=io_uring\nfixedbufs=1\ndirect=1\nrw=write\nbs=" << cfg.part << "\niodepth=" << depth
    << "\nnumjobs=" << jobs
    << (cfg.huge_pages ? "\niomem=shmhuge" : "")
    << "\ngroup_reporting=1\nfile_service_type=sequential\nfsync_on_close=1\ndirectory=" << dir.string()
    << "\nnrfiles=" << per_job << "\nfilesize=" << object_bytes << "\nsize=" << per_job * object_bytes << "\n[write]\n";
  return at;
}

/// HugePages_Free of /proc/meminfo (-1 when unreadable).
long free_hugetlb_pages() {
  const auto free = kvtier::bench::meminfo_field("HugePages_Free:");
  return free ? static_cast<long>(*free) : -1;
}

std::string size_label(std::size_t object_bytes) { return std::to_string(object_bytes >> 20) + " MiB"; }

struct figures {
  std::vector<double> fio_read, ours_read, ours_pread, fio_write, ours_write;
  std::vector<double> fio_read_full_pct, fio_write_full_pct;  ///< per repeat: % of submissions at full depth
};

figures measure(const bench_config& cfg, std::size_t object_bytes) {
  const std::size_t n = std::max<std::size_t>(
      cfg.batch, static_cast<std::size_t>(cfg.gib * static_cast<double>(std::size_t{1} << 30)) / object_bytes);
  std::printf(
      "== %s objects: %zu per measurement (%.2f GiB), lookups of %zu, stores of %zu (up to %.2f GiB of them in "
      "flight), bs %zu KiB, depth %u; fio store: %u jobs of depth %u\n",
      size_label(object_bytes).c_str(), n, static_cast<double>(n * object_bytes) / (1 << 30), cfg.batch,
      store_batch_keys(cfg, object_bytes), static_cast<double>(cfg.store_inflight_bytes) / (1 << 30), cfg.part >> 10,
      cfg.depth, cfg.store_jobs(), std::max(1u, cfg.depth / cfg.store_jobs()));
  aligned_buffer sources(cfg.batch * object_bytes);  // cfg.batch objects, one after the other
  if (cfg.huge_pages) {
    const std::string huge = server::advise_l1_huge_pages(std::span<std::byte>(sources.data(), sources.size()));
    if (huge != "asked") throw std::runtime_error("--huge-pages: madvise(MADV_HUGEPAGE) " + huge);
  }
  for (std::size_t i = 0; i < cfg.batch; ++i) {
    for (std::size_t j = 0; j < object_bytes; j += 8) {
      const std::uint64_t v = (i + 1) * 0x9e3779b97f4a7c15ULL ^ j;
      std::memcpy(sources.data() + i * object_bytes + j, &v, 8);
    }
  }
  const fs::path set = cfg.dir / ("load-" + std::to_string(object_bytes >> 20) + "m");
  fs::remove_all(set);
  fs::path read_job;
  if (cfg.loads) {
    ours_store(cfg, set, object_bytes, n, sources);  // the load set (not timed as a figure)
    read_job = write_read_job(cfg, cfg.dir / "read.fio", set);
  }
  figures f;
  bool uring = false;
  for (int r = 0; r < cfg.repeats; ++r) {
    // Odd repeats run ours first: a drift of the device over time (this VM's disk swings 2x)
    // then does not favour either side.
    const bool fio_first = r % 2 == 0;
    std::string read_depths, write_depths;
    auto fio_read = [&] {
      const fio_run fr = run_fio(cfg, read_job, false);
      f.fio_read.push_back(fr.bytes_per_s);
      f.fio_read_full_pct.push_back(depth_pct(fr.depths, cfg.depth));
      read_depths = depth_text(fr.depths);
    };
    auto fio_write = [&] {
      const fs::path fio_dir = cfg.dir / "fio-write";
      fs::remove_all(fio_dir);
      fs::create_directories(fio_dir);
      const fio_run fr = run_fio(cfg, write_write_job(cfg, cfg.dir / "write.fio", fio_dir, object_bytes, n), true);
      f.fio_write.push_back(fr.bytes_per_s);
      f.fio_write_full_pct.push_back(depth_pct(fr.depths, std::max(1u, cfg.depth / cfg.store_jobs())));
      write_depths = depth_text(fr.depths);
      fs::remove_all(fio_dir);
    };
    if (cfg.loads) {
      if (fio_first) fio_read();
      f.ours_read.push_back(ours_load(cfg, set, object_bytes, n, io::file_io_choice::automatic, &uring));
      f.ours_pread.push_back(ours_load(cfg, set, object_bytes, n, io::file_io_choice::pread));
      if (!fio_first) fio_read();
      std::printf("  repeat %d: read fio %.2f, ours %.2f (%s), pread %.2f GB/s\n", r, f.fio_read.back() / 1e9,
                  f.ours_read.back() / 1e9, uring ? "io_uring" : "pread fallback", f.ours_pread.back() / 1e9);
    }
    if (cfg.stores) {
      if (fio_first) fio_write();
      const fs::path ours_dir = cfg.dir / "ours-write";
      fs::remove_all(ours_dir);
      f.ours_write.push_back(ours_store(cfg, ours_dir, object_bytes, n, sources));
      fs::remove_all(ours_dir);
      if (!fio_first) fio_write();
      std::printf("  repeat %d: write fio %.2f, ours %.2f GB/s\n", r, f.fio_write.back() / 1e9,
                  f.ours_write.back() / 1e9);
    }
    std::printf("    fio iodepth histogram (%% of submissions): read %s; write (per job) %s\n",
                cfg.loads ? read_depths.c_str() : "-", cfg.stores ? write_depths.c_str() : "-");
    std::fflush(stdout);
  }
  fs::remove_all(set);
  return f;
}

}  // namespace

int main(int argc, char** argv) try {
  bench_config cfg;
  const char* env_dir = std::getenv("KVTIER_BENCH_DIR");
  cfg.dir = env_dir != nullptr ? fs::path(env_dir) : fs::path("l2-disk-bench");
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(a + " needs a value");
      return argv[++i];
    };
    if (a == "--dir") cfg.dir = next();
    else if (a == "--gib") cfg.gib = std::stod(next());
    else if (a == "--repeats") cfg.repeats = std::stoi(next());
    else if (a == "--fio") cfg.fio = next();
    else if (a == "--fio-store-jobs")
      cfg.fio_store_jobs = static_cast<unsigned>(std::stoul(next()));
    else if (a == "--store-batch")
      cfg.store_batch = std::stoul(next());
    else if (a == "--store-inflight-gib") {
      const double gib = std::stod(next());
      if (!(gib > 0 && gib <= 1024)) throw std::invalid_argument("--store-inflight-gib must be in (0, 1024]");
      cfg.store_inflight_bytes = static_cast<std::uint64_t>(gib * static_cast<double>(1ULL << 30));
    } else if (a == "--lookup-keys") {
      cfg.batch = std::stoul(next());
      if (cfg.batch == 0 || cfg.batch > 1024) throw std::invalid_argument("--lookup-keys must be in 1..1024");
    } else if (a == "--lookups-in-flight") {
      cfg.lookups_in_flight = std::stoul(next());
      if (cfg.lookups_in_flight == 0 || cfg.lookups_in_flight > 8)
        throw std::invalid_argument("--lookups-in-flight must be in 1..8 (the prefetch controller's bound)");
    } else if (a == "--huge-pages")
      cfg.huge_pages = true;
    else if (a == "--name-sync") {
      const std::string v = next();
      if (v == "auto") cfg.name_sync = l2::disk_name_sync::automatic;
      else if (v == "directory") cfg.name_sync = l2::disk_name_sync::directory;
      else if (v == "file") cfg.name_sync = l2::disk_name_sync::file;
      else throw std::invalid_argument("--name-sync takes auto, directory or file");
    }
    else if (a == "--only") {
      const std::string phase = next();
      if (phase != "loads" && phase != "stores") throw std::invalid_argument("--only takes loads or stores");
      cfg.loads = phase == "loads";  // (a second --only replaces the first)
      cfg.stores = phase == "stores";
    } else if (a == "--sizes") {
      cfg.sizes_mib.clear();
      std::stringstream list(next());
      for (std::string item; std::getline(list, item, ',');) {
        const bool digits = !item.empty() && item.size() <= 4 &&
                            std::all_of(item.begin(), item.end(), [](char c) { return c >= '0' && c <= '9'; });
        const std::size_t mib = digits ? std::stoul(item) : 0;
        if (mib == 0 || mib > 1024 || std::find(cfg.sizes_mib.begin(), cfg.sizes_mib.end(), mib) != cfg.sizes_mib.end())
          throw std::invalid_argument("--sizes takes distinct MiB in 1..1024, comma separated (e.g. 32,3)");
        cfg.sizes_mib.push_back(mib);
      }
      if (cfg.sizes_mib.empty()) throw std::invalid_argument("--sizes takes distinct MiB in 1..1024, comma separated (e.g. 32,3)");
    } else if (a == "--quick") {
      cfg.gib = 0.25;
      cfg.repeats = 2;
    } else
      throw std::invalid_argument(
          "unknown argument " + a +
          " (use --dir, --gib, --repeats, --quick, --fio, "
          "--fio-store-jobs, --store-batch, --store-inflight-gib, --huge-pages, --name-sync, --lookup-keys, "
          "--lookups-in-flight, --only, --sizes)");
  }
  if (cfg.repeats < 1 || cfg.gib <= 0) throw std::invalid_argument("--repeats and --gib must be positive");
  if (cfg.fio_store_jobs > 64) throw std::invalid_argument("--fio-store-jobs must be at most 64");
  if (cfg.huge_pages) {
    // fio's shm buffer per job: depth x bs plus alignment, rounded up to 2 MiB pages, and one
    // page more: measured, 8 jobs of depth 2 x 1 MiB fail ("no huge pages available") with 20
    // free pages and run with 24.
    // The read job is one job of the whole depth; the two never run at once.
    const auto pages = [&](unsigned depth) {
      return static_cast<long>((depth * cfg.part + 4096 + (std::size_t{2} << 20) - 1) / (std::size_t{2} << 20) + 1);
    };
    const long need =
        std::max(static_cast<long>(cfg.store_jobs()) * pages(cfg.depth / cfg.store_jobs()), pages(cfg.depth));
    if (free_hugetlb_pages() < need)
      throw std::runtime_error("--huge-pages: fio needs " + std::to_string(need) +
                               " free hugetlb pages (HugePages_Free in /proc/meminfo); as root: echo " +
                               std::to_string(need + 8) + " > /proc/sys/vm/nr_hugepages");
  }
  if (cfg.store_batch == 0 || cfg.store_batch > 4096) throw std::invalid_argument("--store-batch must be in 1..4096");
  fs::create_directories(cfg.dir);
  std::printf("l2_disk_bench in %s (%s)\n", cfg.dir.c_str(), io::probe_uring().detail.c_str());

  using kvtier::bench::median;
  using kvtier::bench::median_ratio;
  using kvtier::bench::print_result;
  const std::string huge = cfg.huge_pages ? "_huge" : "";
  // Loads with several lookups in flight are another figure than one lookup after the other:
  // every load figure (and its fio baseline, from the same run) carries the suffix.
  const std::string lk = cfg.lookups_in_flight > 1 ? "_inflight" + std::to_string(cfg.lookups_in_flight) : "";
  for (const std::size_t mib : cfg.sizes_mib) {
    const figures f = measure(cfg, mib << 20);
    // 32 MiB (a 256-token chunk of Llama-3.1-8B) names the plain figures; other sizes add _<n>m.
    const std::string m = mib == 32 ? "" : "_" + std::to_string(mib) + "m";
    if (cfg.loads) {
      print_result("l2_load_vs_fio" + m + lk + huge, median_ratio(f.ours_read, f.fio_read));
      print_result("l2_load_pread_vs_fio" + m + lk + huge, median_ratio(f.ours_pread, f.fio_read));
      print_result("l2_load" + m + lk + "_gbps" + huge, median(f.ours_read) / 1e9);
      print_result("fio_read" + m + lk + "_gbps" + huge, median(f.fio_read) / 1e9);
      if (mib == 32) print_result("l2_load_pread" + lk + "_gbps" + huge, median(f.ours_pread) / 1e9);
      print_result("fio_read" + m + "_depth_full_pct" + huge, median(f.fio_read_full_pct));
    }
    if (cfg.stores) {
      print_result("l2_store_vs_fio" + m + huge, median_ratio(f.ours_write, f.fio_write));
      print_result("l2_store" + m + "_gbps" + huge, median(f.ours_write) / 1e9);
      print_result("fio_write" + m + "_gbps" + huge, median(f.fio_write) / 1e9);
      print_result("fio_write" + m + "_depth_full_pct" + huge, median(f.fio_write_full_pct));
    }
  }
  if (cfg.stores) {
    print_result("fio_store_jobs", cfg.store_jobs());
    print_result("l2_store_directory_fsync" + huge, store_directory_fsync);
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "kvtier_bench_l2_disk: %s\n", e.what());
  return 1;
}
