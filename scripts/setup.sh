#!/usr/bin/env bash
# strata's one entry point for a new machine (Debian 12, root).
#
#   scripts/setup.sh demo   install what is missing, build, run the main example
#   scripts/setup.sh test   install what is missing, build, run the whole test suite,
#                           then the non-LibTorch unit tests under ASan + UBSan and
#                           TSan, then fuzz the checkpoint parsers for 30 s
#
# Idempotent: packages already present are not reinstalled, and builds are
# incremental (ccache across clones). Every step says what it does.
set -euo pipefail

mode="${1:-}"
case "$mode" in
  demo|test) ;;
  *) echo "usage: $0 demo|test" >&2; exit 2 ;;
esac

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
jobs="$(nproc)"
step() { printf '\n==> %s\n' "$*"; }

# clang, libclang-rt-14-dev: libFuzzer for the checkpoint parsers (scripts/fuzz.sh).
# libopenblas0-pthread: LibTorch's fp32 matmuls go through libblas.so.3, which
# is otherwise Debian's unoptimised reference BLAS (about 10x slower here).
packages=(
  g++ cmake ninja-build ccache pkg-config
  libtorch-dev libopenblas0-pthread libgloo-dev libhwloc-dev liburing-dev libjemalloc-dev
  nlohmann-json3-dev libcli11-dev libfmt-dev libxxhash-dev
  googletest libgtest-dev libgmock-dev libbenchmark-dev fio fortunes-min libxml2-utils
  clang libclang-rt-14-dev
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  step "installing ${#missing[@]} Debian package(s): ${missing[*]}"
  sudo_cmd=()
  [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
  "${sudo_cmd[@]}" apt-get update -q
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"
else
  step "all ${#packages[@]} Debian packages already installed"
fi

# ccache: share hits between clones in different folders.
export CCACHE_BASEDIR="$root" CCACHE_NOHASHDIR=1 CCACHE_MAXSIZE="${CCACHE_MAXSIZE:-5G}"

configure_and_build() {  # <build dir> <cmake args...>
  local dir="$1"; shift
  step "configuring $dir ($*)"
  cmake -S "$root" -B "$root/$dir" -G Ninja "$@" > "$root/$dir.configure.log" 2>&1 || {
    cat "$root/$dir.configure.log"; exit 1; }
  grep -E "^-- strata:" "$root/$dir.configure.log" || true
  step "building $dir with $jobs jobs"
  local start=$SECONDS
  cmake --build "$root/$dir" -j "$jobs"
  echo "built $dir in $((SECONDS - start)) s"
}

configure_and_build build -DCMAKE_BUILD_TYPE=RelWithDebInfo

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
(cd "$root/build" && ctest -j "$jobs" --output-on-failure)
echo "test suite took $((SECONDS - start)) s"

configure_and_build build-asan -DSTRATA_SANITIZE=ON -DSTRATA_WITH_TORCH=OFF -DSTRATA_BUILD_EXAMPLES=OFF
step "running the unit tests under AddressSanitizer + UndefinedBehaviorSanitizer"
start=$SECONDS
(cd "$root/build-asan" && ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1 \
  ctest -j "$jobs" -L unit --output-on-failure)
echo "sanitizer run took $((SECONDS - start)) s"

# The concurrent parts (chunk manager threads, copy engine, NVMe store, the
# device arena's deferred frees and the emulated copy streams) under ThreadSanitizer.
configure_and_build build-tsan -DSTRATA_TSAN=ON -DSTRATA_WITH_TORCH=OFF -DSTRATA_WITH_CUDA=OFF \
  -DSTRATA_BUILD_EXAMPLES=OFF
step "running the concurrency tests under ThreadSanitizer"
start=$SECONDS
(cd "$root/build-tsan" && TSAN_OPTIONS=halt_on_error=1 \
  ctest -j "$jobs" -R "Concurrency|NvmeStoreTest|ThreadCount|DeviceArena|EmulatedStreams|EvictionWaits|ArrivalNotTheCaller|ShortOfRoomWaitsForUploads" -E "Leftovers" \
  --output-on-failure)
echo "thread sanitizer run took $((SECONDS - start)) s"

# The checkpoint and safetensors parsers under libFuzzer (bounded; scripts/fuzz.sh SECONDS for longer).
step "fuzzing the checkpoint parsers for 30 s"
"$root/scripts/fuzz.sh" 30
