#pragma once
// The disk probes that L2-hit figures are paired with (kvtier_long_doc_qa --io-bound-dir:
// examples/long_doc_qa/io_bound.hpp makes its pairs; kvtier_bench_rpc's L2 hit): memcpy
// bandwidth, the O_DIRECT read bandwidth of a disk backend's object files (into small reused
// buffers, or into memory spread like the server's L1 slots, in huge pages), and the server's
// CPU and run-queue time from /proc.

#include <fcntl.h>
#include <liburing.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <new>
#include <span>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

namespace examples::disk_probe {

// What memcpy_bandwidth copies: `bytes` bytes in `piece`-byte calls over a pre-touched
// working set of up to 2 x 256 MiB (cycled when `bytes` is larger).
class piecewise_copy {
 public:
  piecewise_copy(std::size_t bytes, std::size_t piece)
      : bytes_(bytes),
        piece_(piece),
        set_(std::max(piece, std::min<std::size_t>(bytes, 256u << 20) / piece * piece)),
        src_(set_, 1),
        dst_(set_, 2) {
    std::memcpy(dst_.data(), src_.data(), set_);  // fault everything in before timing
  }
  /// Copies all the bytes; returns how many.
  std::size_t run() {
    std::size_t done = 0, off = 0;
    while (done < bytes_) {
      const std::size_t n = std::min(piece_, bytes_ - done);
      std::memcpy(dst_.data() + off, src_.data() + off, n);
      done += n;
      off = off + piece_ >= set_ ? 0 : off + piece_;
    }
    volatile char sink = dst_[set_ / 2];
    (void)sink;
    return done;
  }

