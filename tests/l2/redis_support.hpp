#pragma once
// Test support for the Redis backend: real redis-server processes on loopback (standalone, or
// three masters made into a cluster with `redis-cli --cluster create`), an admin connection
// (hiredis, blocking: test code only), and a helper that runs an io_context until a
// condition holds (waiting on events with a deadline, never a fixed sleep).
//
// Ports: 27000-27099 for the servers (27000 + 10000.. for cluster buses), free ones picked
// at run time; a server that finds its port taken (another test process) moves on to the
// next. Each server runs in its own temporary directory with persistence off and dies with
// the test process (PR_SET_PDEATHSIG).

#include <kvtier/l2/redis/detail/redis_wire.hpp>

#include "support/asio.hpp"
#include "support/process.hpp"

#include <boost/asio/io_context.hpp>

#include <arpa/inet.h>
#include <hiredis.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace kvtier::test {

using redis_reply = l2::detail::redis_reply_ptr;

/// Sends one command to 127.0.0.1:port on a fresh blocking connection; nullptr when the
/// server cannot be reached.
inline redis_reply redis_command(std::uint16_t port, const std::vector<std::string>& args,
                                 std::chrono::milliseconds timeout = std::chrono::milliseconds(2000)) {
  timeval tv{static_cast<time_t>(timeout.count() / 1000), static_cast<suseconds_t>((timeout.count() % 1000) * 1000)};
  std::unique_ptr<redisContext, decltype(&redisFree)> c(redisConnectWithTimeout("127.0.0.1", port, tv), &redisFree);
  if (!c || c->err) return nullptr;
  redisSetTimeout(c.get(), tv);
  std::vector<const char*> argv;
  std::vector<std::size_t> lens;
  for (const auto& a : args) {
    argv.push_back(a.data());
    lens.push_back(a.size());
  }
  return redis_reply(
      static_cast<redisReply*>(redisCommandArgv(c.get(), static_cast<int>(argv.size()), argv.data(), lens.data())));
}

inline std::string reply_text(const redis_reply& r) {
  return r && r->str ? std::string(r->str, r->len) : std::string();
}

/// Polls `pred` (a blocking check, e.g. a command to a server) until it holds or `limit`.
template <class Pred>
bool poll_until(Pred pred, std::chrono::seconds limit = std::chrono::seconds(30)) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (!pred()) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));  // between two polls of an external process
  }
  return true;
}

namespace detail {
inline bool port_free(std::uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return false;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
  ::close(fd);
  return ok;
}
inline std::atomic<unsigned>& next_port_offset() {
  static std::atomic<unsigned> o{static_cast<unsigned>(::getpid()) * 7u};
  return o;
}
}  // namespace detail

/// One redis-server child process, SIGKILLed on destruction.
class redis_server {
 public:
  static constexpr std::uint16_t first_port = 27000;
  static constexpr std::uint16_t port_count = 100;

  explicit redis_server(bool cluster = false, std::vector<std::string> extra = {})
      : dir_("kvtier-redis"), cluster_(cluster), extra_(std::move(extra)) {
    for (unsigned attempt = 0; attempt < port_count; ++attempt) {
      const auto port = static_cast<std::uint16_t>(first_port + detail::next_port_offset().fetch_add(1) % port_count);
      if (!detail::port_free(port) || (cluster_ && !detail::port_free(static_cast<std::uint16_t>(port + 10000))))
        continue;
      port_ = port;
      if (spawn()) return;
    }
    throw std::runtime_error("redis_server: no free port in 27000-27099 (or redis-server does not start)");
  }

  redis_server(const redis_server&) = delete;
  redis_server& operator=(const redis_server&) = delete;
  ~redis_server() { kill(); }

  [[nodiscard]] std::uint16_t port() const noexcept { return port_; }
  [[nodiscard]] std::string endpoint() const { return "127.0.0.1:" + std::to_string(port_); }
  [[nodiscard]] pid_t pid() const noexcept { return pid_; }
  [[nodiscard]] const std::filesystem::path& dir() const noexcept { return dir_.path(); }

