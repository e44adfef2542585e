#!/usr/bin/env bash
# Fuzzes the checkpoint parsers (fuzz/fuzz_checkpoint.cpp) with libFuzzer,
# AddressSanitizer and UndefinedBehaviorSanitizer for a bounded time.
#
#   scripts/fuzz.sh [SECONDS]    default 60; needs clang and libclang-rt-14-dev
#                                (scripts/setup.sh test installs them)
#
# Builds into build-fuzz/ with clang (the parsers and strata_core's sources
# only: no LibTorch), seeds a corpus with a valid safetensors file and a valid
# manifest, and fails if libFuzzer finds a crash; the input that crashed is
# left in build-fuzz/ as crash-*.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
seconds="${1:-60}"
out="$root/build-fuzz"
mkdir -p "$out/corpus"
command -v clang++ > /dev/null || { echo "clang++ is missing: run scripts/setup.sh test first" >&2; exit 1; }

echo "==> building the fuzz target with clang (its sources side by side, then one link)"
sources=(fuzz/fuzz_checkpoint.cpp checkpoint/safetensors.cpp checkpoint/checkpoint_dir.cpp checkpoint/files.cpp
  core/error.cpp core/bytes.cpp core/log.cpp core/dtype.cpp)
common=(-std=c++17 -g -O1 -fno-sanitize-recover=undefined)
rm -rf "$out/obj" && mkdir -p "$out/obj"
pids=()
for src in "${sources[@]}"; do
  # fuzzer-no-link: instrumented for libFuzzer, whose main joins at the link below.
  clang++ "${common[@]}" -fsanitize=fuzzer-no-link,address,undefined -I"$root/core/include" \
    -I"$root/checkpoint/include" -c "$root/$src" -o "$out/obj/${src//\//_}.o" &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done  # set -e: a failed compile stops the script here
clang++ "${common[@]}" -fsanitize=fuzzer,address,undefined "$out"/obj/*.o -lfmt -lxxhash -o "$out/fuzz_checkpoint"

# Seeds: selector byte 0 + a safetensors file; selector byte 1 + a manifest.
header='{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"__metadata__":{"format":"pt"}}'
python3 - "$out/corpus" "$header" <<'PY'
import struct, sys
d, header = sys.argv[1], sys.argv[2].encode()
open(d + "/safetensors", "wb").write(b"\0" + struct.pack("<Q", len(header)) + header + b"\0" * 8)
open(d + "/manifest", "wb").write(b"\1" + b'{"format": "strata-checkpoint", "version": 1, "kind": "strata-engine", '
    b'"files": [{"name": "state.json", "bytes": 10, "xxh3_64": "0123456789abcdef"}]}')
PY

echo "==> fuzzing for ${seconds} s"
cd "$out"
./fuzz_checkpoint -max_total_time="$seconds" -max_len=4096 -print_final_stats=1 corpus 2>&1 | tail -15
echo "fuzzing found no crash in ${seconds} s"
