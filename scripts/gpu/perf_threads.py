"""Where a process's time goes, by thread, from `perf` call graphs (issue 25: what the default
configuration costs a step, part by part). Two modes:

    perf script -F comm,tid,ip,sym,dso -i DATA | python3 perf_threads.py aggregate LABEL STEPS > FILE.json
    python3 perf_threads.py report RATE FILE.json [FILE.json ...]

`aggregate` reads perf's samples (each a thread name, then its frames, innermost first) and
counts, per thread name: the sample's innermost library (`leaf_dso`) and symbol (`leaf_sym`);
the samples with a frame in each of a few libraries anywhere on the stack (`incl`: the time
spent in or under that library: `libcachealloc` is the shim with what it calls, `libc10_cuda`
PyTorch's own allocator); and, with Python 3.12's perf trampolines (`python3 -X perf`), the
innermost Python function (`py_inner`), whose samples are that function's own bytecode and the
C it calls directly (`py_cachealloc_inner`: those of the Python integration's functions).
STEPS is the number of steps the samples cover.

`report` prints, for each thread name and counter, a table with one column per file: ms a step
(samples / STEPS / RATE, RATE the sampling frequency in kHz). Several processes per
configuration are worth comparing: processes differ by several per cent as a whole (every
library's share scales together), which is why these tables name where a cost is and the
within-process and lockstep benchmarks say how much it is. Run by
scripts/gpu/thread_profile.sh."""
import collections
import json
import os
import sys

MARKERS = ("libcachealloc.so", "libcachealloc_torch", "libc10_cuda", "libcuda.so", "libcudart",
           "libtorch_cuda", "libtorch_cpu", "libtorch_python", "kernel.kallsyms", "[nvidia]")
KEEP = 400  # entries kept per counter


def aggregate(lines, label, steps):
    """The counters of one process's samples (see the module docs)."""
    threads = collections.defaultdict(lambda: collections.defaultdict(collections.Counter))

    def sample(comm, frames):
        if comm is None or not frames:
            return
        t = threads[comm]
        t["n"]["samples"] += 1
        sym, dso = frames[0]
        t["leaf_dso"][os.path.basename(dso)] += 1
        t["leaf_sym"][f"{sym} [{os.path.basename(dso)}]"] += 1
        for marker in MARKERS:
            if any(marker in d for _, d in frames):
                t["incl"][marker] += 1
        py = next((s for s, _ in frames if s.startswith("py::")), None)
        if py is not None:
            t["py_inner"][py] += 1
            if "cachealloc_" in py:
                t["incl"]["py_cachealloc_inner"] += 1

    comm, frames = None, []
    for line in lines:
        if not line.strip():
            sample(comm, frames)
            comm, frames = None, []
        elif not line[0].isspace():
            sample(comm, frames)
            comm, frames = line.split()[0], []
        else:
            fields = line.strip().split(None, 1)
            if len(fields) == 2:
                rest = fields[1]
                at = rest.rfind(" (")
                frames.append((rest[:at], rest[at + 2:-1]) if at >= 0 else (rest, "?"))
    sample(comm, frames)
    return {
        "label": label,
        "steps": steps,
        "threads": {
            comm: {k: dict(c.most_common(KEEP)) for k, c in counters.items()}
            for comm, counters in threads.items()
        },
    }


def report(rate_khz, profiles, out=sys.stdout, floor=0.05):
    """Tables of ms a step per thread and counter, a column per profile; rows under `floor`
    ms in every column are left out."""
    labels = [p["label"] for p in profiles]

    def per_step(p, comm, counter):
        counts = p["threads"].get(comm, {}).get(counter, {})
        return {k: v / max(p["steps"], 1) / rate_khz for k, v in counts.items()}

    comms = sorted({c for p in profiles for c in p["threads"]},
                   key=lambda c: -max(per_step(p, c, "n").get("samples", 0) for p in profiles))
    for comm in comms:
        totals = [per_step(p, comm, "n").get("samples", 0) for p in profiles]
        if max(totals) < floor:
            continue
        print(f"== {comm}: ms a step " + " ".join(f"{t:.2f}" for t in totals), file=out)
        for counter in ("leaf_dso", "incl"):
            rows = [per_step(p, comm, counter) for p in profiles]
            keys = {k for r in rows for k, v in r.items() if v >= floor}
            print(f"  {counter:<34}" + "".join(f"{label[:10]:>11}" for label in labels), file=out)
            for k in sorted(keys, key=lambda k: -max(r.get(k, 0) for r in rows)):
                print(f"  {k[:34]:<34}" + "".join(f"{r.get(k, 0):>11.3f}" for r in rows), file=out)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "aggregate":
        json.dump(aggregate(sys.stdin, sys.argv[2], int(sys.argv[3])), sys.stdout)
    elif len(sys.argv) >= 4 and sys.argv[1] == "report":
        report(float(sys.argv[2]), [json.load(open(f)) for f in sys.argv[3:]])
    else:
        sys.exit(__doc__)
