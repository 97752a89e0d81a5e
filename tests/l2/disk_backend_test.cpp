// The disk backend beyond the conformance suite: format and index, restart, crash recovery
// (a child killed mid-write), torn files, ENOSPC on a small tmpfs, EIO and corruption (never
// a wrong byte), capacity by st_blocks, deadlines and the buffer contract, JSON options.
#include <kvtier/l2/disk/disk_backend.hpp>

#include <kvtier/core/buffer.hpp>
#include <kvtier/l2/fault_injecting_backend.hpp>
#include <kvtier/telemetry/collectors.hpp>

#include <catch2/catch.hpp>

#include "support/asio.hpp"
#include "support/captured_log.hpp"
#include "support/process.hpp"

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/bind_cancellation_slot.hpp>
#include <boost/asio/cancellation_signal.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <fcntl.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <optional>
#include <set>
#include <thread>
#include <vector>

// This file's names (its test binary is compiled in unity batches with the module's other files).
namespace file_disk_backend_test {

using namespace kvtier;
namespace asio = boost::asio;
namespace fs = std::filesystem;
using kvtier::test::captured_log;
using kvtier::test::run_sync;
using kvtier::test::run_until;
using kvtier::test::temp_dir;

namespace {

chunk_key key_of(std::uint64_t i) { return chunk_key{0xd15c, 1, 0, hash128{i * 0x9e3779b97f4a7c15ULL + 7, i}}; }

/// The bytes of key k's object: a function of the key alone, so any object served can be
/// checked byte for byte without remembering what was written.
void fill_for(const chunk_key& k, std::span<std::byte> out) {
  std::uint64_t x = k.hash.lo ^ (k.hash.hi << 1) ^ out.size();
  for (std::size_t j = 0; j < out.size(); j += 8) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    const std::size_t n = std::min<std::size_t>(8, out.size() - j);
    std::memcpy(out.data() + j, &x, n);
  }
}
bool matches(const chunk_key& k, std::span<const std::byte> got) {
  if (got.empty()) return true;  // memcmp of an empty vector's data() (null) is undefined
  std::vector<std::byte> want(got.size());
  fill_for(k, want);
  return std::memcmp(want.data(), got.data(), got.size()) == 0;
}

/// The backend's series and its file I/O's, as the server registers them.
void collect(telemetry::registry& reg, const l2::disk_backend& b) {
  telemetry::collect_io(reg, b.file_io_kind() == io::file_io_kind::uring, b.shared_io_stats());
  telemetry::collect_disk_backend(reg, b);
}

l2::deadline soon() { return l2::clock::now() + std::chrono::seconds(60 * config::timeout_scale); }

l2::disk_backend_options options_for(const fs::path& p, std::uint64_t capacity = std::uint64_t{1} << 30) {
  l2::disk_backend_options o;
  o.path = p;
  o.capacity_bytes = capacity;
  return o;
}

/// Objects of `bytes` each for keys [first, first + n), in 4 KiB-aligned buffers.
struct objects {
  std::vector<chunk_key> keys;
  std::vector<aligned_buffer> data;
  std::size_t bytes;
  objects(std::uint64_t first, std::size_t n, std::size_t object_bytes) : bytes(object_bytes) {
    for (std::size_t i = 0; i < n; ++i) {
      keys.push_back(key_of(first + i));
      data.emplace_back(object_bytes);
      fill_for(keys.back(), std::span(data.back().data(), object_bytes));
    }
  }
  [[nodiscard]] std::vector<std::span<const std::byte>> sources() const {
    std::vector<std::span<const std::byte>> s;
    for (const auto& b : data) s.emplace_back(b.data(), bytes);
    return s;
  }
};

template <class B>
l2::batch_result store(asio::io_context& io, B& b, std::span<const chunk_key> keys,
                       std::vector<std::span<const std::byte>> src, l2::deadline d = soon()) {
  auto [ec, r] = run_sync(io, [&]() -> asio::awaitable<std::tuple<error_code, l2::batch_result>> {
    co_return co_await b.async_store(keys, src, d, asio::as_tuple(asio::use_awaitable));
  }());
  (void)ec;
  return r;
}
template <class B>
l2::batch_result store(asio::io_context& io, B& b, const objects& o) {
  return store(io, b, o.keys, o.sources());
}

struct loaded {
  error_code ec;
  l2::batch_result r;
  std::vector<aligned_buffer> out;
};

template <class B>
loaded load(asio::io_context& io, B& b, std::span<const chunk_key> keys, std::size_t bytes, l2::deadline d = soon()) {
  loaded l;
  std::vector<std::span<std::byte>> dst;
  for (std::size_t i = 0; i < keys.size(); ++i) {
    l.out.emplace_back(bytes);
    if (bytes > 0) std::memset(l.out.back().data(), 0xee, bytes);
  }
  for (auto& x : l.out) dst.emplace_back(x.data(), bytes);
  std::tie(l.ec, l.r) = run_sync(io, [&]() -> asio::awaitable<std::tuple<error_code, l2::batch_result>> {
    co_return co_await b.async_load(keys, dst, d, asio::as_tuple(asio::use_awaitable));
  }());
  return l;
}

template <class B>
bitmap lookup(asio::io_context& io, B& b, std::span<const chunk_key> keys) {
  auto [ec, found] = run_sync(io, [&]() -> asio::awaitable<std::tuple<error_code, bitmap>> {
    co_return co_await b.async_lookup_and_pin(keys, soon(), asio::as_tuple(asio::use_awaitable));
  }());
  (void)ec;
  return found;
}

template <class B>
l2::batch_result remove(asio::io_context& io, B& b, std::span<const chunk_key> keys) {
  auto [ec, r] = run_sync(io, [&]() -> asio::awaitable<std::tuple<error_code, l2::batch_result>> {
    co_return co_await b.async_remove(keys, soon(), asio::as_tuple(asio::use_awaitable));
  }());
  (void)ec;
  return r;
}

/// A first life of the directory: a backend on `dir` stores every object of `o` (all must
/// answer ok), `then(b)` looks at it, and it closes, as a process that ends; the test then
/// opens the directory again.
template <class Then>
void first_life(const fs::path& dir, const objects& o, Then then) {
  asio::io_context io;
  l2::disk_backend b(io.get_executor(), options_for(dir));
  REQUIRE(store(io, b, o).count(l2::key_outcome::ok) == o.keys.size());
  then(b);
}

/// What is on disk under a backend's directory: object files and their allocated bytes.
struct on_disk {
  std::size_t objects = 0;
  std::uint64_t allocated = 0;
  std::size_t temp_files = 0;
};
on_disk scan(const fs::path& root) {
  on_disk d;
  for (const auto& e : fs::recursive_directory_iterator(root / "objects")) {
    if (!e.is_regular_file() || e.path().extension() != ".kvo") continue;
    struct ::stat st {};
    REQUIRE(::stat(e.path().c_str(), &st) == 0);
    ++d.objects;
    d.allocated += static_cast<std::uint64_t>(st.st_blocks) * 512;
  }
  for (const auto& e : fs::directory_iterator(root / "tmp")) d.temp_files += e.is_regular_file() ? 1 : 0;
  return d;
}

/// Checks every object the backend says it has against the bytes its key implies.
std::size_t check_all_served(asio::io_context& io, l2::disk_backend& b, std::span<const chunk_key> candidates,
                             std::size_t bytes) {
  std::size_t served = 0;
  for (const auto& k : candidates) {
    auto l = load(io, b, std::span(&k, 1), bytes);
    const auto o = l.r.outcomes[0];
    INFO(k.to_string() << " " << l2::name(o));
    CHECK((o == l2::key_outcome::ok || o == l2::key_outcome::not_found));
    if (o == l2::key_outcome::ok) {
      CHECK(matches(k, std::span(l.out[0].data(), bytes)));
      ++served;
    }
  }
  return served;
}

/// One call of a load_observer: the key's index, the verified bytes told, and a copy of the
/// destination's bytes [from, verified) as they were when told (from: 0, or with scribble the
/// previous call's verified).
struct told {
  std::size_t index = 0;
  std::size_t verified = 0;
  std::size_t from = 0;
  std::vector<std::byte> bytes;
};

struct observed {
  error_code ec;
  l2::batch_result r;
  std::vector<aligned_buffer> out;
  std::vector<told> calls;
  /// The calls for key i, in order.
  [[nodiscard]] std::vector<std::size_t> verified_of(std::size_t i) const {
    std::vector<std::size_t> v;
    for (const auto& c : calls)
      if (c.index == i) v.push_back(c.verified);
    return v;
  }
};

/// Loads keys[i] into a fresh 0xee-filled buffer of sizes[i] bytes with an observer that
/// records each call (and copies the told prefix). With `scribble`, the observer then
/// overwrites the newly told bytes with 0x5a: a load that wrote into told bytes afterwards
/// would overwrite the marks (observed_told_bytes_kept checks them).
observed observed_load(asio::io_context& io, l2::disk_backend& b, std::span<const chunk_key> keys,
                       std::span<const std::size_t> sizes, bool scribble = false) {
  observed o;
  std::vector<std::span<std::byte>> dst;
  for (const std::size_t n : sizes) {
    o.out.emplace_back(std::max<std::size_t>(n, 1));
    std::memset(o.out.back().data(), 0xee, o.out.back().size());
    dst.emplace_back(o.out.back().data(), n);
  }
  std::vector<std::size_t> marked(keys.size(), 0);
  l2::load_observer observer = [&](std::size_t i, std::size_t verified) {
    const std::size_t from = scribble ? std::min(marked[i], verified) : 0;
    o.calls.push_back({i, verified, from, std::vector<std::byte>(dst[i].begin() + from, dst[i].begin() + verified)});
    if (scribble && verified > marked[i]) {
      std::memset(dst[i].data() + marked[i], 0x5a, verified - marked[i]);
      marked[i] = verified;
    }
  };
  std::tie(o.ec, o.r) = run_sync(io, [&]() -> asio::awaitable<std::tuple<error_code, l2::batch_result>> {
    co_return co_await b.async_load(keys, dst, soon(), observer, asio::as_tuple(asio::use_awaitable));
  }());
  return o;
}

/// What the observer of a load was told about key i (stored as fill_for(keys[i]) of
/// `bytes`): a strictly growing verified prefix whose every told prefix held the stored
/// bytes. Returns the verified values told.
std::vector<std::size_t> check_told(const observed& o, std::size_t i, const chunk_key& k, std::size_t bytes) {
  std::vector<std::byte> want(bytes);
  fill_for(k, want);
  std::vector<std::size_t> seen;
  for (const auto& c : o.calls) {
    if (c.index != i) continue;
    INFO("key " << i << " told " << c.verified << " of " << bytes);
    CHECK(c.verified <= bytes);
    if (!seen.empty()) CHECK(c.verified > seen.back());
    if (c.verified <= bytes && c.from < c.verified)  // (memcmp of no bytes may get a null pointer: undefined)
      CHECK(std::memcmp(c.bytes.data(), want.data() + c.from, c.verified - c.from) == 0);
    seen.push_back(c.verified);
  }
  return seen;
}

/// The verified prefixes a segmented object of `bytes` is told: the end of each segment.
std::vector<std::size_t> segment_ends(std::size_t bytes) {
  const std::uint64_t sb = l2::detail::disk_segment_bytes(bytes);
  std::vector<std::size_t> ends;
  for (std::uint64_t e = sb; e < bytes; e += sb) ends.push_back(e);
  ends.push_back(bytes);
  return ends;
}

/// The header and, for a segmented object, the segment table of an object file.
struct stored_format {
  l2::object_header header;
  std::uint64_t segment_bytes = 0;
  std::uint32_t segments = 0;
};
stored_format format_of(const fs::path& file) {
  std::vector<std::byte> block(4096);
  std::ifstream f(file, std::ios::binary);
  f.read(reinterpret_cast<char*>(block.data()), 4096);
  REQUIRE(f.gcount() == 4096);
  const auto h = l2::decode_header(block);
  REQUIRE(h.has_value());
  stored_format sf{*h};
  if ((h->flags & l2::object_flag_segmented) != 0) {
    const auto t = l2::decode_segment_table(*h, l2::detail::table_area(std::span<const std::byte>(block)));
    REQUIRE(t.has_value());
    sf.segment_bytes = t->segment_bytes;
    sf.segments = t->count;
  }
  return sf;
}

/// Flips the byte at `offset` of a file (a buffered write: an O_DIRECT read writes the dirty
/// page back before reading).
void flip_byte(const fs::path& file, std::uint64_t offset) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  REQUIRE(f);
  f.seekg(static_cast<std::streamoff>(offset));
  char c = 0;
  f.get(c);
  f.seekp(static_cast<std::streamoff>(offset));
  f.put(static_cast<char>(c ^ 0x10));
  REQUIRE(f);
}

