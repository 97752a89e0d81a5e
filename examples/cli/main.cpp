// kvtier: an operator's command line for a running kvtier-server (docs/server.md,
// "Administration"), over the server's Unix socket:
//
//   kvtier [--socket PATH] [--timeout S] [--json] status    the server's state (its /status) as tables
//   kvtier ... ls [--model M] [--salt S]                     objects per model and salt, per tier
//   kvtier ... clear (--all | --model M | --salt S | --model-id HEX...) [--force] [--yes]
//                                                            remove them from L1 and every L2 backend
//   kvtier ... evict (same selection) [--tier NAME]... [--force] [--yes]
//                                                            remove them from the tiers named (default
//                                                            L1: the L2 copies stay and load back)
//   kvtier ... ping [--count N]                              round trip and boot token
//
// ls, clear and evict use the administration requests (list_objects_request, evict_request),
// which the server answers to its owner and root only; status and ping to anyone it serves.
// clear and evict show what they would remove and ask for "yes" (or take --yes; without a
// terminal they need it). Exit status: 0 done; 1 refused by the server, not confirmed, a
// backend that could not list, or objects that failed to go; 2 a bad command line; 3 no
// server on the socket, or no answer in time.
#include "client.hpp"
#include "format.hpp"

#include <kvtier/protocol/messages.hpp>
#include <kvtier/protocol/unix_socket.hpp>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

namespace {

using namespace kvtier_cli;
using nlohmann::json;

struct options {
  std::string socket = p::default_socket_path();
  std::optional<double> timeout_s;
  bool json_out = false;

