"""Medians of a benchmark log's step times, and their ratios to the first label's:
    python3 medians.py LOG ANCHOR_LABEL OTHER_LABEL...
LOG holds the workloads' `workload=W label=L step_ms=X ...` lines. Prints one `summary` line per
workload: `ANCHOR_step_ms=… OTHER_step_ms=… OTHER_ratio=…`."""
import re
import statistics
import sys

log, anchor, others = sys.argv[1], sys.argv[2], sys.argv[3:]
rows = [dict(re.findall(r"(\w+)=(\S+)", line)) for line in open(log)]
for w in dict.fromkeys(r["workload"] for r in rows if "workload" in r):
    def med(label):
        vals = [float(r["step_ms"]) for r in rows if r.get("workload") == w and r.get("label") == label]
        return statistics.median(vals) if vals else float("nan")
    n = med(anchor)
    parts = [f"{anchor}_step_ms={n:.3f}"]
    for label in others:
        parts.append(f"{label}_step_ms={med(label):.3f} {label}_ratio={med(label) / n:.3f}")
    print(f"summary workload={w} " + " ".join(parts))
