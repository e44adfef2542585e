#!/bin/sh
# examples/gpt run two ways must print the same per-step losses (averaged
# over the ranks) within 1e-5 (relative) at each of 10 steps: a reference
# run and a parallel one of the same model on the same batches.
#   gpt_losses_match.sh STRATA GPT WORKDIR NAME REF_RANKS "REF_ARGS" RANKS "ARGS"
# RANKS 1 runs the example directly, more under `strata run -n RANKS`; REF_ARGS
# "none" for none.
# Prints "gpt: NAME over 10 steps" when they match.
set -eu
strata=$1 gpt=$2 dir=$3 name=$4 ref_n=$5 ref_args=$6 n=$7 run_args=$8
[ "$ref_args" = none ] && ref_args=""
rm -rf "$dir"
mkdir -p "$dir"
args="--steps 10 --layers 2 --dim 32 --heads 4 --context 32 --batch 4 --print-losses"
run() {  # run RANKS OUT EXTRA_ARGS
  if [ "$1" = 1 ]; then
    "$gpt" $args $3 --nvme-dir "$dir/$2-nvme" > "$dir/$2.txt" 2>&1
  else
    "$strata" run -n "$1" -- "$gpt" $args $3 --nvme-dir "$dir/$2-nvme" > "$dir/$2.txt" 2>&1
  fi || { cat "$dir/$2.txt"; echo "gpt: the $2 run ($1 ranks, $3) failed"; exit 1; }
}
run "$ref_n" reference "$ref_args"
run "$n" parallel "$run_args"
# "step K loss X", from one process or from rank 0 under the launcher.
losses() { sed -n 's/^\(\[rank 0\] \)\{0,1\}step \([0-9]*\) loss \([0-9.e+-]*\)$/\2 \3/p' "$1"; }
losses "$dir/reference.txt" > "$dir/reference.loss"
losses "$dir/parallel.txt" > "$dir/parallel.loss"
for f in reference parallel; do
  [ "$(wc -l < "$dir/$f.loss")" -eq 10 ] || { cat "$dir/$f.txt"; echo "gpt: the $f run printed no 10 losses"; exit 1; }
done
paste "$dir/reference.loss" "$dir/parallel.loss" | awk -v what="$name" '
  { d = $2 - $4; if (d < 0) d = -d; r = d / ($2 > 0 ? $2 : 1); if (r > worst) worst = r;
    if (r > 1e-5) { printf "gpt: step %s loss %s (reference) vs %s\n", $1, $2, $4; bad = 1 } }
  END { if (bad) exit 1; printf "gpt: %s over 10 steps (worst relative difference %.2e)\n", what, worst }'
