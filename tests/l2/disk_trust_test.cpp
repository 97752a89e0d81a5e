// The disk backend's files are private and trusted only when ours: 0600 files and 0700
// directories whatever the umask, a directory another user owns or others may write is
// refused, what an older version made wider is tightened, and an object file another user
// owns is skipped (and counted) by the recovery scan, never served, never deleted.
#include <kvtier/l2/disk/disk_backend.hpp>

#include <catch2/catch.hpp>

#include "support/other_user.hpp"
#include "support/process.hpp"

#include <boost/asio/io_context.hpp>

#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

// This file's names (its test binary is compiled in unity batches with the module's other files).
namespace file_disk_trust_test {

using namespace kvtier;
namespace asio = boost::asio;
namespace fs = std::filesystem;
using kvtier::test::temp_dir;

namespace {

l2::disk_backend_options options_for(const fs::path& p) {
  l2::disk_backend_options o;
  o.path = p;
  o.capacity_bytes = std::uint64_t{64} << 20;
  return o;
}

::mode_t mode_of(const fs::path& p) {
  struct ::stat st {};
  REQUIRE(::lstat(p.c_str(), &st) == 0);
  return st.st_mode & 07777;
}

}  // namespace

TEST_CASE("the disk tier's directories are created 0700 and its files 0600 whatever the umask", "[l2][disk][trust]") {
  temp_dir dir;
  const fs::path root = dir.path() / "a" / "b" / "tier";  // parents created too
  asio::io_context io;
  const ::mode_t old_umask = ::umask(0);
  { l2::disk_backend b(io.get_executor(), options_for(root)); }
  ::umask(old_umask);
  CHECK(mode_of(dir.path() / "a") == 0700);
  CHECK(mode_of(root) == 0700);
  CHECK(mode_of(root / "objects") == 0700);
  CHECK(mode_of(root / "tmp") == 0700);
  CHECK(mode_of(root / "objects" / "00") == 0700);
  CHECK(mode_of(root / "objects" / "ff") == 0700);
  CHECK(mode_of(root / "FORMAT") == 0600);
  CHECK(mode_of(root / "LOCK") == 0600);
}

TEST_CASE("what an older version made wider is tightened at start", "[l2][disk][trust]") {
  temp_dir dir;
  asio::io_context io;
  { l2::disk_backend b(io.get_executor(), options_for(dir.path())); }
  ::chmod((dir.path() / "objects").c_str(), 0755);
  ::chmod((dir.path() / "objects" / "7f").c_str(), 0755);
  ::chmod((dir.path() / "LOCK").c_str(), 0644);
  const fs::path old_object = dir.path() / "objects" / "7f" / (std::string(56, 'a') + ".kvo");
  std::ofstream(old_object) << "an object of an older version (its header is checked after)";
  ::chmod(old_object.c_str(), 0644);
  { l2::disk_backend b(io.get_executor(), options_for(dir.path())); }
  CHECK(mode_of(dir.path() / "objects") == 0700);
  CHECK(mode_of(dir.path() / "objects" / "7f") == 0700);
  CHECK(mode_of(dir.path() / "LOCK") == 0600);
}

TEST_CASE("a tier directory that others may write is refused with what to change", "[l2][disk][trust]") {
  temp_dir dir;
  asio::io_context io;
  SECTION("the root") {
    fs::create_directory(dir.path() / "t");
    ::chmod((dir.path() / "t").c_str(), 0777);
    CHECK_THROWS_AS(l2::disk_backend(io.get_executor(), options_for(dir.path() / "t")), std::invalid_argument);
    CHECK_THROWS_WITH(l2::disk_backend(io.get_executor(), options_for(dir.path() / "t")),
                      Catch::Contains("is writable by group or others (mode 0777)") && Catch::Contains("chmod 700"));
  }
  SECTION("objects/, tmp/ or a shard") {
    for (const fs::path& sub : std::vector<fs::path>{"objects", "tmp", fs::path("objects") / "a0"}) {
      { l2::disk_backend b(io.get_executor(), options_for(dir.path() / "t")); }
      ::chmod((dir.path() / "t" / sub).c_str(), 0775);
      INFO(sub.string());
      CHECK_THROWS_WITH(l2::disk_backend(io.get_executor(), options_for(dir.path() / "t")),
                        Catch::Contains((dir.path() / "t" / sub).string() + " is writable by group or others"));
      ::chmod((dir.path() / "t" / sub).c_str(), 0700);
    }
  }
  SECTION("a symlink in place of objects/") {
    { l2::disk_backend b(io.get_executor(), options_for(dir.path() / "t")); }
    fs::rename(dir.path() / "t" / "objects", dir.path() / "elsewhere");
    fs::create_directory_symlink(dir.path() / "elsewhere", dir.path() / "t" / "objects");
    CHECK_THROWS_WITH(l2::disk_backend(io.get_executor(), options_for(dir.path() / "t")),
                      Catch::Contains("cannot open objects/"));
  }
}

TEST_CASE("a tier directory or object file of another user is not trusted", "[l2][disk][trust]") {
  if (!kvtier::test::can_play_other_user()) {
    WARN("not root: cannot play a second user");
    return;
  }
  const auto nobody = kvtier::test::nobody();
  temp_dir dir;
  asio::io_context io;
  fs::create_directory(dir.path() / "theirs");
  ::chmod((dir.path() / "theirs").c_str(), 0700);
  kvtier::test::give_to(dir.path() / "theirs", nobody);
  CHECK_THROWS_WITH(l2::disk_backend(io.get_executor(), options_for(dir.path() / "theirs")),
                    Catch::Contains("is owned by uid " + std::to_string(nobody.uid)));

  { l2::disk_backend b(io.get_executor(), options_for(dir.path() / "ours")); }
  const fs::path planted = dir.path() / "ours" / "objects" / "3c" / (std::string(56, 'b') + ".kvo");
  std::ofstream(planted) << "crafted, with checksums its author computed";
  kvtier::test::give_to(planted, nobody);
  const fs::path writable = dir.path() / "ours" / "objects" / "3d" / (std::string(56, 'c') + ".kvo");
  std::ofstream(writable) << "ours, but anyone could have rewritten it";
  ::chmod(writable.c_str(), 0666);
  l2::disk_backend b(io.get_executor(), options_for(dir.path() / "ours"));
  CHECK(b.recovery().untrusted_files == 2);
  CHECK(b.recovery().objects == 0);
  CHECK(b.recovery().dropped == 0);
  CHECK(fs::exists(planted));  // left alone
  CHECK(fs::exists(writable));
}

}  // namespace file_disk_trust_test
