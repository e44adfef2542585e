#!/bin/sh
# A checkpoint saved under one layout resumes under another (Note
# [Checkpoints across layouts]): examples/gpt trains 3 steps under BEFORE and
# saves, then resumes under AFTER to step 6; every one of the 6 losses must
# be one process's, trained straight through, within 1e-5 (relative). The
# layouts change the summation order, so not bit for bit.
#   gpt_reshard_test.sh STRATA GPT WORKDIR NAME N_BEFORE "BEFORE" N_AFTER "AFTER" [convert]
# N 1 runs the example directly, more under `strata run -n N`. With
# "convert", the checkpoint goes through `strata checkpoint convert
# --to-layout single` (offline, one part) before the resume; with "like",
# through `convert --like` a checkpoint AFTER saved (of 1 step, from another
# seed's data: only its layout is used). Prints
# "gpt reshard: NAME matches one process over 6 steps" when they match.
set -eu
strata=$1 gpt=$2 dir=$3 name=$4 n_before=$5 before=$6 n_after=$7 after=$8 convert=${9:-}
[ "$before" = none ] && before=""
[ "$after" = none ] && after=""
rm -rf "$dir"
mkdir -p "$dir"
# Untied: the example ties the head only in some layouts, and a checkpoint is of one model.
args="--layers 2 --dim 32 --heads 4 --context 32 --batch 4 --print-losses --untied-head --schedule-steps 6"
run() {  # run RANKS OUT ARGS...
  n=$1 out=$2
  shift 2
  if [ "$n" = 1 ]; then
    "$gpt" $args "$@" --nvme-dir "$dir/$out-nvme" > "$dir/$out.txt" 2>&1
  else
    "$strata" run -n "$n" -- "$gpt" $args "$@" --nvme-dir "$dir/$out-nvme" > "$dir/$out.txt" 2>&1
  fi || { cat "$dir/$out.txt"; echo "gpt reshard: the $out run ($n ranks, $*) failed"; exit 1; }
}
run 1 straight --steps 6
run "$n_before" before --steps 3 --save-every 3 --checkpoint-dir "$dir/ckpt" $before
ckpt="$dir/ckpt"
if [ "$convert" = convert ]; then
  "$strata" checkpoint convert "$ckpt" --to-layout single --out "$dir/single"
  ckpt="$dir/single"
  "$strata" checkpoint inspect "$ckpt" | grep -q "saved at tp 1 x pp 1" || { echo "gpt reshard: not one part"; exit 1; }
elif [ "$convert" = like ]; then
  run "$n_after" template --steps 1 --save-every 1 --checkpoint-dir "$dir/template" $after
  "$strata" checkpoint convert "$ckpt" --like "$dir/template" --out "$dir/like"
  ckpt="$dir/like"
  want=$("$strata" checkpoint inspect "$dir/template" | head -1 | sed 's/.*saved at \([^,]*\),.*/\1/')
  "$strata" checkpoint inspect "$ckpt" | head -1 | grep -q "saved at $want" \
    || { "$strata" checkpoint inspect "$ckpt" | head -1; echo "gpt reshard: not the layout of $want"; exit 1; }
fi
run "$n_after" after --steps 6 --resume "$ckpt" $after
grep -q "resumed from $ckpt at step 4" "$dir/after.txt" || { cat "$dir/after.txt"; echo "gpt reshard: no resume"; exit 1; }
# "step K loss X", from one process or from rank 0 under the launcher.
losses() { sed -n 's/^\(\[rank 0\] \)\{0,1\}step \([0-9]*\) loss \([0-9.e+-]*\)$/\2 \3/p' "$1"; }
losses "$dir/straight.txt" > "$dir/straight.loss"
{ losses "$dir/before.txt"; losses "$dir/after.txt"; } > "$dir/changed.loss"
for f in straight changed; do
  [ "$(wc -l < "$dir/$f.loss")" -eq 6 ] || { cat "$dir/$f.loss"; echo "gpt reshard: the $f losses are not 6"; exit 1; }
done
paste "$dir/straight.loss" "$dir/changed.loss" | awk -v what="$name" '
  { if ($1 != $3) { printf "gpt reshard: step %s beside step %s\n", $1, $3; bad = 1 }
    d = $2 - $4; if (d < 0) d = -d; r = d / ($2 > 0 ? $2 : 1); if (r > worst) worst = r;
    if (r > 1e-5) { printf "gpt reshard: step %s loss %s (one process) vs %s\n", $1, $2, $4; bad = 1 } }
  END { if (bad) exit 1; printf "gpt reshard: %s matches one process over 6 steps (worst relative difference %.2e)\n", what, worst }'