/// Writes, by hand, an object file in the format of the versions before segments: the header
/// block (flags 0, the XXH3-64 of the whole payload), then the payload padded to 4 KiB, 0600.
void write_unsegmented_object(const fs::path& file, const chunk_key& k, std::span<const std::byte> payload) {
  std::vector<std::byte> f(l2::detail::object_file_bytes(payload.size()));
  l2::object_header h;
  h.key = k;
  h.payload_bytes = payload.size();
  h.payload_checksum = l2::payload_checksum(payload);
  l2::detail::encode_header_block(h, std::span<std::byte, 4096>(f.data(), 4096));
  if (!payload.empty()) std::memcpy(f.data() + 4096, payload.data(), payload.size());
  const int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  REQUIRE(fd >= 0);
  CHECK(::write(fd, f.data(), f.size()) == static_cast<ssize_t>(f.size()));
  ::close(fd);
}

/// A small tmpfs mounted on a fresh directory for the scope of a test (root only).
class tmpfs_mount {
 public:
  explicit tmpfs_mount(std::size_t bytes) {
    const std::string opts = "size=" + std::to_string(bytes);
    if (::mount("tmpfs", dir_.path().c_str(), "tmpfs", 0, opts.c_str()) == 0) mounted_ = true;
    else error_ = std::strerror(errno);
  }
  tmpfs_mount(const tmpfs_mount&) = delete;
  tmpfs_mount& operator=(const tmpfs_mount&) = delete;
  ~tmpfs_mount() {
    if (mounted_) ::umount2(dir_.path().c_str(), MNT_DETACH);
  }
  [[nodiscard]] bool mounted() const noexcept { return mounted_; }
  [[nodiscard]] const std::string& error() const noexcept { return error_; }
  [[nodiscard]] fs::path path() const { return dir_.path(); }

 private:
  temp_dir dir_{"kvtier-tmpfs"};
  bool mounted_ = false;
  std::string error_;
};

/// A bind mount of a file onto itself for the scope of a test (root only): the file stays
/// readable and intact, but unlink(2) fails with EBUSY, as it would on a device that refuses
/// to delete (EIO, EROFS, EPERM): the disk backend's failed-removal paths, without a seam.
class undeletable {
 public:
  explicit undeletable(const fs::path& file) : file_(file) {
    if (::mount(file_.c_str(), file_.c_str(), nullptr, MS_BIND, nullptr) == 0)
      mounted_ = true;
    else
      error_ = std::strerror(errno);
  }
  undeletable(const undeletable&) = delete;
  undeletable& operator=(const undeletable&) = delete;
  ~undeletable() { release(); }
  void release() {
    if (mounted_) ::umount2(file_.c_str(), MNT_DETACH);
    mounted_ = false;
  }
  [[nodiscard]] bool mounted() const noexcept { return mounted_; }
  [[nodiscard]] const std::string& error() const noexcept { return error_; }

 private:
  fs::path file_;
  bool mounted_ = false;
  std::string error_;
};

}  // namespace

// --- format and index --------------------------------------------------------------------------

TEST_CASE("object file names round-trip their key and spread over the shards", "[l2][disk]") {
  std::set<unsigned> shards;
  for (std::uint64_t i = 0; i < 2000; ++i) {
    const auto k = key_of(i);
    const auto p = l2::detail::object_path_of(k);
    const std::string_view v = p.view();
    REQUIRE(v.size() == 3 + 56 + 4);
    CHECK(v.substr(0, 2) == fmt::format("{:02x}", l2::detail::shard_of(k)));
    const auto back = l2::detail::parse_object_name(v.substr(3));
    REQUIRE(back.has_value());
    CHECK(*back == k);
    shards.insert(l2::detail::shard_of(k));
  }
  CHECK(shards.size() > 200);  // 2000 keys over 256 shards: nearly all used
  CHECK_FALSE(l2::detail::parse_object_name("zz").has_value());
  CHECK_FALSE(l2::detail::parse_object_name(std::string(56, 'g') + ".kvo").has_value());
  CHECK_FALSE(l2::detail::parse_object_name(std::string(56, 'a') + ".tmp").has_value());
  const auto t = l2::detail::temp_name_of(key_of(1), 0x1234);
  CHECK(std::string(t.view()).ends_with(".0000000000001234.tmp"));
}

TEST_CASE("the object check catches bad headers, foreign keys, bad flags and wrong sizes", "[l2][disk]") {
  aligned_buffer block(4096);
  l2::object_header h;
  h.key = key_of(5);
  h.payload_bytes = 10000;
  h.payload_checksum = 42;
  l2::detail::encode_header_block(h, std::span<std::byte, 4096>(block.data(), 4096));
  l2::object_header out;
  const std::uint64_t good_size = 4096 + 12288;
  CHECK(l2::detail::object_file_bytes(10000) == good_size);
  CHECK(l2::detail::check_object(block.span(), key_of(5), good_size, out) == l2::detail::object_check::ok);
  CHECK(out == h);
  CHECK(l2::detail::check_object(block.span(), key_of(6), good_size, out) == l2::detail::object_check::wrong_key);
  CHECK(l2::detail::check_object(block.span(), key_of(5), good_size - 4096, out) ==
        l2::detail::object_check::wrong_size);
  block.data()[50] ^= std::byte{1};  // inside the header: its checksum fails
  CHECK(l2::detail::check_object(block.span(), key_of(5), good_size, out) == l2::detail::object_check::bad_header);
  h.flags = 2;  // a bit this version does not know
  l2::detail::encode_header_block(h, std::span<std::byte, 4096>(block.data(), 4096));
  CHECK(l2::detail::check_object(block.span(), key_of(5), good_size, out) == l2::detail::object_check::bad_flags);
  h.flags = l2::object_flag_segmented;  // segmented, but no table (zeros)
  l2::detail::encode_header_block(h, std::span<std::byte, 4096>(block.data(), 4096));
  CHECK(l2::detail::check_object(block.span(), key_of(5), good_size, out) == l2::detail::object_check::bad_table);
  {  // a valid table (one segment of 128 KiB): its checksum is the header's payload checksum
    const auto table = l2::detail::table_area(block.data());
    l2::encode_segment_table(128 * 1024, 1, table);
    l2::put_segment_checksum(table, 0, 99);
    h.payload_checksum = l2::segment_table_checksum(table, 1);
    l2::encode_header(h, std::span<std::byte, l2::object_header_bytes>(block.data(), l2::object_header_bytes));
    std::uint64_t segment_bytes = 0;
    CHECK(l2::detail::check_object(block.span(), key_of(5), good_size, out, &segment_bytes) ==
          l2::detail::object_check::ok);
    CHECK(out == h);
    CHECK(segment_bytes == 128 * 1024);
    table[16] ^= std::byte{1};  // the segment's checksum: the table's own checksum fails
    CHECK(l2::detail::check_object(block.span(), key_of(5), good_size, out) == l2::detail::object_check::bad_table);
    table[16] ^= std::byte{1};
    l2::encode_segment_table(4096, 1, table);  // a count that does not match the length (3 needed)
    l2::put_segment_checksum(table, 0, 99);
    h.payload_checksum = l2::segment_table_checksum(table, 1);
    l2::encode_header(h, std::span<std::byte, l2::object_header_bytes>(block.data(), l2::object_header_bytes));
    CHECK(l2::detail::check_object(block.span(), key_of(5), good_size, out) == l2::detail::object_check::bad_table);
  }
  h.flags = 0;
  h.payload_checksum = 42;
  h.payload_bytes = ~std::uint64_t{0} - 100;  // would wrap the size arithmetic
  l2::detail::encode_header_block(h, std::span<std::byte, 4096>(block.data(), 4096));
  CHECK(l2::detail::check_object(block.span(), key_of(5), 4096, out) == l2::detail::object_check::wrong_size);
}

TEST_CASE("the index evicts in LRU or FIFO order between the watermarks and never pinned objects", "[l2][disk]") {
  using l2::detail::disk_index;
  for (auto policy : {l2::disk_eviction::lru, l2::disk_eviction::fifo}) {
    disk_index idx(policy);
    for (std::uint64_t i = 0; i < 10; ++i) idx.add_ready(key_of(i), 100, 100, i + 1);
    CHECK(idx.bytes_used() == 1000);
    idx.touch(*idx.find_ready(key_of(0)));  // a use: last under LRU, no change under FIFO
    idx.find_ready(key_of(1))->pins = 1;
    // 1000 + 50 > 0.95 * 1100: evict down to 0.5 * 1100 = 550 -> 500 bytes of victims.
    auto v = idx.make_room(50, 1100, 0.95, 0.5);
    REQUIRE(v.has_value());
    std::vector<chunk_key> gone;
    for (const auto& x : *v) gone.push_back(x.key);
    const std::vector<chunk_key> want_lru = {key_of(2), key_of(3), key_of(4), key_of(5), key_of(6)};
    const std::vector<chunk_key> want_fifo = {key_of(0), key_of(2), key_of(3), key_of(4), key_of(5)};
    CHECK(gone == (policy == l2::disk_eviction::lru ? want_lru : want_fifo));
    CHECK(idx.find_ready(key_of(1)) != nullptr);  // pinned: kept
    CHECK(idx.objects() == 5);
    CHECK(idx.bytes_used() == 1000);  // counted until the unlinks finish
    for (const auto& x : *v) idx.finish_remove(x.key, x.generation);
    CHECK(idx.bytes_used() == 500);
  }
  disk_index all_pinned;
  all_pinned.add_ready(key_of(1), 100, 100, 1);
  all_pinned.find_ready(key_of(1))->pins = 1;
  CHECK_FALSE(all_pinned.make_room(50, 120, 0.9, 0.5).has_value());  // cannot fit: nothing evicted
  CHECK(all_pinned.objects() == 1);
  disk_index none(l2::disk_eviction::none);
  none.add_ready(key_of(1), 100, 100, 1);
  CHECK_FALSE(none.make_room(50, 120, 0.9, 0.5).has_value());
  CHECK(none.make_room(20, 120, 0.9, 0.5).has_value());
}

