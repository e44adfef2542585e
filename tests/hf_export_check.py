#!/usr/bin/env python3
"""An independent reader of Hugging Face's sharded safetensors layout (the
standard library only, none of strata's code): every tensor of the exported
directory HF equals the same tensor of the one-process weights file REF
(strata's export_weights) within TOL, dtype conversions included, and the
index maps every tensor to a shard that holds it.
    hf_export_check.py HF REF DTYPE TOL
Prints "hf export: N tensors in K shards equal the one-process weights"."""
import json
import os
import struct
import sys

def read_file(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    header.pop("__metadata__", None)
    return header, data[8 + n:]

def values(entry, payload):
    begin, end = entry["data_offsets"]
    raw = payload[begin:end]
    count = 1
    for s in entry["shape"]:
        count *= s
    dtype = entry["dtype"]
    if dtype == "F32":
        return list(struct.unpack("<%df" % count, raw))
    if dtype == "BF16":
        halves = struct.unpack("<%dH" % count, raw)
        return [struct.unpack("<f", struct.pack("<I", h << 16))[0] for h in halves]
    if dtype == "F16":
        return list(struct.unpack("<%de" % count, raw))
    raise SystemExit("hf export: unexpected dtype %s" % dtype)

def main():
    hf, ref_path, want_dtype, tol = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
    index = json.load(open(os.path.join(hf, "model.safetensors.index.json")))
    ref_header, ref_payload = read_file(ref_path)
    shards = {}
    total = 0
    for name, shard in index["weight_map"].items():
        if shard not in shards:
            shards[shard] = read_file(os.path.join(hf, shard))
        header, payload = shards[shard]
        if name not in header:
            raise SystemExit("hf export: %s is not in %s, which the index names" % (name, shard))
        entry = header[name]
        if entry["dtype"] != want_dtype:
            raise SystemExit("hf export: %s is %s, expected %s" % (name, entry["dtype"], want_dtype))
        ref = ref_header.get(name)
        if ref is None:
            raise SystemExit("hf export: %s is not in the one-process weights" % name)
        if entry["shape"] != ref["shape"]:
            raise SystemExit("hf export: %s is %s, one process's %s" % (name, entry["shape"], ref["shape"]))
        got, expected = values(entry, payload), values(ref, ref_payload)
        for i, (g, e) in enumerate(zip(got, expected)):
            if abs(g - e) > tol * max(1.0, abs(e)):
                raise SystemExit("hf export: %s[%d] is %r, one process's %r" % (name, i, g, e))
        total += entry["data_offsets"][1] - entry["data_offsets"][0]
    names = set(index["weight_map"])
    if names != set(ref_header):
        raise SystemExit("hf export: tensors %s differ from one process's" % sorted(names ^ set(ref_header)))
    if index["metadata"]["total_size"] != total:
        raise SystemExit("hf export: total_size %d, the tensors hold %d" % (index["metadata"]["total_size"], total))
    count = len(shards)
    want = set("model-%05d-of-%05d.safetensors" % (k, count) for k in range(1, count + 1))
    present = set(f for f in os.listdir(hf) if f.startswith("model-"))
    if set(shards) != want or present != want:
        raise SystemExit("hf export: shards %s (index) and %s (files), expected %s" %
                         (sorted(shards), sorted(present), sorted(want)))
    for shard, (header, _) in shards.items():
        for name in header:
            if index["weight_map"].get(name) != shard:
                raise SystemExit("hf export: %s holds %s, which the index puts elsewhere" % (shard, name))
    print("hf export: %d tensors in %d shards equal the one-process weights" % (len(names), len(shards)))

main()
