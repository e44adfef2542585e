#!/bin/sh
# Installs strata from build tree BUILD into WORK/prefix, configures and builds
# the downstream project (this folder) against that prefix alone, and runs it.
#   build_and_run.sh BUILD WORK
set -eu
build=$1
work=$2
here=$(cd "$(dirname "$0")" && pwd)
rm -rf "$work" && mkdir -p "$work"
cmake --install "$build" --prefix "$work/prefix" > "$work/install.log"
test -f "$work/prefix/lib/cmake/strata/strataConfig.cmake"
launcher=""
if command -v ccache > /dev/null; then launcher="-DCMAKE_CXX_COMPILER_LAUNCHER=ccache"; fi
cmake -S "$here" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$work/prefix" $launcher \
  > "$work/configure.log" 2>&1 || { cat "$work/configure.log"; exit 1; }
cmake --build "$work/build"
"$work/build/downstream_app"