TEST_CASE("an index commit measures the bytes and a late step never touches a newer object", "[l2][disk]") {
  l2::detail::disk_index idx;
  idx.begin_write(key_of(1), 10, 8192, 7);
  CHECK(idx.find_ready(key_of(1)) == nullptr);  // invisible while written
  CHECK(idx.bytes_used() == 8192);
  CHECK_FALSE(idx.commit(key_of(1), 6, 8192));  // another generation
  CHECK(idx.commit(key_of(1), 7, 12288));
  CHECK(idx.bytes_used() == 12288);
  CHECK_FALSE(idx.start_remove(key_of(1), 6).has_value());
  CHECK(idx.start_remove(key_of(1), 7) == 7);
  idx.finish_remove(key_of(1), 7);
  CHECK(idx.entries() == 0);
  CHECK(idx.bytes_used() == 0);
}

// --- the backend -----------------------------------------------------------------------------

TEST_CASE("objects survive a restart with the same usage, in their eviction order", "[l2][disk]") {
  temp_dir dir;
  const objects o(0, 6, 256 * 1024);
  l2::usage_info before;
  first_life(dir.path(), o, [&](l2::disk_backend& b) {
    before = b.usage();
    CHECK(b.o_direct_active());
  });
  asio::io_context io;
  captured_log cap;
  l2::disk_backend b(io.get_executor(), options_for(dir.path()), &cap.log);
  CHECK(b.recovery().objects == 6);
  CHECK(b.recovery().dropped == 0);
  CHECK(b.usage().objects == before.objects);
  CHECK(b.usage().bytes_used == before.bytes_used);
  CHECK(b.usage().bytes_used == scan(dir.path()).allocated);
  CHECK(cap.count("6 objects") == 1);  // the start-up line says what it found
  auto l = load(io, b, o.keys, o.bytes);
  CHECK_FALSE(l.ec);
  for (std::size_t i = 0; i < 6; ++i) {
    CHECK(l.r.outcomes[i] == l2::key_outcome::ok);
    CHECK(matches(o.keys[i], std::span(l.out[i].data(), o.bytes)));
  }
}

TEST_CASE("a second backend on the same directory, or a foreign directory, is refused", "[l2][disk]") {
  temp_dir dir;
  asio::io_context io;
  l2::disk_backend first(io.get_executor(), options_for(dir.path() / "a"));
  CHECK_THROWS_WITH(l2::disk_backend(io.get_executor(), options_for(dir.path() / "a")),
                    Catch::Contains("in use by another disk backend"));
  fs::create_directories(dir.path() / "b");
  std::ofstream(dir.path() / "b" / "FORMAT") << "something else 7\n";
  CHECK_THROWS_WITH(l2::disk_backend(io.get_executor(), options_for(dir.path() / "b")), Catch::Contains("FORMAT"));
  auto bad = options_for(dir.path() / "c", 0);
  CHECK_THROWS_WITH(l2::disk_backend(io.get_executor(), bad), Catch::Contains("capacity_bytes is 0"));
}

TEST_CASE("sizes that are not 4 KiB multiples and unaligned buffers round-trip", "[l2][disk]") {
  temp_dir dir;
  asio::io_context io;
  l2::disk_backend b(io.get_executor(), options_for(dir.path()));
  for (std::size_t bytes : {std::size_t{1}, std::size_t{4095}, std::size_t{4097}, std::size_t{1 << 20} + 100}) {
    INFO(bytes);
    const auto k = key_of(1000 + bytes);
    std::vector<std::byte> src(bytes + 1);  // data() + 1: not aligned, so buffered I/O
    fill_for(k, std::span(src.data() + 1, bytes));
    auto r = store(io, b, std::span(&k, 1), {std::span<const std::byte>(src.data() + 1, bytes)});
    REQUIRE(r.outcomes[0] == l2::key_outcome::ok);
    CHECK(fs::file_size(b.object_file(k)) == l2::detail::object_file_bytes(bytes));
    auto l = load(io, b, std::span(&k, 1), bytes);  // aligned destination: O_DIRECT + bounce tail
    CHECK(l.r.outcomes[0] == l2::key_outcome::ok);
    CHECK(matches(k, std::span(l.out[0].data(), bytes)));
    std::vector<std::byte> dst(bytes + 3);
    std::vector<std::span<std::byte>> d = {std::span(dst.data() + 3, bytes)};
    auto [ec, r2] = run_sync(io, [&]() -> asio::awaitable<std::tuple<error_code, l2::batch_result>> {
      co_return co_await b.async_load(std::span(&k, 1), d, soon(), asio::as_tuple(asio::use_awaitable));
    }());
    CHECK(r2.outcomes[0] == l2::key_outcome::ok);
    CHECK(matches(k, d[0]));
  }
}

TEST_CASE("two stores of one key at once: one writes, the other answers exists", "[l2][disk]") {
  temp_dir dir;
  asio::io_context io;
  l2::disk_backend b(io.get_executor(), options_for(dir.path()));
  const objects o(50, 1, 4 << 20);
  const auto src = o.sources();
  std::vector<l2::batch_result> results;
  for (int i = 0; i < 2; ++i)
    b.async_store(o.keys, src, soon(), [&](error_code, l2::batch_result r) { results.push_back(std::move(r)); });
  io.run();
  REQUIRE(results.size() == 2);
  CHECK(results[0].count(l2::key_outcome::ok) + results[1].count(l2::key_outcome::ok) == 1);
  CHECK(results[0].count(l2::key_outcome::exists) + results[1].count(l2::key_outcome::exists) == 1);
  CHECK(scan(dir.path()).objects == 1);
  CHECK(scan(dir.path()).temp_files == 0);
}

TEST_CASE("usage is what st_blocks says; eviction keeps it under capacity and spares pinned keys",
          "[l2][disk]") {
  temp_dir dir;
  asio::io_context io;
  const std::size_t bytes = 64 * 1024;
  const std::uint64_t capacity = 1 << 20;  // ~15 objects of 68 KiB on disk
  auto opts = options_for(dir.path(), capacity);
  l2::disk_backend b(io.get_executor(), opts);
  const objects first(0, 4, bytes);
  REQUIRE(store(io, b, first).count(l2::key_outcome::ok) == 4);
  REQUIRE(lookup(io, b, std::span(first.keys).first(2)).to_string() == "11");  // pin two
  std::size_t ok = 0;
  for (std::uint64_t round = 0; round < 10; ++round) {
    const objects more(100 + round * 4, 4, bytes);
    ok += store(io, b, more).count(l2::key_outcome::ok);
    const auto u = b.usage();
    CHECK(u.bytes_used <= capacity);
    CHECK(u.bytes_used == scan(dir.path()).allocated);  // bytes really allocated, not sizes
    CHECK(u.objects == scan(dir.path()).objects);
  }
  CHECK(ok == 40);
  CHECK(b.stats().evicted_objects.load() > 0);
  CHECK(lookup(io, b, std::span(first.keys).first(2)).to_string() == "11");  // pinned survived
  CHECK(lookup(io, b, std::span(first.keys).subspan(2)).to_string() == "00");  // the others went
  b.unpin(std::span(first.keys).first(2));
  b.unpin(std::span(first.keys).first(2));
  CHECK(b.pins(first.keys[0]) == 0);
}

TEST_CASE("with eviction none a full backend answers no_space and evicts nothing", "[l2][disk]") {
  temp_dir dir;
  asio::io_context io;
  auto opts = options_for(dir.path(), 5 * 68 * 1024);
  opts.eviction = l2::disk_eviction::none;
  l2::disk_backend b(io.get_executor(), opts);
  const objects o(0, 8, 64 * 1024);
  const auto r = store(io, b, o);
  CHECK(r.count(l2::key_outcome::ok) == 5);
  CHECK(r.count(l2::key_outcome::no_space) == 3);
  CHECK(b.stats().evicted_objects.load() == 0);
  CHECK(b.stats().enospc.load() == 0);  // the capacity, not the file system
  CHECK(scan(dir.path()).temp_files == 0);
}

TEST_CASE("a payload corrupted on disk answers corrupt, is dropped and counted", "[l2][disk]") {
  temp_dir dir;
  asio::io_context io;
  telemetry::registry reg;
  l2::disk_backend b(io.get_executor(), options_for(dir.path()));
  collect(reg, b);
  const objects o(0, 3, 1 << 20);
  REQUIRE(store(io, b, o).count(l2::key_outcome::ok) == 3);
  REQUIRE(b.corrupt_stored(o.keys[1]));
  CHECK_FALSE(b.corrupt_stored(key_of(999)));
  auto l = load(io, b, o.keys, o.bytes);
  CHECK(l.r.outcomes[0] == l2::key_outcome::ok);
  CHECK(l.r.outcomes[1] == l2::key_outcome::corrupt);
  CHECK(l.r.outcomes[2] == l2::key_outcome::ok);
  CHECK(lookup(io, b, std::span(o.keys).subspan(1, 1)).to_string() == "0");
  CHECK_FALSE(fs::exists(b.object_file(o.keys[1])));
  CHECK(reg.value("kvtier_l2_disk_corrupt_objects_total", {{"backend", "disk"}}) == 1);
  CHECK(reg.value("kvtier_l2_disk_dropped_objects_total", {{"backend", "disk"}}) == 1);
  CHECK(reg.value("kvtier_l2_disk_o_direct", {{"backend", "disk"}}) == 1);
  CHECK(reg.value("kvtier_io_uring_enabled").has_value());  // the file I/O's metrics too
  CHECK(b.usage().objects == 2);
}

TEST_CASE("the disk backend's series stay readable after it is gone", "[l2][disk]") {
  temp_dir dir;
  asio::io_context io;
  telemetry::registry reg;
  {
    l2::disk_backend b(io.get_executor(), options_for(dir.path()));
    collect(reg, b);
    const objects o(0, 2, 1 << 20);
    REQUIRE(store(io, b, o).count(l2::key_outcome::ok) == 2);
  }
  CHECK(reg.value("kvtier_l2_disk_written_bytes_total", {{"backend", "disk"}}) == 2.0 * (1 << 20));
  CHECK(reg.value("kvtier_l2_disk_io_errors_total", {{"backend", "disk"}, {"op", "store"}}) == 0.0);
  CHECK(reg.value("kvtier_io_ops_total").value_or(0) > 0);
}

