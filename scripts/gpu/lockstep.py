"""Configurations that cannot share a process (PyTorch's own allocator against the shim, the
shim's settings read at start), compared step by step as if they shared one: one process per
configuration, all alive at once, taking turns a training step at a time (issue 25).

    LIB=DIR/libcachealloc.so python3 scripts/gpu/lockstep.py MODEL ROUNDS LOG LABEL...
    LIB_old=A/libcachealloc.so LIB_new=B/libcachealloc.so \\
        python3 scripts/gpu/lockstep.py MODEL ROUNDS LOG native shim@old shim@new

MODEL is one of models.py's (llama, cnn, mlp, gpt2). Every LABEL's process builds the model
(the same seed), trains 6 warm-up steps, then waits. Round `r`: each process in turn, in an
order that rotates with `r`, runs step `r` untimed and then step `r` timed (each synchronized),
while the others wait on their pipes, idle. So the machine's slow drifts and bursts (the
neighbours, the clocks: the ±15 % seen between separate processes) fall on every label of a
round alike, and the per-round ratios (`scripts/gpu/ratio_ci.py LOG native LABEL`) see what
separate processes cannot. What stays per process (where its memory and threads landed) is
averaged by running the whole set again: SETS (default 1) sets of fresh processes, ROUNDS
rounds each; ratio_ci.py's interval then resamples the sets before their rounds (on the
allocation-heavy Llama, five or more sets of ~20 rounds).

Labels: `native` (PyTorch's caching allocator), `shim` (the default), and the default with one
part off: `notrace` (`trace:off`: the route and pools alone), `nocategories`, `nostacks`
(`stacks:none`), `fixed` (`expandable_segments:False`), `notrace_fixed` (both); a suffix
starts another process of the same configuration (`native.2`: a second native process, to see
how much processes of one configuration differ). `@BUILD` after a shim label runs that process
with the library `$LIB_BUILD` instead of `$LIB` (`LIB_old=… LIB_new=… … shim@old shim@new`:
two builds in lockstep, where separate processes one after another could not see 1 %). CPUS
(e.g. 4-5) pins every process to that CPU set; only one runs at a time. Pinned to two CPUs, a
second native process sits within ~1 % of the first on mlp and 0.3 % on gpt2 (BENCHMARKS.md,
"Lockstep").

Prints each label's median step and, for each label after the first, the median of per-round
ratios to the first with its 95 % interval (ratio_ci.py over the whole LOG: start a fresh one).
Writes `workload=MODEL label=L set=S round=R step_ms=X main_ms=Y proc_ms=Z cpu=C` lines to LOG
(`main_ms`: the main thread's CPU time in the timed step; `proc_ms`: all its threads' (autograd's
backward, the recorder); `cpu`: the CPU the main thread ended on), and each process's
last line: peak reserved and allocated and the trained parameters' sum (`final=1`)."""
import os
import statistics
import subprocess
import sys
import time

CONFS = {
    "native": None,
    "shim": "log:quiet",
    "notrace": "log:quiet,trace:off",
    "nocategories": "log:quiet,categories:off",
    "nostacks": "log:quiet,stacks:none",
    "fixed": "log:quiet,expandable_segments:False",
    "notrace_fixed": "log:quiet,trace:off,expandable_segments:False",
}


