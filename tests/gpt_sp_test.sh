#!/bin/sh
# examples/gpt with sequence parallelism against one process on the whole
# sequence: the per-step losses (averaged over the ranks) of
#   strata run -n 2 -- gpt --sp 2 --sp-mode MODE
# must equal one process's within 1e-5 (relative), step by step.
#   gpt_sp_test.sh STRATA GPT MODE WORKDIR
set -eu
strata=$1 gpt=$2 mode=$3 dir=$4
rm -rf "$dir"
mkdir -p "$dir"
args="--steps 10 --layers 2 --dim 32 --heads 4 --context 32 --batch 4 --print-losses"
"$gpt" $args --nvme-dir "$dir/one" > "$dir/one.txt" 2>&1 || { cat "$dir/one.txt"; echo "gpt sp: one process failed"; exit 1; }
"$strata" run -n 2 -- "$gpt" $args --sp 2 --sp-mode "$mode" --nvme-dir "$dir/sp" > "$dir/sp.txt" 2>&1 ||
  { cat "$dir/sp.txt"; echo "gpt sp: the sp 2 run failed"; exit 1; }
grep '^step [0-9]* loss' "$dir/one.txt" | awk '{print $2, $4}' > "$dir/one.loss"
grep '^\[rank 0\] step [0-9]* loss' "$dir/sp.txt" | awk '{print $4, $6}' > "$dir/sp.loss"
[ "$(wc -l < "$dir/one.loss")" -eq 10 ] || { cat "$dir/one.txt"; echo "gpt sp: one process printed no 10 losses"; exit 1; }
[ "$(wc -l < "$dir/sp.loss")" -eq 10 ] || { cat "$dir/sp.txt"; echo "gpt sp: the sp run printed no 10 losses"; exit 1; }
paste "$dir/one.loss" "$dir/sp.loss" | awk -v mode="$mode" '
  { d = $2 - $4; if (d < 0) d = -d; r = d / ($2 > 0 ? $2 : 1); if (r > worst) worst = r;
    if (r > 1e-5) { printf "gpt sp: step %s loss %s (one process) vs %s (%s, sp 2)\n", $1, $2, $4, mode; bad = 1 } }
  END { if (bad) exit 1; printf "gpt sp: %s at sp 2 matches one process over 10 steps (worst relative difference %.2e)\n", mode, worst }'
