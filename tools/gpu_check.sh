#!/usr/bin/env bash
# Build strata on a GPU machine against its pip LibTorch and CUDA, and run the
# GPU-labelled tests (then the unit and LibTorch tests, and `strata info`).
#
# GPU machines have CUDA, cmake, ninja and torch (pip) but no Debian dev
# packages and no network, so strata's other dependencies travel as .deb files:
#
#   here (Debian 12, network):  tools/gpu_check.sh fetch     # -> .debs/ (git-ignored)
#   there (carry .debs):         tools/gpu_check.sh [OUTDIR]  # logs go to OUTDIR if given
#
# The .debs are unpacked into a private prefix (never into /), which is put
# first on CMAKE_PREFIX_PATH and LD_LIBRARY_PATH.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
step() { printf '\n==> %s\n' "$*"; }

debs=(
  libhwloc-dev libhwloc15 libudev1 liburing-dev liburing2 libjemalloc-dev libjemalloc2
  nlohmann-json3-dev libcli11-dev libfmt-dev libfmt9 libxxhash-dev libxxhash0
  libgtest-dev libgmock-dev libgloo-dev
)

if [ "${1:-}" = fetch ]; then
  step "downloading ${#debs[@]} .deb files into .debs/"
  mkdir -p .debs
  (cd .debs && apt-get download "${debs[@]}")
  du -sh .debs
  exit 0
fi

out="${1:-}"
[ -n "$out" ] && mkdir -p "$out"
log() { if [ -n "$out" ]; then tee -a "$out/gpu_check.log"; else cat; fi; }

{
  ls .debs/*.deb > /dev/null 2>&1 || { echo "no .debs/: run 'tools/gpu_check.sh fetch' on a Debian machine and carry .debs"; exit 2; }
  prefix=/tmp/strata-deps
  step "unpacking $(ls .debs/*.deb | wc -l) .deb files into $prefix"
  mkdir -p "$prefix"
  for f in .debs/*.deb; do dpkg-deb -x "$f" "$prefix"; done
  export LD_LIBRARY_PATH="$prefix/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

  torch_prefix="$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)')"
  step "torch $(python3 -c 'import torch;print(torch.__version__, "cuda", torch.version.cuda)') at $torch_prefix"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

  step "configuring build-gpu"
  cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_PREFIX_PATH="$torch_prefix;$prefix/usr" -DCMAKE_LIBRARY_ARCHITECTURE=x86_64-linux-gnu \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DCUDAToolkit_ROOT=/usr/local/cuda 2>&1 | grep -E "strata:|Torch|CUDA|Error|error" || true
  step "building with $(nproc) jobs"
  start=$SECONDS
  cmake --build build-gpu -j "$(nproc)"
  echo "built in $((SECONDS - start)) s"

  step "strata info"
  build-gpu/tools/strata info
  step "GPU-labelled tests"
  (cd build-gpu && ctest -L gpu --output-on-failure)
  step "unit and LibTorch tests on the GPU machine"
  (cd build-gpu && ctest -j 8 -L "unit|torch" --output-on-failure)
  step "main example with the device tier on the GPU"
  build-gpu/examples/offload_demo
} 2>&1 | log
