// Fuzz target: what the disk L2 backend trusts of a file it finds on disk: the object header
// (l2/object_format.hpp decode_header), the judgement of a header block and file size
// (l2/disk/detail/disk_layout.hpp check_object), object file names (parse_object_name), and the
// recovery scan of a real l2::disk_backend over the file (l2/disk/impl/disk_backend.hpp
// recover(), with verify_on_start) followed by a load of what it recovered.
//
// Input: two bytes of choices, then the file's bytes.
//   [0] bit 0  fix the header checksum (bytes 64..71 := XXH3-64 of bytes 0..63), so the
//              fuzzer gets past it and exercises what follows
//       bit 1  fix the payload checksum (bytes 56..63 := XXH3-64 of the payload; for a
//              segmented object (flags bit 0), fix each segment's checksum in the table and
//              the table's checksum instead)
//       bit 2  name the file after the key in its header (else after a fixed key)
//       bit 3  put the file in the wrong shard directory
//       bit 4  pad (or cut) the file to the size its header claims, when that is <= 64 KiB
//       bit 5  write the file and run the recovery scan over it (the slow part: a backend
//              start opens and lists 256 shard directories, ~5 ms): when the header is
//              valid, or bit 6 is set too (an invalid header gets check_object's verdict,
//              checked on every input)
//   [1] also read the first 64 bytes of the file as a file name for parse_object_name
//       when odd
//
// Oracle: an independent check of the format (docs/l2-disk.md: magic, version, header size,
// header checksum, key == the file name's key, flags 0 or 1 (segmented: a valid segment table
// whose checksum is the header's payload checksum), file size == 4 KiB + padded payload,
// payload checksum or every segment's checksum) says whether the file is a servable object. decode_header and
// check_object agree with it, and a decoded header re-encodes to the same 72 bytes; the
// scan recovers the object exactly when it is servable (and then a load gives back exactly
// its payload), and drops (deletes) the file otherwise. A name that parses re-encodes to
// itself.

#include <kvtier/l2/disk/detail/disk_layout.hpp>
#include <kvtier/l2/disk/disk_backend.hpp>
#include <kvtier/l2/object_format.hpp>
#include <kvtier/telemetry/logger.hpp>

#include "fuzz_support.hpp"

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/awaitable.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

