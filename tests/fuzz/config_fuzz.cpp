// Fuzz target: the server's JSON configuration (server/config/server_config.hpp, server_config_json.hpp) and the
// L2 backend descriptions (server/config/backend_factory.hpp with the memory, disk and redis types:
// server/config/disk_backend_json.hpp, server/config/redis_options_json.hpp), read the way kvtier-server
// reads them (examples/server/main.cpp).
//
// Input: one byte of choice (mode % 4), then text.
//   0, 2: the text is a --config file: parse_config_text (server/config/server_config_json.hpp, what
//         main() calls), then server_config::parse;
//   1:    the text is one --l2-backend flag: json::parse without exceptions (a discarded
//         value is main()'s exit 2), then the backend factory parses it;
//   3:    [1] picks a key of the configuration, the rest is its value given as a flag
//         (flag_value, server/config/server_config_json.hpp, what main() calls), then server_config::parse.
// The seeds' first byte is an ASCII digit: '0' file, '1' backend, '3' flag (cli-flag-*).
//
// Oracle: whatever the text, the only exception is config_error, whose message names what
// to change (main() prints it and exits 2; any other exception would abort the server); a
// configuration that is accepted survives to_json() and parse() unchanged (the documented
// round trip), and prints (--print-config dumps it).

#include <kvtier/server/config/backend_factory.hpp>
#include <kvtier/server/config/disk_backend_type.hpp>
#include <kvtier/server/config/server_config.hpp>
#include <kvtier/server/config/server_config_json.hpp>
#if KVTIER_FUZZ_WITH_REDIS
#include <kvtier/server/config/redis_backend_type.hpp>
#endif

#include "fuzz_support.hpp"

#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace {

namespace srv = kvtier::server;
using kvtier::fuzz::fuzz_input;
using nlohmann::json;

// Every backend type kvtier-server registers.
const srv::backend_factory& program_backends() {
  static const srv::backend_factory factory = [] {
    auto f = srv::backend_factory::builtin_copy();
    srv::add_disk_backend_type(f);
#if KVTIER_FUZZ_WITH_REDIS
    srv::add_redis_backend_type(f);
#endif
    return f;
  }();
  return factory;
}

void check_refusal(const srv::config_error& e) {
  FUZZ_CHECK(!e.option().empty() && !e.fix().empty(), std::string("a refusal that does not say what: ") + e.what());
}

void config_file(std::string_view text) {
  srv::server_config c;
  try {
    const json j = srv::parse_config_text(text, "--config", "fuzz.json");
    if (!j.is_object()) return;  // main(): "the file must hold one JSON object", exit 2
    c = srv::server_config::parse(j, program_backends());
  } catch (const srv::config_error& e) {
    check_refusal(e);
    return;
  }
  const json out = c.to_json();
  (void)out.dump(2);  // --print-config
  srv::server_config again;
  try {
    again = srv::server_config::parse(out, program_backends());
  } catch (const srv::config_error& e) {
    FUZZ_CHECK(false, std::string("an accepted configuration is refused after to_json(): ") + e.what());
  }
  FUZZ_CHECK(again == c, "parse(to_json()) differs from the configuration: " + out.dump());
}

void backend_flag(std::string_view text) {
  json b = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (b.is_discarded()) return;  // main(): "--l2-backend ('...'): not valid JSON", exit 2
  std::vector<json> list{std::move(b)};
  try {
    const auto specs = program_backends().parse_all(list);
    FUZZ_CHECK(specs.size() == 1 && !specs[0].name.empty() && !specs[0].type.empty() && specs[0].create,
               "an accepted backend description without a name, type or create()");
  } catch (const srv::config_error& e) {
    check_refusal(e);
  }
}

// A key of the configuration given as a command-line flag (every flag of kvtier-server is
// one of these keys, dashes for underscores); numeric when its default is a number.
void flag(std::uint8_t which, std::string_view text) {
  static const std::vector<std::pair<std::string, bool>> keys = [] {
    std::vector<std::pair<std::string, bool>> k;
    const json defaults = srv::server_config{}.to_json();
    for (const auto& [key, value] : defaults.items())
      if (key != "l2_backends") k.emplace_back(key, value.is_number());
    k.emplace_back("l1_size_gb", true);
    k.emplace_back("l1_size_mb", true);
    return k;
  }();
  const auto& [key, numeric] = keys[which % keys.size()];
  std::string name = "--" + key;
  for (auto& c : name)
    if (c == '_') c = '-';
  srv::server_config c;
  try {
    json j = json::object();
    j[key] = srv::flag_value(name, text, numeric);
    c = srv::server_config::parse(j, program_backends());
  } catch (const srv::config_error& e) {
    check_refusal(e);
    return;
  }
  (void)c.to_json().dump(2);  // --print-config
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz_input in(data, size);
  const auto mode = in.take<std::uint8_t>();
  const auto which = mode % 4 == 3 ? in.take<std::uint8_t>() : std::uint8_t{0};
  const auto rest = in.rest();
  const std::string_view text(reinterpret_cast<const char*>(rest.data()), rest.size());
  switch (mode % 4) {
    case 1: backend_flag(text); break;
    case 3: flag(which, text); break;
    default: config_file(text);
  }
  return 0;
}
