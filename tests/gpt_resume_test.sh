#!/bin/sh
# examples/gpt interrupted and resumed ends exactly where the uninterrupted run
# does: 6 steps straight, against 4 steps saving a checkpoint, then --resume
# to step 6 (the first part on the 6-step learning-rate schedule, which the
# checkpoint keeps). Both print the last step's loss; the two must be equal.
#   gpt_resume_test.sh GPT WORKDIR
set -eu
gpt=$1
work=$2
rm -rf "$work" && mkdir -p "$work"
common="--layers 1 --dim 32 --context 16 --batch 4 --nvme-dir $work/nvme"
straight=$("$gpt" --steps 6 $common | sed -n "s/.*last step's loss //p")
"$gpt" --steps 4 --schedule-steps 6 --save-every 2 --checkpoint-dir "$work/ckpt" $common > "$work/first.log"
resumed=$("$gpt" --steps 6 --resume "$work/ckpt" --export-weights "$work/w.safetensors" $common | tee "$work/resumed.log" \
  | sed -n "s/.*last step's loss //p")
grep -q "resumed from $work/ckpt at step 5" "$work/resumed.log"
test -s "$work/w.safetensors"
echo "straight $straight resumed $resumed"
test -n "$straight" && test "$straight" = "$resumed"
echo "gpt resume: identical"
