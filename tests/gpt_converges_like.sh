#!/bin/sh
# examples/gpt trained two ways over STEPS steps must learn alike: the mean
# loss of the last 10 steps of the second run within TOL (relative) of the
# first's, and each run's below its mean over the first 10 steps by at
# least a fifth (both learn). For runs that differ by design (a relaxed
# mode), where gpt_losses_match.sh's step-by-step 1e-5 cannot hold.
#   gpt_converges_like.sh GPT WORKDIR NAME STEPS TOL "REF_ARGS" "ARGS"
# Prints "gpt: NAME converges like the reference over STEPS steps" when they do.
set -eu
gpt=$1 dir=$2 name=$3 steps=$4 tol=$5 ref_args=$6 run_args=$7
rm -rf "$dir"
mkdir -p "$dir"
args="--steps $steps --layers 2 --dim 64 --heads 4 --context 32 --batch 8 --print-losses"
run() {  # run OUT EXTRA_ARGS
  "$gpt" $args $2 --nvme-dir "$dir/$1-nvme" > "$dir/$1.txt" 2>&1 ||
    { cat "$dir/$1.txt"; echo "gpt: the $1 run ($2) failed"; exit 1; }
  sed -n 's/^step \([0-9]*\) loss \([0-9.e+-]*\)$/\2/p' "$dir/$1.txt" > "$dir/$1.loss"
  [ "$(wc -l < "$dir/$1.loss")" -eq "$steps" ] || { cat "$dir/$1.txt"; echo "gpt: the $1 run printed no $steps losses"; exit 1; }
}
run reference "$ref_args"
run relaxed "$run_args"
paste "$dir/reference.loss" "$dir/relaxed.loss" | awk -v n="$steps" -v tol="$tol" -v what="$name" '
  NR <= 10 { rf += $1; xf += $2 }
  NR > n - 10 { rl += $1; xl += $2 }
  END {
    rf /= 10; xf /= 10; rl /= 10; xl /= 10
    d = (xl - rl) / rl; if (d < 0) d = -d
    printf "gpt: mean loss of the first 10 steps %.4f (reference) %.4f (%s), of the last 10 %.4f %.4f: %.2e apart\n", rf, xf, what, rl, xl, d
    if (rl > 0.8 * rf || xl > 0.8 * xf) { print "gpt: a run did not learn"; exit 1 }
    if (d > tol) { print "gpt: the last losses differ by more than " tol; exit 1 }
    printf "gpt: %s converges like the reference over %d steps\n", what, n }'
