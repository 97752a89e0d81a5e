// Fuzz target: protocol::frame_decoder (protocol/frame_decoder.hpp, frame.hpp), the first
// code that touches the bytes a peer sends on the Unix socket, on both sides.
//
// Input: 3 bytes of choices, then the byte stream.
//   [0] how the stream is cut into reads: 0 = one read; n = reads of 1..n bytes (a small
//       generator seeded with n decides each length and whether it goes through feed() or
//       through prepare()/commit(), the way recvmsg fills the buffer)
//   [1] the body limit: 0 = the default (16 MiB); n = 8 * n bytes, to reach the limit check
//   [2] which of the first 32 reads carry file descriptors (bit i % 8 for read i; one or two
//       eventfds each), to check the fd rule of the header comment
//
// Oracle: an independent one-shot parse of the whole stream (written from docs/protocol.md,
// not from the decoder) gives the frames and the final error. However the stream is cut,
// the decoder must yield exactly those frames (header and body), then that error (and keep
// yielding it); a frame carries an fd exactly when it is a register_kv_request and the last
// frame that starts in a read that carried fds; every fd is closed once the decoder and the
// frames are gone; bytes_needed() and buffered() describe what is left. Every frame is also
// decoded by the codec (the server does that next).

#include <kvtier/protocol/codec.hpp>
#include <kvtier/protocol/frame_decoder.hpp>

#include "fuzz_support.hpp"

#include <fcntl.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace {

namespace p = kvtier::protocol;
using kvtier::fuzz::fuzz_input;
using kvtier::fuzz::fuzz_rng;

std::uint64_t le(std::span<const std::byte> b, std::size_t at, std::size_t n) {
  std::uint64_t v = 0;
  for (std::size_t i = 0; i < n; ++i) v |= static_cast<std::uint64_t>(b[at + i]) << (8 * i);
  return v;
}

struct ref_frame {
  std::size_t start = 0;
  p::frame_header header;
  std::span<const std::byte> body;
};

struct ref_result {
  std::vector<ref_frame> frames;
  std::size_t consumed = 0;           ///< bytes of the complete frames
  std::optional<kvtier::errc> error;  ///< the stream's fatal error, if any
  std::uint64_t error_call_id = 0;
};

// The header rules of docs/protocol.md, from scratch: magic "KVT1" (a wrong byte fails as
// soon as it is there), version protocol_version, body length at most the limit.
ref_result reference_parse(std::span<const std::byte> s, std::uint32_t max_body) {
  static constexpr char magic[] = {'K', 'V', 'T', '1'};
  ref_result r;
  std::size_t at = 0;
  for (;;) {
    const std::size_t avail = s.size() - at;
    for (std::size_t i = 0; i < std::min<std::size_t>(avail, 4); ++i)
      if (static_cast<char>(s[at + i]) != magic[i]) {
        r.error = kvtier::errc::protocol_error;
        r.consumed = at;
        return r;
      }
    if (avail < 20) break;
    p::frame_header h;
    h.version = static_cast<std::uint16_t>(le(s, at + 4, 2));
    h.type = static_cast<p::message_type>(le(s, at + 6, 2));
    h.call_id = le(s, at + 8, 8);
    h.body_bytes = static_cast<std::uint32_t>(le(s, at + 16, 4));
    if (h.version != p::protocol_version || h.body_bytes > max_body) {
      r.error = h.version != p::protocol_version ? kvtier::errc::version_mismatch : kvtier::errc::message_too_large;
      r.error_call_id = h.call_id;
      r.consumed = at;
      return r;
    }
    if (avail - 20 < h.body_bytes) break;
    r.frames.push_back({at, h, s.subspan(at + 20, h.body_bytes)});
    at += 20 + std::size_t{h.body_bytes};
  }
  r.consumed = at;
  return r;
}

struct read_piece {
  std::size_t first = 0;  ///< stream offset of its first byte
  std::size_t bytes = 0;
  bool via_prepare = false;
  std::vector<int> fds;  ///< the fd numbers sent with it (the decoder owns them)
};

