#pragma once
// vLLM's KV event format (vllm/distributed/kv_events.py): the events a router (llm-d's KV
// cache indexer, Dynamo's KV router) reads to learn which blocks a cache holds, as plain
// structs, and their msgpack encoding in each of the forms vLLM has used (event_form). Field
// names and order are vLLM's, checked against its source; docs/kv-events.md holds the format,
// which vLLM versions read which form, and the replay protocol. Standard library only.

#include <kvtier/config.hpp>
#include <kvtier/kv_events/msgpack_writer.hpp>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <variant>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace kv_events {

/// vLLM's medium names, for our tiers: L1 (CPU memory) is "CPU"; an L2 tier (disk, Redis)
/// may use "STORAGE". Which tier the server maps to which name is the server's decision
/// (docs/kv-events.md); the publisher writes whatever string an event carries.
inline constexpr std::string_view medium_cpu = "CPU";
inline constexpr std::string_view medium_storage = "STORAGE";

/// Bytes, written as msgpack bin (Python bytes), where a std::string would be text (str).
struct byte_string {
  std::string bytes;
  friend bool operator==(const byte_string&, const byte_string&) = default;
};

/// One block's hash as the engine's router computes it: vLLM's ExternalBlockHash, bytes
/// (newer vLLM: a SHA-256 digest) or an int (older vLLM: 64-bit; a uint64_t above 2^63 is
/// written as msgpack uint64, which Python reads as the same int).
using block_hash = std::variant<std::uint64_t, std::int64_t, byte_string>;

/// One element of a block's extra keys (vLLM: a tuple of multimodal ids, LoRA name, cache
/// salt, ...): kept to the scalars kvtier needs.
using extra_key = std::variant<std::int64_t, std::string, byte_string>;

/// BlockStored: blocks entered a tier. token_ids are every token of those blocks, in order
/// (core's token_id is uint32_t). Fields in vLLM's declaration order; the last four have a
/// default (None) in vLLM and are left out when empty.
struct block_stored {
  static constexpr std::string_view vllm_type = "BlockStored";
  std::vector<block_hash> block_hashes;
  std::optional<block_hash> parent_block_hash;  // none: the first block of a sequence
  std::vector<std::uint32_t> token_ids;
  std::int64_t block_size = 0;
  std::optional<std::int64_t> lora_id;  // deprecated in vLLM in favour of lora_name
  std::optional<std::string> medium;
  std::optional<std::string> lora_name;
  /// One entry per block of block_hashes (an entry may be none).
  std::optional<std::vector<std::optional<std::vector<extra_key>>>> extra_keys;
  std::optional<std::int64_t> group_idx;
  std::optional<std::string> kv_cache_spec_kind;
  std::optional<std::int64_t> kv_cache_spec_sliding_window;
  friend bool operator==(const block_stored&, const block_stored&) = default;
};

/// BlockRemoved: blocks left a tier (evicted, deleted).
struct block_removed {
  static constexpr std::string_view vllm_type = "BlockRemoved";
  std::vector<block_hash> block_hashes;
  std::optional<std::string> medium;
  std::optional<std::int64_t> group_idx;  // default none
  friend bool operator==(const block_removed&, const block_removed&) = default;
};

/// AllBlocksCleared: the cache was emptied (vLLM: a reset of the prefix cache).
struct all_blocks_cleared {
  static constexpr std::string_view vllm_type = "AllBlocksCleared";
  friend bool operator==(const all_blocks_cleared&, const all_blocks_cleared&) = default;
};

using kv_event = std::variant<block_stored, block_removed, all_blocks_cleared>;

/// vLLM's EventBatch: ts in seconds since the epoch (Python's time.time()), the events, the
/// data-parallel rank (vLLM's publisher always sets it; left out when none).
struct event_batch {
  double ts = 0.0;
  std::vector<kv_event> events;
  std::optional<std::int64_t> data_parallel_rank;
};

/// The encodings vLLM has used, all msgspec with omit_defaults and tagged events:
///   map          the batch is a map {"ts", "events", "data_parallel_rank"}, each event a map
///                whose first key is "type" (the class name), then its fields; a field that
///                has a default and holds it is left out. vLLM's current form (checked at
///                commit 0181ea3 of vllm/distributed/kv_events.py); our default.
///   array        (array_like) the batch is [ts, events, data_parallel_rank], each event
///                [type, field...]; trailing fields that hold their default are left out.
///                vLLM before its 2026-06 change of the events to maps.
///   array_batch  the batch an array as in `array`, its events maps as in `map`: vLLM's types
///                with the events changed and the batch still array_like, as copies of them
///                decode (and TensorRT-LLM's vLLM-compatible events are written).
///                docs/kv-events.md says what was checked.
enum class event_form : std::uint8_t { map, array, array_batch };

[[nodiscard]] constexpr std::string_view to_string(event_form f) noexcept {
  switch (f) {
    case event_form::map:
      return "map";
    case event_form::array:
      return "array";
    case event_form::array_batch:
      return "array_batch";
  }
  return "?";
}

/// Parses "map", "array" or "array_batch".
[[nodiscard]] constexpr std::optional<event_form> parse_event_form(std::string_view s) noexcept {
  if (s == "map") return event_form::map;
  if (s == "array") return event_form::array;
  if (s == "array_batch") return event_form::array_batch;
  return std::nullopt;
}

