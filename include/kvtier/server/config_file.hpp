#pragma once
// What kvtier-server reads before server_config::parse, as JSON: the text of a --config file
// and the value of each command-line flag (examples/server/main.cpp hands them here; the
// config fuzz target, tests/fuzz/config_fuzz.cpp, calls the same functions). What cannot be
// JSON is a config_error, never another exception.
//
//   nlohmann::json j = parse_config_text(text, path);             // throws config_error
//   j["chunk_size"] = flag_value("--chunk-size", "256", true);     // throws config_error

#include <kvtier/config.hpp>
#include <kvtier/server/json_config.hpp>

#include <nlohmann/json.hpp>

#include <string>
#include <string_view>

namespace kvtier::inline KVTIER_ABI_TAG::server {

/// Parses the text of the configuration file `path` (named in the error). Every refusal of
/// the JSON parser is a config_error "--config (<path>): not valid JSON: <why>": a syntax
/// error (json::parse_error), and also a number beyond a double's range such as 1e400,
/// which nlohmann::json reports as json::out_of_range.
[[nodiscard]] inline nlohmann::json parse_config_text(std::string_view text, const std::string& path) {
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw config_error("--config", path, std::string("not valid JSON: ") + e.what());
  }
}

/// The JSON value of a command-line flag's text: a number when the flag takes one and the
/// text is a JSON number, else the text as a string (the configuration reader then refuses
/// it with its own message). Text that is not UTF-8 is refused here, as the config_error
/// "<flag> (<text, invalid bytes shown as U+FFFD>): must be UTF-8 text": JSON strings are
/// UTF-8, and every message that echoes the value (and --print-config) would otherwise throw
/// json::type_error.
[[nodiscard]] inline nlohmann::json flag_value(std::string_view flag, std::string_view text, bool numeric) {
  if (numeric) {
    nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (j.is_number()) return j;
  }
  nlohmann::json s = std::string(text);
  try {
    (void)s.dump();
  } catch (const nlohmann::json::type_error&) {
    throw config_error(std::string(flag), s.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace),
                       "must be UTF-8 text");
  }
  return s;
}

}  // namespace kvtier::inline KVTIER_ABI_TAG::server