bool is_closed(int fd) { return ::fcntl(fd, F_GETFD) == -1 && errno == EBADF; }

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz_input in(data, size);
  const auto cut = in.take<std::uint8_t>();
  const auto limit_choice = in.take<std::uint8_t>();
  const auto fd_mask = in.take<std::uint8_t>();
  const std::span<const std::byte> stream = in.rest();

  p::limits lim;
  if (limit_choice != 0) lim.max_body_bytes = 8U * limit_choice;
  const ref_result want = reference_parse(stream, lim.max_body_bytes);

  // Cut the stream into reads.
  std::vector<read_piece> reads;
  fuzz_rng rng(cut);
  for (std::size_t at = 0; at < stream.size();) {
    read_piece r;
    r.first = at;
    r.bytes = cut == 0 ? stream.size() : std::min<std::size_t>(1 + rng.next() % cut, stream.size() - at);
    r.via_prepare = (rng.next() & 1) != 0;
    at += r.bytes;
    reads.push_back(std::move(r));
  }

  std::vector<int> all_fds;
  std::vector<p::frame> got;
  std::optional<p::decode_error> error;
  {
    p::frame_decoder dec(lim);
    for (std::size_t i = 0; i < reads.size(); ++i) {
      read_piece& r = reads[i];
      std::vector<p::unique_fd> fds;
      if (i < 32 && ((fd_mask >> (i % 8)) & 1) != 0) {  // the first 32 reads: eventfds cost syscalls
        const int count = 1 + static_cast<int>((i / 8) & 1);
        for (int k = 0; k < count; ++k) {
          const int fd = ::eventfd(0, EFD_CLOEXEC);
          FUZZ_CHECK(fd >= 0, "eventfd failed (fd limit?)");
          r.fds.push_back(fd);
          all_fds.push_back(fd);
          fds.emplace_back(fd);
        }
      }
      const auto piece = stream.subspan(r.first, r.bytes);
      if (r.via_prepare) {
        const std::size_t extra = rng.next() % 64;
        auto space = dec.prepare(r.bytes + extra);
        FUZZ_CHECK(space.size() >= r.bytes + extra, "prepare() gave less room than asked");
        std::memcpy(space.data(), piece.data(), piece.size());
        dec.commit(r.bytes, std::move(fds));
      } else {
        dec.feed(piece, std::move(fds));
      }
      for (;;) {
        auto next = dec.next();
        if (!next) {
          if (!error) error = next.error();
          FUZZ_CHECK(next.error().code == error->code && next.error().reason == error->reason,
                     "the decoder's fatal error changed between calls");
          FUZZ_CHECK(dec.failed(), "failed() is false after an error");
          break;
        }
        if (!next->has_value()) break;
        FUZZ_CHECK(!error, "a frame came after a fatal error");
        got.push_back(std::move(**next));
      }
    }

    FUZZ_CHECK(got.size() == want.frames.size(), "decoder yielded " + std::to_string(got.size()) +
                                                     " frames, the reference parse " +
                                                     std::to_string(want.frames.size()));
    FUZZ_CHECK(error.has_value() == want.error.has_value(), "decoder and reference disagree on the stream error");
    if (error) {
      FUZZ_CHECK(error->code == make_error_code(*want.error), "wrong error code: " + error->reason);
      FUZZ_CHECK(error->call_id == want.error_call_id, "wrong call id in the error");
      FUZZ_CHECK(!error->reason.empty(), "an error without a reason");
    } else {
      const std::size_t left = stream.size() - want.consumed;
      FUZZ_CHECK(dec.buffered() == left, "buffered() is not the bytes after the last frame");
      std::size_t needed = 20 - std::min<std::size_t>(left, 20);
      if (left >= 20) {
        const std::size_t total = 20 + static_cast<std::size_t>(le(stream, want.consumed + 16, 4));
        needed = total - left;  // > 0: otherwise the frame would be complete
      }
      FUZZ_CHECK(dec.bytes_needed() == std::max<std::size_t>(needed, 1), "bytes_needed() is wrong");
    }
  }  // the decoder is gone: it closed every fd it kept

  // Frame starts, with the start of a trailing incomplete (or refused) frame.
  std::vector<std::size_t> starts;
  for (const auto& f : want.frames) starts.push_back(f.start);
  if (want.consumed < stream.size()) starts.push_back(want.consumed);

  for (std::size_t k = 0; k < got.size(); ++k) {
    const ref_frame& w = want.frames[k];
    FUZZ_CHECK(got[k].header == w.header, "frame header differs from the reference");
    FUZZ_CHECK(got[k].body.size() == w.body.size() &&
                   (w.body.empty() || std::memcmp(got[k].body.data(), w.body.data(), w.body.size()) == 0),
               "frame body differs from the reference");
    // The fd rule: the read that holds the frame's first byte carried fds, and no later frame
    // starts in that read.
    int expect_fd = -1;
    if (p::carries_fd(w.header.type)) {
      for (const auto& r : reads) {
        if (w.start < r.first || w.start >= r.first + r.bytes || r.fds.empty()) continue;
        const bool later_start = k + 1 < starts.size() && starts[k + 1] < r.first + r.bytes;
        if (!later_start) expect_fd = r.fds.front();
      }
    }
    FUZZ_CHECK(got[k].fd.get() == expect_fd, "frame " + std::to_string(k) + " has fd " +
                                                 std::to_string(got[k].fd.get()) + ", the rule says " +
                                                 std::to_string(expect_fd));
    // What the server does next with the frame: must not crash, whatever the body.
    auto m = p::decode_message(got[k], lim);
    if (m) FUZZ_CHECK(p::type_of(*m) == w.header.type, "decoded message has another type than the header");
  }
  got.clear();
  for (int fd : all_fds) FUZZ_CHECK(is_closed(fd), "fd " + std::to_string(fd) + " leaked by the decoder");
  return 0;
}
