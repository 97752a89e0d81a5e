#pragma once
// server::server's heavy members (its constructor, start, run, stop and destructor), compiled
// once per build directory in the kvtier_server_instance object library (server_instance.cpp)
// for the programs and tests that run a server in their own process: kvtier-server and the
// in-process server tests (tests/server/in_process_server.hpp).
//
// Why: those members reach the whole server (every request handler of the sessions, the
// tiered_cache of each eviction policy, the HTTP endpoint, the shutdown), and a translation
// unit that calls one of them compiles all of it. g++ 12, CPU seconds: a file that constructs
// and starts a server::server 97-101 at -O3; the same file through these functions 27; with
// ASan+UBSan kvtier-server's main.cpp alone took 184. Calling them, a file still parses
// server.hpp and may use the cheap accessors (boot_token(), io_context(), metrics_url() ...).
// Issue 25 (the test command's cold build time), docs/architecture.md "Build".

#include <kvtier/server/server.hpp>

#include <memory>

namespace kvtier::program {

/// Destroys a server (server::~server, compiled in server_instance.cpp).
struct server_deleter {
  void operator()(server::server* s) const noexcept;
};
using server_ptr = std::unique_ptr<server::server, server_deleter>;

/// server::server(config, options, factory); throws what it throws.
[[nodiscard]] server_ptr make_server(server::server_config config, server::server_options options,
                                     const server::backend_factory& factory);
/// The same with backend_factory::builtin().
[[nodiscard]] server_ptr make_server(server::server_config config, server::server_options options = {});
/// server::start(): listens; throws what it throws.
void start_server(server::server& s);
/// server::run(): the I/O thread until the shutdown completes; returns its status.
int run_server(server::server& s);
/// server::stop(): begins the orderly shutdown; any thread.
void stop_server(server::server& s);

}  // namespace kvtier::program
