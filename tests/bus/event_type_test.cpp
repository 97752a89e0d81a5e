#include <kvtier/bus/event_type.hpp>
#include <kvtier/bus/events.hpp>

#include <catch2/catch.hpp>

#include <set>
#include <string>

using namespace kvtier::bus;

TEST_CASE("every event type has a unique dotted name that parses back", "[bus][event_type]") {
  std::set<std::string_view> names;
  for (std::size_t i = 0; i < event_type_count; ++i) {
    const auto t = static_cast<event_type>(i);
    const auto n = name(t);
    CHECK(n.find('.') != std::string_view::npos);
    CHECK(parse_event_type(n) == t);
    names.insert(n);
  }
  CHECK(names.size() == event_type_count);
  CHECK_FALSE(parse_event_type("l9.nothing").has_value());
}

TEST_CASE("names follow LMCache's where the event exists there", "[bus][event_type]") {
  CHECK(name(event_type::l1_write_finished) == "l1.write.finished");
  CHECK(name(event_type::l1_write_finished_and_read_reserved) == "l1.write_finished_and_read_reserved");
  CHECK(name(event_type::l2_store_submitted) == "l2.store.submitted");
  CHECK(name(event_type::l2_prefetch_lookup_completed) == "l2.prefetch.lookup.completed");
  CHECK(name(event_type::l2_prefetch_load_completed) == "l2.prefetch.load.completed");
}

TEST_CASE("short_name owns a bounded copy of its text", "[bus][events]") {
  std::string s = "disk";
  const short_name n{s};
  s = "changed";
  CHECK(n.view() == "disk");
  const short_name cut{std::string(40, 'x')};
  CHECK(cut.view().size() == short_name::capacity);
}
