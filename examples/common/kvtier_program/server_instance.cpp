// The one translation unit of a build that compiles server::server's heavy members
// (server_instance.hpp says why).
#include "kvtier_program/server_instance.hpp"

#include <utility>

namespace kvtier::program {

void server_deleter::operator()(server::server* s) const noexcept { delete s; }

server_ptr make_server(server::server_config config, server::server_options options,
                       const server::backend_factory& factory) {
  return server_ptr(new server::server(std::move(config), std::move(options), factory));
}

server_ptr make_server(server::server_config config, server::server_options options) {
  return make_server(std::move(config), std::move(options), server::backend_factory::builtin());
}

void start_server(server::server& s) { s.start(); }
int run_server(server::server& s) { return s.run(); }
void stop_server(server::server& s) { s.stop(); }

}  // namespace kvtier::program
