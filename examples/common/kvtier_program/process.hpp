#pragma once
// Child processes for the example programs (the fault-tolerance harness, the long-document
// QA driver, the demo): spawn with posix_spawn, output to files, signals, exit status; plus
// a synchronous status request to a kvtier-server.

#include <kvtier/protocol/codec.hpp>
#include <kvtier/protocol/connection.hpp>
#include <kvtier/protocol/messages.hpp>
#include <kvtier/protocol/unix_socket.hpp>

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace examples {

namespace asio = boost::asio;
using steady = std::chrono::steady_clock;

/// A child process with stdout and stderr redirected to files.
class child_process {
 public:
  child_process(const std::string& binary, std::vector<std::string> args, const std::filesystem::path& log_dir,
                const std::string& tag)
      : out_(log_dir / (tag + ".out")), err_(log_dir / (tag + ".err")) {
    std::vector<std::string> argv_s{binary};
    argv_s.insert(argv_s.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (auto& a : argv_s) argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, out_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    posix_spawn_file_actions_addopen(&fa, 2, err_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    const int rc = ::posix_spawn(&pid_, binary.c_str(), &fa, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    if (rc != 0) throw std::runtime_error("cannot start " + binary + ": " + std::strerror(rc));
  }
  child_process(const child_process&) = delete;
  child_process& operator=(const child_process&) = delete;
  ~child_process() {
    if (pid_ > 0) {
      ::kill(pid_, SIGCONT);
      ::kill(pid_, SIGKILL);
      int st = 0;
      ::waitpid(pid_, &st, 0);
    }
  }

  [[nodiscard]] pid_t pid() const noexcept { return pid_; }
  [[nodiscard]] bool running() {
    if (pid_ <= 0) return false;
    int st = 0;
    if (::waitpid(pid_, &st, WNOHANG) == pid_) {
      pid_ = -1;
      status_ = st;
      return false;
    }
    return true;
  }
  void signal(int sig) {
    if (pid_ > 0) ::kill(pid_, sig);
  }
  /// Waits for the exit (up to `timeout`); returns the wait status, nullopt on timeout.
  std::optional<int> wait_exit(std::chrono::milliseconds timeout) {
    if (pid_ <= 0) return status_;
    const auto deadline = steady::now() + timeout;
    while (steady::now() < deadline) {
      if (!running()) return status_;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return std::nullopt;
  }
  /// Signals and waits.
  std::optional<int> stop(int sig, std::chrono::milliseconds timeout) {
    signal(sig);
    return wait_exit(timeout);
  }

  [[nodiscard]] std::string stdout_text() const { return read(out_); }
  [[nodiscard]] std::string stderr_text() const { return read(err_); }

  static std::string describe(int st) {
    if (WIFEXITED(st)) return "exit status " + std::to_string(WEXITSTATUS(st));
    if (WIFSIGNALED(st)) return "killed by signal " + std::to_string(WTERMSIG(st));
    return "status " + std::to_string(st);
  }

 private:
  static std::string read(const std::filesystem::path& p) {
    std::ifstream in(p);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }

  std::filesystem::path out_;
  std::filesystem::path err_;
  pid_t pid_ = -1;
  int status_ = 0;
};

/// One request to a kvtier-server over a fresh connection; nullopt when the server does not
/// answer within `timeout` (down, hung) or refuses.
template <class Req>
std::optional<typename Req::response_type> ask_server(const std::string& socket, const Req& req,
                                                      std::chrono::milliseconds timeout = std::chrono::seconds(5)) {
  namespace p = kvtier::protocol;
  asio::io_context io;
  auto s = p::connect_unix(io.get_executor(), socket);
  if (!s) return std::nullopt;
  p::connection conn(std::move(*s));
  std::optional<typename Req::response_type> out;
  asio::co_spawn(
      io,
      [&]() -> asio::awaitable<void> {
        auto [ec] = co_await conn.async_send(1, req, asio::as_tuple(asio::use_awaitable));
        if (ec) co_return;
        auto [rec, f] = co_await conn.async_read_frame(asio::as_tuple(asio::use_awaitable));
        if (rec) co_return;
        auto m = p::decode_message(f);
        if (m)
          if (auto* r = std::get_if<typename Req::response_type>(&*m)) out = std::move(*r);
      },
      [&](std::exception_ptr) { io.stop(); });
  io.run_for(timeout);
  return out;
}

/// The server's status JSON, or nullopt.
inline std::optional<nlohmann::json> server_status(const std::string& socket,
                                                   std::chrono::milliseconds timeout = std::chrono::seconds(5)) {
  auto r = ask_server(socket, kvtier::protocol::status_request{}, timeout);
  if (!r) return std::nullopt;
  return nlohmann::json::parse(r->json, nullptr, false);
}

/// Waits until `socket` accepts connections or the process died or the deadline passed.
inline bool wait_listening(child_process& p, const std::string& socket, std::chrono::milliseconds timeout) {
  asio::io_context io;
  const auto deadline = steady::now() + timeout;
  while (steady::now() < deadline) {
    if (kvtier::protocol::connect_unix(io.get_executor(), socket)) return true;
    if (!p.running()) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return false;
}

/// The program `name` next to this executable, or in ../bin (an install prefix), or in the
/// build tree's examples/ directory; empty when not found.
inline std::string find_program(const std::string& name, const char* argv0) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path self = fs::canonical("/proc/self/exe", ec);
  std::vector<fs::path> candidates;
  if (!ec) {
    candidates.push_back(self.parent_path() / name);
    candidates.push_back(self.parent_path() / ".." / "bin" / name);
    candidates.push_back(self.parent_path().parent_path() / "examples" / name);
  }
  if (argv0) candidates.push_back(fs::path(argv0).parent_path() / name);
  for (const auto& c : candidates)
    if (fs::exists(c, ec)) return fs::canonical(c, ec).string();
  return {};
}

}  // namespace examples
