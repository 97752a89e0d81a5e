// request_kind_of: every request and its response map onto their bus request kind; the
// error response and unknown values onto `other`.
#include <kvtier/server/session/request_kinds.hpp>

#include <catch2/catch.hpp>

#include <cstddef>
#include <cstdint>
#include <utility>
#include <variant>

// This file's names (its test binary is compiled in unity batches with the module's other files).
namespace file_request_kinds_test {

TEST_CASE("requests and their responses map onto the bus request kinds", "[server][request_kinds]") {
  namespace p = kvtier::protocol;
  using k = kvtier::bus::request_kind;
  using kvtier::server::request_kind_of;
  CHECK(request_kind_of(p::message_type::register_kv_request) == k::register_kv);
  CHECK(request_kind_of(p::message_type::unregister_kv_request) == k::unregister_kv);
  CHECK(request_kind_of(p::message_type::lookup_request) == k::lookup);
  CHECK(request_kind_of(p::message_type::query_prefetch_request) == k::query_prefetch);
  CHECK(request_kind_of(p::message_type::retrieve_request) == k::retrieve);
  CHECK(request_kind_of(p::message_type::store_request) == k::store);
  CHECK(request_kind_of(p::message_type::free_lookup_locks_request) == k::free_lookup_locks);
  CHECK(request_kind_of(p::message_type::end_request_request) == k::end_request);
  CHECK(request_kind_of(p::message_type::ping_request) == k::ping);
  CHECK(request_kind_of(p::message_type::clear_request) == k::clear);
  CHECK(request_kind_of(p::message_type::get_chunk_size_request) == k::get_chunk_size);
  CHECK(request_kind_of(p::message_type::status_request) == k::status);
  CHECK(request_kind_of(p::message_type::list_objects_request) == k::list_objects);
  CHECK(request_kind_of(p::message_type::evict_request) == k::evict);
  CHECK(request_kind_of(p::message_type::error_response) == k::other);
  CHECK(request_kind_of(static_cast<p::message_type>(0x0777)) == k::other);
  // Every response of the protocol (each alternative of `message`) maps like its request.
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    (
        [&] {
          const p::message_type t = std::variant_alternative_t<I, p::message>::type;
          if (p::is_response(t) && t != p::message_type::error_response) {
            const auto req = static_cast<p::message_type>(static_cast<std::uint16_t>(t) & ~p::response_bit);
            CHECK(request_kind_of(t) == request_kind_of(req));
            CHECK(request_kind_of(t) != k::other);
          }
        }(),
        ...);
  }(std::make_index_sequence<std::variant_size_v<p::message>>{});
}

}  // namespace file_request_kinds_test
