// io_bench: the io/ implementations of file_io against each other and against a plain pread loop.
//
//   - 4 KiB reads of a page-cached file (no device): what an operation costs the CPU, at
//     queue depth 1 and 32, for uring_context in each task-running mode and for the pread
//     pool; the batching factor (SQEs per io_uring_enter);
//   - openat + close pairs through file_io vs plain syscalls (the metadata path);
//   - 4 KiB O_DIRECT random reads at depth 32, and 32 MiB objects read with
//     async_read_all (1 MiB parts, 16 in flight) through O_DIRECT: what reaches the device.
//
// Each figure is the median of interleaved repeats; ratios a_vs_b are medians of per-repeat
// ratios (bench/common/results.hpp). Usage: kvtier_bench_io [repeats] [dir]; the directory
// (default: $TMPDIR or /tmp) must be on a file system with O_DIRECT (not tmpfs for the disk
// figures to mean anything).
#include <kvtier/core/buffer.hpp>
#include <kvtier/io/object_io.hpp>
#include <kvtier/io/pread_pool.hpp>
#include <kvtier/io/probe.hpp>
#include <kvtier/io/uring_context.hpp>

#include <common/results.hpp>

#include <boost/asio/io_context.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

namespace asio = boost::asio;
using namespace kvtier;
using clock_type = std::chrono::steady_clock;

constexpr std::size_t block = 4096;

struct file {
  int fd = -1;
  std::size_t bytes = 0;
  ~file() {
    if (fd >= 0) ::close(fd);
  }
};

void make_file(const std::string& path, std::size_t bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) throw std::runtime_error("open " + path + ": " + std::strerror(errno));
  aligned_buffer chunk(1 << 20);
  for (std::size_t i = 0; i < chunk.size(); ++i) chunk.data()[i] = static_cast<std::byte>(i * 31);
  for (std::size_t done = 0; done < bytes; done += chunk.size())
    if (::write(fd, chunk.data(), chunk.size()) != static_cast<ssize_t>(chunk.size())) throw std::runtime_error("write");
  ::fsync(fd);
  ::close(fd);
}

/// Reads random 4 KiB blocks with `depth` reads in flight (each completion starts the next)
/// for about `seconds`; returns reads per second.
template <class FileIo>
double random_reads(FileIo& fio, asio::io_context& ctx, int fd, std::size_t file_bytes, unsigned depth,
                    double seconds) {
  aligned_buffer mem(std::size_t{depth} * block);
  std::mt19937_64 rng(depth);
  const std::size_t blocks = file_bytes / block;
  std::size_t started = 0;
  std::size_t completed = 0;
  bool stop = false;
  std::function<void(unsigned)> start;
  start = [&](unsigned lane) {
    ++started;
    fio.async_read(fd, mem.span().subspan(std::size_t{lane} * block, block), (rng() % blocks) * block,
                   [&, lane](error_code ec, std::size_t n) {
                     if (ec || n != block) throw std::runtime_error("read failed: " + ec.message());
                     ++completed;
                     if (!stop) start(lane);
                   });
  };
  const auto t0 = clock_type::now();
  const auto end = t0 + std::chrono::duration<double>(seconds);
  for (unsigned l = 0; l < depth; ++l) start(l);
  ctx.restart();
  while (completed < started) {
    ctx.run_one();
    if (!stop && clock_type::now() > end) stop = true;
  }
  const double dt = std::chrono::duration<double>(clock_type::now() - t0).count();
  return static_cast<double>(completed) / dt;
}

/// The same with blocking pread on this thread: the physical limit of a cached read.
double sync_reads(int fd, std::size_t file_bytes, double seconds) {
  aligned_buffer mem(block);
  std::mt19937_64 rng(1);
  const std::size_t blocks = file_bytes / block;
  std::size_t n = 0;
  const auto t0 = clock_type::now();
  const auto end = t0 + std::chrono::duration<double>(seconds);
  while (true) {
    for (int i = 0; i < 256; ++i, ++n)
      if (::pread(fd, mem.data(), block, static_cast<off_t>((rng() % blocks) * block)) != block)
        throw std::runtime_error("pread");
    if (clock_type::now() > end) break;
  }
  return static_cast<double>(n) / std::chrono::duration<double>(clock_type::now() - t0).count();
}

