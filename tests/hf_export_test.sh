#!/bin/sh
# A checkpoint of pp 2 x tp 2 exported offline in Hugging Face's layout
# (strata checkpoint export --hf) equals one process's weights after the
# same steps, read back by an independent parser (hf_export_check.py), in
# fp32 and in bf16; and weights imported from it into tp 2 train as one
# process's import of them does.
#   hf_export_test.sh STRATA GPT WORKDIR
set -eu
strata=$1 gpt=$2 dir=$3
here=$(dirname "$0")
rm -rf "$dir"
mkdir -p "$dir"
args="--layers 2 --dim 32 --heads 4 --context 32 --batch 4 --untied-head --steps 3 --print-losses"
fail() { cat "$dir/$1.txt"; echo "hf export: the $1 run failed"; exit 1; }
"$gpt" $args --nvme-dir "$dir/nvme1" --export-weights "$dir/one.safetensors" > "$dir/one.txt" 2>&1 || fail one
"$strata" run -n 4 -- "$gpt" $args --pp 2 --tp 2 --nvme-dir "$dir/nvme4" --save-every 3 --checkpoint-dir "$dir/ckpt" \
  --export-hf "$dir/hf-online" > "$dir/four.txt" 2>&1 || fail four
# Exported by the training ranks themselves (Engine::export_hf), and offline from the checkpoint.
python3 "$here/hf_export_check.py" "$dir/hf-online" "$dir/one.safetensors" F32 1e-5
[ ! -e "$dir/hf-online.parts" ] || { echo "hf export: the parts were left behind"; exit 1; }
"$strata" checkpoint inspect "$dir/ckpt" | grep -q "saved at tp 2 x pp 2, dp 1 at ZeRO 0 (4 parts)" \
  || { "$strata" checkpoint inspect "$dir/ckpt"; echo "hf export: inspect does not name the layout"; exit 1; }
# Small shards: several files.
"$strata" checkpoint export "$dir/ckpt" --hf "$dir/hf" --shard-size 16KB
"$strata" checkpoint export "$dir/ckpt" --hf "$dir/hf-bf16" --shard-size 1GB --dtype bf16
python3 "$here/hf_export_check.py" "$dir/hf" "$dir/one.safetensors" F32 1e-5
python3 "$here/hf_export_check.py" "$dir/hf-bf16" "$dir/one.safetensors" BF16 1e-2
"$strata" checkpoint verify "$dir/hf"
# Imported into tp 2 and into one process, the same losses.
STRATA_INIT_WEIGHTS="$dir/hf" "$gpt" $args --nvme-dir "$dir/nvme1b" > "$dir/import-one.txt" 2>&1 || fail import-one
STRATA_INIT_WEIGHTS="$dir/hf" "$strata" run -n 2 -- "$gpt" $args --tp 2 --nvme-dir "$dir/nvme2" > "$dir/import-tp2.txt" 2>&1 \
  || fail import-tp2
losses() { sed -n 's/^\(\[rank 0\] \)\{0,1\}step \([0-9]*\) loss \([0-9.e+-]*\)$/\2 \3/p' "$1"; }
losses "$dir/one.txt" > "$dir/one.loss"
losses "$dir/import-one.txt" > "$dir/import-one.loss"
losses "$dir/import-tp2.txt" > "$dir/import-tp2.loss"
[ "$(wc -l < "$dir/import-tp2.loss")" -eq 3 ] || { cat "$dir/import-tp2.txt"; echo "hf export: no 3 losses"; exit 1; }
# The import starts where the export ended: below the fresh run's first loss.
awk 'NR == FNR { if (FNR == 1) first = $2; next } FNR == 1 && $2 >= first { exit 1 }' \
  "$dir/one.loss" "$dir/import-one.loss" || { echo "hf export: the import did not start from the trained weights"; exit 1; }
paste "$dir/import-one.loss" "$dir/import-tp2.loss" | awk '
  { d = $2 - $4; if (d < 0) d = -d; r = d / ($2 > 0 ? $2 : 1); if (r > worst) worst = r;
    if (r > 1e-5) { printf "hf export: step %s loss %s (one process) vs %s (tp 2)\n", $1, $2, $4; bad = 1 } }
  END { if (bad) exit 1; printf "hf import: tp 2 trains as one process from the export (worst relative difference %.2e)\n", worst }'
