// telemetry/log_escaped.hpp: an exception that escapes a coroutine spawned and not awaited is
// written to the log (asio::detached, which the server used before, dropped it silently).
#include <kvtier/telemetry/log_escaped.hpp>

#include <boost/asio/awaitable.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/io_context.hpp>
#include <catch2/catch.hpp>

#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

using namespace kvtier;

namespace {
boost::asio::awaitable<void> escapes_runtime_error() {
  throw std::runtime_error("boom");
  co_return;
}
boost::asio::awaitable<void> escapes_an_int() {
  throw 7;
  co_return;
}
boost::asio::awaitable<void> returns_normally() { co_return; }
}  // namespace

TEST_CASE("an exception escaping a spawned coroutine is logged at error level, a normal end is not",
          "[telemetry][logging]") {
  std::vector<std::pair<telemetry::log_level, std::string>> lines;
  telemetry::logger log(telemetry::log_level::info, "test",
                        [&](telemetry::log_level l, std::string_view line) { lines.emplace_back(l, std::string(line)); });
  boost::asio::io_context io;
  boost::asio::co_spawn(io, escapes_runtime_error(), telemetry::log_escaped{&log, "the reaper"});
  boost::asio::co_spawn(io, returns_normally(), telemetry::log_escaped{&log, "the returner"});
  boost::asio::co_spawn(io, escapes_an_int(), telemetry::log_escaped{&log, "the accept loop"});
  io.run();
  REQUIRE(lines.size() == 2);
  CHECK(lines[0].first == telemetry::log_level::error);
  CHECK(lines[0].second.find("the reaper: ended by an exception it did not catch (a bug): boom") != std::string::npos);
  CHECK(lines[1].first == telemetry::log_level::error);
  CHECK(lines[1].second.find("the accept loop: ended by an exception it did not catch (a bug), not a std::exception") !=
        std::string::npos);
}
