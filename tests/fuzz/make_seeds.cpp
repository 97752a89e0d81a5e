// Writes the generated seed corpora of the fuzz targets (tests/fuzz/corpus/<target>/), from
// real encodings made by kvtier's own encoders, so that the fuzzer starts from bytes the
// parsers accept and mutates from there:
//
//   codec/<message>.default|filled   every alternative of protocol::message, the default
//                                    message and one with every field filled (strings and
//                                    vectors non-empty, enums at their last value), filled
//                                    from the message's own field list: a message added to
//                                    messages.hpp gets its seeds without a change here
//   frame_decoder/*                  streams of those messages as frames, cut and carrying
//                                    fds in several ways, and the three stream errors
//   cuda_descriptor/*                serialized region descriptors (MHA and MLA)
//   disk_object/*                    object files as the disk backend writes them
//   redis_reply/*                    replies of Redis commands, for the reader and the link
//
// The config target's seeds are hand-written JSON files (corpus/config/*.json).
//
//   kvtier_fuzz_make_seeds CORPUS_DIR            (re)writes the files above
//   kvtier_fuzz_make_seeds --check CORPUS_DIR    exit 1 naming every file that is missing or
//                                                stale (ctest fuzz.seeds_current)

#include <kvtier/cuda/ipc_descriptor.hpp>
#include <kvtier/l2/disk/detail/disk_layout.hpp>
#include <kvtier/l2/object_format.hpp>
#include <kvtier/protocol/codec.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

namespace {

namespace p = kvtier::protocol;
namespace fs = std::filesystem;
using bytes = std::vector<std::byte>;

struct seed {
  std::string path;  ///< relative to the corpus directory, e.g. "codec/ping_request.filled"
  bytes data;
};

void append(bytes& b, std::string_view s) {
  for (char c : s) b.push_back(static_cast<std::byte>(c));
}
void append(bytes& b, const bytes& more) { b.insert(b.end(), more.begin(), more.end()); }
void append_u16(bytes& b, std::uint16_t v) {
  b.push_back(static_cast<std::byte>(v & 0xff));
  b.push_back(static_cast<std::byte>(v >> 8));
}
bytes of(std::initializer_list<std::uint8_t> l) {
  bytes b;
  for (auto x : l) b.push_back(static_cast<std::byte>(x));
  return b;
}

// --- protocol messages --------------------------------------------------------------------

struct filler {
  std::uint64_t n = 0;

