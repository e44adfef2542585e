#!/bin/sh
# Two routes to one layout: examples/gpt trains 3 steps under A and under B
# (layouts that train alike), saves each, and resumes both under AFTER to
# step 6. Where AFTER changes the data-parallel world, the batches change
# with it, so one process straight through is no reference; the route
# through B is: all six losses of the two routes must agree within 1e-5.
#   gpt_reshard_routes_test.sh STRATA GPT WORKDIR NAME N_A "A" N_B "B" N_AFTER "AFTER"
set -eu
strata=$1 gpt=$2 dir=$3 name=$4 n_a=$5 a=$6 n_b=$7 b=$8 n_after=$9
shift 9
after=$1
for v in a b after; do eval "[ \"\$$v\" = none ] && $v=''" || true; done
rm -rf "$dir"
mkdir -p "$dir"
args="--layers 2 --dim 32 --heads 4 --context 32 --batch 4 --print-losses --untied-head --schedule-steps 6"
run() {  # run RANKS OUT ARGS...
  n=$1 out=$2
  shift 2
  if [ "$n" = 1 ]; then
    "$gpt" $args "$@" --nvme-dir "$dir/$out-nvme" > "$dir/$out.txt" 2>&1
  else
    "$strata" run -n "$n" -- "$gpt" $args "$@" --nvme-dir "$dir/$out-nvme" > "$dir/$out.txt" 2>&1
  fi || { cat "$dir/$out.txt"; echo "gpt reshard routes: the $out run ($n ranks, $*) failed"; exit 1; }
}
losses() { sed -n 's/^\(\[rank 0\] \)\{0,1\}step \([0-9]*\) loss \([0-9.e+-]*\)$/\2 \3/p' "$1"; }
for route in a b; do
  eval "n=\$n_$route layout=\$$route"
  run "$n" "$route-before" --steps 3 --save-every 3 --checkpoint-dir "$dir/$route-ckpt" $layout
  run "$n_after" "$route-after" --steps 6 --resume "$dir/$route-ckpt" $after
  { losses "$dir/$route-before.txt"; losses "$dir/$route-after.txt"; } > "$dir/$route.loss"
  [ "$(wc -l < "$dir/$route.loss")" -eq 6 ] || { cat "$dir/$route.loss"; echo "gpt reshard routes: not 6 losses"; exit 1; }
done
paste "$dir/a.loss" "$dir/b.loss" | awk -v what="$name" '
  { d = $2 - $4; if (d < 0) d = -d; r = d / ($2 > 0 ? $2 : 1); if (r > worst) worst = r;
    if (r > 1e-5) { printf "gpt reshard routes: step %s loss %s vs %s\n", $1, $2, $4; bad = 1 } }
  END { if (bad) exit 1; printf "gpt reshard routes: %s agree over 6 steps (worst relative difference %.2e)\n", what, worst }'
