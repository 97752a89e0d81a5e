#pragma once
// The load path of l2::disk_backend (declarations: kvtier/l2/disk/disk_backend.hpp; docs/l2-disk.md,
// "Reading objects", "Deadlines and the buffer contract"): lookup_and_pin, then per batch: plan, open, read every part
// of every key through one queue (io::async_run_parts), verify each key as its parts land, drop what was found bad.

#include <kvtier/l2/disk/disk_backend.hpp>
#include <kvtier/l2/disk/impl/disk_backend.hpp>

#include <kvtier/io/parts.hpp>

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/bind_cancellation_slot.hpp>
#include <boost/asio/error.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>
#include <span>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace l2 {

struct disk_backend::load_item : object_item {
  std::span<std::byte> dst;
  std::size_t hash_next = part::none;  ///< the next payload part (index into parts) to feed the checksum
  std::size_t hashed = 0;              ///< payload bytes fed to the checksum (a part may span segments)
  std::uint32_t segments = 0;          ///< of the payload (1 when unsegmented, 0 when empty)
  std::uint32_t verified = 0;          ///< segments [0, verified) passed their checksum
  bool header_ok = false;              ///< the header block landed and passed its checks
  bool digest_pending = false;         ///< segment `verified` is hashed (digest), its check waits for the header
  std::uint64_t digest = 0;
  std::uint64_t whole_checksum = 0;       ///< unsegmented: the header's payload checksum
  const load_observer* landed = nullptr;  ///< told as the verified prefix grows (the caller's observer)
  bool drop = false;                      ///< the object is bad: remove it
  /// Why it is dropped (the key listener): corrupt, or deleted when its file was gone.
  bus::key_removal drop_reason = bus::key_removal::corrupt;

  /// Payload bytes up to the end of segment s.
  [[nodiscard]] std::size_t segment_end(std::uint32_t s) const noexcept {
    return static_cast<std::size_t>(detail::segment_end(segment_bytes, dst.size(), s));
  }
};

/// The reads of a load: the header block of every key, then the first part_bytes of every
/// key's payload, then the next part_bytes of every key, and so on (a read may span several
/// segments: a 3 MiB object's 16 segments come in 3 reads, as fio reads them),
/// queue_depth at a time across keys (io::async_run_parts): the first layers of the whole
/// prefix land (and are verified, and told, segment by segment) before the later layers of
/// any key, which is what a layer-wise consumer needs first.
struct disk_backend::load_plan {
  static constexpr bool writes = false;
  /// end_part checksums what landed (verify_landed): the next reads go to the disk first.
  static constexpr bool digests_parts = true;
  using signature = void(error_code);
  disk_backend* self;
  std::vector<load_item>* items;
  std::vector<part>* parts;

  [[nodiscard]] std::size_t part_count() const noexcept { return parts->size(); }

  [[nodiscard]] std::optional<io::file_part> begin_part(std::size_t i) const noexcept {
    const part& p = (*parts)[i];
    const load_item& it = (*items)[p.item];
    if (it.failed || it.fd < 0) return std::nullopt;  // its open, or another of its parts, failed
    std::byte* buf = p.kind == part_kind::header ? it.header
                     : p.kind == part_kind::tail ? it.tail
                                                 : it.dst.data() + p.offset;
    const std::uint64_t at = p.kind == part_kind::header ? 0 : detail::disk_block_bytes + p.offset;
    return io::file_part{it.fd, buf, p.len, at};
  }

  bool end_part(std::size_t i, const error_code& ec, std::size_t n) {
    self->part_loaded(*items, *parts, i, ec, n);
    return false;  // a failed key does not stop the others
  }

  [[nodiscard]] std::tuple<error_code> result(const io::parts_outcome&) const noexcept { return {}; }
};

// --- lookup -----------------------------------------------------------------------------------

