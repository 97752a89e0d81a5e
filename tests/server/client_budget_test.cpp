// client_budget: connection caps per server and per uid, lookup key budgets per connection
// and per server with the fair share that keeps one abuser from locking others out.
#include <kvtier/server/session/client_budget.hpp>

#include <catch2/catch.hpp>

using namespace kvtier;
using namespace kvtier::server;

namespace {

/// A lookup of `keys` keys (chunks x world size 1) owned by `owner` under `key`.
void hold(lookup_table& t, std::uint64_t owner, const std::string& key, std::uint32_t keys) {
  (void)t.put(owner, key, lookup_table::entry{owner * 1000 + t.size(), owner, keys, 1});
}

}  // namespace

TEST_CASE("connection caps hold per server and per uid, and free up when connections close", "[server][budget]") {
  client_budget b({4, 2, 100, 10});
  CHECK_FALSE(b.admit(1, 1000));
  CHECK_FALSE(b.admit(2, 1000));
  CHECK(b.admit(3, 1000) == client_budget::refusal::max_connections_per_uid);
  CHECK_FALSE(b.admit(4, 2000));
  CHECK_FALSE(b.admit(5, 2000));
  CHECK(b.admit(6, 3000) == client_budget::refusal::max_connections);
  b.closed(1);
  CHECK_FALSE(b.admit(7, 1000));
  b.closed(99);  // unknown: nothing happens
  CHECK_THAT(b.refusal_message(client_budget::refusal::max_connections_per_uid, 1000),
             Catch::Contains("uid 1000") && Catch::Contains("max_connections_per_uid"));
}

TEST_CASE("lookup keys are bounded per connection and per server, with a fair share", "[server][budget]") {
  client_budget b({16, 16, 100, 60});
  lookup_table t;
  // One connection up to its own budget.
  hold(t, 1, "a", 50);
  CHECK_FALSE(b.check_lookup(t, 1, 10, 0, 3));
  auto over = b.check_lookup(t, 1, 11, 0, 3);
  REQUIRE(over);
  CHECK(over->code == errc::over_budget);
  CHECK_THAT(over->message, Catch::Contains("max_lookup_keys_per_client (60)"));
  // A lookup replacing its own counts only the difference.
  CHECK_FALSE(b.check_lookup(t, 1, 60, 50, 3));
  // The server-wide budget: a second abuser fills it...
  hold(t, 2, "b", 50);
  CHECK(t.keys() == 100);
  auto full = b.check_lookup(t, 2, 5, 0, 3);
  REQUIRE(full);
  CHECK_THAT(full->message, Catch::Contains("max_lookup_keys 100"));
  // ...but a connection holding less than its share (100 / 3) still gets in.
  CHECK_FALSE(b.check_lookup(t, 3, 20, 0, 3));
  CHECK(b.check_lookup(t, 3, 40, 0, 3));
  CHECK(b.lookups_refused() == 3);
  // Released keys are given back.
  (void)t.take(1, "a");
  CHECK(t.keys() == 50);
  CHECK(t.owned_keys(1) == 0);
  CHECK_FALSE(b.check_lookup(t, 2, 10, 0, 3));
  CHECK(t.take_owned_by(2).size() == 1);
  CHECK(t.keys() == 0);
}