/// Reads `objects` random 32 MiB objects one after another with async_read_all; GB/s.
template <class FileIo>
double object_reads(FileIo& fio, asio::io_context& ctx, int fd, std::size_t file_bytes, int objects) {
  constexpr std::size_t object = std::size_t{32} << 20;
  aligned_buffer mem(object);
  std::mt19937_64 rng(7);
  const std::size_t slots = file_bytes / object;
  int done = 0;
  std::function<void()> next;
  next = [&] {
    io::async_read_all(fio, fd, mem.span(), (rng() % slots) * object, [&](error_code ec, std::size_t n) {
      if (ec || n != object) throw std::runtime_error("read_all failed: " + ec.message());
      if (++done < objects) next();
    });
  };
  const auto t0 = clock_type::now();
  next();
  ctx.restart();
  while (done < objects) ctx.run_one();
  const double dt = std::chrono::duration<double>(clock_type::now() - t0).count();
  return static_cast<double>(object) * objects / dt / 1e9;
}

/// Opens and closes an existing file `n` times through file_io, one after the other;
/// pairs per second.
template <class FileIo>
double open_close(FileIo& fio, asio::io_context& ctx, const std::string& path, double seconds) {
  std::size_t done = 0;
  bool stop = false;
  bool running = true;
  std::function<void()> next;
  next = [&] {
    fio.async_openat(AT_FDCWD, path.c_str(), O_RDONLY | O_CLOEXEC, 0, [&](error_code ec, int fd) {
      if (ec) throw std::runtime_error("openat failed: " + ec.message());
      fio.async_close(fd, [&](error_code cec) {
        if (cec) throw std::runtime_error("close failed: " + cec.message());
        ++done;
        if (!stop) next();
        else running = false;
      });
    });
  };
  const auto t0 = clock_type::now();
  const auto end = t0 + std::chrono::duration<double>(seconds);
  next();
  ctx.restart();
  while (running) {
    ctx.run_one();
    if (!stop && clock_type::now() > end) stop = true;
  }
  return static_cast<double>(done) / std::chrono::duration<double>(clock_type::now() - t0).count();
}

