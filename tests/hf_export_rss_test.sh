#!/bin/sh
# `strata checkpoint export --hf` streams: its peak RSS stays within what
# `strata checkpoint verify` (which streams every file through a checksum)
# takes in the same binary, plus the shard size, plus 24 MiB, for a
# checkpoint whose fp32 weights alone (about 50 MB) are far more than that,
# of a model whose state (197 MiB) was trained at 4x its host budget.
#   hf_export_rss_test.sh STRATA GPT WORKDIR
set -eu
strata=$1 gpt=$2 dir=$3
rm -rf "$dir"
mkdir -p "$dir"
"$gpt" --layers 4 --dim 512 --heads 8 --context 16 --batch 2 --steps 1 --untied-head --nvme-dir "$dir/nvme" \
  --host-budget 48MiB --save-every 1 --checkpoint-dir "$dir/ckpt" > "$dir/train.txt" 2>&1 \
  || { cat "$dir/train.txt"; exit 1; }
kib() { sed -n 's/.*peak RSS \([0-9.]*\) \([KMG]\)iB.*/\1 \2/p' | awk '{ m = $2 == "K" ? 1 : $2 == "M" ? 1024 : 1048576; printf "%d\n", $1 * m }'; }
base=$("$strata" checkpoint verify "$dir/ckpt" | tee "$dir/verify.txt" | kib)
"$strata" checkpoint export "$dir/ckpt" --hf "$dir/hf" --shard-size 4MiB | tee "$dir/export.txt"
peak=$(kib < "$dir/export.txt")
weights=$(sed -n 's/.* shards\{0,1\}, \([0-9.]*\) MiB in fp32.*/\1/p' "$dir/export.txt")
echo "export peak RSS ${peak} KiB, verify's ${base} KiB, weights ${weights} MiB"
[ -n "$peak" ] && [ -n "$base" ] && [ "$peak" -le $((base + 4096 + 24576)) ] \
  || { echo "hf export rss: the export took more than verify + shard + 24 MiB"; exit 1; }
echo "hf export rss: within verify + shard + 24 MiB, for ${weights} MiB of weights"
