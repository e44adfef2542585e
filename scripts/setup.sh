#!/usr/bin/env bash
# strata's one entry point for a new machine (Debian 12, root).
#
#   scripts/setup.sh demo   install what is missing, build the libraries, `strata`
#                           and the examples (no tests), run the main example
#   scripts/setup.sh test   install what is missing, build everything, run the whole
#                           test suite, then the non-LibTorch unit tests under ASan +
#                           UBSan and TSan, then fuzz the checkpoint parsers for 30 s
#   scripts/setup.sh test-torch2 [CTEST ARGS...]
#                           build and test against LibTorch 2.6 and g++ 14 in a
#                           Debian 13 (trixie) chroot made by mmdebstrap and cached
#                           under ~/.cache/strata; CTEST ARGS (e.g. -L torch) pick
#                           tests, the whole suite by default
#
# Idempotent: packages already present are not reinstalled, and builds are
# incremental (ccache across clones). Every step says what it does.
set -euo pipefail

mode="${1:-}"
case "$mode" in
  demo|test|test-torch2|torch2-inside) ;;
  *) echo "usage: $0 demo|test|test-torch2 [ctest args...]" >&2; exit 2 ;;
esac
shift

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
jobs="$(nproc)"
# A test with no TIMEOUT of its own is stopped after this long: a hang fails one
# test, with its output, instead of running until CI gives up on the whole run.
test_timeout="${STRATA_TEST_TIMEOUT:-900}"
step() { printf '\n==> %s\n' "$*"; }

# What a build and the test suite need, on Debian 12 and in the trixie chroot.
# libopenblas0-pthread: LibTorch's fp32 matmuls go through libblas.so.3, which
# is otherwise Debian's unoptimised reference BLAS (about 10x slower here).
# python3: an independent reader of exported weights (tests/hf_export_check.py).
build_packages=(
  g++ cmake ninja-build ccache pkg-config
  libtorch-dev libopenblas0-pthread libgloo-dev libhwloc-dev liburing-dev libjemalloc-dev
  nlohmann-json3-dev libcli11-dev libfmt-dev libxxhash-dev
  googletest libgtest-dev libgmock-dev fio fortunes-min libxml2-utils
  python3
)
case "$mode" in
  # The demo needs neither the fuzzer's clang nor the benchmark library.
  demo) packages=("${build_packages[@]}") ;;
  # clang, libclang-rt-14-dev: libFuzzer for the checkpoint parsers (scripts/fuzz.sh).
  test) packages=("${build_packages[@]}" libbenchmark-dev clang libclang-rt-14-dev) ;;
  test-torch2) packages=() ;;            # mmdebstrap below; the chroot has build_packages
  torch2-inside) packages=() ;;          # installed by mmdebstrap
esac

