#include <kvtier/error.hpp>

#include <catch2/catch.hpp>

#include <set>
#include <string>

TEST_CASE("every errc has its own message and the kvtier category", "[error]") {
  std::set<std::string> messages;
  for (int v = static_cast<int>(kvtier::errc::invalid_argument); v <= static_cast<int>(kvtier::errc::over_budget);
       ++v) {
    const kvtier::error_code ec = kvtier::make_error_code(static_cast<kvtier::errc>(v));
    CHECK(std::string(ec.category().name()) == "kvtier");
    CHECK(ec.message() != "unknown kvtier error");
    messages.insert(ec.message());
  }
  CHECK(messages.size() == static_cast<std::size_t>(kvtier::errc::over_budget));
}

TEST_CASE("an errc converts implicitly to error_code and compares equal to itself", "[error]") {
  kvtier::error_code ec = kvtier::errc::timeout;
  CHECK(ec == kvtier::errc::timeout);
  CHECK(ec != kvtier::errc::io_error);
  CHECK(static_cast<bool>(ec));
}

TEST_CASE("result carries either a value or an error", "[error]") {
  kvtier::result<int> ok = 42;
  REQUIRE(ok.has_value());
  CHECK(*ok == 42);
  kvtier::result<int> bad = kvtier::make_error_code(kvtier::errc::no_space);
  REQUIRE_FALSE(bad.has_value());
  CHECK(bad.error() == kvtier::errc::no_space);
}