double sync_open_close(const std::string& path, double seconds) {
  std::size_t n = 0;
  const auto t0 = clock_type::now();
  const auto end = t0 + std::chrono::duration<double>(seconds);
  while (clock_type::now() < end) {
    for (int i = 0; i < 64; ++i, ++n) {
      const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0) throw std::runtime_error("open");
      ::close(fd);
    }
  }
  return static_cast<double>(n) / std::chrono::duration<double>(clock_type::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  const int repeats = argc > 1 ? std::atoi(argv[1]) : 5;
  const char* tmp = std::getenv("TMPDIR");
  const std::filesystem::path base = argc > 2 ? argv[2] : (tmp != nullptr ? tmp : "/tmp");
  const auto probe = io::probe_uring();
  if (!probe.available()) {
    std::fprintf(stderr, "io_bench: io_uring unavailable (%s): only the pread figures run\n", probe.detail.c_str());
  }
  std::filesystem::path dir = base / ("kvtier-io-bench-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  struct cleanup {
    std::filesystem::path d;
    ~cleanup() {
      std::error_code ec;
      std::filesystem::remove_all(d, ec);
    }
  } clean{dir};

  constexpr std::size_t cached_bytes = std::size_t{64} << 20;
  constexpr std::size_t disk_bytes = std::size_t{512} << 20;
  make_file((dir / "cached").string(), cached_bytes);
  make_file((dir / "disk").string(), disk_bytes);
  file cached{::open((dir / "cached").c_str(), O_RDONLY | O_CLOEXEC), cached_bytes};
  file direct{::open((dir / "disk").c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC), disk_bytes};
  if (cached.fd < 0 || direct.fd < 0) throw std::runtime_error("open failed");
  {
    // Warm the page cache of the cached file.
    aligned_buffer b(1 << 20);
    for (std::size_t off = 0; off < cached_bytes; off += b.size()) (void)::pread(cached.fd, b.data(), b.size(), off);
  }

  asio::io_context ctx;
  std::map<std::string, std::vector<double>> r;
  const double t = 0.25;
  std::uint64_t sqes = 0;
  std::uint64_t enters = 0;
  for (int rep = 0; rep < repeats; ++rep) {
    if (probe.available()) {
      for (auto mode : {io::taskrun_mode::coop, io::taskrun_mode::defer, io::taskrun_mode::interrupt}) {
        io::uring_options o;
        o.taskrun = mode;
        io::uring_context ring(ctx.get_executor(), o);
        const std::string m(io::to_string(mode));
        r["cached_4k_uring_" + m + "_qd1"].push_back(random_reads(ring, ctx, cached.fd, cached_bytes, 1, t));
        const auto s0 = ring.stats().sqes_submitted.load();
        const auto e0 = ring.stats().enter_calls.load();
        r["cached_4k_uring_" + m + "_qd32"].push_back(random_reads(ring, ctx, cached.fd, cached_bytes, 32, t));
        if (mode == io::taskrun_mode::coop) {
          sqes += ring.stats().sqes_submitted.load() - s0;
          enters += ring.stats().enter_calls.load() - e0;
        }
      }
    }
    {
      io::pread_pool pool(ctx.get_executor());
      r["cached_4k_pread_pool_qd1"].push_back(random_reads(pool, ctx, cached.fd, cached_bytes, 1, t));
      r["cached_4k_pread_pool_qd32"].push_back(random_reads(pool, ctx, cached.fd, cached_bytes, 32, t));
    }
    r["cached_4k_sync_pread"].push_back(sync_reads(cached.fd, cached_bytes, t));

    const std::string meta = (dir / "cached").string();
    if (probe.available()) {
      io::uring_context ring(ctx.get_executor());
      r["open_close_uring"].push_back(open_close(ring, ctx, meta, t));
    }
    {
      io::pread_pool pool(ctx.get_executor());
      r["open_close_pread_pool"].push_back(open_close(pool, ctx, meta, t));
    }
    r["open_close_sync"].push_back(sync_open_close(meta, t));

    if (probe.available()) {
      io::uring_context ring(ctx.get_executor());
      r["direct_4k_uring_qd32"].push_back(random_reads(ring, ctx, direct.fd, disk_bytes, 32, t));
      r["direct_read_all_32mib_uring"].push_back(object_reads(ring, ctx, direct.fd, disk_bytes, 8));
    }
    {
      io::pread_pool pool(ctx.get_executor());
      r["direct_4k_pread_pool_qd32"].push_back(random_reads(pool, ctx, direct.fd, disk_bytes, 32, t));
      r["direct_read_all_32mib_pread_pool"].push_back(object_reads(pool, ctx, direct.fd, disk_bytes, 8));
    }
  }

  for (const auto& [name, v] : r) {
    const bool gb = name.find("read_all") != std::string::npos;
    const bool pairs = name.find("open_close") != std::string::npos;
    bench::print_result("io_" + name + (gb ? "_gbps" : pairs ? "_pairs_per_s" : "_ops_per_s"), bench::median(v));
  }
  if (probe.available()) {
    bench::print_result("io_uring_sqes_per_enter_qd32", enters ? static_cast<double>(sqes) / enters : 0.0);
    bench::print_result("io_cached_4k_uring_qd1_vs_pread_pool_qd1",
                        bench::median_ratio(r["cached_4k_uring_coop_qd1"], r["cached_4k_pread_pool_qd1"]));
    bench::print_result("io_cached_4k_uring_qd32_vs_pread_pool_qd32",
                        bench::median_ratio(r["cached_4k_uring_coop_qd32"], r["cached_4k_pread_pool_qd32"]));
    bench::print_result("io_cached_4k_uring_qd32_vs_sync_pread",
                        bench::median_ratio(r["cached_4k_uring_coop_qd32"], r["cached_4k_sync_pread"]));
    bench::print_result("io_cached_4k_uring_defer_vs_coop_qd32",
                        bench::median_ratio(r["cached_4k_uring_defer_qd32"], r["cached_4k_uring_coop_qd32"]));
    bench::print_result("io_cached_4k_uring_interrupt_vs_coop_qd32",
                        bench::median_ratio(r["cached_4k_uring_interrupt_qd32"], r["cached_4k_uring_coop_qd32"]));
    bench::print_result("io_open_close_uring_vs_sync",
                        bench::median_ratio(r["open_close_uring"], r["open_close_sync"]));
    bench::print_result("io_direct_4k_uring_vs_pread_pool_qd32",
                        bench::median_ratio(r["direct_4k_uring_qd32"], r["direct_4k_pread_pool_qd32"]));
    bench::print_result("io_direct_read_all_32mib_uring_vs_pread_pool",
                        bench::median_ratio(r["direct_read_all_32mib_uring"], r["direct_read_all_32mib_pread_pool"]));
  }
  return 0;
}
