#pragma once
// frame_decoder: cuts a byte stream into frames as bytes arrive (a partial header, a body
// split over many reads, several frames in one read), and hands each frame the file
// descriptors that arrived with it. Used by connection.hpp on both sides; it does no I/O.
//
// Header errors (bad magic, version, body above the limit) are fatal for the stream: frame
// boundaries cannot be trusted afterwards, so the decoder keeps the error and yields it on
// every later call; the caller replies (the error carries the call id when the header was
// readable) and closes. Body errors are not its business (codec.hpp).
//
// File descriptors: on a Unix stream socket the fds of a sendmsg travel with its first
// byte, and the kernel ends a recvmsg right after the segment that carried fds. The sender
// (connection.hpp) starts every fd-carrying sendmsg at the start of a frame. So the fds of
// one recvmsg belong to the last frame that *starts* in the bytes of that recvmsg. They are
// kept only for a frame type that carries an fd (register_kv_request), one fd at most;
// every other fd is closed as soon as its frame is known.

#include <kvtier/config.hpp>
#include <kvtier/protocol/frame.hpp>
#include <kvtier/protocol/limits.hpp>
#include <kvtier/protocol/messages.hpp>
#include <kvtier/protocol/unique_fd.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <optional>
#include <span>
#include <utility>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace protocol {

class frame_decoder {
 public:
  explicit frame_decoder(const limits& lim = {}) : limits_(lim) {}

  frame_decoder(frame_decoder&&) noexcept = default;
  frame_decoder& operator=(frame_decoder&&) noexcept = default;

  /// Appends bytes that arrived (copies them).
  void feed(std::span<const std::byte> bytes, std::vector<unique_fd> fds = {}) {
    auto space = prepare(bytes.size());
    if (!bytes.empty()) std::memcpy(space.data(), bytes.data(), bytes.size());
    commit(bytes.size(), std::move(fds));
  }

  /// Writable space for at least `n` more bytes at the end of the buffer (for recvmsg to
  /// fill without a copy); valid until the next call on the decoder. Then commit().
  [[nodiscard]] std::span<std::byte> prepare(std::size_t n) {
    if (begin_ == end_) begin_ = end_ = 0;
    if (capacity_ - end_ < n) {
      const std::size_t held = end_ - begin_;
      if (capacity_ - held >= n) {
        // Enough room once the unread bytes move to the front.
        std::memmove(buf_.get(), buf_.get() + begin_, held);
      } else {
        const std::size_t cap = std::max({held + n, capacity_ * 2, min_capacity});
        auto fresh = std::make_unique_for_overwrite<std::byte[]>(cap);
        if (held != 0) std::memcpy(fresh.get(), buf_.get() + begin_, held);
        buf_ = std::move(fresh);
        capacity_ = cap;
      }
      begin_ = 0;
      end_ = held;
    }
    return {buf_.get() + end_, capacity_ - end_};
  }

  /// Makes `n` bytes written into prepare()'s span part of the stream, together with the
  /// fds received with them (closed if no frame claims them).
  void commit(std::size_t n, std::vector<unique_fd> fds = {}) {
    n = std::min(n, capacity_ - end_);
    if (!fds.empty() && n != 0 && !error_) {
      const std::uint64_t first = stream_offset_ + (end_ - begin_);
      fd_batches_.push_back({first, first + n, std::move(fds)});
    }  // else: fds without bytes (or after a fatal error) belong to nothing; they close here
    end_ += n;
  }

  /// The next complete frame; nullopt when more bytes are needed; a decode_error when the
  /// stream is malformed (and on every call after that).
  [[nodiscard]] decode_result<std::optional<frame>> next() {
    if (error_) return *error_;
    const std::span<const std::byte> avail(buf_.get() + begin_, end_ - begin_);
    if (auto e = check_header(avail.first(std::min(avail.size(), frame_header_size)), limits_)) {
      error_ = std::move(*e);
      fd_batches_.clear();
      return *error_;
    }
    if (avail.size() < frame_header_size) return std::optional<frame>{};
    const frame_header h = read_header(avail.first<frame_header_size>());
    const std::size_t total = frame_header_size + h.body_bytes;
    if (avail.size() < total) return std::optional<frame>{};

    std::optional<frame> f(std::in_place);
    f->header = h;
    f->body.assign(avail.begin() + frame_header_size, avail.begin() + static_cast<std::ptrdiff_t>(total));
    attach_fds(*f, stream_offset_, stream_offset_ + total);
    begin_ += total;
    stream_offset_ += total;
    if (begin_ == end_ && capacity_ > keep_capacity) release_buffer();
    return f;
  }

  /// Bytes still missing before the current frame is complete (at least 1): a reader can
  /// size its next read with it.
  [[nodiscard]] std::size_t bytes_needed() const noexcept {
    const std::size_t held = end_ - begin_;
    if (held < frame_header_size) return frame_header_size - held;
    const frame_header h = read_header(std::span<const std::byte, frame_header_size>(buf_.get() + begin_, frame_header_size));
    const std::size_t total = frame_header_size + h.body_bytes;
    return total > held ? total - held : 1;
  }

  /// Bytes received and not yet returned as frames.
  [[nodiscard]] std::size_t buffered() const noexcept { return end_ - begin_; }
  /// True after a fatal stream error.
  [[nodiscard]] bool failed() const noexcept { return error_.has_value(); }
  /// File descriptors held for frames not complete yet.
  [[nodiscard]] std::size_t pending_fds() const noexcept {
    std::size_t n = 0;
    for (const auto& b : fd_batches_) n += b.fds.size();
    return n;
  }

 private:
  struct fd_batch {
    std::uint64_t first = 0;  ///< stream offset of the first byte received with the fds
    std::uint64_t last = 0;   ///< one past the last byte
    std::vector<unique_fd> fds;
  };

  // Frame [start, end) is complete. A batch whose bytes end inside the frame (last <= end)
  // is resolved now: the frame owns it when it starts inside the batch's bytes (no later
  // frame starts there), otherwise no frame starts in its bytes and its fds are stray.
  // A batch that reaches past `end` waits for the later frames.
  void attach_fds(frame& f, std::uint64_t start, std::uint64_t end) {
    while (!fd_batches_.empty() && fd_batches_.front().last <= end) {
      fd_batch b = std::move(fd_batches_.front());
      fd_batches_.pop_front();
      if (b.first <= start && carries_fd(f.header.type) && !f.fd) f.fd = std::move(b.fds.front());
      // Every other fd of the batch closes here, with `b`.
    }
  }

  void release_buffer() noexcept {
    buf_.reset();
    capacity_ = begin_ = end_ = 0;
  }

  // 64 KiB: one socket read's worth of small frames; a buffer grown past 1 MiB for a large
  // store is given back when it empties, so idle connections hold little memory.
  static constexpr std::size_t min_capacity = std::size_t{64} << 10;
  static constexpr std::size_t keep_capacity = std::size_t{1} << 20;

  limits limits_;
  std::unique_ptr<std::byte[]> buf_;
  std::size_t capacity_ = 0;
  std::size_t begin_ = 0;  ///< first unread byte
  std::size_t end_ = 0;    ///< one past the last received byte
  std::uint64_t stream_offset_ = 0;  ///< stream offset of buf_[begin_]
  std::deque<fd_batch> fd_batches_;
  std::optional<decode_error> error_;
};

}  // namespace protocol
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