TEST_CASE("a file truncated or rewritten behind the backend's back is never served", "[l2][disk]") {
  temp_dir dir;
  asio::io_context io;
  l2::disk_backend b(io.get_executor(), options_for(dir.path()));
  const objects o(0, 3, 2 << 20);
  REQUIRE(store(io, b, o).count(l2::key_outcome::ok) == 3);
  fs::resize_file(b.object_file(o.keys[0]), 4096 + (1 << 20));  // a short read
  {  // another key's object copied over this one: the header names the other key
    fs::copy_file(b.object_file(o.keys[2]), b.object_file(o.keys[1]), fs::copy_options::overwrite_existing);
  }
  fs::remove(b.object_file(o.keys[2]));  // gone behind our back
  auto l = load(io, b, o.keys, o.bytes);
  CHECK(l.r.outcomes[0] == l2::key_outcome::corrupt);
  CHECK(l.r.outcomes[1] == l2::key_outcome::corrupt);
  CHECK(l.r.outcomes[2] == l2::key_outcome::not_found);
  CHECK(l.r.count(l2::key_outcome::ok) == 0);
  CHECK(b.stats().corrupt_objects.load() == 2);
  CHECK(b.usage().objects == 0);
  CHECK(scan(dir.path()).objects == 0);
}

TEST_CASE("injected EIO fails the key, the others load; a corruption fault is caught by the checksum",
          "[l2][disk]") {
  temp_dir dir;
  asio::io_context io;
  l2::disk_backend disk(io.get_executor(), options_for(dir.path()));
  l2::fault_injecting_backend<l2::disk_backend> b(disk);
  const objects o(0, 3, 256 * 1024);
  REQUIRE(store(io, b, o).count(l2::key_outcome::ok) == 3);
  b.inject({.op = l2::fault_op::load,
            .kind = l2::fault_kind::fail,
            .match = [&](const chunk_key& k) { return k == o.keys[0]; },
            .outcome = l2::key_outcome::io_error,
            .times = 1});
  auto l = load(io, b, o.keys, o.bytes);
  CHECK(l.r.outcomes[0] == l2::key_outcome::io_error);
  CHECK(l.r.outcomes[1] == l2::key_outcome::ok);
  CHECK(matches(o.keys[1], std::span(l.out[1].data(), o.bytes)));
  CHECK(std::to_integer<int>(l.out[0].data()[0]) == 0xee);  // the failed key's buffer untouched
  b.inject({.op = l2::fault_op::load,
            .kind = l2::fault_kind::corrupt,
            .match = [&](const chunk_key& k) { return k == o.keys[2]; },
            .times = 1});
  auto l2r = load(io, b, o.keys, o.bytes);
  CHECK(l2r.r.outcomes[0] == l2::key_outcome::ok);
  CHECK(l2r.r.outcomes[2] == l2::key_outcome::corrupt);
  CHECK(disk.usage().objects == 2);
}

TEST_CASE("removing answers ok, not_found, or rejected while pinned", "[l2][disk]") {
  temp_dir dir;
  asio::io_context io;
  l2::disk_backend b(io.get_executor(), options_for(dir.path()));
  const objects o(0, 2, 8192);
  REQUIRE(store(io, b, o).count(l2::key_outcome::ok) == 2);
  REQUIRE(lookup(io, b, std::span(o.keys).first(1)).to_string() == "1");
  std::vector<chunk_key> ks = {o.keys[0], o.keys[1], key_of(77)};
  auto r = remove(io, b, ks);
  CHECK(r.outcomes[0] == l2::key_outcome::rejected);
  CHECK(r.outcomes[1] == l2::key_outcome::ok);
  CHECK(r.outcomes[2] == l2::key_outcome::not_found);
  CHECK_FALSE(fs::exists(b.object_file(o.keys[1])));
  CHECK(b.usage().bytes_used == scan(dir.path()).allocated);
}

// --- the index and the files agree on every error path ---------------------------------------

TEST_CASE("a remove whose unlink fails keeps the object indexed, counted and served", "[l2][disk]") {
  temp_dir dir;
  asio::io_context io;
  l2::disk_backend b(io.get_executor(), options_for(dir.path()));
  const objects o(0, 2, 64 * 1024);
  REQUIRE(store(io, b, o).count(l2::key_outcome::ok) == 2);
  undeletable stuck(b.object_file(o.keys[0]));
  if (!stuck.mounted()) {
    WARN("cannot bind-mount an object file (" << stuck.error() << "): skipped");
    return;
  }
  const auto r = remove(io, b, std::span(o.keys).first(1));
  CHECK(r.outcomes[0] == l2::key_outcome::io_error);
  CHECK(b.stats().io_errors[l2::disk_stats::remove].load() == 1);
  // The file is still there, so the index still has it: usage, loads and stores agree.
  CHECK(b.usage().objects == 2);
  CHECK(b.usage().bytes_used == scan(dir.path()).allocated);
  auto l = load(io, b, std::span(o.keys).first(1), o.bytes);
  CHECK(l.r.outcomes[0] == l2::key_outcome::ok);
  CHECK(matches(o.keys[0], std::span(l.out[0].data(), o.bytes)));
  CHECK(store(io, b, std::span(o.keys).first(1), {o.sources()[0]}).outcomes[0] == l2::key_outcome::exists);
  // Once the file can go, a remove deletes it and the index forgets it.
  stuck.release();
  CHECK(remove(io, b, std::span(o.keys).first(1)).outcomes[0] == l2::key_outcome::ok);
  CHECK_FALSE(fs::exists(b.object_file(o.keys[0])));
  CHECK(b.usage().objects == 1);
  CHECK(b.usage().bytes_used == scan(dir.path()).allocated);
  CHECK(store(io, b, std::span(o.keys).first(1), {o.sources()[0]}).outcomes[0] == l2::key_outcome::ok);
}

TEST_CASE("an eviction whose unlink fails keeps the victim indexed: usage stays what the disk holds", "[l2][disk]") {
  temp_dir dir;
  asio::io_context io;
  const std::size_t bytes = 64 * 1024;
  l2::disk_backend b(io.get_executor(), options_for(dir.path(), 6 * 68 * 1024));  // 6 objects
  const objects first(0, 5, bytes);
  // keys[0] alone first: the oldest, so the first victim (a batch commits in any order).
  const auto src = first.sources();
  REQUIRE(store(io, b, std::span(first.keys).first(1), {src[0]}).outcomes[0] == l2::key_outcome::ok);
  REQUIRE(store(io, b, std::span(first.keys).subspan(1), {src.begin() + 1, src.end()}).count(l2::key_outcome::ok) == 4);
  undeletable stuck(b.object_file(first.keys[0]));  // the LRU victim
  if (!stuck.mounted()) {
    WARN("cannot bind-mount an object file (" << stuck.error() << "): skipped");
    return;
  }
  const objects more(100, 3, bytes);
  CHECK(store(io, b, more).count(l2::key_outcome::ok) == 3);
  CHECK(b.stats().io_errors[l2::disk_stats::remove].load() >= 1);
  CHECK(fs::exists(b.object_file(first.keys[0])));
  CHECK(b.usage().bytes_used == scan(dir.path()).allocated);
  CHECK(b.usage().objects == scan(dir.path()).objects);
  auto l = load(io, b, std::span(first.keys).first(1), bytes);
  CHECK(l.r.outcomes[0] == l2::key_outcome::ok);
  CHECK(matches(first.keys[0], std::span(l.out[0].data(), bytes)));
}

TEST_CASE("a corrupt object whose unlink fails is never served, stays counted, and a later remove deletes it",
          "[l2][disk]") {
  temp_dir dir;
  asio::io_context io;
  l2::disk_backend b(io.get_executor(), options_for(dir.path()));
  const objects o(0, 2, 64 * 1024);
  REQUIRE(store(io, b, o).count(l2::key_outcome::ok) == 2);
  REQUIRE(b.corrupt_stored(o.keys[0]));
  undeletable stuck(b.object_file(o.keys[0]));
  if (!stuck.mounted()) {
    WARN("cannot bind-mount an object file (" << stuck.error() << "): skipped");
    return;
  }
  CHECK(load(io, b, std::span(o.keys).first(1), o.bytes).r.outcomes[0] == l2::key_outcome::corrupt);
  // Dropped from view (never served again), but its file is still there and still counted.
  CHECK(load(io, b, std::span(o.keys).first(1), o.bytes).r.outcomes[0] == l2::key_outcome::not_found);
  CHECK(lookup(io, b, std::span(o.keys).first(1)).to_string() == "0");
  CHECK(b.usage().objects == 1);
  CHECK(b.usage().bytes_used == scan(dir.path()).allocated);
  // A store of the key cannot replace the bad file yet: it is refused, not claimed stored.
  CHECK(store(io, b, std::span(o.keys).first(1), {o.sources()[0]}).outcomes[0] == l2::key_outcome::rejected);
  stuck.release();
  CHECK(remove(io, b, std::span(o.keys).first(1)).outcomes[0] == l2::key_outcome::ok);
  CHECK(b.usage().bytes_used == scan(dir.path()).allocated);
  CHECK(store(io, b, std::span(o.keys).first(1), {o.sources()[0]}).outcomes[0] == l2::key_outcome::ok);
  auto l = load(io, b, std::span(o.keys).first(1), o.bytes);
  CHECK(l.r.outcomes[0] == l2::key_outcome::ok);
  CHECK(matches(o.keys[0], std::span(l.out[0].data(), o.bytes)));
}

TEST_CASE("a stray file at an object's path the index does not know is replaced by a store, not claimed",
          "[l2][disk]") {
  temp_dir dir;
  asio::io_context io;
  l2::disk_backend b(io.get_executor(), options_for(dir.path()));
  const objects o(0, 1, 64 * 1024);
  std::ofstream(b.object_file(o.keys[0])) << "left behind";  // not ours: the index never saw it
  CHECK(store(io, b, o).outcomes[0] == l2::key_outcome::ok);
  auto l = load(io, b, o.keys, o.bytes);
  CHECK(l.r.outcomes[0] == l2::key_outcome::ok);
  CHECK(matches(o.keys[0], std::span(l.out[0].data(), o.bytes)));
  CHECK(b.usage().bytes_used == scan(dir.path()).allocated);
}

// --- deadlines and the buffer contract ----------------------------------------------------------

TEST_CASE("a load whose deadline passed answers timeout and writes nothing", "[l2][disk]") {
  temp_dir dir;
  asio::io_context io;
  l2::disk_backend b(io.get_executor(), options_for(dir.path()));
  const objects o(0, 2, 1 << 20);
  REQUIRE(store(io, b, o).count(l2::key_outcome::ok) == 2);
  auto l = load(io, b, o.keys, o.bytes, l2::clock::now() - std::chrono::seconds(1));
  CHECK(l.ec == errc::timeout);
  CHECK(l.r.count(l2::key_outcome::timeout) == 2);
  CHECK(std::to_integer<int>(l.out[0].data()[0]) == 0xee);
  CHECK(b.stats().timeouts[l2::disk_stats::load].load() == 2);
}

