#!/bin/sh
# The tracer on a sequence-parallel run of examples/gpt: with STRATA_TRACE
# every rank writes its own trace (rank 1's as <path>.rank1.json), and
# `strata trace report` reads it back.
#   gpt_sp_trace_test.sh STRATA GPT WORKDIR
set -eu
strata=$1 gpt=$2 dir=$3
rm -rf "$dir"
mkdir -p "$dir"
STRATA_TRACE="$dir/t.json" "$strata" run -n 2 -- "$gpt" --sp 2 --steps 3 --layers 1 --dim 32 --context 16 --batch 4 \
  --nvme-dir "$dir/nvme" > "$dir/run.txt" 2>&1 || { cat "$dir/run.txt"; echo "gpt sp trace: the run failed"; exit 1; }
test -s "$dir/t.json" || { echo "gpt sp trace: rank 0 wrote no trace"; exit 1; }
"$strata" trace report "$dir/t.rank1.json"