namespace {

namespace l2 = kvtier::l2;
namespace d = kvtier::l2::detail;
namespace fs = std::filesystem;
namespace asio = boost::asio;
using kvtier::chunk_key;
using kvtier::fuzz::fuzz_input;

constexpr std::size_t max_padded_file = 64 * 1024;
const chunk_key fixed_key{0xd15c, 1, 0, kvtier::hash128{0x1234, 0x5678}};

std::uint64_t le(const std::vector<std::byte>& b, std::size_t at, std::size_t n) {
  std::uint64_t v = 0;
  for (std::size_t i = 0; i < n && at + i < b.size(); ++i) v |= static_cast<std::uint64_t>(b[at + i]) << (8 * i);
  return v;
}
void put_le(std::vector<std::byte>& b, std::size_t at, std::uint64_t v) {
  for (std::size_t i = 0; i < 8; ++i) b[at + i] = static_cast<std::byte>((v >> (8 * i)) & 0xff);
}

// The format, from docs/l2-disk.md and object_format.hpp's layout table (not their code).
bool header_valid(const std::vector<std::byte>& f) {
  return f.size() >= 72 && le(f, 0, 8) == 0x4B5654494552424FULL && le(f, 8, 4) == 1 && le(f, 12, 4) == 72 &&
         le(f, 64, 8) == XXH3_64bits(f.data(), 64);
}
// A segmented object's table (docs/l2-disk.md, "Segments"): at byte 72 the segment size (a
// multiple of 4 KiB, > 0), at 80 the count (ceil(payload / size), 1..501), at 84 zero, then
// the count's XXH3-64 of each segment; the header's payload checksum is the XXH3-64 of those
// 16 + 8 * count bytes. 0: not a valid table; else the count.
std::uint64_t table_segments(const std::vector<std::byte>& f) {
  const std::uint64_t payload = le(f, 48, 8), seg = le(f, 72, 8), count = le(f, 80, 4);
  if (seg == 0 || seg % 4096 != 0 || le(f, 84, 4) != 0 || payload == 0) return 0;
  if (count != (payload + seg - 1) / seg || count > 501) return 0;
  return le(f, 56, 8) == XXH3_64bits(f.data() + 72, 16 + 8 * count) ? count : 0;
}
// Everything but the payload's checksums (what check_object judges from the header block).
bool header_ok(const std::vector<std::byte>& f, const chunk_key& named) {
  if (f.size() < 4096 || !header_valid(f)) return false;
  const auto k = named.encode();
  if (std::memcmp(f.data() + 16, k.data(), k.size()) != 0) return false;
  const std::uint64_t flags = le(f, 44, 4);
  if (flags > 1) return false;
  const std::uint64_t payload = le(f, 48, 8);
  if (payload > (std::uint64_t{1} << 40)) return false;
  if (f.size() != 4096 + (payload + 4095) / 4096 * 4096) return false;
  return flags == 0 || table_segments(f) != 0;
}
bool servable(const std::vector<std::byte>& f, const chunk_key& named) {
  if (!header_ok(f, named)) return false;
  const std::uint64_t payload = le(f, 48, 8);
  if (le(f, 44, 4) == 0) return le(f, 56, 8) == XXH3_64bits(f.data() + 4096, payload);
  const std::uint64_t seg = le(f, 72, 8), count = table_segments(f);
  for (std::uint64_t s = 0; s < count; ++s) {
    const std::uint64_t len = std::min(seg, payload - s * seg);
    if (le(f, 88 + 8 * s, 8) != XXH3_64bits(f.data() + 4096 + s * seg, len)) return false;
  }
  return true;
}

// The scan's directory: made once (mode 0700, ours), emptied after each input.
struct scan_dir {
  fs::path root;
  scan_dir() {
    char tmpl[] = "/tmp/kvtier-fuzz-disk-XXXXXX";
    const char* p = ::mkdtemp(tmpl);
    FUZZ_CHECK(p != nullptr, "mkdtemp failed");
    root = p;
  }
  ~scan_dir() {
    std::error_code ec;
    fs::remove_all(root, ec);
  }
};

scan_dir& dir() {
  static scan_dir s;
  return s;
}

l2::disk_backend_options scan_options() {
  l2::disk_backend_options o;
  o.path = dir().root;
  o.capacity_bytes = std::uint64_t{1} << 30;
  o.o_direct = false;
  o.io = kvtier::io::file_io_choice::pread;
  o.pread_threads = 1;
  o.verify_on_start = true;
  o.sync = l2::disk_sync::none;
  return o;
}

void run_scan(const std::vector<std::byte>& file, const chunk_key& named, bool wrong_shard) {
  asio::io_context io;
  kvtier::telemetry::logger quiet(kvtier::telemetry::log_level::off);
  // First start: creates the layout (FORMAT, objects/<ss>/, tmp/).
  static const bool made = [&] {
    l2::disk_backend b(io.get_executor(), scan_options(), &quiet);
    return true;
  }();
  (void)made;

  const unsigned shard = (d::shard_of(named) + (wrong_shard ? 1 : 0)) % d::disk_shard_count;
  const auto rel = d::object_path_of(named);
  char shard_hex[3];
  std::snprintf(shard_hex, sizeof shard_hex, "%02x", shard);
  const fs::path path = dir().root / "objects" / shard_hex / fs::path(std::string(rel.view())).filename();
  {
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    FUZZ_CHECK(fd >= 0, "cannot create the object file");
    const auto n = file.empty() ? 0 : ::write(fd, file.data(), file.size());
    FUZZ_CHECK(n == static_cast<ssize_t>(file.size()), "short write of the object file");
    ::close(fd);
  }
  const bool want = !wrong_shard && servable(file, named);
  {
    l2::disk_backend b(io.get_executor(), scan_options(), &quiet);
    const auto& r = b.recovery();
    FUZZ_CHECK(r.objects == (want ? 1U : 0U), std::string("the scan ") + (want ? "dropped" : "kept") +
                                                  " the object; the format says it is " +
                                                  (want ? "servable" : "not servable"));
    FUZZ_CHECK(r.dropped == (want ? 0U : 1U), "the scan did not drop the file it refused");
    FUZZ_CHECK(fs::exists(path) == want, "a refused file was left on disk (or a kept one deleted)");
    if (want) {
      const std::size_t payload = static_cast<std::size_t>(le(file, 48, 8));
      std::vector<std::byte> dst(payload);
      const std::span<std::byte> dsts[1] = {std::span<std::byte>(dst)};
      std::optional<std::tuple<kvtier::error_code, l2::batch_result>> got;
      asio::co_spawn(
          io,
          [&]() -> asio::awaitable<void> {
            got = co_await b.async_load(std::span(&named, 1), dsts, l2::clock::now() + std::chrono::seconds(60),
                                        asio::as_tuple(asio::use_awaitable));
          },
          asio::detached);
      io.run();
      FUZZ_CHECK(got.has_value(), "the load did not complete");
      const auto& [ec, res] = *got;
      FUZZ_CHECK(!ec && res.size() == 1 && res.ok(0), "a recovered object does not load");
      FUZZ_CHECK(payload == 0 || std::memcmp(dst.data(), file.data() + 4096, payload) == 0,
                 "a recovered object loads other bytes than its file holds");
    }
  }
  std::error_code ec;
  fs::remove(path, ec);
}

void check_name(std::string_view name) {
  const auto k = d::parse_object_name(name);
  if (!k) return;
  const auto p = d::object_path_of(*k);
  FUZZ_CHECK(p.view().substr(3) == name, "a parsed object name does not re-encode to itself");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz_input in(data, size);
  const auto flags = in.take<std::uint8_t>();
  const auto name_choice = in.take<std::uint8_t>();
  const auto raw = in.rest();
  std::vector<std::byte> file(raw.begin(), raw.end());

  if (name_choice & 1)
    check_name(std::string_view(reinterpret_cast<const char*>(file.data()), std::min<std::size_t>(file.size(), 64)));

  // The fix-ups, payload size first (the checksums cover it).
  if ((flags & 16) && file.size() >= 72) {
    const std::uint64_t payload = le(file, 48, 8);
    if (payload <= max_padded_file - 4096) file.resize(d::object_file_bytes(payload));
  }
  if ((flags & 2) && file.size() >= 72) {
    const std::uint64_t payload = le(file, 48, 8);
    if (payload <= file.size() - std::min<std::size_t>(file.size(), 4096) && file.size() >= 4096) {
      const std::uint64_t seg = le(file, 72, 8), count = le(file, 80, 4);
      if ((le(file, 44, 4) & 1) != 0 && seg != 0 && count <= 501 && count * seg >= payload) {
        for (std::uint64_t s = 0; s < count && s * seg < payload; ++s)
          put_le(file, 88 + 8 * s, XXH3_64bits(file.data() + 4096 + s * seg, std::min(seg, payload - s * seg)));
        put_le(file, 56, XXH3_64bits(file.data() + 72, 16 + 8 * count));
      } else {
        put_le(file, 56, XXH3_64bits(file.data() + 4096, payload));
      }
    }
  }
  if ((flags & 1) && file.size() >= 72) put_le(file, 64, XXH3_64bits(file.data(), 64));

  chunk_key named = fixed_key;
  if ((flags & 4) && file.size() >= 44)
    named = chunk_key::decode(std::span<const std::byte, chunk_key::wire_size>(file.data() + 16, chunk_key::wire_size));

  // decode_header: exactly the valid headers, canonical.
  const auto h = l2::decode_header(file);
  FUZZ_CHECK(h.has_value() == header_valid(file), "decode_header disagrees with the format");
  if (h) {
    const auto again = l2::encode_header(*h);
    FUZZ_CHECK(std::memcmp(again.data(), file.data(), again.size()) == 0, "a decoded header re-encodes differently");
  }
  // check_object: the scan's verdict on the header block, without the payload checksum.
  if (file.size() >= 4096) {
    l2::object_header out;
    const auto verdict = d::check_object(std::span<const std::byte>(file).first(4096), named, file.size(), out);
    const bool want_ok = header_ok(file, named);
    FUZZ_CHECK((verdict == d::object_check::ok) == want_ok,
               std::string("check_object says ") + std::string(d::to_string(verdict)));
    if (verdict == d::object_check::ok) FUZZ_CHECK(out == *h, "check_object's header differs from decode_header's");
  }
  if ((flags & 32) && (h || (flags & 64))) run_scan(file, named, (flags & 8) != 0);
  return 0;
}