TEST_CASE("a load cut by its deadline or cancelled completes only when no read can land any more",
          "[l2][disk]") {
  temp_dir dir;
  asio::io_context io;
  auto opts = options_for(dir.path());
  opts.queue_depth = 4;
  l2::disk_backend b(io.get_executor(), opts);
  const objects o(0, 4, 16 << 20);
  REQUIRE(store(io, b, o).count(l2::key_outcome::ok) == 4);
  for (int mode = 0; mode < 2; ++mode) {
    INFO((mode == 0 ? "deadline" : "cancellation"));
    std::vector<aligned_buffer> out;
    std::vector<std::span<std::byte>> dst;
    for (int i = 0; i < 4; ++i) {
      out.emplace_back(o.bytes);
      std::memset(out.back().data(), 0xee, o.bytes);
    }
    for (auto& x : out) dst.emplace_back(x.data(), o.bytes);
    asio::cancellation_signal cancel;
    std::optional<std::tuple<error_code, l2::batch_result, std::size_t>> result;
    const auto d = mode == 0 ? l2::clock::now() + std::chrono::milliseconds(2) : soon();
    b.async_load(o.keys, dst, d, asio::bind_cancellation_slot(cancel.slot(), [&](error_code ec, l2::batch_result r) {
                   // THE BUFFER CONTRACT: when this runs, nothing reads into dst any more.
                   result.emplace(ec, std::move(r), b.io_in_flight());
                 }));
    if (mode == 1) asio::post(io, [&] { cancel.emit(asio::cancellation_type::terminal); });
    io.restart();
    io.run();
    REQUIRE(result);
    CHECK(std::get<2>(*result) == 0);
    const auto& r = std::get<1>(*result);
    CHECK(r.count(l2::key_outcome::ok) + r.count(l2::key_outcome::timeout) == 4);
    if (r.count(l2::key_outcome::timeout) > 0) {
      const error_code want = mode == 0 ? make_error_code(errc::timeout) : error_code(asio::error::operation_aborted);
      CHECK(std::get<0>(*result) == want);
    }
    // Keys answered ok hold their bytes; and every buffer stays as it was at completion
    // while the backend keeps working (no late read lands).
    std::vector<std::vector<std::byte>> snapshot;
    for (std::size_t i = 0; i < 4; ++i) {
      if (r.outcomes[i] == l2::key_outcome::ok) CHECK(matches(o.keys[i], dst[i]));
      snapshot.emplace_back(dst[i].begin(), dst[i].end());
    }
    auto more = load(io, b, o.keys, o.bytes);
    CHECK(more.r.count(l2::key_outcome::ok) == 4);
    for (std::size_t i = 0; i < 4; ++i) CHECK(std::memcmp(snapshot[i].data(), dst[i].data(), o.bytes) == 0);
  }
}

TEST_CASE("a store cut by its deadline leaves no temporary file and no half object", "[l2][disk]") {
  // Deadlines that fall in every step of a key's pipeline: its create, its writes, its rename
  // and its fdatasync (a renamed key whose sync is cut must leave no object behind).
  for (const int ms : {1, 3, 6, 12, 25, 50}) {
    INFO("deadline " << ms << " ms");
    temp_dir dir;
    asio::io_context io;
    auto opts = options_for(dir.path());
    opts.queue_depth = 2;
    l2::disk_backend b(io.get_executor(), opts);
    const objects o(0, 4, 16 << 20);
    auto r = store(io, b, o.keys, o.sources(), l2::clock::now() + std::chrono::milliseconds(ms));
    CHECK(r.count(l2::key_outcome::ok) + r.count(l2::key_outcome::timeout) == 4);
    CHECK(b.io_in_flight() == 0);
    const auto d = scan(dir.path());
    CHECK(d.temp_files == 0);
    CHECK(d.objects == r.count(l2::key_outcome::ok));
    CHECK(b.usage().bytes_used == d.allocated);
    CHECK(check_all_served(io, b, o.keys, o.bytes) == r.count(l2::key_outcome::ok));
  }
}

TEST_CASE("a batch of more keys than the store runs at once round-trips, each key committed on its own",
          "[l2][disk]") {
  // queue_depth 4: two keys at once (two writes each), so 11 keys go through in six rounds.
  temp_dir dir;
  asio::io_context io;
  auto opts = options_for(dir.path());
  opts.queue_depth = 4;
  l2::disk_backend b(io.get_executor(), opts);
  const objects o(0, 11, (3 << 20) + 100);  // a partial last block too
  REQUIRE(store(io, b, o).count(l2::key_outcome::ok) == 11);
  const auto d = scan(dir.path());
  CHECK(d.temp_files == 0);
  CHECK(d.objects == 11);
  CHECK(b.usage().bytes_used == d.allocated);
  CHECK(check_all_served(io, b, o.keys, o.bytes) == 11);
}

TEST_CASE("stores in flight at once share the backend's store lanes, and every key of each commits",
          "[l2][disk]") {
  // queue_depth 2: one lane for the whole backend. Three batches submitted together (as the
  // store pipeline submits them) go through it one key at a time; the keys that wait have
  // their files open, and each batch answers for its own keys.
  temp_dir dir;
  asio::io_context io;
  auto opts = options_for(dir.path());
  opts.queue_depth = 2;
  l2::disk_backend b(io.get_executor(), opts);
  std::vector<objects> batches;
  for (std::uint64_t i = 0; i < 3; ++i) batches.emplace_back(10 * i, 3, (1 << 20) + 100);
  std::vector<std::vector<std::span<const std::byte>>> sources;
  for (const auto& o : batches) sources.push_back(o.sources());
  std::vector<std::optional<l2::batch_result>> results(batches.size());
  for (std::size_t i = 0; i < batches.size(); ++i)
    b.async_store(batches[i].keys, sources[i], soon(),
                  [&results, i](error_code, l2::batch_result r) { results[i] = std::move(r); });
  REQUIRE(run_until(io, [&] { return results[0] && results[1] && results[2]; }));
  for (const auto& r : results) CHECK(r->count(l2::key_outcome::ok) == 3);
  CHECK(b.io_in_flight() == 0);
  const auto d = scan(dir.path());
  CHECK(d.temp_files == 0);
  CHECK(d.objects == 9);
  CHECK(b.usage().bytes_used == d.allocated);
  for (const auto& o : batches) CHECK(check_all_served(io, b, o.keys, o.bytes) == 3);
}

// --- crash recovery -----------------------------------------------------------------------------

