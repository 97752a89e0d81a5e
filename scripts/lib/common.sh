# Shared by scripts/*.sh and bench/*.sh: Debian package installation and build directories.
# Sourced, not executed.

# Packages needed to configure and build everything (library, tests, examples, benchmarks).
KVTIER_BUILD_PACKAGES=(
  cmake ninja-build g++ make pkg-config ccache
  libboost1.81-dev liburing-dev libfmt-dev nlohmann-json3-dev libxxhash-dev libssl-dev
  libcli11-dev libhiredis-dev libbenchmark-dev catch2 libzmq3-dev cppzmq-dev
)
# Servers and tools the test suite drives.
KVTIER_TEST_PACKAGES=(prometheus redis-server redis-tools fio curl jq procps util-linux universal-ctags cscope)
# The Python package (python/, KVTIER_BUILD_PYTHON) and its tests, for /usr/bin/python3.
KVTIER_PYTHON_PACKAGES=(python3-dev pybind11-dev python3-torch python3-numpy python3-pytest python3-xxhash
  python3-pip python3-venv python3-setuptools python3-wheel python3-zmq python3-msgpack)
# clang 14 and its libFuzzer/sanitizer runtimes: the fuzz targets (scripts/fuzz.sh) and the
# sanitizer builds of scripts/test.sh.
KVTIER_CLANG_PACKAGES=(clang-14 libclang-rt-14-dev)
kvtier_clangxx() { command -v clang++-14 || command -v clang++; }

# kvtier_ensure_packages PKG...: installs, non-interactively, those not installed yet.
# Nothing is installed (and apt is not touched) when everything is present.
kvtier_ensure_packages() {
  local missing=() p
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  echo "kvtier: installing missing Debian packages: ${missing[*]}" >&2
  if [ "$(id -u)" -ne 0 ]; then
    echo "kvtier: run as root, or install them first: apt-get install ${missing[*]}" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  # A fresh machine may have empty package lists: update only when the install needs it.
  if ! apt-get install -y -q --no-install-recommends "${missing[@]}"; then
    apt-get update -q
    apt-get install -y -q --no-install-recommends "${missing[@]}"
  fi
}

# Settings that make ccache effective with precompiled headers.
export CCACHE_SLOPPINESS="${CCACHE_SLOPPINESS:-pch_defines,time_macros,include_file_mtime,include_file_ctime}"
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$PWD}"

kvtier_jobs() { nproc 2>/dev/null || echo 2; }

# kvtier_configure DIR [cmake args...]: configures DIR with Ninja (again, if it exists: a
# package installed since turns its feature on, cmake/kvtier_auto_option.cmake). A DIR whose
# cache was made for another source tree or with another generator (a build/ copied along
# with a checkout, or configured by hand with make) cannot be configured again: it is
# removed first, with a note.
kvtier_configure() {
  local dir=$1
  shift
  local cache=$dir/CMakeCache.txt
  if [ -f "$cache" ]; then
    local home gen cxx want_cxx="" a
    home=$(sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$cache")
    gen=$(sed -n 's/^CMAKE_GENERATOR:INTERNAL=//p' "$cache")
    cxx=$(sed -n 's/^CMAKE_CXX_COMPILER:[A-Z]*=//p' "$cache")
    for a in "$@"; do case "$a" in -DCMAKE_CXX_COMPILER=*) want_cxx=${a#-DCMAKE_CXX_COMPILER=} ;; esac; done
    if [ "$gen" != Ninja ] || [ "$(cd "$home" 2>/dev/null && pwd -P)" != "$(pwd -P)" ]; then
      echo "kvtier: $dir was configured for ${home:-an unknown source tree} with ${gen:-an unknown generator}," \
           "not for $(pwd -P) with Ninja: removing it" >&2
      rm -rf "$dir"
    elif [ -n "$want_cxx" ] && [ "$(readlink -f "$cxx")" != "$(readlink -f "$want_cxx")" ]; then
      # CMake cannot change a configured directory's compiler (it deletes the cache and asks
      # for the options again): a build/-asan made with g++ by an older kvtier, for one.
      echo "kvtier: $dir was configured with the compiler ${cxx:-unknown}, not $want_cxx: removing it" >&2
      rm -rf "$dir"
    fi
  fi
  cmake -S . -B "$dir" -G Ninja "$@"
}
