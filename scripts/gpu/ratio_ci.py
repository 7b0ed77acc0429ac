"""Paired-round ratios with a bootstrap interval, from a log of `workload=W label=L step_ms=X ...`
lines written by alternating rounds (A, B, A, B, ...):
    python3 ratio_ci.py LOG ANCHOR OTHER [FIELD]
For each workload: the median of FIELD (default step_ms) per label, the median of the per-round
ratios OTHER/ANCHOR (round i pairs the i-th line of each label), and its 95 % bootstrap interval
(10 000 resamples of the rounds, seeded). Prints one `ratio` line per workload."""
import random
import re
import statistics
import sys

log, anchor, other = sys.argv[1], sys.argv[2], sys.argv[3]
field = sys.argv[4] if len(sys.argv) > 4 else "step_ms"
rows = [dict(re.findall(r"(\w+)=(\S+)", line)) for line in open(log)]
for w in dict.fromkeys(r["workload"] for r in rows if "workload" in r):
    a = [float(r[field]) for r in rows if r.get("workload") == w and r.get("label") == anchor and field in r]
    b = [float(r[field]) for r in rows if r.get("workload") == w and r.get("label") == other and field in r]
    n = min(len(a), len(b))
    if n == 0:
        continue
    ratios = [b[i] / a[i] for i in range(n)]
    rng = random.Random(0)
    boots = sorted(
        statistics.median(rng.choice(ratios) for _ in range(n)) for _ in range(10_000)
    )
    low, high = boots[249], boots[9749]
    print(
        f"ratio workload={w} field={field} rounds={n} {anchor}={statistics.median(a):.4f} "
        f"{other}={statistics.median(b):.4f} ratio={statistics.median(ratios):.4f} "
        f"ci95=[{low:.4f},{high:.4f}]"
    )