TEST_CASE("torn, foreign and misnamed files are dropped at start-up; good ones are served", "[l2][disk]") {
  temp_dir dir;
  const objects o(0, 8, 64 * 1024);
  std::vector<fs::path> files;
  first_life(dir.path(), o, [&](l2::disk_backend& b) {
    for (const auto& k : o.keys) files.push_back(b.object_file(k));
  });
  fs::resize_file(files[0], 4096 + 32 * 1024);  // truncated payload
  {                                               // a bad header (magic)
    std::fstream f(files[1], std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(0);
    f.put('X');
  }
  fs::copy_file(files[3], files[2], fs::copy_options::overwrite_existing);  // header names key 3
  fs::resize_file(files[4], 0);                                              // zero length
  {  // a payload byte flipped: passes the header check, caught by the load's checksum
    std::fstream f(files[5], std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(4096 + 100);
    f.put('Z');
  }
  std::ofstream(dir.path() / "tmp" / (std::string(56, 'a') + ".0000000000000001.tmp")) << "half an object";
  std::ofstream(files[6].parent_path() / "README") << "not ours";
  asio::io_context io;
  l2::disk_backend b(io.get_executor(), options_for(dir.path()));
  CHECK(b.recovery().dropped == 4);
  CHECK(b.recovery().temp_files == 1);
  CHECK(b.recovery().foreign_files == 1);
  CHECK(b.recovery().objects == 4);
  for (std::size_t i : {0, 1, 2, 4}) CHECK_FALSE(fs::exists(files[i]));  // deleted
  CHECK(fs::exists(files[3]));
  CHECK(fs::exists(files[6].parent_path() / "README"));  // foreign files are left alone
  auto l = load(io, b, o.keys, o.bytes);
  for (std::size_t i = 0; i < 8; ++i) {
    INFO(i);
    if (i < 3 || i == 4) CHECK(l.r.outcomes[i] == l2::key_outcome::not_found);
    else if (i == 5) CHECK(l.r.outcomes[i] == l2::key_outcome::corrupt);
    else {
      CHECK(l.r.outcomes[i] == l2::key_outcome::ok);
      CHECK(matches(o.keys[i], std::span(l.out[i].data(), o.bytes)));
    }
  }
  CHECK(scan(dir.path()).temp_files == 0);
}

TEST_CASE("verify_on_start drops an object whose payload checksum fails", "[l2][disk]") {
  temp_dir dir;
  const objects o(0, 2, 64 * 1024);
  fs::path victim;
  first_life(dir.path(), o, [&](l2::disk_backend& b) {
    REQUIRE(b.corrupt_stored(o.keys[0]));
    victim = b.object_file(o.keys[0]);
  });
  asio::io_context io;
  auto opts = options_for(dir.path());
  opts.verify_on_start = true;
  l2::disk_backend b(io.get_executor(), opts);
  CHECK(b.recovery().dropped == 1);
  CHECK(b.recovery().objects == 1);
  CHECK_FALSE(fs::exists(victim));
}

TEST_CASE("a writer killed mid-store leaves only whole objects, and the restarted backend serves them",
          "[l2][disk]") {
  // The child stores 4 MiB objects in batches of 4, reporting each finished batch on a pipe.
  // The parent kills it (SIGKILL) after k batches, while the next batch's writes, fsyncs or
  // renames are in flight, then starts a backend on the directory.
  // Both ways of making names durable (name_sync): the steps a kill can cut differ.
  constexpr std::size_t bytes = 4 << 20;
  constexpr std::uint64_t per_batch = 4;
  using enum l2::disk_name_sync;
  const std::pair<l2::disk_name_sync, int> runs[] = {
      {directory, 1}, {file, 1}, {directory, 2}, {file, 3}, {directory, 5}};
  for (const auto& [name_sync, kill_after] : runs) {
    INFO("name_sync " << static_cast<int>(name_sync) << ", killed after " << kill_after << " batches");
    temp_dir dir;
    auto opts = options_for(dir.path());
    opts.name_sync = name_sync;
    int fds[2];
    REQUIRE(::pipe(fds) == 0);
    const pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {  // the child: never returns into the test runner
      ::close(fds[0]);
      try {
        asio::io_context io;
        l2::disk_backend b(io.get_executor(), opts);
        for (std::uint64_t batch = 0;; ++batch) {
          const objects o(batch * per_batch, per_batch, bytes);
          const auto r = store(io, b, o);
          const char c = r.count(l2::key_outcome::ok) == per_batch ? 'k' : 'x';
          if (::write(fds[1], &c, 1) != 1) ::_exit(3);
        }
      } catch (...) {
        ::_exit(2);
      }
    }
    ::close(fds[1]);
    int acked = 0;
    char c = 0;
    while (acked < kill_after && ::read(fds[0], &c, 1) == 1) {
      REQUIRE(c == 'k');
      ++acked;
    }
    ::kill(pid, SIGKILL);
    int status = 0;
    REQUIRE(::waitpid(pid, &status, 0) == pid);
    ::close(fds[0]);
    REQUIRE(acked == kill_after);
    CHECK(WIFSIGNALED(status));

    asio::io_context io;
    l2::disk_backend b(io.get_executor(), opts);
    std::vector<chunk_key> candidates;
    for (std::uint64_t i = 0; i < (static_cast<std::uint64_t>(kill_after) + 3) * per_batch; ++i)
      candidates.push_back(key_of(i));
    const std::size_t served = check_all_served(io, b, candidates, bytes);
    CHECK(served >= static_cast<std::size_t>(kill_after) * per_batch);  // every acked object survived
    const auto d = scan(dir.path());
    CHECK(d.temp_files == 0);
    CHECK(d.objects == served);
    CHECK(b.usage().objects == served);
    CHECK(b.usage().bytes_used == d.allocated);
    CHECK(b.stats().corrupt_objects.load() == 0);  // no torn object was ever visible
  }
}

// --- durable names (name_sync) ------------------------------------------------------------------

namespace {

/// A fake /sys and /proc for the name-durability probe: block device `major:minor` named
/// `device`, with ext4's journal_task reading `journal_task` (none: no such file) and
/// jbd2's entry for an internal journal when `jbd2`.
struct fake_kernel_tree {
  temp_dir root;
  fake_kernel_tree(const std::string& numbers, const std::string& device, std::optional<std::string> journal_task,
                   bool jbd2) {
    fs::create_directories(sys() / "dev" / "block");
    fs::create_symlink("../../devices/virtual/block/" + device, sys() / "dev" / "block" / numbers);
    if (journal_task) {
      fs::create_directories(sys() / "fs" / "ext4" / device);
      std::ofstream(sys() / "fs" / "ext4" / device / "journal_task") << *journal_task;
    }
    fs::create_directories(proc() / "fs" / "jbd2");
    if (jbd2) fs::create_directories(proc() / "fs" / "jbd2" / (device + "-8"));
  }
  [[nodiscard]] fs::path sys() const { return root.path() / "sys"; }
  [[nodiscard]] fs::path proc() const { return root.path() / "proc"; }
};

}  // namespace

TEST_CASE("the probe: ext4 with a journal and xfs commit a rename with the file's fsync; nothing else is trusted to",
          "[l2][disk][durability]") {
  using l2::detail::probe_rename_durability;
  const ::dev_t loop0 = makedev(7, 0);
  SECTION("ext4 with a journal: journal_task names jbd2's thread") {
    const fake_kernel_tree t("7:0", "loop0", "7212\n", true);
    const auto p = probe_rename_durability(l2::detail::ext4_magic, loop0, t.sys(), t.proc());
    CHECK(p.file_fsync_commits);
    CHECK(p.file_system == "ext4 with a journal (loop0)");
  }
  SECTION("ext4 without a journal (or ext2): journal_task says <none>") {
    const fake_kernel_tree t("7:0", "loop0", "<none>\n", false);
    const auto p = probe_rename_durability(l2::detail::ext4_magic, loop0, t.sys(), t.proc());
    CHECK_FALSE(p.file_fsync_commits);
    CHECK(p.file_system == "ext4 without a journal (loop0)");
  }
  SECTION("a kernel without journal_task: jbd2's entry for the device's internal journal decides") {
    const fake_kernel_tree with("7:0", "loop0", std::nullopt, true);
    CHECK(probe_rename_durability(l2::detail::ext4_magic, loop0, with.sys(), with.proc()).file_fsync_commits);
    const fake_kernel_tree without("7:0", "loop0", std::nullopt, false);
    CHECK_FALSE(
        probe_rename_durability(l2::detail::ext4_magic, loop0, without.sys(), without.proc()).file_fsync_commits);
  }
  SECTION("ext4 whose device is not found: not trusted") {
    const fake_kernel_tree t("7:1", "loop1", "7212\n", true);
    const auto p = probe_rename_durability(l2::detail::ext4_magic, loop0, t.sys(), t.proc());
    CHECK_FALSE(p.file_fsync_commits);
    CHECK(p.file_system == "ext4 on device 7:0, its journal unknown");
  }
  SECTION("xfs always has its log; any other file system is not trusted") {
    const fake_kernel_tree t("7:0", "loop0", std::nullopt, false);
    CHECK(probe_rename_durability(l2::detail::xfs_magic, loop0, t.sys(), t.proc()).file_fsync_commits);
    const auto tmpfs = probe_rename_durability(0x01021994, loop0, t.sys(), t.proc());
    CHECK_FALSE(tmpfs.file_fsync_commits);
    CHECK(tmpfs.file_system == "file system 0x1021994");
  }
}

TEST_CASE("sync data makes names durable by the shard directory's fsync, or by the object's fsync where that commits",
          "[l2][disk][durability]") {
  // One 1 MiB object through the pread pool, which counts every operation: open, the payload
  // write, the header block, rename, the object's sync (fdatasync or fsync), then the shard
  // directory's fsync only with name_sync directory.
  temp_dir dir;
  asio::io_context io;
  struct run {
    l2::disk_name_sync name_sync;
    l2::disk_sync sync;
    int ops;
    double gauge;  // kvtier_l2_disk_directory_fsync
  };
  const run runs[] = {{l2::disk_name_sync::directory, l2::disk_sync::data, 6, 1.0},
                      {l2::disk_name_sync::file, l2::disk_sync::data, 5, 0.0},
                      {l2::disk_name_sync::directory, l2::disk_sync::none, 4, 0.0}};
  for (const auto& [name_sync, sync, ops, gauge] : runs) {
    INFO("name_sync " << static_cast<int>(name_sync) << ", sync " << static_cast<int>(sync));
    const fs::path path = dir.path() / fmt::format("{}-{}", static_cast<int>(name_sync), static_cast<int>(sync));
    auto opts = options_for(path);
    opts.io = io::file_io_choice::pread;
    opts.name_sync = name_sync;
    opts.sync = sync;
    l2::disk_backend b(io.get_executor(), opts);
    telemetry::registry r;
    collect(r, b);
    CHECK(b.name_sync_active() == name_sync);
    CHECK(r.value("kvtier_l2_disk_directory_fsync", {{"backend", "disk"}}) == gauge);
    const auto stats = b.shared_io_stats();
    const objects o(800, 1, 1 << 20);
    const std::uint64_t before = stats->ops_completed.load();
    REQUIRE(store(io, b, o).count(l2::key_outcome::ok) == 1);
    CHECK(stats->ops_completed.load() - before == static_cast<std::uint64_t>(ops));
    CHECK(load(io, b, o.keys, o.bytes).r.outcomes[0] == l2::key_outcome::ok);
  }
}

TEST_CASE(
    "name_sync: directory by default; auto fsyncs the directories, and file warns, where the file's fsync is "
    "not known to commit a rename",
    "[l2][disk][durability]") {
  CHECK(l2::disk_backend_options{}.name_sync == l2::disk_name_sync::directory);
  tmpfs_mount mnt(8 << 20);
  if (!mnt.mounted()) {
    WARN("cannot mount a tmpfs (" << mnt.error() << "): needs root; skipped");
    CHECK_FALSE(mnt.error().empty());
    return;
  }
  asio::io_context io;
  {
    captured_log cap;  // at info
    auto opts = options_for(mnt.path() / "auto", 2 << 20);
    opts.name_sync = l2::disk_name_sync::automatic;
    l2::disk_backend b(io.get_executor(), opts, &cap.log);
    CHECK(b.name_sync_active() == l2::disk_name_sync::directory);
    CHECK(b.stats().directory_fsync.load());
    CHECK(cap.count("file system 0x1021994: fdatasync of each object, then an fsync of each shard directory") == 1);
  }
  captured_log cap;
  auto opts = options_for(mnt.path() / "file", 2 << 20);
  opts.name_sync = l2::disk_name_sync::file;
  l2::disk_backend b(io.get_executor(), opts, &cap.log);
  CHECK(b.name_sync_active() == l2::disk_name_sync::file);
  CHECK_FALSE(b.stats().directory_fsync.load());
  CHECK(cap.count("name_sync file on file system 0x1021994, whose fsync of a file is not known to commit") == 1);
}

// --- ENOSPC -----------------------------------------------------------------------------------

TEST_CASE("a full file system fails stores with no_space, leaves nothing half-written, keeps serving",
          "[l2][disk]") {
  for (const bool preallocate : {true, false}) {
    INFO("preallocate " << preallocate);
    tmpfs_mount mnt(24 << 20);
    if (!mnt.mounted()) {
      WARN("cannot mount a tmpfs (" << mnt.error() << "): the ENOSPC test needs root; skipped");
      CHECK_FALSE(mnt.error().empty());
      return;
    }
    asio::io_context io;
    captured_log cap;
    auto opts = options_for(mnt.path() / "l2", std::uint64_t{1} << 30);  // above the file system
    opts.preallocate = preallocate;
    opts.warn_interval = std::chrono::hours(1);
    l2::disk_backend b(io.get_executor(), opts, &cap.log);
    std::size_t ok = 0, no_space = 0;
    std::vector<chunk_key> stored;
    for (std::uint64_t batch = 0; batch < 20 && no_space < 4; ++batch) {
      const objects o(batch * 2, 2, 1 << 20);
      const auto r = store(io, b, o);
      for (std::size_t i = 0; i < 2; ++i) {
        if (r.outcomes[i] == l2::key_outcome::ok) {
          ++ok;
          stored.push_back(o.keys[i]);
        } else {
          CHECK(r.outcomes[i] == l2::key_outcome::no_space);
          ++no_space;
        }
      }
    }
    CHECK(ok > 10);
    CHECK(no_space >= 4);
    CHECK(b.stats().enospc.load() == no_space);
    CHECK(cap.count("ENOSPC") == 1);  // logged once per interval
    const auto d = scan(mnt.path() / "l2");
    CHECK(d.temp_files == 0);  // nothing half-written is visible, nothing left behind
    CHECK(d.objects == ok);
    CHECK(b.usage().objects == ok);
    CHECK(b.usage().bytes_used == d.allocated);
    CHECK(check_all_served(io, b, stored, 1 << 20) == ok);  // still serving what it has
  }
}

// --- file I/O and options -----------------------------------------------------------------------

TEST_CASE("reads into a registered arena use fixed buffers where the kernel allows", "[l2][disk]") {
  temp_dir dir;
  asio::io_context io;
  telemetry::registry reg;
  l2::disk_backend b(io.get_executor(), options_for(dir.path()));
  collect(reg, b);
  const objects o(0, 2, 1 << 20);
  REQUIRE(store(io, b, o).count(l2::key_outcome::ok) == 2);
  const double fixed_before = reg.value("kvtier_io_fixed_ops_total").value_or(0);
  aligned_buffer arena(4 << 20);
  const auto ec = b.register_buffers(arena.span());
  std::vector<std::span<std::byte>> dst = {std::span(arena.data(), o.bytes),
                                           std::span(arena.data() + (2 << 20), o.bytes)};
  auto [lec, r] = run_sync(io, [&]() -> asio::awaitable<std::tuple<error_code, l2::batch_result>> {
    co_return co_await b.async_load(o.keys, dst, soon(), asio::as_tuple(asio::use_awaitable));
  }());
  CHECK(r.count(l2::key_outcome::ok) == 2);
  CHECK(matches(o.keys[1], dst[1]));
  if (b.file_io_kind() == io::file_io_kind::uring && !ec) {
    CHECK(reg.value("kvtier_io_fixed_ops_total").value_or(0) >= fixed_before + 2);  // 1 MiB parts, 2 keys
  } else {
    WARN("fixed buffers not active here: " << ec.message());
    CHECK(r.count(l2::key_outcome::ok) == 2);
  }
}

// --- threads ------------------------------------------------------------------------------------

TEST_CASE("operations started from several threads while the I/O thread runs stay consistent",
          "[l2][disk][concurrency]") {
  temp_dir dir;
  asio::io_context io;
  auto work = asio::make_work_guard(io);
  auto opts = options_for(dir.path(), 3 << 20);  // small: stores evict while others load
  l2::disk_backend b(io.get_executor(), opts);
  constexpr std::size_t bytes = 64 * 1024;
  const objects first(0, 32, bytes);  // what the reader reads while the writer evicts
  REQUIRE(store(io, b, first).count(l2::key_outcome::ok) == 32);
  io.restart();  // run_sync leaves the context stopped: run() would return at once
  std::thread io_thread([&] { io.run(); });

  // Blocks the calling thread until one operation started on the backend completes.
  auto wait_for = [](auto start) {
    std::promise<std::pair<error_code, l2::batch_result>> p;
    auto f = p.get_future();
    start([&p](error_code ec, l2::batch_result r) { p.set_value({ec, std::move(r)}); });
    return f.get();
  };
  std::atomic<std::size_t> stored{0}, loaded{0}, wrong{0}, lookups{0};
  std::thread writer([&] {
    for (std::uint64_t round = 0; round < 40; ++round) {
      const objects o(32 + round * 4 % 64, 4, bytes);
      const auto src = o.sources();
      auto [ec, r] = wait_for([&](auto h) { b.async_store(o.keys, src, soon(), h); });
      stored += r.count(l2::key_outcome::ok);
    }
  });
  std::thread reader([&] {
    for (std::uint64_t round = 0; round < 40; ++round) {
      std::vector<chunk_key> keys;
      for (std::uint64_t i = 0; i < 4; ++i) keys.push_back(key_of((round * 4 + i) % 32));
      std::vector<aligned_buffer> out;
      std::vector<std::span<std::byte>> dst;
      for (int i = 0; i < 4; ++i) out.emplace_back(bytes);
      for (auto& x : out) dst.emplace_back(x.data(), bytes);
      auto [ec, r] = wait_for([&](auto h) { b.async_load(keys, dst, soon(), h); });
      for (std::size_t i = 0; i < 4; ++i)
        if (r.outcomes[i] == l2::key_outcome::ok) {
          ++loaded;
          if (!matches(keys[i], dst[i])) ++wrong;
        }
    }
  });
  std::thread poker([&] {
    for (std::uint64_t round = 0; round < 200; ++round) {
      const auto k = key_of(round % 96);
      std::promise<bitmap> p;
      auto f = p.get_future();
      b.async_lookup_and_pin(std::span(&k, 1), soon(), [&p](error_code, bitmap found) { p.set_value(found); });
      if (f.get().test(0)) {
        ++lookups;
        b.unpin(std::span(&k, 1));
      }
      (void)b.usage();
      (void)b.health();
      (void)b.pins(k);
    }
  });
  writer.join();
  reader.join();
  poker.join();
  work.reset();
  io_thread.join();
  CHECK(stored.load() > 0);
  CHECK(wrong.load() == 0);
  CHECK(b.usage().bytes_used <= opts.capacity_bytes);
  CHECK(b.usage().bytes_used == scan(dir.path()).allocated);
  for (std::uint64_t i = 0; i < 96; ++i) CHECK(b.pins(key_of(i)) == 0);
  INFO("loaded " << loaded.load() << ", lookup hits " << lookups.load());
  CHECK(scan(dir.path()).temp_files == 0);
}

// --- segmented objects and layer-wise loads -----------------------------------------------------

TEST_CASE("the segment size gives about 16 segments of at least 128 KiB, 4 KiB multiples", "[l2][disk][segments]") {
  using l2::detail::disk_segment_bytes;
  CHECK(disk_segment_bytes(0) == 0);
  CHECK(disk_segment_bytes(100) == 128 * 1024);
  CHECK(disk_segment_bytes(128 * 1024) == 128 * 1024);
  CHECK(disk_segment_bytes(1 << 20) == 128 * 1024);  // 8 segments: none under 128 KiB
  CHECK(disk_segment_bytes(32 << 20) == 2 << 20);
  for (const std::uint64_t n :
       {std::uint64_t{1}, std::uint64_t{4095}, std::uint64_t{300000}, std::uint64_t{3 << 20} + 100,
        std::uint64_t{32 << 20}, std::uint64_t{1000000007}, l2::detail::max_object_bytes}) {
    INFO(n);
    const auto sb = disk_segment_bytes(n);
    CHECK(sb % 4096 == 0);
    CHECK(sb >= 128 * 1024);
    CHECK(l2::segment_count(n, sb) >= 1);
    CHECK(l2::segment_count(n, sb) <= 16);
  }
}

TEST_CASE("segmented objects of every size round-trip and tell a growing verified prefix per key",
          "[l2][disk][segments]") {
  // Sizes: empty (unsegmented), under one segment and not a 4 KiB multiple, exactly one
  // segment, two segments the second of one block, 16 segments with a partial last block,
  // 16 segments each split in parts (pread: part_bytes 256 KiB under 2 MiB segments); with
  // 1 MiB parts (automatic), parts that span several segments (192 KiB ones at 3 MiB).
  const std::vector<std::size_t> sizes = {0,        100,           128 * 1024, 128 * 1024 + 4096, (3 << 20) + 100,
                                          32 << 20, 300 * 1024 + 7};
  for (const auto choice : {io::file_io_choice::automatic, io::file_io_choice::pread}) {
    INFO((choice == io::file_io_choice::pread ? "pread" : "automatic"));
    temp_dir dir;
    asio::io_context io;
    auto opts = options_for(dir.path());
    opts.io = choice;
    opts.part_bytes = choice == io::file_io_choice::pread ? 256 * 1024 : 1 << 20;
    auto backend = std::make_unique<l2::disk_backend>(io.get_executor(), opts);
    l2::disk_backend& b = *backend;
    std::vector<chunk_key> keys;
    std::vector<aligned_buffer> data;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      keys.push_back(key_of(100 + i));
      data.emplace_back(std::max<std::size_t>(sizes[i], 1));
      fill_for(keys.back(), std::span(data.back().data(), sizes[i]));
      const auto src =
          std::vector<std::span<const std::byte>>{std::span<const std::byte>(data.back().data(), sizes[i])};
      REQUIRE(store(io, b, std::span(&keys.back(), 1), src).count(l2::key_outcome::ok) == 1);
    }
    // The files carry the table the segment size implies (none for the empty payload).
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      INFO("size " << sizes[i]);
      const auto f = format_of(b.object_file(keys[i]));
      CHECK(f.header.payload_bytes == sizes[i]);
      if (sizes[i] == 0) {
        CHECK(f.header.flags == 0);
        continue;
      }
      CHECK(f.header.flags == l2::object_flag_segmented);
      CHECK(f.segment_bytes == l2::detail::disk_segment_bytes(sizes[i]));
      CHECK(f.segments == segment_ends(sizes[i]).size());
    }
    const auto o = observed_load(io, b, keys, sizes);
    CHECK_FALSE(o.ec);
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      INFO("size " << sizes[i]);
      CHECK(o.r.outcomes[i] == l2::key_outcome::ok);
      CHECK(matches(keys[i], std::span(o.out[i].data(), sizes[i])));
      // One call per segment, at each segment's end, the last with the whole size.
      CHECK(check_told(o, i, keys[i], sizes[i]) == segment_ends(sizes[i]));
    }
    // A restart reads the tables back: the same loads, the same calls.
    if (choice == io::file_io_choice::pread) {
      backend.reset();
      backend = std::make_unique<l2::disk_backend>(io.get_executor(), opts);
      CHECK(backend->recovery().objects == sizes.size());
      const auto again = observed_load(io, *backend, keys, sizes);
      for (std::size_t i = 0; i < sizes.size(); ++i) {
        CHECK(again.r.outcomes[i] == l2::key_outcome::ok);
        CHECK(check_told(again, i, keys[i], sizes[i]) == segment_ends(sizes[i]));
      }
    }
  }
}

