#!/usr/bin/env python3
"""Runs `strata bench hybrid --json` on 8 ranks (the strata binary is the
argument) and checks that every grid layout's tensor-axis bytes, and every
pipeline's boundary bytes, are what the layout's formulas predict
(tools/bench_hybrid.cpp's header): a changed collective in a grid layer, or
a formula that no longer describes the code, fails here. 1D and the other
axes carry the engine's small agreements and chunk padding on top and are
not compared this closely."""
import json
import subprocess
import sys

strata = sys.argv[1]
run = subprocess.run([strata, "run", "-n", "8", "--", strata, "bench", "hybrid", "--tp-modes", "2d,2.5d,3d",
                      "--dim", "32", "--layers", "2", "--context", "16", "--batch", "8", "--steps", "1", "--json"],
                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
if run.returncode != 0:
    sys.exit(f"strata bench hybrid exited {run.returncode}:\n{run.stdout[-4000:]}")
text = "".join(line.split("] ", 1)[1] + "\n" if line.startswith("[rank 0] ") else ""
               for line in run.stdout.splitlines())
start = text.find("{")
if start < 0:
    sys.exit("no JSON document from rank 0")
doc = json.loads(text[start:])
grid = [row for row in doc["layouts"] if row["tp_mode"] != "1d" and row["dims"][2] > 1]
modes = sorted({row["tp_mode"] for row in grid})
if modes != ["2.5d", "2d", "3d"]:
    sys.exit(f"expected layouts in 2d, 2.5d and 3d, got {modes}")
bad = []
for row in grid:
    for axis, slack in (("tp", 0.001), ("pp", 0.02)):
        got, want = row[f"{axis}_bytes"], row[f"{axis}_predicted_bytes"]
        # the pipeline's boundary headers (shapes, tags) come on top: 2% and 1 KiB
        if abs(got - want) > slack * want + (1024 if axis == "pp" else 64):
            bad.append(f"{row['layout']}: {axis} sent {got:.0f} bytes, predicted {want:.0f}")
if bad:
    sys.exit("\n".join(bad))
print(f"{len(grid)} grid layouts: tensor and pipeline bytes as predicted")