  /// SIGKILL, then reaps the process.
  void kill() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }
  /// Starts again on the same port and directory (after kill()).
  void restart() {
    kill();
    if (!spawn()) throw std::runtime_error("redis_server: restart on port " + std::to_string(port_) + " failed");
  }
  /// Freezes / thaws the process (a Redis that stops answering).
  void pause() { ::kill(pid_, SIGSTOP); }
  void resume() { ::kill(pid_, SIGCONT); }

  redis_reply command(const std::vector<std::string>& args) const { return redis_command(port_, args); }
  /// redis-cli with this server's port and the given arguments (shell words).
  command_result cli(const std::string& args) const {
    return run_command("redis-cli -p " + std::to_string(port_) + " " + args);
  }

 private:
  bool spawn() {
    std::vector<std::string> args = {"redis-server",
                                     "--port",
                                     std::to_string(port_),
                                     "--bind",
                                     "127.0.0.1",
                                     "--save",
                                     "",
                                     "--appendonly",
                                     "no",
                                     "--dir",
                                     dir_.path().string(),
                                     "--logfile",
                                     (dir_.path() / "redis.log").string(),
                                     "--daemonize",
                                     "no",
                                     "--protected-mode",
                                     "no"};
    if (cluster_) {
      for (const char* a :
           {"--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000"})
        args.emplace_back(a);
    }
    args.insert(args.end(), extra_.begin(), extra_.end());
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    const pid_t parent = ::getpid();
    const pid_t pid = ::fork();
    if (pid < 0) throw std::runtime_error("fork failed");
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(127);
      ::execvp(argv[0], argv.data());
      ::_exit(127);
    }
    pid_ = pid;
    // Up when it answers with our pid (not another test process's server on this port).
    const std::string mine = "process_id:" + std::to_string(pid);
    const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (std::chrono::steady_clock::now() < end) {
      int status = 0;
      if (::waitpid(pid, &status, WNOHANG) == pid) {  // exited: port taken, or cannot start
        pid_ = -1;
        return false;
      }
      auto r = redis_command(port_, {"INFO", "server"}, std::chrono::milliseconds(500));
      if (r && r->type == REDIS_REPLY_STRING && reply_text(r).find(mine) != std::string::npos) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));  // between polls of the child
    }
    kill();
    return false;
  }

  temp_dir dir_;
  bool cluster_;
  std::vector<std::string> extra_;
  std::uint16_t port_ = 0;
  pid_t pid_ = -1;
};

/// Three masters made into a cluster (no replicas), slots split evenly.
class redis_cluster {
 public:
  redis_cluster() {
    for (int i = 0; i < 3; ++i) nodes_.push_back(std::make_unique<redis_server>(true));
    std::string cmd = "redis-cli --cluster create";
    for (auto& n : nodes_) {
      cmd += ' ';
      cmd += n->endpoint();
    }
    cmd += " --cluster-replicas 0 --cluster-yes";
    const auto r = run_command(cmd);
    if (r.exit_code != 0) {
      std::string msg = "redis-cli --cluster create failed: ";
      msg.append(r.output);
      throw std::runtime_error(msg);
    }
    if (!wait_ok()) throw std::runtime_error("the cluster did not reach cluster_state:ok");
  }

  [[nodiscard]] redis_server& node(std::size_t i) { return *nodes_.at(i); }
  [[nodiscard]] std::size_t size() const noexcept { return nodes_.size(); }
  [[nodiscard]] std::vector<std::string> endpoints() const {
    std::vector<std::string> e;
    for (const auto& n : nodes_) e.push_back(n->endpoint());
    return e;
  }

  /// Every node reports cluster_state:ok and knows three masters' slots.
  bool wait_ok(std::chrono::seconds limit = std::chrono::seconds(30)) {
    return poll_until(
        [&] {
          for (auto& n : nodes_) {
            const auto info = reply_text(n->command({"CLUSTER", "INFO"}));
            if (info.find("cluster_state:ok") == std::string::npos) return false;
            auto slots = n->command({"CLUSTER", "SLOTS"});
            if (!slots || slots->type != REDIS_REPLY_ARRAY || slots->elements < 3) return false;
          }
          return true;
        },
        limit);
  }

  /// The node id (CLUSTER MYID) of node i.
  [[nodiscard]] std::string id(std::size_t i) { return reply_text(node(i).command({"CLUSTER", "MYID"})); }

  /// Which node serves a slot now (index), from CLUSTER SLOTS of node 0; -1 when unknown.
  [[nodiscard]] int owner(std::uint16_t slot) {
    auto r = node(0).command({"CLUSTER", "SLOTS"});
    if (!r || r->type != REDIS_REPLY_ARRAY) return -1;
    for (std::size_t i = 0; i < r->elements; ++i) {
      const auto* e = r->element[i];
      if (slot < e->element[0]->integer || slot > e->element[1]->integer) continue;
      const auto port = e->element[2]->element[1]->integer;
      for (std::size_t n = 0; n < nodes_.size(); ++n)
        if (nodes_[n]->port() == port) return static_cast<int>(n);
    }
    return -1;
  }

  /// Empties every master.
  void flush() {
    for (auto& n : nodes_) n->command({"FLUSHALL"});
  }

 private:
  std::vector<std::unique_ptr<redis_server>> nodes_;
};

/// One standalone server and one cluster per test process, started on first use (each
/// takes ~0.1 s and ~1-2 s to start); tests that kill or reconfigure servers start their own.
inline redis_server& shared_standalone() {
  static redis_server s;
  return s;
}
inline redis_cluster& shared_cluster() {
  static redis_cluster c;
  return c;
}

}  // namespace kvtier::test