TEST_CASE("a payload moves in part_bytes reads and writes, whatever its segments", "[l2][disk][segments]") {
  // 3 MiB: 16 segments of 192 KiB. The device sees part_bytes (1 MiB) operations, as fio
  // does, not one per segment: 3 payload writes and 3 payload reads, not 16 of each. The
  // pread pool counts every operation it runs (io_stats::ops_completed).
  constexpr std::size_t bytes = std::size_t{3} << 20;
  REQUIRE(l2::segment_count(bytes, l2::detail::disk_segment_bytes(bytes)) == 16);
  temp_dir dir;
  asio::io_context io;
  auto opts = options_for(dir.path());
  opts.io = io::file_io_choice::pread;
  opts.part_bytes = std::size_t{1} << 20;
  l2::disk_backend b(io.get_executor(), opts);
  const auto stats = b.shared_io_stats();
  const objects o(700, 1, bytes);
  const std::uint64_t before_store = stats->ops_completed.load();
  REQUIRE(store(io, b, o).count(l2::key_outcome::ok) == 1);
  // open, 3 payload writes, the header block, rename, fdatasync, the shard directory's fsync
  // (name_sync directory, the default)
  CHECK(stats->ops_completed.load() - before_store == 1 + 3 + 1 + 1 + 1 + 1);
  const std::vector<std::size_t> sizes = {bytes};
  const std::uint64_t before_load = stats->ops_completed.load();
  const auto l = observed_load(io, b, o.keys, sizes);
  REQUIRE(l.r.outcomes[0] == l2::key_outcome::ok);
  // open, the header block, 3 payload reads
  CHECK(stats->ops_completed.load() - before_load == 1 + 1 + 3);
  // Still verified and told segment by segment.
  CHECK(check_told(l, 0, o.keys[0], bytes) == segment_ends(bytes));
}

TEST_CASE("a load reads in rounds across keys, telling each segment as it completes", "[l2][disk][segments]") {
  // Round r reads the bytes [r * part_bytes, (r + 1) * part_bytes) of every key that has
  // them, in key order: the first layers of every key come before the later layers of any.
  // Queue depth 1: one read at a time, in the order issued, so the calls come in that order.
  // Parts of 64 KiB (several per segment) and of 1 MiB (several segments per part).
  for (const std::size_t part_bytes : {std::size_t{64} << 10, std::size_t{1} << 20}) {
    INFO("part_bytes " << part_bytes);
    temp_dir dir;
    asio::io_context io;
    auto opts = options_for(dir.path());
    opts.queue_depth = 1;
    opts.part_bytes = part_bytes;
    l2::disk_backend b(io.get_executor(), opts);
    const std::vector<std::size_t> sizes = {(3 << 20) + 100, 256 * 1024, (3 << 20) + 100, 64 * 1024, 1 << 20};
    std::vector<chunk_key> keys;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      keys.push_back(key_of(200 + i));
      aligned_buffer d(sizes[i]);
      fill_for(keys.back(), std::span(d.data(), sizes[i]));
      const auto src = std::vector<std::span<const std::byte>>{std::span<const std::byte>(d.data(), sizes[i])};
      REQUIRE(store(io, b, std::span(&keys.back(), 1), src).count(l2::key_outcome::ok) == 1);
    }
    std::vector<std::pair<std::size_t, std::size_t>> want;  // (key, verified), round by round
    for (std::size_t from = 0; from < (std::size_t{3} << 20) + 100; from += part_bytes)
      for (std::size_t i = 0; i < sizes.size(); ++i)
        for (const std::size_t end : segment_ends(sizes[i]))
          if (end > from && end <= std::min(from + part_bytes, sizes[i])) want.emplace_back(i, end);
    const auto o = observed_load(io, b, keys, sizes);
    CHECK(o.r.count(l2::key_outcome::ok) == sizes.size());
    std::vector<std::pair<std::size_t, std::size_t>> got;
    for (const auto& c : o.calls) got.emplace_back(c.index, c.verified);
    CHECK(got == want);
    for (std::size_t i = 0; i < sizes.size(); ++i) CHECK(check_told(o, i, keys[i], sizes[i]) == segment_ends(sizes[i]));
  }
}

