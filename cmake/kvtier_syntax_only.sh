#!/bin/sh
# Compiler launcher of the syntax-check objects (cmake/kvtier_syntax_check.cmake). Their compile
# runs with -fsyntax-only and writes no object file, so this creates the one named by -o once
# the compile passed: the build then sees the step as done, and redoes it only when the source
# or a header it includes changes (the dependency file is written as usual).
out=""
prev=""
for arg in "$@"; do
  [ "$prev" = "-o" ] && out=$arg
  prev=$arg
done
"$@" || exit
if [ -n "$out" ]; then
  : > "$out"
fi
