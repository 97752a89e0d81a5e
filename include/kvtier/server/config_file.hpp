#pragma once
// The text of a kvtier-server --config file as JSON (examples/server/main.cpp reads the file
// and hands its text here; the config fuzz target, tests/fuzz/config_fuzz.cpp, calls the
// same function): anything that is not one JSON value is a config_error, never another
// exception.
//
//   nlohmann::json j = parse_config_text(text, path);   // throws config_error

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

}  // namespace kvtier::inline KVTIER_ABI_TAG::server
