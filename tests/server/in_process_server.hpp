#pragma once
// The in-process server of the server tests: server::server on its own thread and
// io_context, on a socket in a temporary directory, stopped and joined on destruction.
// Small L1 by default: 256 slots of 4 KiB (one chunk of the test model each); `tweak`
// changes the configuration before the server starts. factory_with() adds a test's own L2
// backend type.

#include <kvtier/server/server.hpp>
#include <kvtier_program/server_instance.hpp>

#include "server/server_fixtures.hpp"

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

namespace kvtier::test {

/// The built-in backend types and `type`, whose backend (made on the server's executor by
/// Backend(executor)) is put in `out`: a test's own L2 backend ({"type": type}).
template <class Backend>
server::backend_factory factory_with(const std::string& type, std::shared_ptr<Backend>& out) {
  server::backend_factory f = server::backend_factory::builtin_copy();
  f.add_type(type, type + " (test)", [&out, type](server::json_object_reader&) {
    server::backend_spec s;
    s.description = type;
    s.create = [&out](const server::backend_context& ctx, const std::string&) {
      out = std::make_shared<Backend>(ctx.executor);
      return l2::any_backend(out);
    };
    return s;
  });
  return f;
}

struct running_server {
  temp_dir dir{"kvtier-server"};
  server::server_config cfg;
  // Made, started and stopped through kvtier_server_instance (the server's code is compiled
  // once per build: kvtier_program/server_instance.hpp).
  program::server_ptr srv;
  std::thread thread;

  explicit running_server(const std::function<void(server::server_config&)>& tweak = {},
                          server::server_options opts = {},
                          const server::backend_factory& factory = server::backend_factory::builtin()) {
    cfg.socket_path = (dir.path() / "kvtier.sock").string();
    cfg.chunk_tokens = test_chunk_tokens;
    cfg.l1_slot_bytes = 4096;
    cfg.l1_size_bytes = 256 * 4096;
    cfg.log_level = telemetry::log_level::error;
    if (tweak) tweak(cfg);
    srv = program::make_server(cfg, std::move(opts), factory);
    program::start_server(*srv);
    thread = std::thread([s = srv.get()] { program::run_server(*s); });
  }
  running_server(const running_server&) = delete;
  running_server& operator=(const running_server&) = delete;
  ~running_server() {
    program::stop_server(*srv);
    thread.join();
  }
  [[nodiscard]] const std::string& path() const { return cfg.socket_path; }
};

/// Blocks a server hook (server_hooks::during_copy, during_prefault, ...) on the server's
/// thread until the test opens it: the test acts while the server is inside. Armed, the next
/// pass() blocks (once: it disarms); disarmed, pass() returns at once. A blocked pass() gives
/// up after server_deadline, so a failing test ends instead of hanging the server.
class hook_gate {
 public:
  explicit hook_gate(bool armed) : armed_(armed) {}

  void arm() {
    std::lock_guard g(m_);
    armed_ = true;
  }
  /// In the hook.
  void pass() {
    std::unique_lock g(m_);
    if (!armed_) return;
    armed_ = false;
    inside_ = entered_ = true;
    cv_.notify_all();
    cv_.wait_for(g, server_deadline, [&] { return open_; });
    inside_ = false;
  }
  /// Waits (up to server_deadline) until a pass() entered; false if none did.
  [[nodiscard]] bool wait_entered() {
    std::unique_lock g(m_);
    return cv_.wait_for(g, server_deadline, [&] { return entered_; });
  }
  /// Whether a pass() is blocked in the gate now.
  [[nodiscard]] bool inside() {
    std::lock_guard g(m_);
    return inside_;
  }
  void open() {
    {
      std::lock_guard g(m_);
      open_ = true;
    }
    cv_.notify_all();
  }

 private:
  std::mutex m_;
  std::condition_variable cv_;
  bool armed_;
  bool entered_ = false, inside_ = false, open_ = false;
};

}  // namespace kvtier::test
