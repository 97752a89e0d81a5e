#pragma once
// kvtier_long_doc_qa --io-bound-dir: the end-to-end L2-hit figure (main.cpp's header comment
// says what is measured and why): memcpy and disk read bandwidth, and per trial the query
// round's kvtier time against the disk + memcpy time of its bytes; medians over trials as
// RESULT lines.

#include <kvtier_program/stats.hpp>
#include "../mini_engine/engine.hpp"

#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <liburing.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace long_doc_qa {

// Bytes per second of memcpy for `bytes` bytes in `piece`-byte calls over a pre-touched
// working set of up to 2 x 256 MiB (cycled when `bytes` is larger).
inline double memcpy_bandwidth(std::size_t bytes, std::size_t piece) {
  const std::size_t set = std::max(piece, std::min<std::size_t>(bytes, 256u << 20) / piece * piece);
  std::vector<char> src(set, 1), dst(set, 2);
  std::memcpy(dst.data(), src.data(), set);  // fault everything in before timing
  const auto t0 = std::chrono::steady_clock::now();
  std::size_t done = 0, off = 0;
  while (done < bytes) {
    const std::size_t n = std::min(piece, bytes - done);
    std::memcpy(dst.data() + off, src.data() + off, n);
    done += n;
    off = off + piece >= set ? 0 : off + piece;
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  volatile char sink = dst[set / 2];
  (void)sink;
  return static_cast<double>(done) / s;
}

// The object files the probe reads: the newest regular files under dir/objects, as many as
// hold `bytes`, cut into 1 MiB reads (fd, offset) in file order. Opens them O_DIRECT.
struct probe_files {
  static constexpr std::size_t part = std::size_t{1} << 20;
  std::vector<int> fds;
  std::vector<std::pair<int, std::size_t>> parts;
  probe_files(const std::filesystem::path& dir, std::size_t bytes) {
    namespace fs = std::filesystem;
    std::vector<std::pair<fs::file_time_type, fs::path>> files;
    for (const auto& e : fs::recursive_directory_iterator(dir / "objects"))
      if (e.is_regular_file()) files.emplace_back(e.last_write_time(), e.path());
    std::sort(files.begin(), files.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
    std::size_t planned = 0;
    for (const auto& [t, p] : files) {
      if (planned >= bytes) break;
      const int fd = ::open(p.c_str(), O_RDONLY | O_DIRECT);
      if (fd < 0) continue;
      fds.push_back(fd);
      const std::size_t size = fs::file_size(p);
      for (std::size_t off = 0; off < size; off += part) parts.emplace_back(fd, off);
      planned += size;
    }
    if (parts.empty()) throw std::runtime_error("--io-bound-dir: no object files under " + (dir / "objects").string());
  }
  probe_files(const probe_files&) = delete;
  probe_files& operator=(const probe_files&) = delete;
  ~probe_files() {
    for (int fd : fds) ::close(fd);
  }
};

// The strongest plain read of those files at the disk backend's depth: one io_uring, `depth`
// 1 MiB reads in flight, into one registered buffer (READ_FIXED, as the server's loads into
// its registered L1). Bytes per second, or 0 where the kernel refuses io_uring.
inline double uring_read_bandwidth(const probe_files& f, unsigned depth) {
  io_uring ring;
  if (::io_uring_queue_init(depth, &ring, 0) != 0) return 0;
  const std::size_t part = probe_files::part;
  void* buf = std::aligned_alloc(4096, part * depth);
  if (buf == nullptr) {
    ::io_uring_queue_exit(&ring);
    return 0;
  }
  std::memset(buf, 0, part * depth);  // resident before it is registered and timed
  const iovec iov{buf, part * depth};
  const bool fixed = ::io_uring_register_buffers(&ring, &iov, 1) == 0;
  std::vector<unsigned> free_slots;
  for (unsigned i = 0; i < depth; ++i) free_slots.push_back(i);
  std::size_t next = 0, in_flight = 0, total = 0;
  bool failed = false;
  const auto t0 = std::chrono::steady_clock::now();
  while (!failed && (next < f.parts.size() || in_flight > 0)) {
    while (next < f.parts.size() && !free_slots.empty()) {
      io_uring_sqe* sqe = ::io_uring_get_sqe(&ring);
      if (sqe == nullptr) break;
      const unsigned slot = free_slots.back();
      free_slots.pop_back();
      char* dst = static_cast<char*>(buf) + std::size_t{slot} * part;
      const auto [fd, off] = f.parts[next++];
      if (fixed)
        ::io_uring_prep_read_fixed(sqe, fd, dst, part, off, 0);
      else
        ::io_uring_prep_read(sqe, fd, dst, part, off);
      ::io_uring_sqe_set_data64(sqe, slot);
      ++in_flight;
    }
    if (::io_uring_submit_and_wait(&ring, 1) < 0) {
      failed = true;
      break;
    }
    io_uring_cqe* cqe = nullptr;
    while (::io_uring_peek_cqe(&ring, &cqe) == 0) {
      if (cqe->res > 0)
        total += static_cast<std::size_t>(cqe->res);
      else if (cqe->res < 0)
        failed = true;
      free_slots.push_back(static_cast<unsigned>(::io_uring_cqe_get_data64(cqe)));
      --in_flight;
      ::io_uring_cqe_seen(&ring, cqe);
    }
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ::io_uring_queue_exit(&ring);
  std::free(buf);
  return failed ? 0 : static_cast<double>(total) / s;
}

// The same reads on `depth` threads with one blocking pread each (where io_uring is refused).
inline double pread_read_bandwidth(const probe_files& f, unsigned depth) {
  const std::size_t part = probe_files::part;
  std::atomic<std::size_t> next{0}, total{0};
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> threads;
  for (unsigned i = 0; i < depth; ++i)
    threads.emplace_back([&] {
      void* buf = std::aligned_alloc(4096, part);
      std::size_t got = 0;
      for (std::size_t k; (k = next.fetch_add(1)) < f.parts.size();) {
        const ssize_t n = ::pread(f.parts[k].first, buf, part, static_cast<off_t>(f.parts[k].second));
        if (n > 0) got += static_cast<std::size_t>(n);
      }
      std::free(buf);
      total += got;
    });
  for (auto& t : threads) t.join();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return static_cast<double>(total.load()) / s;
}

// Bytes per second reading the newest object files under dir (as many as hold `bytes`) with
// O_DIRECT, 1 MiB reads, `depth` in flight: io_uring with a registered buffer, else threads.
inline double disk_read_bandwidth(const std::filesystem::path& dir, std::size_t bytes, unsigned depth = 16) {
  const probe_files f(dir, bytes);
  if (const double bps = uring_read_bandwidth(f, depth); bps > 0) return bps;
  return pread_read_bandwidth(f, depth);
}

/// The io-bound figures of every trial, and their medians as RESULT lines.
class io_bound_series {
 public:
  /// One trial's query round `qrep` (not empty) against the disk read bandwidth over the
  /// object files under `dir` and `memcpy_bps` (measured before the round); prints the
  /// trial's line and returns its JSON.
  nlohmann::json measure(const mini_engine::run_report& qrep, const std::string& dir, double memcpy_bps,
                         double tokens_per_second, std::size_t token_bytes) {
    double kv_s = 0, bytes = 0;
    for (const auto& r : qrep.requests) {
      kv_s += r.ttft_s - (tokens_per_second > 0 ? static_cast<double>(r.computed_tokens) / tokens_per_second : 0);
      bytes += static_cast<double>(r.retrieved_tokens * token_bytes);
    }
    const double nreq = static_cast<double>(qrep.requests.size());
    kv_s /= nreq;
    bytes /= nreq;
    const double disk_bps = disk_read_bandwidth(dir, static_cast<std::size_t>(bytes * nreq));
    const double disk_s = bytes / disk_bps, copy_s = bytes / memcpy_bps;
    const double bound = disk_s + copy_s;  // the old serial figure; the overlap bound below
    ratios_.push_back(kv_s / bound);
    kvtier_s_.push_back(kv_s);
    bound_s_.push_back(bound);
    disk_bps_.push_back(disk_bps);
    memcpy_bps_.push_back(memcpy_bps);
    bytes_.push_back(bytes);
    // The bounds that count: the copy of one chunk overlaps the read of the next, so the
    // limit is the larger of the two costs (bound_s_, their sum, is kept as the old figure).
    const double overlap_s = std::max(disk_s, copy_s);
    disk_s_.push_back(disk_s);
    copy_s_.push_back(copy_s);
    overlap_s_.push_back(overlap_s);
    vs_overlap_.push_back(kv_s / overlap_s);
    vs_disk_.push_back(kv_s / disk_s);
    std::fprintf(stderr,
                 "io-bound: %.1f MiB per request; kvtier %.4f s; disk %.2f GB/s + memcpy %.2f GB/s -> bound %.4f s; "
                 "ratio %.3f\n",
                 bytes / 1048576, kv_s, disk_bps / 1e9, memcpy_bps / 1e9, bound, kv_s / bound);
    return {{"bytes_per_request", bytes},      {"kvtier_s", kv_s},    {"disk_read_gbps", disk_bps / 1e9},
            {"memcpy_gbps", memcpy_bps / 1e9}, {"io_bound_s", bound}, {"ratio", kv_s / bound}};
  }

  [[nodiscard]] bool empty() const noexcept { return ratios_.empty(); }

  /// The RESULT lines (names end in `suffix`); with `recompute_ratios` (L2 mode: the query
  /// round was served from L2, the warmup computed the same documents) also
  /// l2_hit_vs_recompute.
  void print_results(const std::string& suffix, const std::vector<double>* recompute_ratios) const {
    using kvtier::program::median;
    const char* sfx = suffix.c_str();
    std::printf("RESULT l2_hit_kvtier_s%s=%.6f\n", sfx, median(kvtier_s_));
    std::printf("RESULT l2_hit_io_bound_s%s=%.6f\n", sfx, median(bound_s_));
    std::printf("RESULT l2_hit_disk_read_gbps%s=%.4f\n", sfx, median(disk_bps_) / 1e9);
    std::printf("RESULT l2_hit_memcpy_gbps%s=%.4f\n", sfx, median(memcpy_bps_) / 1e9);
    std::printf("RESULT l2_hit_bytes_per_request%s=%.1f\n", sfx, median(bytes_));
    std::printf("RESULT l2_hit_ttft_vs_io_bound%s=%.6f\n", sfx, median(ratios_));
    std::printf("RESULT l2_hit_disk_time_s%s=%.6f\n", sfx, median(disk_s_));
    std::printf("RESULT l2_hit_copy_time_s%s=%.6f\n", sfx, median(copy_s_));
    std::printf("RESULT l2_hit_overlap_bound_s%s=%.6f\n", sfx, median(overlap_s_));
    std::printf("RESULT l2_hit_ttft_vs_overlap_bound%s=%.6f\n", sfx, median(vs_overlap_));
    std::printf("RESULT l2_hit_ttft_vs_disk_time%s=%.6f\n", sfx, median(vs_disk_));
    if (recompute_ratios) std::printf("RESULT l2_hit_vs_recompute%s=%.6f\n", sfx, median(*recompute_ratios));
  }

 private:
  std::vector<double> ratios_, kvtier_s_, bound_s_, disk_bps_, memcpy_bps_, bytes_;
  std::vector<double> disk_s_, copy_s_, overlap_s_, vs_overlap_, vs_disk_;
};

}  // namespace long_doc_qa