namespace detail {

inline void write_value(msgpack_writer& w, std::int64_t v) { w.signed_int(v); }
inline void write_value(msgpack_writer& w, std::uint64_t v) { w.unsigned_int(v); }
inline void write_value(msgpack_writer& w, std::uint32_t v) { w.unsigned_int(v); }
inline void write_value(msgpack_writer& w, const std::string& v) { w.str(v); }
inline void write_value(msgpack_writer& w, const byte_string& v) { w.bin(v.bytes); }
// Declared first: each of them writes the others' values (an optional inside a vector...).
template <class... T>
void write_value(msgpack_writer& w, const std::variant<T...>& v);
template <class T>
void write_value(msgpack_writer& w, const std::optional<T>& v);
template <class T>
void write_value(msgpack_writer& w, const std::vector<T>& v);

template <class... T>
void write_value(msgpack_writer& w, const std::variant<T...>& v) {
  std::visit([&](const auto& x) { write_value(w, x); }, v);
}
template <class T>
void write_value(msgpack_writer& w, const std::optional<T>& v) {
  if (v) {
    write_value(w, *v);
  } else {
    w.nil();
  }
}
template <class T>
void write_value(msgpack_writer& w, const std::vector<T>& v) {
  w.array_header(v.size());
  for (const auto& x : v) write_value(w, x);
}

// One field of an event: its name, its value, and whether vLLM gives it a default (always
// None here), which omit_defaults leaves out when the value is that default.
template <class T>
struct field {
  std::string_view name;
  const T& value;
  bool has_default = false;

  [[nodiscard]] bool holds_default() const noexcept {
    if constexpr (requires { value.has_value(); }) {
      return has_default && !value.has_value();
    } else {
      return false;
    }
  }
};
template <class T>
field(std::string_view, const T&, bool) -> field<T>;

inline auto fields_of(const block_stored& e) {
  return std::tuple{field{"block_hashes", e.block_hashes, false},
                    field{"parent_block_hash", e.parent_block_hash, false},
                    field{"token_ids", e.token_ids, false},
                    field{"block_size", e.block_size, false},
                    field{"lora_id", e.lora_id, false},
                    field{"medium", e.medium, false},
                    field{"lora_name", e.lora_name, false},
                    field{"extra_keys", e.extra_keys, true},
                    field{"group_idx", e.group_idx, true},
                    field{"kv_cache_spec_kind", e.kv_cache_spec_kind, true},
                    field{"kv_cache_spec_sliding_window", e.kv_cache_spec_sliding_window, true}};
}
inline auto fields_of(const block_removed& e) {
  return std::tuple{field{"block_hashes", e.block_hashes, false}, field{"medium", e.medium, false},
                    field{"group_idx", e.group_idx, true}};
}
inline auto fields_of(const all_blocks_cleared&) { return std::tuple{}; }

// map: {"type": tag, every field not holding its default}.
template <class Event, class... F>
void write_event_map(msgpack_writer& w, const F&... f) {
  w.map_header(1 + (std::size_t{0} + ... + (f.holds_default() ? 0 : 1)));
  w.str("type");
  w.str(Event::vllm_type);
  [[maybe_unused]] auto one = [&](const auto& x) {  // unused for an event without fields
    if (x.holds_default()) return;
    w.str(x.name);
    write_value(w, x.value);
  };
  (one(f), ...);
}

// array: [tag, fields up to the last one not holding its default] (msgspec's array_like
// omit_defaults leaves out trailing defaults only; an inner one is written, as nil).
template <class Event, class... F>
void write_event_array(msgpack_writer& w, const F&... f) {
  std::size_t written = 0;
  std::size_t i = 0;
  ((++i, written = f.holds_default() ? written : i), ...);
  w.array_header(1 + written);
  w.str(Event::vllm_type);
  i = 0;
  [[maybe_unused]] auto one = [&](const auto& x) {  // unused for an event without fields
    if (++i <= written) write_value(w, x.value);
  };
  (one(f), ...);
}

}  // namespace detail

/// Appends one event: a map in the map and array_batch forms, an array in the array form.
inline void write_event(msgpack_writer& w, const kv_event& ev, event_form form) {
  std::visit(
      [&](const auto& e) {
        using event_t = std::remove_cvref_t<decltype(e)>;
        std::apply(
            [&](const auto&... f) {
              if (form != event_form::array) {
                detail::write_event_map<event_t>(w, f...);
              } else {
                detail::write_event_array<event_t>(w, f...);
              }
            },
            detail::fields_of(e));
      },
      ev);
}

/// Appends one EventBatch of these events (the publisher encodes from its queue this way,
/// without building an event_batch).
inline void write_batch(msgpack_writer& w, double ts, std::span<const kv_event> events,
                        std::optional<std::int64_t> data_parallel_rank, event_form form) {
  const std::size_t n = data_parallel_rank ? 3 : 2;
  const bool as_map = form == event_form::map;
  if (as_map) {
    w.map_header(n);
    w.str("ts");
  } else {
    w.array_header(n);
  }
  w.float64(ts);
  if (as_map) w.str("events");
  w.array_header(events.size());
  for (const auto& ev : events) write_event(w, ev, form);
  if (data_parallel_rank) {
    if (as_map) w.str("data_parallel_rank");
    w.signed_int(*data_parallel_rank);
  }
}

/// The msgpack payload of a batch: the third frame of a published message.
[[nodiscard]] inline std::string encode(const event_batch& batch, event_form form) {
  std::string out;
  msgpack_writer w(out);
  write_batch(w, batch.ts, batch.events, batch.data_parallel_rank, form);
  return out;
}

}  // namespace kv_events
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
