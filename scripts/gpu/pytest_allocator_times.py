"""A pytest plugin that counts and times the allocator entry points PyTorch's tests reach
(graph trees' pool checks, snapshots, statistics), natively or under the shim, and prints them
when pytest ends: `SNAPTIME NAME calls=N total_s=S`. How the twenty-fourth session found that
`memory_snapshot()` took 1.9 s a call under the shim (BENCHMARKS.md, "Memory snapshots, not
Python stacks, in a compile-bound graph tree test"). Use it from the test's folder:
    PYTHONPATH=/path/to/scripts/gpu python3 -m pytest -s -p pytest_allocator_times TEST_ID
(under LD_PRELOAD the library puts its Python integration first on PYTHONPATH; this folder
stays on it)."""
import time

calls = {}


def _wrap(owner, name, label):
    f = getattr(owner, name, None)
    if f is None:
        return

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            c = calls.setdefault(label, [0, 0.0])
            c[0] += 1
            c[1] += time.perf_counter() - start

    setattr(owner, name, timed)


def pytest_configure(config):
    import torch
    import torch.cuda.memory  # the shim's integration replaces its entry points on import

    for name in ("_cuda_memorySnapshot", "_cuda_checkPoolLiveAllocations", "_cuda_getCheckpointState",
                 "_cuda_setCheckpointPoolState", "_cuda_memoryStats"):
        _wrap(torch._C, name, name)
    # memory_snapshot() may not go through torch._C's entry point (under the shim it asks for
    # the segments alone); the one in torch.cuda is what callers use.
    _wrap(torch.cuda, "memory_snapshot", "torch.cuda.memory_snapshot")


def pytest_unconfigure(config):
    for name, (count, total) in sorted(calls.items()):
        print(f"SNAPTIME {name} calls={count} total_s={total:.2f}", flush=True)