def current_cpu():
    """The CPU the calling thread last ran on (field 39 of /proc/thread-self/stat)."""
    with open("/proc/thread-self/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[36]


def worker(model_name):
    """One configuration's process: build, warm up, then a timed step per `step R` line on
    stdin, answered by a line on stdout; `end` prints the final line and exits."""
    import torch
    from models import build  # beside this file (sys.path[0])

    torch.manual_seed(0)
    step, model = build(model_name)
    for i in range(6):
        step(i)
    torch.cuda.synchronize()
    print("ready", flush=True)
    for line in sys.stdin:
        words = line.split()
        if words[0] == "end":
            break
        r = int(words[1])
        step(r)
        torch.cuda.synchronize()
        t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
        step(r)
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1000
        main_ms, proc_ms = (time.thread_time() - c0) * 1000, (time.process_time() - p0) * 1000
        print(
            f"step_ms={ms:.4f} main_ms={main_ms:.4f} proc_ms={proc_ms:.4f} cpu={current_cpu()}",
            flush=True,
        )
    mb = 1 << 20
    param_sum = sum(p.detach().double().sum().item() for p in model.parameters())
    print(
        f"torch_max_reserved_MB={torch.cuda.max_memory_reserved() / mb:.1f} "
        f"torch_max_allocated_MB={torch.cuda.max_memory_allocated() / mb:.1f} "
        f"param_sum={param_sum:.6g}",
        flush=True,
    )


def library(label, build):
    """The library a shim label's process preloads: `$LIB`, or `$LIB_BUILD` for `CONF@BUILD`."""
    name = f"LIB_{build}" if build else "LIB"
    if not os.environ.get(name):
        sys.exit(f"lockstep.py: label {label!r} needs {name}=PATH of a libcachealloc.so")
    return os.path.realpath(os.environ[name])


def start(label, model_name):
    conf, at, build = label.split(".")[0].partition("@")
    if conf not in CONFS or (at and (not build or CONFS[conf] is None)):
        sys.exit(
            f"lockstep.py: unknown label {label!r}; valid: {', '.join(CONFS)} "
            "(@BUILD after a shim label for $LIB_BUILD, .N for more)"
        )
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    if CONFS[conf] is not None:
        env["LD_PRELOAD"] = library(label, build)
        env["CACHEALLOC_CONF"] = CONFS[conf]
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", model_name]
    if os.environ.get("CPUS"):
        cmd = ["taskset", "-c", os.environ["CPUS"]] + cmd
    p = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    return p


def answer(p, label):
    """The process's next line, or exit naming the label if it ended."""
    line = p.stdout.readline()
    if not line:
        sys.exit(f"lockstep.py: the {label} process ended (rc {p.wait()})")
    return line.strip()


def run_set(model_name, rounds, labels, set_no, log):
    procs = {label: start(label, model_name) for label in labels}
    for label, p in procs.items():
        line = answer(p, label)
        while line != "ready":  # a library's start-up message: passed on
            print(f"[{label}] {line}", file=sys.stderr)
            line = answer(p, label)
    for r in range(rounds):
        k = r % len(labels)
        for label in labels[k:] + labels[:k]:
            p = procs[label]
            p.stdin.write(f"step {r}\n")
            p.stdin.flush()
            fields = answer(p, label)
            print(f"workload={model_name} label={label} set={set_no} round={r} {fields}", file=log)
    for label, p in procs.items():
        p.stdin.write("end\n")
        p.stdin.flush()
        final = answer(p, label)
        print(f"workload={model_name} label={label} set={set_no} final=1 {final}", file=log)
        p.wait()
    log.flush()


def main():
    if sys.argv[1] == "--worker":
        return worker(sys.argv[2])
    model_name, rounds, log_path, labels = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
    with open(log_path, "a") as log:
        for s in range(int(os.environ.get("SETS", "1"))):
            t0 = time.time()
            run_set(model_name, rounds, labels, s, log)
            took = time.time() - t0
            print(f"set {s}: {rounds} rounds of {len(labels)} in {took:.0f} s", file=sys.stderr)
    rows = [
        line for line in open(log_path) if "final=1" not in line and f"workload={model_name} " in line
    ]
    for label in labels:
        steps = [
            float(line.split("step_ms=")[1].split()[0]) for line in rows if f" label={label} " in line
        ]
        if steps:
            print(f"{label}: {len(steps)} steps, median {statistics.median(steps):.3f} ms")
    # Each label against the first: the paired rounds' ratio and its interval (of the whole LOG).
    ratio_ci = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ratio_ci.py")
    for label in labels[1:]:
        subprocess.run([sys.executable, ratio_ci, log_path, labels[0], label], check=False)


if __name__ == "__main__":
    main()