inline boost::asio::awaitable<disk_backend::lookup_tuple> disk_backend::lookup_impl(std::span<const chunk_key> keys,
                                                                                    deadline d) {
  bitmap found(keys.size());
  if (clock::now() >= d) co_return lookup_tuple{make_error_code(errc::timeout), found};
  std::lock_guard g(mutex_);
  for (std::size_t i = 0; i < keys.size(); ++i) {
    if (auto* e = index_.find_ready(keys[i])) {
      ++e->pins;
      index_.touch(*e);
      found.set(i);
    }
  }
  co_return lookup_tuple{error_code{}, found};
}

// --- load -------------------------------------------------------------------------------------

inline boost::asio::awaitable<disk_backend::batch_tuple> disk_backend::load_impl(
    std::span<const chunk_key> keys, std::span<const std::span<std::byte>> destinations, deadline d,
    load_observer observer) {
  namespace asio = boost::asio;
  co_await asio::this_coro::throw_if_cancelled(false);
  if (auto refused = refuse_batch(keys.size(), destinations.size(), d, disk_stats::load)) co_return std::move(*refused);
  batch_result r(keys.size(), key_outcome::timeout);

  // 1. Plan: which keys are there, with the right size.
  std::vector<load_item> items = plan_load(keys, destinations, observer, r);
  if (items.empty()) co_return batch_tuple{error_code{}, r};

  // 2. Parts, in rounds of part_bytes: every key's header block, then the payload's first
  //    part of every key, then its second, ... (the partial last block through a bounce block).
  aligned_buffer blocks(items.size() * 2 * detail::disk_block_bytes);
  std::vector<hash_state> hashes(items.size());
  std::vector<part> parts = load_parts(items, blocks.data(), hashes);

  fan_state fs;
  // 3. Open every file (through file_io: a slow directory lookup never blocks the thread).
  auto open_body = [this, &items](std::size_t j, fan_state& f, unsigned lane) -> asio::awaitable<void> {
    load_item& it = items[j];
    const int flags = O_RDONLY | O_CLOEXEC | (it.direct ? O_DIRECT : 0);
    auto [ec, fd] = co_await file_io_->async_openat(objects_fd_, it.path.c_str(), flags, 0, f.bind(lane));
    if (ec)
      fail_open(it, ec);
    else
      it.fd = fd;
  };
  co_await fan_out(fs, items.size(), 64, d, open_body);

  // 4. Read every part, queue_depth at a time across keys; verify each segment as it and its
  //    header landed, telling the observer of each key's verified prefix.
  co_await run_parts(fs, d, load_plan{this, &items, &parts});

  // 5. Close, drop what was found bad, answer.
  std::vector<bad_object> bad;
  std::size_t timeouts = 0;
  for (auto& it : items) {
    if (it.fd >= 0) ::close(it.fd);
    if (it.drop) bad.push_back({it.key, it.generation, it.drop_reason});
    if (it.outcome == key_outcome::timeout) ++timeouts;
    r.outcomes[it.index] = it.outcome;
  }
  if (!bad.empty()) co_await drop(std::move(bad));
  co_return finish_batch(fs, disk_stats::load, timeouts, std::move(r));
}

inline std::vector<disk_backend::load_item> disk_backend::plan_load(std::span<const chunk_key> keys,
                                                                    std::span<const std::span<std::byte>> destinations,
                                                                    const load_observer& observer, batch_result& r) {
  std::vector<load_item> items;
  items.reserve(keys.size());
  std::lock_guard g(mutex_);
  for (std::size_t i = 0; i < keys.size(); ++i) {
    auto* e = index_.find_ready(keys[i]);
    if (e == nullptr) {
      r.outcomes[i] = key_outcome::not_found;
      continue;
    }
    if (e->payload_bytes != destinations[i].size()) {
      r.outcomes[i] = key_outcome::rejected;
      continue;
    }
    index_.touch(*e);
    load_item it;
    it.key = keys[i];
    it.dst = destinations[i];
    it.segment_bytes = e->segment_bytes;
    it.generation = e->generation;
    it.index = i;
    it.landed = observer ? &observer : nullptr;
    items.push_back(it);
  }
  return items;
}