TEST_CASE("bytes told verified are never written again by the load", "[l2][disk][segments]") {
  // The observer overwrites each newly told range with a mark; a read or a tail copy landing
  // in it afterwards would replace the mark with the object's bytes. Partial last blocks,
  // small parts and a deep queue give late writes every chance.
  temp_dir dir;
  asio::io_context io;
  auto opts = options_for(dir.path());
  opts.part_bytes = 32 * 1024;
  opts.queue_depth = 64;
  l2::disk_backend b(io.get_executor(), opts);
  const objects o(300, 6, (3 << 20) + 100);
  REQUIRE(store(io, b, o).count(l2::key_outcome::ok) == 6);
  const std::vector<std::size_t> sizes(6, o.bytes);
  for (int round = 0; round < 3; ++round) {
    const auto l = observed_load(io, b, o.keys, sizes, /*scribble=*/true);
    for (std::size_t i = 0; i < 6; ++i) {
      INFO("round " << round << " key " << i);
      CHECK(l.r.outcomes[i] == l2::key_outcome::ok);
      CHECK(check_told(l, i, o.keys[i], o.bytes) == segment_ends(o.bytes));
      // Every byte was told (the last call is the whole size), so every byte holds the mark.
      const auto* p = l.out[i].data();
      CHECK(std::all_of(p, p + o.bytes, [](std::byte x) { return x == std::byte{0x5a}; }));
    }
  }
}

TEST_CASE("a corrupt segment fails its key after telling only the segments before it", "[l2][disk][segments]") {
  constexpr std::size_t bytes = (3 << 20) + 100;  // 16 segments, a partial last block
  const std::uint64_t sb = l2::detail::disk_segment_bytes(bytes);
  for (const std::uint64_t k : {std::uint64_t{0}, std::uint64_t{5}, std::uint64_t{15}}) {
    INFO("segment " << k);
    temp_dir dir;
    asio::io_context io;
    telemetry::registry reg;
    l2::disk_backend b(io.get_executor(), options_for(dir.path()));
    collect(reg, b);
    const objects o(400, 3, bytes);
    REQUIRE(store(io, b, o).count(l2::key_outcome::ok) == 3);
    // A byte inside segment k of key 1 (the last byte of the object for the last segment).
    const std::uint64_t at = k == 15 ? bytes - 1 : k * sb + 777;
    flip_byte(b.object_file(o.keys[1]), 4096 + at);
    const std::vector<std::size_t> sizes(3, bytes);
    const auto l = observed_load(io, b, o.keys, sizes);
    CHECK(l.r.outcomes[0] == l2::key_outcome::ok);
    CHECK(l.r.outcomes[1] == l2::key_outcome::corrupt);
    CHECK(l.r.outcomes[2] == l2::key_outcome::ok);
    CHECK(check_told(l, 0, o.keys[0], bytes) == segment_ends(bytes));
    CHECK(check_told(l, 2, o.keys[2], bytes) == segment_ends(bytes));
    // Key 1: segments 0..k-1 verified and told (the prefix up to segment k's start), no more.
    const auto told1 = check_told(l, 1, o.keys[1], bytes);
    const auto ends = segment_ends(bytes);
    CHECK(told1 == std::vector<std::size_t>(ends.begin(), ends.begin() + static_cast<std::ptrdiff_t>(k)));
    // Dropped: counted, its file gone, the next lookup misses.
    CHECK(reg.value("kvtier_l2_disk_corrupt_objects_total", {{"backend", "disk"}}) == 1);
    CHECK_FALSE(fs::exists(b.object_file(o.keys[1])));
    CHECK(lookup(io, b, std::span(o.keys).subspan(1, 1)).to_string() == "0");
    CHECK(b.usage().objects == 2);
  }
}

TEST_CASE("a damaged segment table fails its key before anything is told", "[l2][disk][segments]") {
  constexpr std::size_t bytes = (3 << 20) + 100;
  // Offsets in the header block: a segment's checksum, the segment size, the count, the
  // reserved field; and the header's own payload checksum (the table's checksum).
  SECTION("found by a load") {
    for (const std::uint64_t at : {std::uint64_t{72 + 16 + 8 * 3}, std::uint64_t{72 + 1}, std::uint64_t{72 + 8},
                                   std::uint64_t{72 + 13}, std::uint64_t{56 + 2}}) {
      INFO("byte " << at);
      temp_dir dir;
      const objects o(500, 2, bytes);
      fs::path file;
      {
        asio::io_context io;
        l2::disk_backend b(io.get_executor(), options_for(dir.path()));
        REQUIRE(store(io, b, o).count(l2::key_outcome::ok) == 2);
        file = b.object_file(o.keys[0]);
        flip_byte(file, at);
        const std::vector<std::size_t> sizes(2, bytes);
        const auto l = observed_load(io, b, o.keys, sizes);
        CHECK(l.r.outcomes[0] == l2::key_outcome::corrupt);
        CHECK(l.r.outcomes[1] == l2::key_outcome::ok);
        CHECK(l.verified_of(0).empty());  // nothing told
        CHECK(check_told(l, 1, o.keys[1], bytes) == segment_ends(bytes));
        CHECK_FALSE(fs::exists(file));
        CHECK(lookup(io, b, std::span(o.keys).first(1)).to_string() == "0");
      }
    }
  }
  SECTION("found at start-up, the object is dropped") {
    temp_dir dir;
    const objects o(510, 2, bytes);
    fs::path file;
    first_life(dir.path(), o, [&](l2::disk_backend& b) { file = b.object_file(o.keys[0]); });
    flip_byte(file, 72 + 16 + 8 * 3);
    asio::io_context io;
    l2::disk_backend b(io.get_executor(), options_for(dir.path()));
    CHECK(b.recovery().dropped == 1);
    CHECK(b.recovery().objects == 1);
    CHECK_FALSE(fs::exists(file));
  }
}

TEST_CASE("verify_on_start checks every segment of segmented objects", "[l2][disk][segments]") {
  constexpr std::size_t bytes = (3 << 20) + 100;
  temp_dir dir;
  const objects o(600, 3, bytes);
  std::vector<fs::path> files;
  first_life(dir.path(), o, [&](l2::disk_backend& b) {
    for (const auto& k : o.keys) files.push_back(b.object_file(k));
  });
  flip_byte(files[1], 4096 + 9 * l2::detail::disk_segment_bytes(bytes) + 5);  // segment 9 of 16
  flip_byte(files[2], 4096 + bytes - 1);                                      // the last byte
  asio::io_context io;
  auto opts = options_for(dir.path());
  opts.verify_on_start = true;
  l2::disk_backend b(io.get_executor(), opts);
  CHECK(b.recovery().dropped == 2);
  CHECK(b.recovery().objects == 1);
  CHECK(fs::exists(files[0]));
  CHECK_FALSE(fs::exists(files[1]));
  CHECK_FALSE(fs::exists(files[2]));
  CHECK(check_all_served(io, b, o.keys, bytes) == 1);
}

TEST_CASE("objects of the format before segments load whole, and survive restarts and verify_on_start",
          "[l2][disk][segments]") {
  // A directory as an earlier version left it: unsegmented objects (flags 0, one XXH3-64 of
  // the whole payload), written here by hand, next to one stored by this version.
  temp_dir dir;
  const std::vector<std::size_t> sizes = {(3 << 20) + 100, 100, 0, (3 << 20) + 100};
  std::vector<chunk_key> keys;
  for (std::size_t i = 0; i < sizes.size(); ++i) keys.push_back(key_of(700 + i));
  std::vector<std::vector<std::byte>> payloads;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    payloads.emplace_back(sizes[i]);
    fill_for(keys[i], payloads.back());
  }
  std::vector<fs::path> files;
  {
    asio::io_context io;
    l2::disk_backend b(io.get_executor(), options_for(dir.path()));
    for (const auto& k : keys) files.push_back(b.object_file(k));
    // The last key through this version: segmented.
    const auto src = std::vector<std::span<const std::byte>>{std::span<const std::byte>(payloads[3])};
    REQUIRE(store(io, b, std::span(keys).subspan(3, 1), src).count(l2::key_outcome::ok) == 1);
  }
  for (std::size_t i = 0; i < 3; ++i) write_unsegmented_object(files[i], keys[i], payloads[i]);
  CHECK(format_of(files[0]).header.flags == 0);
  CHECK(format_of(files[3]).header.flags == l2::object_flag_segmented);
  auto check_loads = [&](asio::io_context& io, l2::disk_backend& b) {
    const auto l = observed_load(io, b, keys, sizes);
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      INFO("key " << i);
      CHECK(l.r.outcomes[i] == l2::key_outcome::ok);
      CHECK(matches(keys[i], std::span(l.out[i].data(), sizes[i])));
      // Unsegmented: told once, whole; segmented: once per segment.
      const auto told_i = check_told(l, i, keys[i], sizes[i]);
      if (i < 3)
        CHECK(told_i == std::vector<std::size_t>{sizes[i]});
      else
        CHECK(told_i == segment_ends(sizes[i]));
    }
  };
  for (const bool verify : {true, false, true}) {
    INFO("verify_on_start " << verify);
    asio::io_context io;
    auto opts = options_for(dir.path());
    opts.verify_on_start = verify;
    l2::disk_backend b(io.get_executor(), opts);
    CHECK(b.recovery().objects == 4);
    CHECK(b.recovery().dropped == 0);
    check_loads(io, b);
  }
  SECTION("a damaged unsegmented object fails whole: nothing told") {
    flip_byte(files[0], 4096 + 5);
    asio::io_context io;
    l2::disk_backend b(io.get_executor(), options_for(dir.path()));
    const auto l = observed_load(io, b, std::span(keys).first(1), std::span(sizes).first(1));
    CHECK(l.r.outcomes[0] == l2::key_outcome::corrupt);
    CHECK(l.calls.empty());
    CHECK_FALSE(fs::exists(files[0]));
  }
  SECTION("verify_on_start drops a damaged unsegmented object") {
    flip_byte(files[0], 4096 + sizes[0] - 1);
    asio::io_context io;
    auto opts = options_for(dir.path());
    opts.verify_on_start = true;
    l2::disk_backend b(io.get_executor(), opts);
    CHECK(b.recovery().dropped == 1);
    CHECK(b.recovery().objects == 3);
  }
}

}  // namespace file_disk_backend_test