  template <class T>
  void operator()(const p::plain_field<T>& f) {
    if constexpr (std::is_same_v<T, bool>) {
      f.value = true;
    } else if constexpr (std::is_same_v<T, kvtier::hash128>) {
      f.value = {0x0123456789abcdefULL + ++n, 0xfedcba9876543210ULL - n};
    } else if constexpr (std::is_same_v<T, kvtier::model_shape>) {
      std::apply([this](const auto&... g) { ((*this)(g), ...); }, p::model_shape_fields(f.value));
    } else {
      f.value = static_cast<T>(++n);
    }
  }
  template <class E>
  void operator()(const p::enum_field<E>& f) {
    f.value = f.last;
  }
  template <class T>
  void operator()(const p::string_list_field<T>& f) {
    f.value.assign(std::min<std::size_t>(3, f.max), std::string());
    for (auto& e : f.value) e = std::string("seed-").append(std::to_string(++n)).substr(0, f.max_bytes);
  }
  template <class T>
  void operator()(const p::bounded_field<T>& f) {
    if constexpr (std::is_same_v<T, std::string>) {
      f.value = std::string("seed-").append(std::to_string(++n)).substr(0, f.max);
    } else {
      f.value.resize(std::min<std::size_t>(3, f.max));
      for (auto& e : f.value) {
        if constexpr (std::is_same_v<std::decay_t<decltype(e)>, kvtier::hash128>)
          e = {++n, ~n};
        else
          e = static_cast<std::decay_t<decltype(e)>>(++n);
      }
    }
  }
};

template <class T>
bytes frame_of(const T& msg, std::uint64_t call_id) {
  auto frame = p::encode_frame(call_id, msg);
  if (!frame) {
    std::fprintf(stderr, "make_seeds: a %s does not encode: %s\n", std::string(p::name(T::type)).c_str(),
                 frame.error().message().c_str());
    std::exit(2);
  }
  return std::move(*frame);
}

struct message_frames {
  std::vector<bytes> defaults, filled;  ///< whole frames, one per alternative
};

template <class T>
void add_message(std::vector<seed>& out, message_frames& frames) {
  T filled{};
  filler f;
  std::apply([&](const auto&... g) { (f(g), ...); }, T::fields(filled));
  for (const auto& [suffix, msg] : {std::pair<const char*, T>{"default", T{}}, {"filled", filled}}) {
    const bytes frame = frame_of(msg, 7);
    bytes s;
    append_u16(s, static_cast<std::uint16_t>(T::type));
    s.insert(s.end(), frame.begin() + p::frame_header_size, frame.end());
    out.push_back({"codec/" + std::string(p::name(T::type)) + "." + suffix, std::move(s)});
  }
  frames.defaults.push_back(frame_of(T{}, 1));
  frames.filled.push_back(frame_of(filled, 2));
}

template <std::size_t... I>
message_frames add_messages(std::vector<seed>& out, std::index_sequence<I...>) {
  message_frames frames;
  (add_message<std::variant_alternative_t<I, p::message>>(out, frames), ...);
  return frames;
}

void add_frame_streams(std::vector<seed>& out, const message_frames& f) {
  auto stream = [&](std::string name, std::initializer_list<std::uint8_t> choices, const std::vector<bytes>& frames) {
    bytes s = of(choices);
    for (const auto& fr : frames) append(s, fr);
    out.push_back({"frame_decoder/" + std::move(name), std::move(s)});
  };
  // [cut, limit, fd mask] (frame_decoder_fuzz.cpp)
  stream("defaults-one-read", {0, 0, 0}, f.defaults);
  stream("filled-small-reads-fds", {7, 0, 0xff}, f.filled);
  stream("filled-reads-of-33-some-fds", {33, 0, 0x55}, f.filled);
  stream("register-in-one-read-with-fd", {0, 0, 1}, {f.filled.front()});
  // The three fatal errors, each after one good frame.
  bytes bad_magic = f.defaults.front();
  append(bad_magic, "KVT2");
  out.push_back({"frame_decoder/bad-magic", of({3, 0, 0})});
  append(out.back().data, bad_magic);
  bytes other_version = f.filled[1];
  other_version[4] = std::byte{kvtier::protocol::protocol_version + 1};
  stream("version-" + std::to_string(kvtier::protocol::protocol_version + 1), {0, 0, 0},
         {f.defaults.front(), other_version});
  stream("body-above-a-32-byte-limit", {5, 4, 0}, {f.defaults.back(), f.filled[2]});
}

// --- CUDA region descriptors ----------------------------------------------------------------

void add_descriptors(std::vector<seed>& out) {
  namespace kc = kvtier::cuda;
  kc::region_descriptor mha;
  mha.layout = {{3, 8, 128, kvtier::dtype_kind::bf16, kvtier::attention_kind::mha}, 16, 100};
  for (int i = 0; i < 16; ++i) mha.device[static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(i * 7 + 1);
  kc::ipc_allocation a0, a1;
  a0.handle.fill(0xab);
  a0.bytes = 2 * mha.layout.layer_bytes() + 4096;
  a1.handle.fill(0xcd);
  a1.bytes = mha.layout.layer_bytes();
  mha.allocations = {a0, a1};
  mha.layers = {{0, 0, 0}, {0, 0, mha.layout.layer_bytes() + 4096}, {1, 0, 0}};
  kc::region_descriptor mla;
  mla.layout = {{2, 1, 576, kvtier::dtype_kind::bf16, kvtier::attention_kind::mla}, 64, 32};
  kc::ipc_allocation one;
  one.bytes = mla.layout.total_bytes();
  mla.allocations = {one};
  mla.layers = {{0, 0, 0}, {0, 0, mla.layout.layer_bytes()}};
  // Every dimension at its largest: 2 TiB per block of one layer (the edge of validate()).
  kc::region_descriptor big;
  big.layout = {{1, 1024, 65536, kvtier::dtype_kind::fp32, kvtier::attention_kind::mha}, 4096, 1};
  kc::ipc_allocation whole;
  whole.bytes = big.layout.layer_bytes();
  big.allocations = {whole};
  big.layers = {{0, 0, 0}};
  // K|V packed per (token, head), NHD stride order: memory (blocks, block_size, heads, 2 * head_dim).
  kc::region_descriptor packed;
  packed.layout = {{2, 8, 128, kvtier::dtype_kind::bf16, kvtier::attention_kind::mha}, 16, 64};
  packed.layout.strides = {0, 256, 16 * 8 * 512, 8 * 512, 512};
  packed.layout.strides.layer = packed.layout.layer_bytes();
  kc::ipc_allocation both;
  both.bytes = packed.layout.total_bytes();
  packed.allocations = {both};
  packed.layers = {{0, 0, 0}, {0, 0, packed.layout.strides.layer}};
  using named = std::pair<const char*, const kc::region_descriptor*>;
  for (const auto& [name, d] : {named{"mha-3-layers-2-allocations", &mha}, named{"mla-one-allocation", &mla},
                                named{"largest-dimensions", &big}, named{"packed-kv-strides", &packed}}) {
    if (d->validate()) {
      std::fprintf(stderr, "make_seeds: the %s descriptor is invalid\n", name);
      std::exit(2);
    }
    out.push_back({std::string("cuda_descriptor/") + name, d->serialize()});
  }
}

// --- disk object files ------------------------------------------------------------------------

void add_disk_objects(std::vector<seed>& out) {
  namespace l2 = kvtier::l2;
  // [flags, name choice] (disk_object_fuzz.cpp): flags 0x24 = scan, file named by its key.
  auto object = [&](std::string name, std::uint8_t flags, std::size_t payload_bytes) {
    bytes payload(payload_bytes);
    for (std::size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<std::byte>(i * 31 + 7);
    l2::object_header h;
    h.key = kvtier::chunk_key{0xd15c, 2, 1, kvtier::hash128{0xabc, 0xdef}};
    h.payload_bytes = payload.size();
    h.payload_checksum = l2::payload_checksum(payload);
    bytes file(l2::detail::object_file_bytes(payload.size()));
    l2::detail::encode_header_block(h, std::span<std::byte, 4096>(file.data(), 4096));
    if (!payload.empty()) std::memcpy(file.data() + 4096, payload.data(), payload.size());
    bytes s = of({flags, 0});
    append(s, file);
    out.push_back({"disk_object/" + std::move(name), std::move(s)});
  };
  object("valid-empty-payload-scanned", 0x24, 0);
  object("valid-5000-byte-payload-scanned", 0x24, 5000);
  object("valid-4096-byte-payload-unscanned", 0x04, 4096);
  // A segmented object, as the backend writes every non-empty one (3 segments of 4 KiB, the
  // last short: the smallest a table allows); flags 0x26 = scan, named by its key, fix the
  // segment checksums.
  {
    const std::size_t payload_bytes = 2 * 4096 + 100, seg = 4096;
    bytes payload(payload_bytes);
    for (std::size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<std::byte>(i * 13 + 1);
    bytes file(l2::detail::object_file_bytes(payload.size()));
    const auto table = std::span<std::byte>(file).subspan(l2::object_header_bytes, 4096 - l2::object_header_bytes);
    l2::encode_segment_table(seg, 3, table);
    for (std::size_t s = 0; s < 3; ++s)
      l2::put_segment_checksum(
          table, s, l2::payload_checksum(std::span<const std::byte>(payload).subspan(s * seg, std::min(seg, payload_bytes - s * seg))));
    l2::object_header h;
    h.key = kvtier::chunk_key{0xd15c, 2, 1, kvtier::hash128{0xabc, 0xdef}};
    h.payload_bytes = payload.size();
    h.flags = l2::object_flag_segmented;
    h.payload_checksum = l2::segment_table_checksum(table, 3);
    l2::encode_header(h, std::span<std::byte, l2::object_header_bytes>(file.data(), l2::object_header_bytes));
    std::memcpy(file.data() + 4096, payload.data(), payload.size());
    bytes s = of({0x26, 0});
    append(s, file);
    out.push_back({"disk_object/valid-segmented-scanned", std::move(s)});
  }
  bytes name = of({0, 1});
  const auto p = l2::detail::object_path_of(kvtier::chunk_key{1, 1, 0, kvtier::hash128{2, 3}});
  append(name, p.view().substr(3));
  out.push_back({"disk_object/object-file-name", std::move(name)});
}

// --- Redis replies ----------------------------------------------------------------------------

void add_redis(std::vector<seed>& out) {
  auto wire = [&](std::string name, std::string_view stream) {
    bytes s = of({0, 0});  // wire mode, one feed
    append(s, stream);
    out.push_back({"redis_reply/wire-" + std::move(name), std::move(s)});
  };
  wire("status-integer-nil-bulk", "+OK\r\n:1\r\n$-1\r\n$5\r\nhello\r\n");
  wire("moved-ask", "-MOVED 3999 127.0.0.1:6381\r\n-ASK 12 :7000\r\n");
  wire("cluster-slots",
       "*2\r\n*3\r\n:0\r\n:8191\r\n*3\r\n$9\r\n127.0.0.1\r\n:7000\r\n$4\r\nabcd\r\n"
       "*3\r\n:8192\r\n:16383\r\n*2\r\n$0\r\n\r\n:7001\r\n");
  wire("info", "$45\r\n# Memory\r\nused_memory:1048576\r\nmaxmemory:0\r\n\r\n");
  // Link mode (redis_reply_fuzz.cpp): [1, n | auth/select bits, cut], then per request
  // [kind, form]; form 1 = a well-formed reply the target builds.
  auto link = [&](std::string name, bytes s) { out.push_back({"redis_reply/link-" + std::move(name), std::move(s)}); };
  link("get-4096-and-exists", of({1, 1, 0, 0x15, 1, 0x00, 1}));   // object 4096, generic
  link("auth-select-asking-get-100", of({1, 0xc0, 3, 0x13, 1}));  // AUTH, SELECT, ASKING + GET 100
  link("get-20000-in-small-sends", of({1, 0, 1, 0x1d, 1}));       // object 20000, cut 1
  link("defects",
       of({1, 7, 2, 0x15, 0x02, 0x15, 0x06, 0x15, 0x0a, 0x15, 0x0e, 0x15, 0x12, 0x15, 0x16, 0x15, 0x1a, 0x15, 0x1e}));
  bytes raw = of({1, 0, 0, 0x11, 0});  // object of 100 bytes, raw form
  append_u16(raw, 5);
  append(raw, "$-1\r\n");
  link("raw-nil", std::move(raw));
}

bytes read_file(const fs::path& path, bool& ok) {
  std::ifstream in(path, std::ios::binary);
  ok = static_cast<bool>(in);
  std::vector<char> c((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  bytes b(c.size());
  for (std::size_t i = 0; i < c.size(); ++i) b[i] = static_cast<std::byte>(c[i]);
  return b;
}

}  // namespace

int main(int argc, char** argv) {
  const bool check = argc == 3 && std::string_view(argv[1]) == "--check";
  if (!(argc == 2 || check)) {
    std::fprintf(stderr, "usage: %s [--check] CORPUS_DIR\n", argv[0]);
    return 2;
  }
  const fs::path dir = argv[argc - 1];
  std::vector<seed> seeds;
  const auto frames = add_messages(seeds, std::make_index_sequence<std::variant_size_v<p::message>>{});
  add_frame_streams(seeds, frames);
  add_descriptors(seeds);
  add_disk_objects(seeds);
  add_redis(seeds);

  int bad = 0;
  for (const auto& s : seeds) {
    const fs::path path = dir / s.path;
    if (check) {
      bool ok = false;
      const auto have = read_file(path, ok);
      if (!ok || have != s.data) {
        std::fprintf(stderr, "make_seeds: %s is %s\n", path.c_str(), ok ? "stale" : "missing");
        ++bad;
      }
      continue;
    }
    fs::create_directories(path.parent_path());
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(s.data.data()), static_cast<std::streamsize>(s.data.size()));
    if (!out) {
      std::fprintf(stderr, "make_seeds: cannot write %s\n", path.c_str());
      return 1;
    }
  }
  if (bad != 0) {
    std::fprintf(stderr,
                 "make_seeds: %d seeds differ from what the encoders write now (a message, the disk or the\n"
                 "descriptor format changed): regenerate them with\n  %s %s\nand commit the result "
                 "(docs/fuzzing.md)\n",
                 bad, argv[0], dir.c_str());
    return 1;
  }
  std::printf("make_seeds: %zu seeds %s %s\n", seeds.size(), check ? "match in" : "written to", dir.c_str());
  return 0;
}