  [[nodiscard]] std::chrono::milliseconds timeout(double default_s) const {
    return std::chrono::milliseconds(static_cast<std::int64_t>(timeout_s.value_or(default_s) * 1000));
  }
};

/// What clear and evict remove.
struct selection {
  bool all = false;
  CLI::Option* model = nullptr;
  CLI::Option* salt = nullptr;
  CLI::Option* model_id = nullptr;
  std::string model_name, cache_salt, model_id_text;
  std::vector<std::string> tiers;
  bool force = false;
  bool yes = false;
};

/// Whether the option was given on the command line.
bool given(const CLI::Option* o) { return o != nullptr && o->count() > 0; }

std::string text_or(const json& v, const std::string& fallback) { return v.is_string() ? v.get<std::string>() : fallback; }

std::string hex16(std::uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

std::string salt_text(const json& n) {
  if (!n["known"].get<bool>()) return "?";
  const std::string s = n["cache_salt"].get<std::string>();
  return s.empty() ? "(none)" : s;
}

// --- status ---------------------------------------------------------------------------

int run_status(const options& o) {
  admin_client c(o.socket);
  const json s = json::parse(c.call(p::status_request{}, o.timeout(30)).json);
  if (o.json_out) {
    std::cout << s.dump(2) << "\n";
    return exit_ok;
  }
  std::printf("kvtier-server %s (protocol %d), pid %lld, up %s, boot token %s\n",
              text_or(s["version"], "?").c_str(), s.value("protocol_version", 0),
              static_cast<long long>(s.value("pid", 0LL)), human_seconds(s.value("uptime_s", 0.0)).c_str(),
              hex16(s.value("boot_token", std::uint64_t{0})).c_str());
  std::printf("socket %s, metrics %s\n", text_or(s["socket"], "?").c_str(),
              s.value("metrics_url", std::string()).empty() ? "off" : s["metrics_url"].get<std::string>().c_str());
  std::printf("chunks of %u tokens; eviction %s, store %s, prefetch %s\n\n", s.value("chunk_tokens", 0u),
              text_or(s["eviction_policy"], "?").c_str(), text_or(s["store_policy"], "?").c_str(),
              text_or(s["prefetch_policy"], "?").c_str());

  table tiers({"TIER", "TYPE", "OBJECTS", "USED", "CAPACITY", "USE", "HEALTH"},
              {false, false, true, true, true, true, false});
  auto use = [](std::uint64_t used, std::uint64_t cap) {
    return cap == 0 ? std::string("-") : std::to_string(used * 100 / cap) + "%";
  };
  const json& l1 = s["l1"];
  const auto l1_used = l1.value("bytes_used", std::uint64_t{0});
  const auto l1_cap = l1.value("bytes_capacity", std::uint64_t{0});
  tiers.add({"l1", "memory, " + std::to_string(l1.value("slot_count", 0ULL)) + " slots of " +
                       human_bytes(l1.value("slot_bytes", std::uint64_t{0})),
             std::to_string(l1.value("objects", 0ULL)), human_bytes(l1_used), human_bytes(l1_cap),
             use(l1_used, l1_cap), "ok"});
  for (const auto& b : s["backends"]) {
    const auto used = b.value("bytes_used", std::uint64_t{0});
    const auto cap = b.value("bytes_capacity", std::uint64_t{0});
    const bool healthy = b.value("healthy", true);
    tiers.add({text_or(b["name"], "?"), text_or(b["type"], "?"), std::to_string(b.value("objects", 0ULL)),
               human_bytes(used), cap == 0 ? std::string("-") : human_bytes(cap), use(used, cap),
               healthy ? std::string("ok") : "down: " + b.value("reason", std::string())});
  }
  std::cout << tiers.str() << "\n";

  std::printf("connections %llu, engines %llu, lookups %llu; prefetch: %llu active, %s in flight; store: %llu tasks, "
              "%s in flight, %llu keys pending\n",
              s.value("connections", 0ULL), s.value("engines", 0ULL), s.value("lookups", 0ULL),
              s["prefetch"].value("active", 0ULL), human_bytes(s["prefetch"].value("inflight_bytes", 0ULL)).c_str(),
              s["store"].value("inflight_tasks", 0ULL), human_bytes(s["store"].value("inflight_bytes", 0ULL)).c_str(),
              s["store"].value("pending_keys", 0ULL));
  table clients({"CLIENT", "PID", "RANK", "MODEL", "REGION", "IDLE", "REQUESTS", "LOOKUPS", "ENGINE"},
                {true, true, false, false, false, true, true, true, false});
  for (const auto& cl : s["clients"]) {
    const bool reg = cl.value("registered", false);
    clients.add({std::to_string(cl.value("client_id", 0ULL)),
                 reg ? std::to_string(cl.value("instance_id", 0ULL)) : std::string("-"),
                 reg ? std::to_string(cl.value("rank", 0)) + "/" + std::to_string(cl.value("world_size", 1))
                     : std::string("-"),
                 reg ? text_or(cl["model"], "?") : std::string("(not registered)"),
                 reg ? text_or(cl["region_kind"], "?") + (cl.value("region_bytes", 0ULL) != 0
                                                              ? " " + human_bytes(cl.value("region_bytes", 0ULL))
                                                              : std::string())
                     : std::string("-"),
                 human_seconds(cl.value("idle_s", 0.0)), std::to_string(cl.value("requests", 0ULL)),
                 std::to_string(cl.value("lookups", 0ULL)), cl.value("engine_id", std::string())});
  }
  if (!clients.empty()) std::cout << "\n" << clients.str();
  if (s.contains("clients_truncated"))
    std::printf("(%llu clients not listed)\n", s.value("clients_truncated", 0ULL));
  return exit_ok;
}

// --- ls -------------------------------------------------------------------------------

/// The server's listing, and the namespaces of it a selection names (all when none).
json list_objects(admin_client& c, const options& o) {
  return json::parse(c.call(p::list_objects_request{}, o.timeout(60)).json);
}

bool names(const json& n, const selection& sel) {
  if (sel.all) return true;
  if (given(sel.model_id) && n["model_id"] != sel.model_id_text) return false;
  if (given(sel.model) || given(sel.salt)) {
    if (!n["known"].get<bool>()) return false;
    if (given(sel.model) && n["model"] != sel.model_name) return false;
    if (given(sel.salt) && n["cache_salt"] != sel.cache_salt) return false;
  }
  return true;
}

std::string cell(const json& n, const std::string& tier) {
  if (!n["tiers"].contains(tier)) return "-";
  const json& t = n["tiers"][tier];
  return std::to_string(t["objects"].get<std::uint64_t>()) + " (" + human_bytes(t["bytes"].get<std::uint64_t>()) + ")";
}

/// The namespaces sorted for people: by model name (unknown last), then salt.
std::vector<json> sorted(const json& namespaces, const selection& sel) {
  std::vector<json> v;
  for (const auto& n : namespaces)
    if (names(n, sel)) v.push_back(n);
  std::stable_sort(v.begin(), v.end(), [](const json& a, const json& b) {
    const bool ka = a["known"].get<bool>(), kb = b["known"].get<bool>();
    if (ka != kb) return ka;
    if (!ka) return a["model_id"].get<std::string>() < b["model_id"].get<std::string>();
    if (a["model"] != b["model"]) return a["model"].get<std::string>() < b["model"].get<std::string>();
    return a["cache_salt"].get<std::string>() < b["cache_salt"].get<std::string>();
  });
  return v;
}

/// The namespaces as a table with one column per tier ("objects (bytes)") and a total row.
std::string namespace_table(const std::vector<json>& spaces, const std::vector<std::string>& tiers) {
  bool deployment = false;
  for (const auto& n : spaces) deployment = deployment || !text_or(n["deployment_salt"], "").empty();
  std::vector<std::string> header = {"MODEL", "SALT"};
  if (deployment) header.push_back("DEPLOYMENT SALT");
  header.insert(header.end(), {"DTYPE", "MODEL ID"});
  std::vector<bool> numeric(header.size(), false);
  for (const auto& t : tiers) {
    header.push_back(t == "l1" ? "L1" : t);
    numeric.push_back(true);
  }
  table out(header, numeric);
  std::vector<std::uint64_t> objects(tiers.size()), bytes(tiers.size());
  for (const auto& n : spaces) {
    const bool known = n["known"].get<bool>();
    std::vector<std::string> row = {known ? n["model"].get<std::string>() : "(unknown)", salt_text(n)};
    if (deployment) row.push_back(known ? n["deployment_salt"].get<std::string>() : "?");
    row.push_back(known ? n["dtype"].get<std::string>() + " " + n["layout"].get<std::string>() : "?");
    row.push_back(n["model_id"].get<std::string>());
    for (std::size_t i = 0; i < tiers.size(); ++i) {
      row.push_back(cell(n, tiers[i]));
      if (n["tiers"].contains(tiers[i])) {
        objects[i] += n["tiers"][tiers[i]]["objects"].get<std::uint64_t>();
        bytes[i] += n["tiers"][tiers[i]]["bytes"].get<std::uint64_t>();
      }
    }
    out.add(std::move(row));
  }
  std::vector<std::string> total = {"TOTAL"};
  total.resize(header.size() - tiers.size());
  for (std::size_t i = 0; i < tiers.size(); ++i)
    total.push_back(std::to_string(objects[i]) + " (" + human_bytes(bytes[i]) + ")");
  out.add(std::move(total));
  return out.str();
}

/// Backends that could not list, to stderr; true when there was one.
bool report_list_errors(const json& l) {
  for (const auto& [tier, why] : l["errors"].items())
    std::fprintf(stderr, "kvtier: %s: %s\n", tier.c_str(), why.get<std::string>().c_str());
  if (l.contains("namespaces_truncated"))
    std::fprintf(stderr, "kvtier: %llu smaller namespaces left out (the listing is limited to 4 MiB)\n",
                 l["namespaces_truncated"].get<unsigned long long>());
  return !l["errors"].empty();
}

/// `ls --keys TIER`: the chunk keys one tier holds, one per line (list_keys_request): what a
/// router's index of the KV events can be checked against or rebuilt from.
int run_ls_keys(const options& o, const std::string& tier) {
  admin_client c(o.socket);
  const json l = json::parse(c.call(p::list_keys_request{tier, 0}, o.timeout(60)).json);
  if (o.json_out) {
    std::cout << l.dump(2) << "\n";
  } else {
    for (const auto& k : l["keys"]) std::cout << k.get<std::string>() << "\n";
  }
  if (l["truncated"].get<bool>())
    std::fprintf(stderr, "kvtier: %zu of %llu keys listed (the listing is limited to 4 MiB)\n", l["keys"].size(),
                 l["total"].get<unsigned long long>());
  return exit_ok;
}

int run_ls(const options& o, const selection& sel) {
  admin_client c(o.socket);
  const json l = list_objects(c, o);
  if (o.json_out) {
    std::cout << l.dump(2) << "\n";
    return report_list_errors(l) ? exit_refused : exit_ok;
  }
  const auto tiers = l["tiers"].get<std::vector<std::string>>();
  const auto spaces = sorted(l["namespaces"], sel);
  if (spaces.empty())
    std::printf("no objects%s\n", given(sel.model) || given(sel.salt) ? " of that model and salt" : "");
  else
    std::cout << namespace_table(spaces, tiers);
  bool unknown = false;
  for (const auto& n : spaces) unknown = unknown || !n["known"].get<bool>();
  if (unknown)
    std::printf("(unknown: a model id no engine has used since the server started; select it with --model-id)\n");
  return report_list_errors(l) ? exit_refused : exit_ok;
}

// --- clear and evict ------------------------------------------------------------------

/// The evict_request of a selection; throws cli_error (exit_usage) for a bad one.
p::evict_request make_request(selection& sel, const std::string& tiers) {
  const bool named = given(sel.model) || given(sel.salt) || given(sel.model_id);
  if (sel.all && named) throw cli_error(exit_usage, "--all and --model/--salt/--model-id exclude each other");
  if (!sel.all && !named)
    throw cli_error(exit_usage, "name what to remove: --all, or --model, --salt and/or --model-id (see kvtier ls)");
  p::evict_request r;
  r.all = sel.all;
  r.by_model = given(sel.model);
  r.model_name = sel.model_name;
  r.by_salt = given(sel.salt);
  r.cache_salt = sel.cache_salt;
  if (given(sel.model_id)) {
    std::string t = sel.model_id_text;
    if (t.starts_with("0x")) t = t.substr(2);
    bool hex = !t.empty() && t.size() <= 16;
    for (char ch : t) hex = hex && ((ch >= '0' && ch <= '9') || (ch >= 'a' && ch <= 'f') || (ch >= 'A' && ch <= 'F'));
    if (!hex) throw cli_error(exit_usage, "--model-id " + sel.model_id_text + ": give the 16 hex digits kvtier ls shows");
    r.by_model_id = true;
    r.model_id = std::stoull(t, nullptr, 16);
    sel.model_id_text = hex16(r.model_id);
  }
  r.tiers = tiers;
  r.force = sel.force;
  return r;
}

int run_evict(const options& o, selection& sel, bool every_tier) {
  std::string tiers;
  if (!every_tier) {
    if (sel.tiers.empty()) sel.tiers = {"l1"};
    for (const auto& t : sel.tiers) tiers += (tiers.empty() ? "" : ",") + t;
  }
  const p::evict_request req = make_request(sel, tiers);
  admin_client c(o.socket);
  const char* verb = every_tier ? "clear" : "evict";
  if (!sel.yes) {
    if (::isatty(STDIN_FILENO) == 0)
      throw cli_error(exit_refused, std::string(verb) +
                                        " asks for a confirmation and stdin is not a terminal: add --yes to remove "
                                        "without asking (nothing was removed)");
    // What it would remove, from the listing (the server decides: objects in use stay).
    const json l = list_objects(c, o);
    std::vector<std::string> chosen = every_tier ? l["tiers"].get<std::vector<std::string>>() : sel.tiers;
    const auto spaces = sorted(l["namespaces"], sel);
    std::uint64_t objects = 0, bytes = 0;
    for (const auto& n : spaces)
      for (const auto& t : chosen)
        if (n["tiers"].contains(t)) {
          objects += n["tiers"][t]["objects"].get<std::uint64_t>();
          bytes += n["tiers"][t]["bytes"].get<std::uint64_t>();
        }
    (void)report_list_errors(l);
    if (objects == 0) {
      std::printf("nothing to remove: no objects of that selection in %s (see kvtier ls)\n",
                  every_tier ? "any tier" : tiers.c_str());
      return exit_ok;
    }
    std::cout << namespace_table(spaces, chosen);
    std::printf("Remove %llu objects (%s) from %s? Type yes to remove them: ", static_cast<unsigned long long>(objects),
                human_bytes(bytes).c_str(), every_tier ? "every tier" : tiers.c_str());
    std::fflush(stdout);
    std::string answer;
    if (!std::getline(std::cin, answer) || answer != "yes") {
      std::printf("not confirmed: nothing was removed\n");
      return exit_refused;
    }
  }
  const p::evict_response r = c.call(req, o.timeout(600));
  const json detail = json::parse(r.json, nullptr, false);
  if (o.json_out) {
    json out = {{"removed_objects", r.removed_objects},
                {"removed_bytes", r.removed_bytes},
                {"in_use_objects", r.in_use_objects},
                {"failed_objects", r.failed_objects},
                {"tiers", detail.is_object() ? detail["tiers"] : json::array()}};
    std::cout << out.dump(2) << "\n";
  } else {
    std::string per_tier;
    if (detail.is_object())
      for (const auto& t : detail["tiers"])
        per_tier += (per_tier.empty() ? ": " : ", ") + t["tier"].get<std::string>() + " " +
                    std::to_string(t["removed_objects"].get<std::uint64_t>()) + " (" +
                    human_bytes(t["removed_bytes"].get<std::uint64_t>()) + ")";
    std::printf("removed %llu objects (%s)%s\n", static_cast<unsigned long long>(r.removed_objects),
                human_bytes(r.removed_bytes).c_str(), per_tier.c_str());
    if (r.in_use_objects > 0)
      std::printf("kept %llu objects in use (held by a lookup or a copy, pinned by a prefetch, or being stored)%s\n",
                  static_cast<unsigned long long>(r.in_use_objects),
                  sel.force ? "" : "; --force removes the L1 ones now (their readers finish first)");
  }
  bool failed = r.failed_objects > 0;
  if (detail.is_object())
    for (const auto& t : detail["tiers"])
      if (!t["error"].get<std::string>().empty()) {
        std::fprintf(stderr, "kvtier: %s: %s\n", t["tier"].get<std::string>().c_str(),
                     t["error"].get<std::string>().c_str());
        failed = true;
      }
  return failed ? exit_refused : exit_ok;
}

// --- ping -----------------------------------------------------------------------------

int run_ping(const options& o, unsigned count) {
  admin_client c(o.socket);
  const auto who = c.server_identity();
  std::vector<double> ms;
  std::uint64_t boot = 0;
  for (unsigned i = 0; i < count; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    const auto r = c.call(p::ping_request{0}, o.timeout(5));
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    if (i > 0 && r.boot_token != boot) std::printf("the boot token changed: the server restarted\n");
    boot = r.boot_token;
    if (o.json_out) continue;
    std::printf("pong from %s: boot token %s, round trip %.3f ms%s\n", c.path().c_str(), hex16(boot).c_str(), ms.back(),
                who ? (" (server pid " + std::to_string(who->pid) + ", uid " + std::to_string(who->uid) + ")").c_str()
                    : "");
  }
  std::vector<double> s = ms;
  std::sort(s.begin(), s.end());
  if (o.json_out) {
    json out = {{"boot_token", boot},
                {"boot_token_hex", hex16(boot)},
                {"round_trip_ms", ms},
                {"server_pid", who ? json(who->pid) : json(nullptr)},
                {"server_uid", who ? json(who->uid) : json(nullptr)}};
    std::cout << out.dump(2) << "\n";
  } else if (count > 1) {
    std::printf("%u pings: min %.3f ms, median %.3f ms, max %.3f ms\n", count, s.front(), s[s.size() / 2], s.back());
  }
  return exit_ok;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"kvtier: look at and administer a running kvtier-server over its Unix socket (docs/server.md, "
               "\"Administration\"). ls, clear and evict are for the server's owner and root."};
  app.require_subcommand(1);
  options o;
  app.add_option("--socket", o.socket, "the server's socket (kvtier-server --socket)")->capture_default_str();
  app.add_option("--timeout", o.timeout_s,
                 "seconds to wait for each answer (default: 5 for ping, 30 for status, 60 for ls, 600 for clear and "
                 "evict)")
      ->check(CLI::PositiveNumber);
  app.add_flag("--json", o.json_out, "print JSON (the server's document) instead of tables");

  app.add_subcommand("status", "the server's state (what its /status shows) as tables");
  selection ls_sel;
  auto* ls = app.add_subcommand("ls", "objects per model and salt, with their count and bytes in L1 and each L2 backend");
  ls_sel.model = ls->add_option("--model", ls_sel.model_name, "only this model name");
  ls_sel.salt = ls->add_option("--salt", ls_sel.cache_salt, "only this request salt ('' for unsalted requests)");
  std::string ls_keys_tier;
  ls->add_option("--keys", ls_keys_tier,
                 "instead: the chunk keys of this tier (l1 or a backend's name), one per line as "
                 "model_id/world_size/rank/hash (what a KV event router's index is checked against)")
      ->excludes(ls_sel.model)
      ->excludes(ls_sel.salt);

  selection clear_sel, evict_sel;
  auto add_selection = [](CLI::App* cmd, selection& sel) {
    cmd->add_flag("--all", sel.all, "every object");
    sel.model = cmd->add_option("--model", sel.model_name, "the objects of this model name (every salt of it)");
    sel.salt = cmd->add_option("--salt", sel.cache_salt,
                               "the objects of this request salt (vLLM's cache_salt; '' for unsalted requests)");
    sel.model_id = cmd->add_option("--model-id", sel.model_id_text,
                                   "the objects of this model id (16 hex digits, as ls shows; the way to name an "
                                   "unknown one)");
    cmd->add_flag("--force", sel.force,
                  "also remove L1 objects in use: they leave at once, their memory is freed when the copy holding "
                  "them ends");
    cmd->add_flag("-y,--yes", sel.yes, "remove without asking");
  };
  auto* clear = app.add_subcommand("clear", "remove objects from L1 and every L2 backend (e.g. after a model update)");
  add_selection(clear, clear_sel);
  auto* evict = app.add_subcommand(
      "evict", "remove objects from the tiers named, L1 by default (frees memory; the L2 copies stay and load back)");
  add_selection(evict, evict_sel);
  evict->add_option("--tier", evict_sel.tiers, "a tier: l1, or an L2 backend's name (as ls shows); repeatable");

  unsigned count = 1;
  auto* ping = app.add_subcommand("ping", "round trip and boot token (a new token: the server restarted)");
  ping->add_option("-c,--count", count, "pings to send")->check(CLI::Range(1u, 100000u));

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? exit_ok : exit_usage;
  }
  try {
    const std::string cmd = app.get_subcommands().front()->get_name();
    if (cmd == "status") return run_status(o);
    if (cmd == "ls") return ls_keys_tier.empty() ? run_ls(o, ls_sel) : run_ls_keys(o, ls_keys_tier);
    if (cmd == "clear") return run_evict(o, clear_sel, true);
    if (cmd == "evict") return run_evict(o, evict_sel, false);
    return run_ping(o, count);
  } catch (const cli_error& e) {
    std::fprintf(stderr, "kvtier: %s\n", e.what());
    return e.status;
  } catch (const json::exception& e) {
    std::fprintf(stderr, "kvtier: the server's document does not read as expected: %s\n", e.what());
    return exit_refused;
  }
}
