#!/usr/bin/env bash
# The options whose default depends on what is installed follow what is installed at each
# configure (cmake/kvtier_auto_option.cmake; issue 25: ./scripts/demo.sh configured build/
# before the Python packages were there, KVTIER_BUILD_PYTHON stuck at OFF and the test
# command never built the extension). Each case configures a build directory of its own
# (tests, examples and benchmarks off: a configure takes ~2 s) with a package hidden, then
# again with it visible, and reads the value the configure resolved (<option>_EFFECTIVE in
# CMakeCache.txt) and whether the target is in build.ninja. Hiding never uninstalls anything:
#   Python headers   -DPython_INCLUDE_DIR=/nonexistent, then -UPython_INCLUDE_DIR
#   the interpreter  -DPython_EXECUTABLE=/nonexistent/python3, then -UPython_EXECUTABLE
#   pybind11         -DCMAKE_DISABLE_FIND_PACKAGE_pybind11=ON, then -U...
#   hiredis          PKG_CONFIG_LIBDIR=/nonexistent in the environment, then not
#   nvcc             CUDACXX=/nonexistent/nvcc in the environment, then not (where nvcc exists)
# plus: an explicit OFF stays OFF, an explicit ON fails the configure naming the package, and
# a build directory left by a kvtier whose KVTIER_BUILD_PYTHON was an option() (BOOL OFF)
# builds the package at its next configure.
#
#   tests/configure_options_test.sh [SOURCE_DIR]      (ctest: configure.auto_options)
# Exit status 0 when every case passed, 1 otherwise (each failure is printed).
set -uo pipefail
src=$(cd "${1:-$(dirname "$0")/..}" && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/kvtier-configure-XXXXXX")
trap 'rm -rf "$work"' EXIT
failures=0
base=(-G Ninja -DKVTIER_BUILD_TESTS=OFF -DKVTIER_BUILD_EXAMPLES=OFF -DKVTIER_BUILD_BENCH=OFF)

fail() { echo "FAILED: $*"; failures=$((failures + 1)); }
# configure <dir> <cmake args...>: configures, output in <dir>.log; returns cmake's status.
configure() {
  local dir=$1
  shift
  cmake -S "$src" -B "$dir" "$@" >"$dir.log" 2>&1
}
# effective <dir> <option>: the value the last configure resolved (where there is no such
# entry, as with a plain option(), the cached value).
effective() {
  local v
  v=$(sed -n "s/^$2_EFFECTIVE:INTERNAL=//p" "$1/CMakeCache.txt")
  [ -n "$v" ] || v=$(sed -n "s/^$2:[A-Z]*=//p" "$1/CMakeCache.txt")
  echo "$v"
}
# expect <dir> <option> <ON|OFF> <case>
expect() {
  local got
  got=$(effective "$1" "$2")
  if [ "$got" = "$3" ]; then
    echo "ok: $4: $2 resolved to $3"
  else
    fail "$4: $2 resolved to '$got', expected $3 (configure output: $1.log)"
    tail -n 20 "$1.log"
  fi
}
# has_target <dir> <target> <yes|no> <case>
has_target() {
  local n
  n=$(grep -c "^build [^:]*CMakeFiles/$2\.dir/" "$1/build.ninja" 2>/dev/null)
  if { [ "$3" = yes ] && [ "$n" -gt 0 ]; } || { [ "$3" = no ] && [ "$n" -eq 0 ]; }; then
    echo "ok: $4: target $2 $([ "$3" = yes ] && echo present || echo absent)"
  else
    fail "$4: target $2 expected $([ "$3" = yes ] && echo present || echo absent) in $1/build.ninja"
  fi
}
# says <dir> <regex> <case>: the configure output names what is missing.
says() {
  if grep -qE "$2" "$1.log"; then echo "ok: $3: the configure says /$2/"; else fail "$3: no /$2/ in $1.log"; fi
}

# Everything visible first: the cases below need the Python package buildable here.
d=$work/baseline
configure "$d" "${base[@]}" -DKVTIER_WITH_CUDA=OFF || { tail -n 30 "$d.log" >&2; exit 1; }
if [ "$(effective "$d" KVTIER_BUILD_PYTHON)" != ON ]; then
  grep "KVTIER_BUILD_PYTHON" "$d.log" >&2
  echo "SKIPPED: the Python package cannot be built here (python3-dev, pybind11-dev), so it cannot be hidden and shown" >&2
  exit 77
fi

d=$work/headers
configure "$d" "${base[@]}" -DKVTIER_WITH_CUDA=OFF -DPython_INCLUDE_DIR=/nonexistent
expect "$d" KVTIER_BUILD_PYTHON OFF "python3-dev hidden"
has_target "$d" kvtier_python_ext no "python3-dev hidden"
says "$d" "KVTIER_BUILD_PYTHON=AUTO -> OFF.*python3-dev" "python3-dev hidden"
configure "$d" -UPython_INCLUDE_DIR
expect "$d" KVTIER_BUILD_PYTHON ON "python3-dev installed since"
has_target "$d" kvtier_python_ext yes "python3-dev installed since"

d=$work/interpreter
configure "$d" "${base[@]}" -DKVTIER_WITH_CUDA=OFF -DPython_EXECUTABLE=/nonexistent/python3
expect "$d" KVTIER_BUILD_PYTHON OFF "no interpreter"
configure "$d" -UPython_EXECUTABLE
expect "$d" KVTIER_BUILD_PYTHON ON "interpreter installed since"
has_target "$d" kvtier_python_ext yes "interpreter installed since"

d=$work/pybind11
configure "$d" "${base[@]}" -DKVTIER_WITH_CUDA=OFF -DCMAKE_DISABLE_FIND_PACKAGE_pybind11=ON
expect "$d" KVTIER_BUILD_PYTHON OFF "pybind11-dev hidden"
says "$d" "pybind11-dev" "pybind11-dev hidden"
# ON with the package missing stops the configure and says which.
if configure "$d" -DKVTIER_BUILD_PYTHON=ON; then
  fail "KVTIER_BUILD_PYTHON=ON without pybind11: the configure passed"
else
  says "$d" "KVTIER_BUILD_PYTHON=ON, but" "ON without pybind11 fails"
  says "$d" "pybind11-dev" "ON without pybind11 fails"
fi
configure "$d" -UCMAKE_DISABLE_FIND_PACKAGE_pybind11
expect "$d" KVTIER_BUILD_PYTHON ON "pybind11-dev installed since (ON)"
# An explicit OFF is the user's: it stays, with everything found.
configure "$d" -DKVTIER_BUILD_PYTHON=OFF
expect "$d" KVTIER_BUILD_PYTHON OFF "explicit OFF"
configure "$d"
expect "$d" KVTIER_BUILD_PYTHON OFF "explicit OFF, configured again"
has_target "$d" kvtier_python_ext no "explicit OFF"
if configure "$d" -DKVTIER_BUILD_PYTHON=maybe; then
  fail "KVTIER_BUILD_PYTHON=maybe: the configure passed"
else
  says "$d" "use ON, OFF or AUTO" "a value that is no switch"
fi

# A build directory from a kvtier whose KVTIER_BUILD_PYTHON was option(): the default it
# computed then (OFF) is not a choice.
d=$work/older
configure "$d" "${base[@]}" -DKVTIER_WITH_CUDA=OFF
# Drop the entry with its help lines, write it as option() did.
awk '/^\/\//{buf = buf $0 "\n"; next} /^KVTIER_BUILD_PYTHON:/{buf = ""; next} {printf "%s", buf; buf = ""; print}' \
  "$d/CMakeCache.txt" >"$d/cache.new"
printf '%s\n' '//Build the kvtier Python package (pybind11 bindings, python/)' 'KVTIER_BUILD_PYTHON:BOOL=OFF' >>"$d/cache.new"
mv "$d/cache.new" "$d/CMakeCache.txt"
grep -q '^KVTIER_BUILD_PYTHON:BOOL=OFF' "$d/CMakeCache.txt" || fail "older cache: could not write the old entry"
configure "$d"
expect "$d" KVTIER_BUILD_PYTHON ON "build directory of an older kvtier (option() cached OFF)"
says "$d" "cached by an older kvtier" "build directory of an older kvtier"

# hiredis (pkg-config): kvtier::redis follows it.
d=$work/hiredis
PKG_CONFIG_LIBDIR=/nonexistent configure "$d" "${base[@]}" -DKVTIER_WITH_CUDA=OFF
if grep -q "hiredis not found" "$d.log"; then echo "ok: hiredis hidden: kvtier::redis not built"; else fail "hiredis hidden: no note in $d.log"; fi
configure "$d"
if grep -q "kvtier: hiredis not found" "$d.log"; then
  fail "hiredis visible again: kvtier::redis still not built ($d.log)"
elif pkg-config --exists hiredis; then
  echo "ok: hiredis visible again: kvtier::redis built"
fi

# nvcc: on PATH or not, at each configure.
if nvcc_path=$(command -v nvcc); then
  d=$work/cuda
  CUDACXX=/nonexistent/nvcc configure "$d" "${base[@]}" -DKVTIER_BUILD_PYTHON=OFF
  expect "$d" KVTIER_WITH_CUDA OFF "nvcc not found"
  says "$d" "KVTIER_WITH_CUDA=AUTO -> OFF.*nvcc" "nvcc not found"
  configure "$d"
  expect "$d" KVTIER_WITH_CUDA ON "nvcc installed since"
else
  d=$work/cuda
  configure "$d" "${base[@]}" -DKVTIER_BUILD_PYTHON=OFF
  expect "$d" KVTIER_WITH_CUDA OFF "no nvcc on this machine"
  echo "note: no nvcc here, the case of nvcc appearing was not run"
fi

# A second configure with the same arguments changes no compile command: the test command
# configures build/ again after the demo, and a changed command rebuilds (libzmq's
# "-isystem" Cflag was an include directory at the first configure and a compile option
# after it, so kvtier-server's main.cpp was compiled twice; cmake/kvtier_dependencies.cmake).
d=$work/reconfigure
compile_vars() { grep -E '^  (DEFINES|FLAGS|INCLUDES) = ' "$1/build.ninja"; }
if configure "$d" -G Ninja -DKVTIER_BUILD_TESTS=OFF -DKVTIER_BUILD_EXAMPLES=ON -DKVTIER_BUILD_BENCH=OFF \
     -DKVTIER_BUILD_PYTHON=OFF -DKVTIER_WITH_CUDA=OFF; then
  compile_vars "$d" >"$d.first"
  configure "$d"
  compile_vars "$d" >"$d.second"
  if [ ! -s "$d.first" ]; then
    fail "configured twice: no compile commands in $d/build.ninja"
  elif cmp -s "$d.first" "$d.second"; then
    echo "ok: configured twice: the same $(wc -l <"$d.first") compile variables"
  else
    fail "configured twice: the compile commands changed:"
    diff "$d.first" "$d.second" | head -n 10
  fi
else
  fail "configured twice: the first configure failed ($d.log)"
fi

if [ "$failures" -gt 0 ]; then
  echo "configure_options_test: $failures FAILED" >&2
  exit 1
fi
echo "configure_options_test: all passed"
