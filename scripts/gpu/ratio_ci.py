"""Paired-round ratios with a bootstrap interval, from a log of `workload=W label=L step_ms=X ...`
lines written by alternating rounds (A, B, A, B, ...):
    python3 ratio_ci.py LOG ANCHOR OTHER [FIELD]
For each workload: the median of FIELD (default step_ms) per label, the median of the per-round
ratios OTHER/ANCHOR (round i pairs the i-th line of each label), and its 95 % bootstrap interval
(10 000 resamples, seeded). Prints one `ratio` line per workload.

Lines with `set=S` (lockstep.py: a fresh process per label and set) pair rounds within their set,
and the interval resamples the sets first, then the rounds of each set drawn: processes of one
configuration differ (where their memory and threads landed: 2-8 % on the allocation-heavy Llama),
and an interval over rounds alone would not see that, however many rounds. The line then also
gives `sets=N` and each set's median ratio (`per_set=`). With one set, or without `set=`, the
rounds are resampled as before."""
import random
import re
import statistics
import sys

log, anchor, other = sys.argv[1], sys.argv[2], sys.argv[3]
field = sys.argv[4] if len(sys.argv) > 4 else "step_ms"
rows = [dict(re.findall(r"(\w+)=(\S+)", line)) for line in open(log)]
for w in dict.fromkeys(r["workload"] for r in rows if "workload" in r):

    def values(label, s):
        return [
            float(r[field])
            for r in rows
            if r.get("workload") == w and r.get("label") == label and field in r
            and r.get("set") == s
        ]

    sets = list(dict.fromkeys(r.get("set") for r in rows if r.get("workload") == w))
    per_set, a_all, b_all = [], [], []
    for s in sets:
        a, b = values(anchor, s), values(other, s)
        n = min(len(a), len(b))
        if n:
            per_set.append([b[i] / a[i] for i in range(n)])
            a_all += a
            b_all += b
    if not per_set:
        continue
    ratios = [x for set_ratios in per_set for x in set_ratios]
    rng = random.Random(0)
    if len(per_set) > 1:
        boots = []
        for _ in range(10_000):
            drawn = [rng.choice(per_set) for _ in per_set]
            boots.append(statistics.median(rng.choice(d) for d in drawn for _ in d))
    else:
        boots = [statistics.median(rng.choice(ratios) for _ in ratios) for _ in range(10_000)]
    boots.sort()
    low, high = boots[249], boots[9749]
    sets_part = ""
    if len(per_set) > 1:
        medians = ",".join(f"{statistics.median(r):.4f}" for r in per_set)
        sets_part = f" sets={len(per_set)} per_set=[{medians}]"
    print(
        f"ratio workload={w} field={field} rounds={len(ratios)} "
        f"{anchor}={statistics.median(a_all):.4f} {other}={statistics.median(b_all):.4f} "
        f"ratio={statistics.median(ratios):.4f} "
        f"ci95=[{low:.4f},{high:.4f}]{sets_part}"
    )