 private:
  std::size_t bytes_, piece_, set_;
  std::vector<char> src_, dst_;
};

// Bytes per second of memcpy for `bytes` bytes in `piece`-byte calls (piecewise_copy).
inline double memcpy_bandwidth(std::size_t bytes, std::size_t piece) {
  piecewise_copy copy(bytes, piece);
  const auto t0 = std::chrono::steady_clock::now();
  const std::size_t done = copy.run();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return static_cast<double>(done) / s;
}

// The object files the probe reads: the newest regular files under dir/objects, as many as
// hold `bytes` (right after a warmup: the files it stored, which its query round loads),
// in the order they were written (oldest first: about the order the round loads them), cut
// into 1 MiB reads (fd, offset). Opens them O_DIRECT and keeps them open, so that the probes
// before and after a round read exactly the same bytes.
struct probe_files {
  static constexpr std::size_t part = std::size_t{1} << 20;
  std::vector<int> fds;
  std::vector<std::pair<int, std::size_t>> parts;
  std::size_t bytes = 0;  ///< the files' total size
  probe_files(const std::filesystem::path& dir, std::size_t want) {
    namespace fs = std::filesystem;
    std::vector<std::pair<fs::file_time_type, fs::path>> files;
    for (const auto& e : fs::recursive_directory_iterator(dir / "objects"))
      if (e.is_regular_file()) files.emplace_back(e.last_write_time(), e.path());
    std::sort(files.begin(), files.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
    std::size_t taken = 0;
    while (taken < files.size() && bytes < want) bytes += fs::file_size(files[taken++].second);
    files.resize(taken);
    std::reverse(files.begin(), files.end());  // oldest first
    for (const auto& [t, p] : files) {
      const int fd = ::open(p.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
      if (fd < 0) continue;
      fds.push_back(fd);
      const std::size_t size = fs::file_size(p);
      for (std::size_t off = 0; off < size; off += part) parts.emplace_back(fd, off);
    }
    if (parts.empty()) throw std::runtime_error("disk probe: no object files under " + (dir / "objects").string());
  }
  probe_files(const probe_files&) = delete;
  probe_files& operator=(const probe_files&) = delete;
  ~probe_files() {
    for (int fd : fds) ::close(fd);
  }
  /// The k-th read of a pass, forward (write order) or backward.
  [[nodiscard]] std::pair<int, std::size_t> at(std::size_t k, bool backward) const noexcept {
    return parts[backward ? parts.size() - 1 - k : k];
  }
};

// Where a probe's reads land. small(): `depth` 1 MiB buffers, each reused as its read
// completes, freshly allocated per probe (the probe before this change). spread(): part k at
// offset k MiB (mod the region) of a region as large as one request's bytes, as the server's
// loads fill distinct L1 slots, in transparent huge pages where the kernel gives them
// (MADV_HUGEPAGE). Why: on the dev VM the same O_DIRECT reads run at 1.25 to 1.97 GB/s
// depending on the buffer they land in, steady for one buffer and different between two
// buffers allocated side by side; 4 KiB pages that happen to be physically scattered make
// every 1 MiB read 256 segments (virtio's max_segments is 254: two requests), contiguous
// ones one. Buffers in 2 MiB pages all read at the top rate (1.75-1.78 GB/s where 4 KiB
// buffers read 1.24-1.49). That top rate is the disk's; the "disk modes" of the earlier
// figures were mostly which buffer a probe, or the server's L1, happened to get.
// /work/notes/part2-perf.md has the measurements.
class probe_memory {
 public:
  static constexpr std::size_t part = std::size_t{1} << 20;
  static constexpr std::size_t huge_page = std::size_t{2} << 20;
  static constexpr std::size_t max_region = std::size_t{512} << 20;  ///< an 8B request is 512 MiB

  /// A region of `bytes` (rounded up to 2 MiB, at most max_region) asked to be in huge
  /// pages, touched now.
  explicit probe_memory(std::size_t bytes)
      : bytes_(std::clamp<std::size_t>((bytes + huge_page - 1) / huge_page * huge_page, huge_page, max_region)),
        data_(static_cast<std::byte*>(std::aligned_alloc(huge_page, bytes_))) {
    if (data_ == nullptr) throw std::bad_alloc();
    (void)::madvise(data_, bytes_, MADV_HUGEPAGE);  // a kernel without THP: 4 KiB pages, said below
    std::memset(data_, 0, bytes_);
    huge_fraction_ = huge_fraction_of(data_, bytes_);
  }
  probe_memory(const probe_memory&) = delete;
  probe_memory& operator=(const probe_memory&) = delete;
  ~probe_memory() { std::free(data_); }
  [[nodiscard]] std::span<std::byte> region() const noexcept { return {data_, bytes_}; }
  /// The share of the region the kernel gave huge pages (AnonHugePages of its mapping in
  /// /proc/self/smaps; 0 where unreadable).
  [[nodiscard]] double huge_fraction() const noexcept { return huge_fraction_; }

 private:
  static double huge_fraction_of(const std::byte* p, std::size_t bytes) {
    std::FILE* f = std::fopen("/proc/self/smaps", "r");
    if (f == nullptr) return 0;
    const auto at = reinterpret_cast<std::uintptr_t>(p);
    char line[512];
    bool inside = false;
    double huge_kib = 0;
    while (std::fgets(line, sizeof line, f) != nullptr) {
      unsigned long lo = 0, hi = 0;
      if (std::sscanf(line, "%lx-%lx ", &lo, &hi) == 2 && std::strchr(line, '-') < std::strchr(line, ' ')) {
        inside = at >= lo && at < hi;
        continue;
      }
      double kib = 0;
      if (inside && std::sscanf(line, "AnonHugePages: %lf kB", &kib) == 1) huge_kib = kib;
    }
    std::fclose(f);
    return std::min(1.0, huge_kib * 1024 / static_cast<double>(bytes));
  }

  std::size_t bytes_;
  std::byte* data_;
  double huge_fraction_ = 0;
};

// The reads of those files at the disk backend's depth: one io_uring, `depth` 1 MiB reads in
// flight, into registered memory (READ_FIXED, as the server's loads into its registered L1):
// `spread` (k-th read at k MiB mod its size) when given, else `depth` reused buffers. Bytes
// per second, or 0 where the kernel refuses io_uring. `at_start`, when given, runs right
// before the first read is prepared (where the timing starts).
inline double uring_read_bandwidth(const probe_files& f, bool backward, unsigned depth,
                                   std::span<std::byte> spread = {}, const std::function<void()>& at_start = {}) {
  io_uring ring;
  if (::io_uring_queue_init(depth, &ring, 0) != 0) return 0;
  const std::size_t part = probe_files::part;
  void* small = nullptr;
  std::span<std::byte> mem = spread;
  if (mem.size() < part * depth) {  // the small reused buffers
    small = std::aligned_alloc(4096, part * depth);
    if (small == nullptr) {
      ::io_uring_queue_exit(&ring);
      return 0;
    }
    std::memset(small, 0, part * depth);  // resident before it is registered and timed
    mem = {static_cast<std::byte*>(small), part * depth};
  }
  const bool spreading = small == nullptr;
  const iovec iov{mem.data(), mem.size()};
  const bool fixed = ::io_uring_register_buffers(&ring, &iov, 1) == 0;
  std::vector<unsigned> free_slots;
  for (unsigned i = 0; i < depth; ++i) free_slots.push_back(i);
  std::size_t next = 0, in_flight = 0, total = 0;
  bool failed = false;
  if (at_start) at_start();
  const auto t0 = std::chrono::steady_clock::now();
  while (!failed && (next < f.parts.size() || in_flight > 0)) {
    while (next < f.parts.size() && !free_slots.empty()) {
      io_uring_sqe* sqe = ::io_uring_get_sqe(&ring);
      if (sqe == nullptr) break;
      const unsigned slot = free_slots.back();
      free_slots.pop_back();
      const std::size_t k = next++;
      std::byte* dst = spreading ? mem.data() + (k * part) % mem.size() : mem.data() + std::size_t{slot} * part;
      const auto [fd, off] = f.at(k, backward);
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
  std::free(small);
  return failed ? 0 : static_cast<double>(total) / s;
}

// The same reads on `depth` threads with one blocking pread each (where io_uring is refused),
// into `spread` as above when given, else one buffer per thread.
inline double pread_read_bandwidth(const probe_files& f, bool backward, unsigned depth,
                                   std::span<std::byte> spread = {}) {
  const std::size_t part = probe_files::part;
  const bool spreading = spread.size() >= part * depth;
  std::atomic<std::size_t> next{0}, total{0};
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> threads;
  for (unsigned i = 0; i < depth; ++i)
    threads.emplace_back([&] {
      void* buf = spreading ? nullptr : std::aligned_alloc(4096, part);
      std::size_t got = 0;
      for (std::size_t k; (k = next.fetch_add(1)) < f.parts.size();) {
        const auto [fd, off] = f.at(k, backward);
        void* dst = spreading ? static_cast<void*>(spread.data() + (k * part) % spread.size()) : buf;
        const ssize_t n = ::pread(fd, dst, part, static_cast<off_t>(off));
        if (n > 0) got += static_cast<std::size_t>(n);
      }
      std::free(buf);
      total += got;
    });
  for (auto& t : threads) t.join();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return static_cast<double>(total.load()) / s;
}

// Bytes per second reading every part of `f` once (forward or backward) with O_DIRECT,
// 1 MiB reads, `depth` in flight: io_uring into registered memory, else threads; into
// `spread` when given (see probe_memory). O_DIRECT: the guest's page cache neither serves the
// probe nor keeps what it read, so a probe before a round cannot make the round's loads
// (O_DIRECT too: l2::disk_backend, disk_load.hpp) any faster.
inline double disk_read_bandwidth(const probe_files& f, bool backward, unsigned depth = 16,
                                  std::span<std::byte> spread = {}) {
  if (const double bps = uring_read_bandwidth(f, backward, depth, spread); bps > 0) return bps;
  return pread_read_bandwidth(f, backward, depth, spread);
}

// The disk and a copy at the same time: the reads of disk_read_bandwidth (io_uring, into
// `spread`) while a second thread memcpys as many bytes as they read, in `piece`-byte calls
// (memcpy_bandwidth's working set), both started together. An L2 hit does both with the
// same bytes (the load reads them into L1, the retrieve copies each chunk into the engine's
// blocks as it lands), so `both_s` is the overlapped bound as this machine delivers it: on
// hardware where a disk's DMA and a CPU copy do not compete it is max(disk, copy); on a VM
// whose virtual disk is a copy by the host (the dev VM's at 5 GB/s), a copy in the guest
// slows the disk, and `read_s` says by how much. All zero where io_uring is refused.
struct read_with_copy {
  double read_s = 0;  ///< the reads alone, from their start
  double copy_s = 0;  ///< the copy, from the same start
  double both_s = 0;  ///< until both ended
};
inline read_with_copy read_with_copy_seconds(const probe_files& f, bool backward, std::span<std::byte> spread,
                                             std::size_t piece) {
  piecewise_copy copy(f.bytes, piece);
  enum : int { waiting, started, abandoned };
  std::atomic<int> state{waiting};
  std::chrono::steady_clock::time_point t0{}, copy_end{};
  std::thread copier([&] {
    state.wait(waiting);
    if (state == abandoned) return;
    copy.run();
    copy_end = std::chrono::steady_clock::now();
  });
  const double bps = uring_read_bandwidth(f, backward, 16, spread, [&] {
    t0 = std::chrono::steady_clock::now();
    state = started;
    state.notify_one();
  });
  if (state == waiting) {  // io_uring refused before the reads started
    state = abandoned;
    state.notify_one();
  }
  copier.join();
  if (bps <= 0) return {};
  read_with_copy r;
  r.read_s = static_cast<double>(f.bytes) / bps;
  r.copy_s = std::chrono::duration<double>(copy_end - t0).count();
  r.both_s = std::max(r.read_s, r.copy_s);
  return r;
}

// CPU time and time spent runnable but waiting for a CPU, per thread of process `pid`
// (/proc/PID/task/*/schedstat, nanoseconds; empty where unreadable: another machine's
// server, or no schedstats). Where the time of an L2 hit goes when the host is busy.
struct sched_time {
  double cpu_s = 0, wait_s = 0;
};
using sched_sample = std::vector<std::pair<long, sched_time>>;  ///< (tid, times), by tid
inline sched_sample sched_sample_of(long pid) {
  sched_sample out;
  if (pid <= 0) return out;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/task", ec)) {
    std::FILE* f = std::fopen((e.path() / "schedstat").c_str(), "r");
    if (f == nullptr) continue;
    unsigned long long run = 0, wait = 0;
    if (std::fscanf(f, "%llu %llu", &run, &wait) == 2)
      out.emplace_back(std::atol(e.path().filename().c_str()),
                       sched_time{static_cast<double>(run) * 1e-9, static_cast<double>(wait) * 1e-9});
    std::fclose(f);
  }
  std::sort(out.begin(), out.end(), [](const auto& x, const auto& y) { return x.first < y.first; });
  return out;
}
// What the threads alive at `after` spent since `before` (a thread born since: all its time).
// A thread that ended in between is missed (io_uring's iou-wrk threads come and go): an
// underestimate, never negative.
inline sched_time sched_delta(const sched_sample& before, const sched_sample& after) {
  sched_time d;
  for (const auto& [tid, t] : after) {
    const auto it =
        std::lower_bound(before.begin(), before.end(), tid, [](const auto& x, long id) { return x.first < id; });
    const bool known = it != before.end() && it->first == tid;
    d.cpu_s += t.cpu_s - (known ? it->second.cpu_s : 0);
    d.wait_s += t.wait_s - (known ? it->second.wait_s : 0);
  }
  return d;
}

}  // namespace examples::disk_probe
