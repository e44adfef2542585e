#!/usr/bin/env bash
# Build strata on a GPU machine against its pip LibTorch and CUDA, then run
# the GPU-labelled tests, `strata bench step --device cuda` (strata at 100%,
# 50% and 25% of the model state on the device against plain LibTorch with
# everything on the GPU) and `strata bench optim --cuda` (the CUDA kernels
# against a device copy of the same bytes). It fits in one 10-minute run;
# each phase has a time limit. Results go to OUTDIR (default $OUT):
# gpu_check.log, gpu_check.json (the summary), bench_step.json, bench_optim.json.
#
# GPU machines have CUDA, cmake, ninja and torch (pip) but no Debian dev
# packages and no network, so strata's other dependencies travel as .deb files:
#
#   here (Debian 12, network):  tools/gpu_check.sh fetch     # -> .debs/ (git-ignored)
#   there (carry .debs):         tools/gpu_check.sh [OUTDIR]
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

out="${1:-${OUT:-}}"
[ -n "$out" ] && mkdir -p "$out"
log() { if [ -n "$out" ]; then tee -a "$out/gpu_check.log"; else cat; fi; }
put() { if [ -n "$out" ]; then cat > "$out/$1"; else cat; fi; }  # a result file under $OUT

# Time limits of the phases: the whole script fits in 10 minutes of one run.
# Build 270 + tests 80 + bench step 180 + bench optim 40 s, with unpacking
# and configuring, leave about half a minute of the 600.
build_s=${STRATA_GPU_BUILD_S:-270}
tests_s=${STRATA_GPU_TESTS_S:-80}
step_s=${STRATA_GPU_STEP_S:-180}
optim_s=${STRATA_GPU_OPTIM_S:-40}

{
  ls .debs/*.deb > /dev/null 2>&1 || { echo "no .debs/: run 'tools/gpu_check.sh fetch' on a Debian machine and carry .debs"; exit 2; }
  prefix=/tmp/strata-deps
  step "unpacking $(ls .debs/*.deb | wc -l) .deb files into $prefix"
  mkdir -p "$prefix"
  for f in .debs/*.deb; do dpkg-deb -x "$f" "$prefix"; done
  export LD_LIBRARY_PATH="$prefix/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

  torch_prefix="$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)')"
  torch_version="$(python3 -c 'import torch;print(torch.__version__, "cuda", torch.version.cuda)')"
  step "torch $torch_version at $torch_prefix"
  gpu="$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo none)"
  echo "gpu: $gpu"

  step "configuring build-gpu"
  cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_PREFIX_PATH="$torch_prefix;$prefix/usr" -DCMAKE_LIBRARY_ARCHITECTURE=x86_64-linux-gnu \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DCUDAToolkit_ROOT=/usr/local/cuda 2>&1 | grep -E "strata:|Torch|CUDA|Error|error" || true
  step "building with $(nproc) jobs (at most ${build_s} s)"
  start=$SECONDS
  build_rc=0
  timeout "$build_s" cmake --build build-gpu -j "$(nproc)" -- -k 0 || build_rc=$?
  build_time=$((SECONDS - start))
  echo "built in ${build_time} s (exit status $build_rc)"

  step "strata info"
  build-gpu/tools/strata info || true

  step "GPU-labelled tests (at most ${tests_s} s)"
  tests_rc=0
  (cd build-gpu && timeout "$tests_s" ctest -L gpu --output-on-failure --timeout 60) 2>&1 | tee /tmp/strata-gpu-tests.log || tests_rc=$?
  summary="$(grep -E "tests passed|tests failed" /tmp/strata-gpu-tests.log | tail -1)"
  echo "tests: $summary"

  # The step against plain LibTorch with everything on the GPU, at 100%, 50%
  # and 25% of the model state on the device (and the other rows), at about
  # 100 M and 300 M parameters (1.6 and 5 GB of fp32 AdamW state).
  step "strata bench step --device cuda (at most ${step_s} s)"
  step_rc=0
  timeout "$step_s" build-gpu/tools/strata bench step --device cuda --sizes 1024x8,2048x6 --batch 8 --context 256 \
    --steps 2 --warmup 1 --nvme-dir /tmp/strata-bench-step --json > /tmp/strata-bench-step.json || step_rc=$?
  cat /tmp/strata-bench-step.json
  put bench_step.json < /tmp/strata-bench-step.json

  step "strata bench optim --cuda (at most ${optim_s} s)"
  optim_rc=0
  timeout "$optim_s" build-gpu/tools/strata bench optim --cuda --params 64M --threads "$(nproc)" --iters 5 --json \
    > /tmp/strata-bench-optim.json || optim_rc=$?
  cat /tmp/strata-bench-optim.json
  put bench_optim.json < /tmp/strata-bench-optim.json

  step "summary"
  python3 - "$torch_version" "$gpu" "$build_rc" "$build_time" "$tests_rc" "$summary" "$step_rc" "$optim_rc" <<'PY' | put gpu_check.json
import json, sys
keys = ["torch", "gpu", "build_exit", "build_s", "gpu_tests_exit", "gpu_tests", "bench_step_exit", "bench_optim_exit"]
print(json.dumps(dict(zip(keys, sys.argv[1:])), indent=2))
PY
  [ -n "$out" ] && cat "$out/gpu_check.json"
  [ "$build_rc" = 0 ] && [ "$tests_rc" = 0 ] && [ "$step_rc" = 0 ] && [ "$optim_rc" = 0 ]
} 2>&1 | log
exit "${PIPESTATUS[0]}"
