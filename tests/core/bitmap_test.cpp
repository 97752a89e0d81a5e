#include <kvtier/core/bitmap.hpp>

#include <catch2/catch.hpp>

using kvtier::bitmap;

TEST_CASE("bitmap counts its contiguous prefix of set bits", "[core][bitmap]") {
  bitmap b(10);
  CHECK(b.count_leading_ones() == 0);
  b.set(0).set(1).set(3).set(4);
  CHECK(b.count_leading_ones() == 2);
  CHECK(b.count() == 4);
  CHECK(b.find_first_unset() == 2);
  CHECK(b.to_string() == "1101100000");
}

TEST_CASE("bitmap prefix queries cross word boundaries", "[core][bitmap]") {
  bitmap b(200, true);
  CHECK(b.all());
  CHECK(b.count_leading_ones() == 200);
  CHECK(b.find_first_unset() == bitmap::npos);
  b.reset(130);
  CHECK(b.count_leading_ones() == 130);
  CHECK(b.count() == 199);
  b.clear_from(64);
  CHECK(b.count() == 64);
  CHECK(b.count_leading_ones() == 64);
}

TEST_CASE("bitmap set operations require equal sizes", "[core][bitmap]") {
  bitmap a(5), c(5);
  a.set(0).set(2);
  c.set(2).set(4);
  CHECK((a & c).to_string() == "00100");
  CHECK((a | c).to_string() == "10101");
  CHECK(bitmap(a).subtract(c).to_string() == "10000");
  CHECK_THROWS_AS(a &= bitmap(6), std::invalid_argument);
  CHECK_THROWS_AS(a.test(5), std::out_of_range);
}

TEST_CASE("bitmap resize keeps bits and fills the new ones", "[core][bitmap]") {
  bitmap b(3);
  b.set(1);
  b.resize(70, true);
  CHECK(b.size() == 70);
  CHECK(b.count() == 68);
  CHECK_FALSE(b.test(0));
  b.resize(2);
  CHECK(b.to_string() == "01");
  CHECK(b.words()[0] == 2);  // bits past size() are zero
  CHECK(bitmap().empty());
  CHECK(bitmap(0).count_leading_ones() == 0);
}