inline std::vector<disk_backend::part> disk_backend::load_parts(std::vector<load_item>& items, std::byte* blocks,
                                                                std::vector<hash_state>& hashes) {
  std::vector<part> parts;
  std::size_t longest = 0;
  for (std::size_t j = 0; j < items.size(); ++j) {
    load_item& it = items[j];
    prepare_item(it, static_cast<std::uint32_t>(j), it.dst.data(), it.dst.size(), blocks, hashes[j]);
    it.segments = it.dst.empty()          ? 0
                  : it.segment_bytes == 0 ? 1
                                          : static_cast<std::uint32_t>(segment_count(it.dst.size(), it.segment_bytes));
    longest = std::max(longest, it.dst.size());
    parts.push_back({static_cast<std::uint32_t>(j), part_kind::header, false, 0, detail::disk_block_bytes});
  }
  // The bytes [from, from + part_bytes) of every key that has them, in key order; each key's
  // payload parts linked in payload order (part::next) for the checksum.
  const std::size_t round_bytes = detail::round_up_block(options_.part_bytes);
  std::vector<std::size_t> last(items.size(), part::none);
  for (std::size_t from = 0; from < longest; from += round_bytes) {
    for (std::size_t j = 0; j < items.size(); ++j) {
      load_item& it = items[j];
      if (from >= it.dst.size()) continue;
      const std::size_t first = parts.size();
      add_payload_parts(parts, it, static_cast<std::uint32_t>(j), from, std::min(from + round_bytes, it.dst.size()));
      for (std::size_t q = first; q < parts.size(); ++q) {
        (last[j] == part::none ? it.hash_next : parts[last[j]].next) = q;
        last[j] = q;
      }
    }
  }
  return parts;
}

inline void disk_backend::fail_open(load_item& it, const error_code& ec) {
  if (detail::is_errno(ec, ENOENT)) {
    it.failed = true;
    it.outcome = key_outcome::not_found;  // removed behind our back: forget it
    it.drop = true;
    it.drop_reason = bus::key_removal::deleted;
    return;
  }
  fail_load(it, ec);
}

inline void disk_backend::fail_load(load_item& it, const error_code& ec) {
  it.failed = true;
  it.outcome = outcome_of_failure(ec);
  if (it.outcome == key_outcome::io_error) {
    it.drop = detail::is_media_error(ec);
    count_io_error(disk_stats::load, ec, it.key);
  }
}

inline void disk_backend::part_loaded(std::vector<load_item>& items, std::vector<part>& parts, std::size_t i,
                                      const error_code& ec, std::size_t got) {
  part& p = parts[i];
  load_item& it = items[p.item];
  if (it.failed) return;  // another part of this key failed meanwhile
  if (ec) {
    fail_load(it, ec);
    return;
  }
  if (got < p.len) {  // end of file before the header's length: a truncated object
    fail_corrupt(it, "the file is shorter than its header says");
    return;
  }
  // The partial last block: into the last segment only (segments are whole 4 KiB blocks but
  // the last), which is not verified, hence not told, before this part landed.
  if (p.kind == part_kind::tail)
    std::memcpy(it.dst.data() + it.aligned_bytes, it.tail, it.dst.size() - it.aligned_bytes);
  p.landed = true;
  if (p.kind == part_kind::header && !check_header(it)) return;
  verify_landed(it, parts);
}

inline bool disk_backend::check_header(load_item& it) {
  // The start-up scan's judgement (detail::check_object: header, key, flags, segment table),
  // for the file this destination implies; then what the index recorded: the exact length
  // and the segment layout.
  object_header h;
  std::uint64_t segment_bytes = 0;
  const auto check = detail::check_object(std::span<const std::byte>(it.header, detail::disk_block_bytes), it.key,
                                          detail::object_file_bytes(it.dst.size()), h, &segment_bytes);
  std::string_view why;
  if (check != detail::object_check::ok) why = detail::to_string(check);
  else if (h.payload_bytes != it.dst.size()) why = "the header's length differs";
  else if (segment_bytes != it.segment_bytes) why = "the segment layout differs from the one indexed";
  else if (it.dst.empty() && h.payload_checksum != payload_checksum({})) why = "payload checksum mismatch";
  if (!why.empty()) {
    fail_corrupt(it, why);
    return false;
  }
  it.header_ok = true;
  it.whole_checksum = h.payload_checksum;
  return true;
}

