"""The host cost of one tensor allocation and free through PyTorch's allocator entry, for
comparing routes process by process (issue 25): natively, with PyTorch's own
`backend:cudaMallocAsync`, and under the shim (same command, the environment chooses):

    LABEL=native python3 route_micro.py
    LABEL=async PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync python3 route_micro.py
    LABEL=shim LD_PRELOAD=.../libcachealloc.so python3 route_micro.py
    LABEL=pluggable ROUTE=pluggable CACHEALLOC_CONF=torch_caching:keep LD_PRELOAD=... python3 route_micro.py

Each size is warmed up, then `torch.empty(size)` and its release run PAIRS times (default
200 000) in ROUNDS rounds; one line per size, the median of the rounds in µs per pair:
    workload=alloc_pair_SIZE label=L us_per_pair=X
No kernel runs: this is the allocator's and PyTorch's bookkeeping on the host, which an
allocation-heavy, CPU-bound training step pays about 2 400 times a step (1 200 allocations and
their frees), against the Python and dispatcher cost of `torch.empty` itself, the same on
every route."""
import os
import statistics
import time

import torch

from pluggable import use_if_asked

LABEL = os.environ.get("LABEL", "-")
PAIRS = int(os.environ.get("PAIRS", "200000"))
ROUNDS = int(os.environ.get("ROUNDS", "5"))
SIZES = [512, 64 << 10, 4 << 20]

use_if_asked()
device = torch.device("cuda:0")
torch.empty(1, device=device)  # context and allocator up
for size in SIZES:
    for _ in range(1000):
        torch.empty(size, dtype=torch.uint8, device=device)
    rounds = []
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        for _ in range(PAIRS):
            torch.empty(size, dtype=torch.uint8, device=device)
        rounds.append((time.perf_counter() - t0) / PAIRS * 1e6)
    torch.cuda.synchronize()
    print(
        f"workload=alloc_pair_{size} label={LABEL} us_per_pair={statistics.median(rounds):.4f}",
        flush=True,
    )