install_missing() {  # <packages...>
  local missing=() p
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    step "installing ${#missing[@]} Debian package(s): ${missing[*]}"
    local sudo_cmd=()
    [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
    "${sudo_cmd[@]}" apt-get update -q
    DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"
  else
    step "all $# Debian packages already installed"
  fi
}
[ ${#packages[@]} -eq 0 ] || install_missing "${packages[@]}"

# ccache: share hits between clones in different folders, with the precompiled
# LibTorch header (Note [One precompiled LibTorch header]). CMakeLists.txt puts
# the same on its launcher; these cover what no strata build launches (the
# downstream test's own project).
export CCACHE_BASEDIR="$root" CCACHE_NOHASHDIR=1 CCACHE_MAXSIZE="${CCACHE_MAXSIZE:-5G}"
export CCACHE_SLOPPINESS="${CCACHE_SLOPPINESS:-pch_defines,time_macros,include_file_mtime,include_file_ctime}"

configure_and_build() {  # <build dir> <cmake args...>
  local dir="$1"; shift
  step "configuring $dir ($*)"
  cmake -S "$root" -B "$root/$dir" -G Ninja "$@" > "$root/$dir.configure.log" 2>&1 || {
    cat "$root/$dir.configure.log"; exit 1; }
  grep -E "^-- strata:" "$root/$dir.configure.log" || true
  step "building $dir with $jobs jobs"
  local start=$SECONDS
  cmake --build "$root/$dir" -j "$jobs" "${build_targets[@]}"
  echo "built $dir in $((SECONDS - start)) s"
}
build_targets=()

if [ "$mode" = test-torch2 ]; then
  # Note [LibTorch 2.x in a chroot]
  # Debian 12 has LibTorch 1.13 only; Debian 13 (trixie), in the same
  # registry, has 2.6 with g++ 14. mmdebstrap makes a trixie root with
  # build_packages (about a minute); it is kept under ~/.cache/strata, named
  # by a hash of its package list, so a new list makes a new one. The tree is
  # bind-mounted at /src inside a private mount namespace (unshare -m), so
  # nothing stays mounted when the run ends, however it ends; ccache has a
  # directory of its own there (another ccache version, another compiler).
  install_missing mmdebstrap util-linux
  # Root with CAP_SYS_ADMIN, for the mount namespace and chroot; 77 says "cannot here".
  unshare --mount --propagation private true 2> /dev/null || {
    echo "test-torch2: cannot make a private mount namespace here (unshare --mount needs root with" \
      "CAP_SYS_ADMIN); run it as root on a machine or container that allows mounts" >&2
    exit 77
  }
  cache="${STRATA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/strata}"
  key="$(printf '%s\n' trixie "${build_packages[@]}" | sha256sum | cut -c1-12)"
  chroot_dir="$cache/trixie-$key"
  if [ ! -x "$chroot_dir/usr/bin/g++" ]; then
    step "making a Debian 13 (trixie) chroot with LibTorch 2.6 and g++ 14 in $chroot_dir"
    mkdir -p "$cache"
    partial="$chroot_dir.partial"
    rm -rf --one-file-system "$partial"
    start=$SECONDS
    mmdebstrap --variant=apt --include="$(IFS=,; echo "${build_packages[*]}")" trixie "$partial" \
      > "$cache/trixie-$key.log" 2>&1 || { tail -30 "$cache/trixie-$key.log"; exit 1; }
    mv "$partial" "$chroot_dir"
    echo "made the chroot in $((SECONDS - start)) s"
  else
    step "using the trixie chroot in $chroot_dir"
  fi
  mkdir -p "$cache/ccache-trixie" "$chroot_dir/src" "$chroot_dir/ccache"
  step "building and testing in the chroot (LibTorch $(chroot "$chroot_dir" dpkg-query -W -f='${Version}' libtorch-dev))"
  exec env CACHE_DIR="$cache/ccache-trixie" unshare --mount --propagation private -- sh -c '
    set -e
    r="$1"; shift
    mount --bind "$0" "$r/src"
    mount --bind "$CACHE_DIR" "$r/ccache"
    mount -t proc proc "$r/proc"
    mount --rbind /dev "$r/dev"
    mount --rbind /sys "$r/sys"
    exec chroot "$r" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 CCACHE_DIR=/ccache \
      ${STRATA_COMM_TIMEOUT:+STRATA_COMM_TIMEOUT="$STRATA_COMM_TIMEOUT"} bash /src/scripts/setup.sh torch2-inside "$@"
  ' "$root" "$chroot_dir" "$@"
fi

if [ "$mode" = torch2-inside ]; then
  # Inside the chroot (Note [LibTorch 2.x in a chroot]): no CUDA there (the
  # host's build compiles the .cu files), no debug information, and -O1: this
  # build checks that strata compiles and passes against 2.6, not its speed
  # (the host's -O2 build runs the benchmarks). g++ 14 compiled one of
  # strata_parallel's unity batches in 18.0 s at -O1 against 33.8 s at -O2.
  configure_and_build build-torch2 -DCMAKE_BUILD_TYPE=Release "-DCMAKE_CXX_FLAGS_RELEASE=-O1 -DNDEBUG" \
    "-DCMAKE_C_FLAGS_RELEASE=-O1 -DNDEBUG" -DSTRATA_WITH_CUDA=OFF
  step "running the test suite against LibTorch 2.6 (ctest ${*:-all})"
  start=$SECONDS
  (cd "$root/build-torch2" && ctest -j "$jobs" --timeout "$test_timeout" --output-on-failure "$@")
  echo "LibTorch 2.6 test suite took $((SECONDS - start)) s"
  exit 0
fi

if [ "$mode" = demo ]; then
  # Only what the demo runs: the libraries come with these (tests build with `test`).
  build_targets=(--target strata offload_demo gpt)
fi
# -g1: line tables only (backtraces and perf keep file:line), which compiles
# the LibTorch files about 11% faster than -g; configure build/ yourself for
# full debug information.
configure_and_build build -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -g1 -DNDEBUG" \
  "-DCMAKE_C_FLAGS_RELWITHDEBINFO=-O2 -g1 -DNDEBUG"

if [ "$mode" = demo ]; then
  step "strata info"
  "$root/build/tools/strata" info
  step "examples/offload_demo: an MLP through device, host and NVMe tiers, checked against plain LibTorch"
  "$root/build/examples/offload_demo"
  step "the main example: examples/gpt trains a small GPT on Debian's fortunes corpus (a few minutes)"
  "$root/build/examples/gpt"
  exit 0
fi

step "running the test suite (ctest, all labels; gpu tests skip without a GPU)"
start=$SECONDS
(cd "$root/build" && ctest -j "$jobs" --timeout "$test_timeout" --output-on-failure)
echo "test suite took $((SECONDS - start)) s"

# The sanitizer builds at -O1 -g1 (the optimisation ASan's docs suggest; line
# tables for the reports' file:line): memory/trace.cpp compiles in 16.6 s
# under ASan so, against 35.8 s at the default -O2 -g.
sanitizer_flags=(-DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG"
  "-DCMAKE_C_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG")
configure_and_build build-asan -DSTRATA_SANITIZE=ON -DSTRATA_WITH_TORCH=OFF -DSTRATA_BUILD_EXAMPLES=OFF \
  "${sanitizer_flags[@]}"
step "running the unit tests under AddressSanitizer + UndefinedBehaviorSanitizer"
start=$SECONDS
(cd "$root/build-asan" && ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1 \
  ctest -j "$jobs" --timeout "$test_timeout" -L unit --output-on-failure)
echo "sanitizer run took $((SECONDS - start)) s"

# The concurrent parts (chunk manager threads, copy engine, NVMe store, the
# kernel thread pool, the device arena's deferred frees and the emulated copy
# streams) under ThreadSanitizer: only the three test programs that hold them are built.
build_targets=(--target kernels_test offload_test memory_test)
configure_and_build build-tsan -DSTRATA_TSAN=ON -DSTRATA_WITH_TORCH=OFF -DSTRATA_WITH_CUDA=OFF \
  -DSTRATA_BUILD_EXAMPLES=OFF "${sanitizer_flags[@]}"
build_targets=()
step "running the concurrency tests under ThreadSanitizer"
start=$SECONDS
(cd "$root/build-tsan" && TSAN_OPTIONS=halt_on_error=1 \
  ctest -j "$jobs" --timeout "$test_timeout" -R "Concurrency|NvmeStoreTest|ThreadCount|DeviceArena|EmulatedStreams|EvictionWaits|ArrivalNotTheCaller|ShortOfRoomWaitsForUploads|CopyEngine|ThreadPool" -E "Leftovers" \
  --output-on-failure)
echo "thread sanitizer run took $((SECONDS - start)) s"

# The checkpoint and safetensors parsers under libFuzzer (bounded; scripts/fuzz.sh SECONDS for longer).
step "fuzzing the checkpoint parsers for 30 s"
"$root/scripts/fuzz.sh" 30
