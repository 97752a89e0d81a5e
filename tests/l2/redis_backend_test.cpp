#include <kvtier/l2/redis_backend.hpp>
#include <catch2/catch.hpp>
TEST_CASE("placeholder", "[redis]") { CHECK(true); }
