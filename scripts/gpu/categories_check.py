"""Check cachealloc's categories against the program's own count (issue 23):
    categories_check.py TRUTH.json AT_ANNOTATIONS.json SUMMARY.txt
TRUTH.json is what `categories.py MODEL truth` wrote (bytes of parameters, optimizer state,
gradients and saved tensors at instants of each step, each annotated in the trace);
AT_ANNOTATIONS.json is `cachealloc memory-timeline TRACE --at-annotations -o …`; SUMMARY.txt is
`cachealloc summary TRACE`. At each annotation after the first step (the first step creates the
optimizer's state), compares PARAMETER, OPTIMIZER_STATE and GRADIENT with the truth (within 1 %,
or 1 MiB for the gradients when there are none) and ACTIVATION after the forward (within 5 %),
and the share of UNKNOWN bytes at the peak (at most 5 %). Prints one line per instant and a
final `PASS`/`FAIL` line; exits 1 on a failure."""
import json
import re
import sys

truth = json.load(open(sys.argv[1]))
# The requests' bytes: the tensors' own (a block's size adds the allocator's rounding).
ours = {r["annotation"]: r["requested"] for r in json.load(open(sys.argv[2]))}
summary = open(sys.argv[3]).read()
model = truth["model"]
failed = []
worst = {}


def check(name, category, want, got, tolerance, floor=0):
    error = abs(got - want)
    allowed = max(tolerance * want, floor)
    rel = error / want if want else (0.0 if error == 0 else float("inf"))
    worst[category] = max(worst.get(category, 0.0), rel)
    ok = error <= allowed
    if not ok:
        failed.append(f"{name} {category}: ours {got} truth {want}")
    return f"{category}={got}/{want}({rel * 100:.2f}%){'' if ok else '!'}"


for row in truth["truth"]:
    name = row["annotation"]
    step = int(name.split()[-1])
    if name not in ours:
        failed.append(f"{name}: not in the trace's annotations")
        continue
    got = ours[name]
    parts = [check(name, "PARAMETER", row["parameter"], got["PARAMETER"], 0.01)]
    if step >= 1:
        parts.append(
            check(name, "OPTIMIZER_STATE", row["optimizer_state"], got["OPTIMIZER_STATE"], 0.01)
        )
    parts.append(check(name, "GRADIENT", row["gradient"], got["GRADIENT"], 0.01, 1 << 20))
    if "activation" in row:
        parts.append(check(name, "ACTIVATION", row["activation"], got["ACTIVATION"], 0.05))
    print(f"{model} {name}: " + " ".join(parts))

m = re.search(r"by category at peak allocated:(.*?)\n  \S", summary, re.S)
unknown = 0.0
if m:
    u = re.search(r"UNKNOWN\s+\S+ \S+\s+([\d.]+)%", m.group(1))
    unknown = float(u.group(1)) if u else 0.0
else:
    failed.append("the summary shows no categories at the peak")
if unknown > 5.0:
    failed.append(f"UNKNOWN at the peak: {unknown}% of it")
summary_line = " ".join(f"{c}={w * 100:.2f}%" for c, w in worst.items())
print(f"{model} worst errors: {summary_line}; UNKNOWN at the peak {unknown}%")
if failed:
    print(f"FAIL categories {model}: " + "; ".join(failed[:6]))
    sys.exit(1)
print(f"PASS categories {model}")
