"""PyTorch's allocator features across two GPUs, natively and under the shim (same command): a
CUDA graph captured and replayed on GPU 1 while another thread trains on GPU 0 (capture mode
"thread_local", as such a program must), and one MemPool used on both devices.

Prints one line per check, `multi_gpu_features label=L check=NAME ok=True|False detail=...`,
and a last `multi_gpu_features label=L passed=N/M` (0/0, "skipped", with fewer than two GPUs).
GRAPH_DEVICE=0 runs the graph checks on one GPU (the capture beside the training thread on the
same device) and skips the MemPool check.
"""
import os
import sys
import threading
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import Checks  # noqa: E402

warnings.simplefilter("ignore")
checks = Checks("multi_gpu_features")
check = checks.check
MIB = 1 << 20

GRAPH_DEVICE = int(os.environ.get("GRAPH_DEVICE", "1"))
if torch.cuda.device_count() < 1 + GRAPH_DEVICE:
    print(f"multi_gpu_features label={checks.label} passed=0/0 skipped: needs two GPUs", flush=True)
    raise SystemExit(0)


def train(device, steps, losses, start=None):
    """An MLP trained on `device`, deterministic in its data; appends each step's loss. Waits on
    `start` (a threading.Event) after two warm-up steps when given."""
    torch.cuda.set_device(device)
    gen = torch.Generator(device=device).manual_seed(0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)
    ).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for i in range(steps):
        if i == 2 and start is not None:
            torch.cuda.synchronize(device)
            start.set()
        # Sizes vary, so the pool keeps allocating and freeing during the other device's capture.
        x = torch.randn(64 * (1 + i % 4), 1024, device=device, generator=gen)
        loss = model(x).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())


def graph_on_device_1(mode):
    """Capture on GPU 1 (GRAPH_DEVICE; its intermediates in the graph's private pool) while GPU
    0 trains in another thread; replay among eager allocations on GPU 1; the training's losses
    must equal a run alone."""
    steps = 40
    alone = []
    train(0, steps, alone)
    during, start = [], threading.Event()
    trainer = threading.Thread(target=train, args=(0, steps, during, start))
    trainer.start()
    start.wait(timeout=60)
    dev = torch.device(f"cuda:{GRAPH_DEVICE}")
    torch.cuda.set_device(GRAPH_DEVICE)
    gen = torch.Generator(device=dev).manual_seed(1)
    static_in = torch.randn(256, 1024, device=dev, generator=gen)
    w = torch.randn(1024, 1024, device=dev, generator=gen) / 32
    side = torch.cuda.Stream(device=dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        for _ in range(3):
            (static_in @ w).relu() @ w
    torch.cuda.current_stream(dev).wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode=mode):
        static_out = ((static_in @ w).relu() @ w).tanh()
    worst = 0.0
    for i in range(30):
        static_in.copy_(torch.randn(256, 1024, device=dev, generator=gen))
        g.replay()
        # Eager work between replays, in the ordinary pool: must not touch the graph's memory.
        junk = [torch.full((256, 1024), float(i), device=dev) for _ in range(4)]
        expected = ((static_in @ w).relu() @ w).tanh()
        worst = max(worst, float((static_out - expected).abs().max()))
        del junk
    trainer.join(timeout=120)
    torch.cuda.synchronize(GRAPH_DEVICE)
    same = during == alone
    del g, static_out
    return same and worst < 1e-3, f"replay max error {worst:.2e}; losses equal to a run alone: {same} ({len(during)} steps)"


def mem_pool_on_both_devices():
    """One MemPool used on GPU 0 and on GPU 1: each device's allocations inside `use_mem_pool`
    (for that device) land in the pool, others in the ordinary pool; the pool's snapshot names
    both devices; deleting the pool and emptying the cache gives the memory back."""
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    torch.cuda.empty_cache()
    base = [torch.cuda.memory_reserved(d) for d in (0, 1)]
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool, device=0):
        a = torch.full((64 * MIB // 4,), 1.0, device="cuda:0")
        outside = torch.full((8 * MIB // 4,), 2.0, device="cuda:1")  # device 1: not routed
    with torch.cuda.use_mem_pool(pool, device=1):
        b = torch.full((32 * MIB // 4,), 3.0, device="cuda:1")
    snap = pool.snapshot()
    per_device = {}
    for seg in snap:
        live = sum(blk["size"] for blk in seg["blocks"] if blk["state"] == "active_allocated")
        per_device[seg["device"]] = per_device.get(seg["device"], 0) + live
    routed = per_device.get(0, 0) == 64 * MIB and per_device.get(1, 0) == 32 * MIB
    values = float(a.sum()) == 16 * MIB and float(b.sum()) == 24 * MIB and float(outside.sum()) == 4 * MIB
    del a, b, outside
    del pool
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    torch.cuda.empty_cache()
    back = [torch.cuda.memory_reserved(d) for d in (0, 1)]
    released = all(back[d] <= base[d] for d in (0, 1))
    return routed and values and released, (
        f"live bytes in the pool by device {per_device}; values {values}; "
        f"reserved before {base}, after {back}"
    )


# In PyTorch's default capture mode ("global") any thread's unsafe CUDA call (a cudaMalloc when
# the cache misses, say) fails the capture, so a program that trains in another thread meanwhile
# must capture "thread_local": natively "global" failed here on one GPU and once on two.
check("graph_on_gpu1_while_gpu0_trains_thread_local", lambda: graph_on_device_1("thread_local"))
if GRAPH_DEVICE == 1:
    check("mem_pool_on_both_devices", mem_pool_on_both_devices)
checks.summary()
sys.exit(0 if all(checks.results) else 1)
