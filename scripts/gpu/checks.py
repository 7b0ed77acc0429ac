"""The line protocol of the GPU check scripts (mem_pools.py, memory_history.py,
torch_settings.py, gpu_trace.py) that check.sh's `both` runs natively and under the shim: one line per check,
`TAG label=L check=NAME ok=True|False detail=...`, and a last `TAG label=L passed=N/M`. LABEL
(env) names the run."""
import os


class Checks:
    """Runs checks and prints their lines under `tag`."""

    def __init__(self, tag):
        self.tag = tag
        self.label = os.environ.get("LABEL", "-")
        self.results = []

    def check(self, name, fn):
        """Run `fn`, which returns (ok, detail); an exception is a failed check, its first line
        the detail (the point is to see what breaks)."""
        try:
            ok, detail = fn()
        except Exception as e:
            first = str(e).splitlines()[0][:200] if str(e) else ""
            ok, detail = False, f"{type(e).__name__}: {first}"
        self.results.append(ok)
        print(f"{self.tag} label={self.label} check={name} ok={ok} detail={detail}", flush=True)

    def summary(self):
        """The last line: how many checks passed."""
        print(f"{self.tag} label={self.label} passed={sum(self.results)}/{len(self.results)}", flush=True)


def run_ranks(prefix, target, args, world=2, timeout=240):
    """Run `target(rank, world, *args)` in `world` spawned processes (a rank a GPU, as the
    multi-GPU scripts run them) and print `PREFIX passed=N/WORLD`, N the ranks that exited with
    0, or `PREFIX skipped: K GPU(s)` on a machine with fewer GPUs. Returns the exit code."""
    import multiprocessing as mp

    import torch

    if torch.cuda.device_count() < world:
        print(f"{prefix} skipped: {torch.cuda.device_count()} GPU(s)", flush=True)
        return 0
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(rank, world, *args)) for rank in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    passed = sum(p.exitcode == 0 for p in procs)
    print(f"{prefix} passed={passed}/{world}", flush=True)
    return 0 if passed == world else 1
