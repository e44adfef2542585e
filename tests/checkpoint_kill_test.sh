#!/bin/sh
# kill -9 during `strata checkpoint export --hf` (MODE export) or
# `strata checkpoint convert --to-layout single` (MODE convert), at each
# point the commit passes and at random moments: the output is the previous
# one or the complete new one (every file verifies against its manifest),
# or absent when there was none; never half a directory.
#   hf_export_kill_test.sh STRATA GPT WORKDIR MODE
set -eu
strata=$1 gpt=$2 dir=$3 mode=$4
rm -rf "$dir"
mkdir -p "$dir"
# A checkpoint of two tensor parts, for the conversion to merge.
"$strata" run -n 2 -- "$gpt" --layers 2 --dim 128 --heads 4 --context 32 --batch 4 --steps 1 --untied-head --tp 2 \
  --nvme-dir "$dir/nvme" --save-every 1 --checkpoint-dir "$dir/ckpt" > "$dir/train.txt" 2>&1 \
  || { cat "$dir/train.txt"; exit 1; }
out="$dir/out"
# The tool runs as the shell itself (exec) when $1 is "exec": run in the
# background that way, $! is the tool's own pid, so kill -9 hits the writer
# and not a subshell that would leave it running while the next round starts.
export_to() {
  run_as=
  [ "${1:-}" = exec ] && run_as=exec
  if [ "$mode" = export ]; then
    $run_as "$strata" checkpoint export "$dir/ckpt" --hf "$out" --shard-size 64KB > /dev/null 2>&1
  else
    $run_as "$strata" checkpoint convert "$dir/ckpt" --to-layout single --out "$out" > /dev/null 2>&1
  fi
}
done_file=model.safetensors.index.json
[ "$mode" = export ] || done_file=state.json
# Complete, or absent when allowed ($1 = "may-be-absent").
check() {
  if [ ! -e "$out" ]; then
    [ "$1" = may-be-absent ] || { echo "checkpoint kill: $out vanished ($2)"; exit 1; }
    return 0
  fi
  "$strata" checkpoint verify "$out" > /dev/null 2>&1 && [ -f "$out/$done_file" ] \
    || { "$strata" checkpoint verify "$out"; echo "checkpoint kill: $out is not a complete export ($2)"; exit 1; }
}
# With nothing there before: killed while writing data, the output is absent.
STRATA_CHECKPOINT_KILL_AT=data export_to && { echo "checkpoint kill: the kill point did not fire"; exit 1; }
[ ! -e "$out" ] || { echo "checkpoint kill: a killed first export left $out"; exit 1; }
export_to
check complete "a whole export"
for point in data before-manifest before-rename after-rename; do
  STRATA_CHECKPOINT_KILL_AT=$point export_to && { echo "checkpoint kill: kill point $point did not fire"; exit 1; }
  check complete "killed at $point"
done
i=0
while [ $i -lt 8 ]; do
  i=$((i + 1))
  [ $((i % 2)) -eq 0 ] && rm -rf "$out"
  export_to exec &
  pid=$!
  sleep "0.0$(od -An -N1 -tu1 /dev/urandom | tr -d ' ' | cut -c1)"
  kill -9 "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  check may-be-absent "random kill $i"
done
echo "checkpoint kill: 13 kills during $mode, the output complete or absent every time"
