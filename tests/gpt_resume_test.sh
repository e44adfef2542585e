#!/bin/sh
# examples/gpt interrupted and resumed ends exactly where the uninterrupted run
# does: 6 steps straight, against 4 steps saving a checkpoint, then --resume
# to step 6 (the first part on the 6-step learning-rate schedule, which the
# checkpoint keeps). Both print the last step's loss; the two must be equal.
#   gpt_resume_test.sh GPT WORKDIR [STRATA RANKS "ARGS"]
# With STRATA: every run under `strata run -n RANKS` with ARGS (e.g. --tp 2),
# rank 0's loss compared.
set -eu
gpt=$1
work=$2
launch=""
extra=""
if [ $# -ge 5 ]; then
  launch="$3 run -n $4 --"
  extra=$5
fi
rm -rf "$work" && mkdir -p "$work"
common="--layers 1 --dim 32 --context 16 --batch 4 --nvme-dir $work/nvme $extra"
# The last step's loss, from one process or from rank 0 under the launcher.
last_loss() { sed -n -e '/^\[rank [1-9]/d' -e "s/.*last step's loss //p"; }
straight=$($launch "$gpt" --steps 6 $common | last_loss)
$launch "$gpt" --steps 4 --schedule-steps 6 --save-every 2 --checkpoint-dir "$work/ckpt" $common > "$work/first.log"
resumed=$($launch "$gpt" --steps 6 --resume "$work/ckpt" --export-weights "$work/w.safetensors" $common \
  | tee "$work/resumed.log" | last_loss)
grep -q "resumed from $work/ckpt at step 5" "$work/resumed.log"
ls "$work"/w*.safetensors > /dev/null
echo "straight $straight resumed $resumed"
test -n "$straight" && test "$straight" = "$resumed"
echo "gpt resume: identical"
