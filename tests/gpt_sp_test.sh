#!/bin/sh
# examples/gpt with sequence parallelism against the same run without it:
# the per-step losses (averaged over the ranks) must agree within 1e-5
# (relative) at each of 10 steps.
#   gpt_sp_test.sh STRATA GPT MODE WORKDIR [DP]
# DP 1 (default): `strata run -n 2 -- gpt --sp 2` against one process.
# DP 2: `strata run -n 4 -- gpt --sp 2 --zero-stage 2` against
# `strata run -n 2 -- gpt` (data parallel alone; the replicas draw the same
# batches in both).
set -eu
strata=$1 gpt=$2 mode=$3 dir=$4 dp=${5:-1}
rm -rf "$dir"
mkdir -p "$dir"
args="--steps 10 --layers 2 --dim 32 --heads 4 --context 32 --batch 4 --print-losses"
if [ "$dp" = 1 ]; then
  "$gpt" $args --nvme-dir "$dir/one" > "$dir/one.txt" 2>&1 || { cat "$dir/one.txt"; echo "gpt sp: one process failed"; exit 1; }
  "$strata" run -n 2 -- "$gpt" $args --sp 2 --sp-mode "$mode" --nvme-dir "$dir/sp" > "$dir/sp.txt" 2>&1 ||
    { cat "$dir/sp.txt"; echo "gpt sp: the sp 2 run failed"; exit 1; }
  what="$mode at sp 2 matches one process"
else
  "$strata" run -n 2 -- "$gpt" $args --zero-stage 2 --nvme-dir "$dir/one" > "$dir/one.txt" 2>&1 ||
    { cat "$dir/one.txt"; echo "gpt sp: the dp 2 run failed"; exit 1; }
  "$strata" run -n 4 -- "$gpt" $args --sp 2 --sp-mode "$mode" --zero-stage 2 --nvme-dir "$dir/sp" > "$dir/sp.txt" 2>&1 ||
    { cat "$dir/sp.txt"; echo "gpt sp: the dp 2 x sp 2 run failed"; exit 1; }
  what="$mode at dp 2 x sp 2 matches dp 2"
fi
# "step K loss X", from one process or from rank 0 under the launcher.
losses() { sed -n 's/^\(\[rank 0\] \)\{0,1\}step \([0-9]*\) loss \([0-9.e+-]*\)$/\2 \3/p' "$1"; }
losses "$dir/one.txt" > "$dir/one.loss"
losses "$dir/sp.txt" > "$dir/sp.loss"
[ "$(wc -l < "$dir/one.loss")" -eq 10 ] || { cat "$dir/one.txt"; echo "gpt sp: the reference printed no 10 losses"; exit 1; }
[ "$(wc -l < "$dir/sp.loss")" -eq 10 ] || { cat "$dir/sp.txt"; echo "gpt sp: the sp run printed no 10 losses"; exit 1; }
paste "$dir/one.loss" "$dir/sp.loss" | awk -v what="$what" '
  { d = $2 - $4; if (d < 0) d = -d; r = d / ($2 > 0 ? $2 : 1); if (r > worst) worst = r;
    if (r > 1e-5) { printf "gpt sp: step %s loss %s (reference) vs %s\n", $1, $2, $4; bad = 1 } }
  END { if (bad) exit 1; printf "gpt sp: %s over 10 steps (worst relative difference %.2e)\n", what, worst }'
