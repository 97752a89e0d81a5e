#pragma once
// Reading configuration out of JSON objects with messages that say what to change: the
// server's configuration file (server/config/server_config.hpp) and every L2 backend description
// (server/config/backend_factory.hpp) go through json_object_reader, so a wrong key, type or value
// is reported the same way everywhere:
//
//   <what> (<value>): <what to change>
//   e.g.  chunk_size ("abc"): must be an integer in 1..65536, e.g. 256
//
// config_error carries the three parts; main() prefixes "kvtier-server: " and exits 2. A
// refused value is quoted as a short excerpt (value_excerpt: at most ~80 bytes, with its
// size when cut), never whole: a megabyte string or a deep array stays out of the log.
//
// parse_config_text() is the one way configuration text becomes JSON (a --config file, an
// --l2-backend flag): nesting deeper than max_config_depth is refused while parsing, before
// anything deep is built (100,000 nested arrays would otherwise overflow the stack of the
// recursive copies and printers that come later); every other refusal of the JSON parser,
// including a number beyond a double's range (json::out_of_range), is a config_error too.
// flag_value() is the one way a command-line flag's text becomes JSON. Both are what
// kvtier-server (examples/server/main.cpp) and the config fuzz target call.

#include <kvtier/config.hpp>

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace server {

/// Nesting depth accepted in configuration JSON (the real configuration needs 4).
inline constexpr int max_config_depth = 32;
/// The longest refused value (or key) quoted in a message, in bytes.
inline constexpr std::size_t max_value_excerpt = 80;

/// `text` when short, else its first bytes, "...", and its size.
[[nodiscard]] inline std::string excerpt(std::string_view text, std::size_t limit = max_value_excerpt) {
  if (text.size() <= limit) return std::string(text);
  return std::string(text.substr(0, limit - 20)) + "... (" + std::to_string(text.size()) + " bytes)";
}

/// A JSON value as text for a message: excerpt(v.dump()).
[[nodiscard]] inline std::string value_excerpt(const nlohmann::json& v) {
  return excerpt(v.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
}

/// A configuration value was refused. what() is "<what> (<value>): <fix>"; `what` and
/// `value` are cut to excerpts.
class config_error : public std::invalid_argument {
 public:
  config_error(std::string what, std::string value, std::string fix)
      : std::invalid_argument(excerpt(what, 2 * max_value_excerpt) + " (" + excerpt(value) + "): " + fix),
        what_(excerpt(what, 2 * max_value_excerpt)),
        value_(excerpt(value)),
        fix_(std::move(fix)) {}

  /// The option or key, e.g. "chunk_size" or "l2_backends[1].capacity_mb".
  [[nodiscard]] const std::string& option() const noexcept { return what_; }
  /// The refused value as written (JSON text for JSON values).
  [[nodiscard]] const std::string& value() const noexcept { return value_; }
  /// What to change.
  [[nodiscard]] const std::string& fix() const noexcept { return fix_; }

 private:
  std::string what_;
  std::string value_;
  std::string fix_;
};

/// Reads the keys of one JSON object, each at most once, with typed getters that throw
/// config_error; finish() refuses the keys nobody asked for (a misspelt key is an error,
/// never silently ignored). `prefix` names the object in messages ("" for the top level,
/// "l2_backends[0]." for a backend).
class json_object_reader {
 public:
  json_object_reader(const nlohmann::json& j, std::string prefix, std::string_view what_it_is = "configuration")
      : j_(j), prefix_(std::move(prefix)) {
    if (!j_.is_object())
      throw config_error(prefix_.empty() ? std::string(what_it_is) : prefix_.substr(0, prefix_.size() - 1),
                         value_excerpt(j_), "must be a JSON object, e.g. {\"key\": value}");
  }

  [[nodiscard]] bool has(std::string_view key) const { return j_.contains(key); }

  /// The raw value of `key` (marks it used), or null when absent.
  [[nodiscard]] const nlohmann::json* raw(std::string_view key) {
    known_.emplace(key);
    auto it = j_.find(key);
    return it == j_.end() ? nullptr : &*it;
  }

  /// An unsigned integer in [lo, hi].
  std::optional<std::uint64_t> integer(std::string_view key, std::uint64_t lo, std::uint64_t hi,
                                       std::string_view hint = {}) {
    const nlohmann::json* v = raw(key);
    if (!v) return std::nullopt;
    const std::string fix = "must be an integer in " + std::to_string(lo) + ".." + std::to_string(hi) +
                            (hint.empty() ? std::string() : ", " + std::string(hint));
    if (v->is_number_integer()) {  // signed or unsigned
      if (!v->is_number_unsigned() && v->get<std::int64_t>() < 0) throw error(key, *v, fix);
      const auto x = v->get<std::uint64_t>();
      if (x < lo || x > hi) throw error(key, *v, fix);
      return x;
    }
    if (v->is_number_float()) {
      const double d = v->get<double>();
      if (std::floor(d) == d && d >= static_cast<double>(lo) && d <= static_cast<double>(hi) && d < 1.8e19)
        return static_cast<std::uint64_t>(d);
    }
    throw error(key, *v, fix);
  }

  /// A finite number in [lo, hi].
  std::optional<double> number(std::string_view key, double lo, double hi, std::string_view hint = {}) {
    const nlohmann::json* v = raw(key);
    if (!v) return std::nullopt;
    std::string fix = "must be a number";
    if (lo > -std::numeric_limits<double>::max()) fix += " >= " + format(lo);
    if (hi < std::numeric_limits<double>::max())
      fix += (lo > -std::numeric_limits<double>::max() ? " and <= " : " <= ") + format(hi);
    if (!hint.empty()) fix += ", " + std::string(hint);
    if (!v->is_number()) throw error(key, *v, fix);
    const double d = v->get<double>();
    if (!std::isfinite(d) || d < lo || d > hi) throw error(key, *v, fix);
    return d;
  }

  /// true or false; from a flag (text) also "true", "false", "on" or "off".
  std::optional<bool> boolean(std::string_view key) {
    const nlohmann::json* v = raw(key);
    if (!v) return std::nullopt;
    if (v->is_boolean()) return v->get<bool>();
    if (v->is_string()) {
      const auto& s = v->get_ref<const std::string&>();
      if (s == "true" || s == "on") return true;
      if (s == "false" || s == "off") return false;
    }
    throw error(key, *v, "must be true or false");
  }

  /// A string; when `choices` is not empty, one of them.
  std::optional<std::string> string(std::string_view key, const std::vector<std::string_view>& choices = {},
                                    std::string_view hint = {}) {
    const nlohmann::json* v = raw(key);
    if (!v) return std::nullopt;
    std::string fix = choices.empty() ? "must be a string" : "must be one of " + join(choices);
    if (!hint.empty()) fix += ", " + std::string(hint);
    if (!v->is_string()) throw error(key, *v, fix);
    auto s = v->get<std::string>();
    if (!choices.empty()) {
      bool ok = false;
      for (auto c : choices) ok = ok || c == s;
      if (!ok) throw error(key, *v, fix);
    }
    return s;
  }

  /// The keys no getter has asked for yet, as one object, and marks them all used: for a
  /// part that parses its own keys (a backend's options reader), which then refuses the
  /// unknown ones itself.
  [[nodiscard]] nlohmann::json rest() {
    nlohmann::json out = nlohmann::json::object();
    for (auto it = j_.begin(); it != j_.end(); ++it)
      if (known_.emplace(it.key()).second) out[it.key()] = it.value();
    return out;
  }

  /// Refuses every key no getter asked for, naming the known ones.
  void finish() const {
    for (auto it = j_.begin(); it != j_.end(); ++it) {
      if (known_.contains(it.key())) continue;
      std::vector<std::string_view> names(known_.begin(), known_.end());
      throw config_error("unknown key " + prefix_ + excerpt(it.key()), value_excerpt(it.value()),
                         "remove it or check its spelling; known keys: " + join(names));
    }
  }

  /// The refusal of `key`'s value.
  [[nodiscard]] config_error error(std::string_view key, const nlohmann::json& v, std::string fix) const {
    return config_error(prefix_ + std::string(key), value_excerpt(v), std::move(fix));
  }

  [[nodiscard]] const std::string& prefix() const noexcept { return prefix_; }

  [[nodiscard]] static std::string join(const std::vector<std::string_view>& v) {
    std::string s;
    for (std::size_t i = 0; i < v.size(); ++i) {
      if (i) s += ", ";
      s += v[i];
    }
    return s;
  }

  [[nodiscard]] static std::string format(double d) {
    std::string s = nlohmann::json(d).dump();
    if (s.size() > 2 && s.ends_with(".0")) s.resize(s.size() - 2);
    return s;
  }

 private:
  const nlohmann::json& j_;
  std::string prefix_;
  std::set<std::string, std::less<>> known_;
};

/// Parses configuration text (`what` names it in messages: "--config", "--l2-backend #2").
/// Throws config_error for text that is not JSON or nests deeper than max_config_depth.
[[nodiscard]] inline nlohmann::json parse_config_text(std::string_view text, const std::string& what,
                                                      const std::string& value_name) {
  struct too_deep {};
  const nlohmann::json::parser_callback_t limit_depth = [](int depth, nlohmann::json::parse_event_t event,
                                                           nlohmann::json&) {
    if ((event == nlohmann::json::parse_event_t::object_start || event == nlohmann::json::parse_event_t::array_start) &&
        depth >= max_config_depth)
      throw too_deep{};
    return true;
  };
  try {
    return nlohmann::json::parse(text, limit_depth);
  } catch (const too_deep&) {
    throw config_error(what, value_name,
                       "arrays and objects nested more than " + std::to_string(max_config_depth) +
                           " deep: the configuration needs 4 at most; check the brackets");
  } catch (const nlohmann::json::exception& e) {
    throw config_error(what, value_name, std::string("not valid JSON: ") + excerpt(e.what(), 200));
  }
}

/// The JSON value of a command-line flag's text: a number when the flag takes one and the
/// text looks like a JSON number (digits, sign, point, exponent: nothing that can nest), else
/// the text as a string (the configuration reader then refuses it with its own message).
/// Text that is not UTF-8 is refused here, as the config_error "<flag> (<text, invalid bytes
/// shown as U+FFFD>): must be UTF-8 text": JSON strings are UTF-8, and every message that
/// echoes the value (and --print-config) would otherwise throw json::type_error.
[[nodiscard]] inline nlohmann::json flag_value(std::string_view flag, std::string_view text, bool numeric) {
  if (numeric && !text.empty() && text.size() < 64 && text.find_first_not_of("0123456789+-.eE") == text.npos) {
    nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (j.is_number()) return j;
  }
  nlohmann::json s = std::string(text);
  try {
    (void)s.dump();
  } catch (const nlohmann::json::type_error&) {
    throw config_error(std::string(flag),
                       excerpt(s.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)),
                       "must be UTF-8 text");
  }
  return s;
}

}  // namespace server
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