inline void disk_backend::verify_landed(load_item& it, std::vector<part>& parts) {
  for (;;) {
    if (it.digest_pending) {
      if (!it.header_ok) return;  // its header block has not landed yet
      // (the table was checked against the header by check_header)
      const std::uint64_t want = it.segment_bytes == 0
                                     ? it.whole_checksum
                                     : stored_segment_checksum(detail::table_area(it.header), it.verified);
      if (it.digest != want) {
        fail_corrupt(it, it.segment_bytes == 0 ? "payload checksum mismatch" : "segment checksum mismatch");
        return;
      }
      it.digest_pending = false;
      const std::size_t verified_bytes = it.segment_end(it.verified++);
      if (verified_bytes == it.dst.size()) break;
      // Bytes [0, verified_bytes) are final: they were hashed only once the reads holding them
      // had landed whole, reads never overlap, and the tail copy happened as its read landed.
      if (it.landed != nullptr) (*it.landed)(it.index, verified_bytes);
      continue;
    }
    if (it.hash_next == part::none) break;  // an empty payload (nothing to hash)
    const part& q = parts[it.hash_next];
    if (!q.landed) return;
    // Up to the end of the part or of the segment being verified, whichever comes first: a
    // part may span several segments, each checked (and told) on its own.
    const std::size_t part_end = std::min<std::size_t>(q.offset + q.len, it.dst.size());
    const std::size_t segment_end = it.segment_end(it.verified);
    const std::size_t upto = std::min(part_end, segment_end);
    kvtier::detail::xxh3_update(it.hash, it.dst.data() + it.hashed, upto - it.hashed);
    it.hashed = upto;
    if (upto == part_end) it.hash_next = q.next;
    if (upto == segment_end) {
      it.digest = XXH3_64bits_digest(it.hash);
      XXH3_64bits_reset(it.hash);
      it.digest_pending = true;
    }
  }
  if (it.header_ok && it.verified == it.segments) verify_loaded(it);
}

inline void disk_backend::fail_corrupt(load_item& it, std::string_view why) {
  it.failed = true;
  it.outcome = key_outcome::corrupt;
  it.drop = true;
  count_corrupt(it.key, why);
}

inline void disk_backend::verify_loaded(load_item& it) {
  // Every segment landed and verified: nothing writes dst any more.
  it.outcome = key_outcome::ok;
  stats_->loaded_bytes.fetch_add(it.dst.size(), std::memory_order_relaxed);
  count_success();
  if (it.landed != nullptr) (*it.landed)(it.index, it.dst.size());
}

inline boost::asio::awaitable<void> disk_backend::drop(std::vector<bad_object> bad) {
  std::vector<detail::object_path> paths;
  std::vector<std::pair<chunk_key, std::uint64_t>> gone;
  {
    std::lock_guard g(mutex_);
    for (const auto& b : bad)
      if (index_.start_remove(b.key, b.generation)) {
        gone.emplace_back(b.key, b.generation);
        paths.push_back(detail::object_path_of(b.key));
        tell(key_change::removed, b.why, {&b.key, 1});  // never served again, whatever the unlink does
      }
  }
  const auto errors = co_await unlink_all(objects_fd_, std::move(paths));
  std::size_t dropped = 0;
  {
    std::lock_guard g(mutex_);
    for (std::size_t i = 0; i < gone.size(); ++i) {
      if (errors[i]) {
        // The bad file is still there: never served, still counted, remove() retries.
        index_.mark_stuck(gone[i].first, gone[i].second);
        continue;
      }
      index_.finish_remove(gone[i].first, gone[i].second);
      ++dropped;
    }
  }
  for (std::size_t i = 0; i < gone.size(); ++i)
    if (errors[i]) count_io_error(disk_stats::remove, errors[i], gone[i].first);
  stats_->dropped_objects.fetch_add(dropped, std::memory_order_relaxed);
}

}  // namespace l2
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
