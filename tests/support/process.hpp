#pragma once
// Test support: run a shell command and capture its output and exit status; a temporary
// directory removed at the end of the test.

#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <unistd.h>

namespace kvtier::test {

struct command_result {
  int exit_code = -1;
  std::string output;  ///< stdout and stderr together
};

/// Runs `command` with /bin/sh, stderr merged into stdout.
inline command_result run_command(const std::string& command) {
  command_result r;
  FILE* p = ::popen((command + " 2>&1").c_str(), "r");
  if (p == nullptr) throw std::runtime_error("popen failed: " + command);
  char buf[4096];
  std::size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) r.output.append(buf, n);
  const int status = ::pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return r;
}

/// A fresh directory under $TMPDIR (or /tmp), removed with everything in it on destruction.
class temp_dir {
 public:
  explicit temp_dir(const std::string& prefix = "kvtier-test") {
    const char* base = std::getenv("TMPDIR");
    std::string templ = std::string(base ? base : "/tmp") + "/" + prefix + "-XXXXXX";
    if (::mkdtemp(templ.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = templ;
  }
  temp_dir(const temp_dir&) = delete;
  temp_dir& operator=(const temp_dir&) = delete;
  ~temp_dir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  [[nodiscard]] const std::filesystem::path& path() const noexcept { return path_; }

 private:
  std::filesystem::path path_;
};

}  // namespace kvtier::test
