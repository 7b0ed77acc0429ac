"""PyTorch's memory settings and graph pools as programs use them, natively and under the shim
(same command; issue 22): each check is what PyTorch's own allocator gives.

* `fraction_counts_mempools`: `set_per_process_memory_fraction` limits the device's pools
  together: with a MemPool holding most of the allowance, an ordinary allocation beyond it
  raises `OutOfMemoryError`.
* `settings_rounding`: `_set_allocator_settings("roundup_power2_divisions:4")` rounds the next
  allocation up (84 MiB takes 96 MiB of `active_bytes`), and `""` resets it.
* `settings_expandable`: `_set_allocator_settings("expandable_segments:True")` puts the next
  new memory in an expandable segment of the snapshot, `False` in a fixed one.
* `caching_off`: `caching_allocator_enable(False)` leaves `requested_bytes` unchanged by a raw
  allocation; on again, it counts.
* `graph_side_stream`: a graph captured on two streams (the second joins through
  `wait_stream`) replays right, and its segments (both streams') belong to one pool.
* `graph_reset_recapture`: after `reset()`, a new capture that writes into the old graph's
  output replays right.

Prints `torch_settings label=L check=NAME ok=True|False detail=...` per check and a last
`torch_settings label=L passed=N/M`.
"""
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import Checks  # noqa: E402

checks = Checks("torch_settings")
check = checks.check

warnings.simplefilter("ignore")
MIB = 1 << 20



def stat(key):
    return torch.cuda.memory_stats().get(key, 0)


def fraction_counts_mempools():
    torch.cuda.empty_cache()
    device = torch.device("cuda:0")
    _, total = torch.cuda.mem_get_info(device)
    before = torch.cuda.get_per_process_memory_fraction()
    allowed = torch.cuda.memory_reserved(device) + 100 * MIB
    torch.cuda.set_per_process_memory_fraction(allowed / total, device)
    pool = torch.cuda.MemPool()
    try:
        with torch.cuda.use_mem_pool(pool):
            held = torch.empty(80 * MIB, dtype=torch.uint8, device="cuda")
        try:
            extra = torch.empty(40 * MIB, dtype=torch.uint8, device="cuda")
            refused = False
            del extra
        except torch.OutOfMemoryError:
            refused = True
        del held
    finally:
        torch.cuda.set_per_process_memory_fraction(before, device)
        del pool
        torch.cuda.empty_cache()
    return refused, f"40 MiB beyond 80 MiB in a MemPool under a 100 MiB allowance refused: {refused}"


def settings_rounding():
    torch.cuda.empty_cache()
    n = 84 * MIB
    start = stat("active_bytes.all.current")
    torch.cuda.memory._set_allocator_settings("roundup_power2_divisions:4")
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    rounded = stat("active_bytes.all.current") - start
    del a
    torch.cuda.memory._set_allocator_settings("")
    torch.cuda.empty_cache()
    start = stat("active_bytes.all.current")
    b = torch.empty(n, dtype=torch.uint8, device="cuda")
    plain = stat("active_bytes.all.current") - start
    del b
    ok = rounded == 96 * MIB and plain == n
    return ok, f"84 MiB took {rounded // MIB} MiB rounded, {plain // MIB} MiB after the reset"


def segment_of(address):
    for s in torch.cuda.memory_snapshot():
        if s["address"] <= address < s["address"] + s["total_size"]:
            return s
    return None


def settings_expandable():
    torch.cuda.empty_cache()
    torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    try:
        a = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")
        on = segment_of(a.data_ptr())
    finally:
        torch.cuda.memory._set_allocator_settings("expandable_segments:False")
    b = torch.empty(256 * MIB, dtype=torch.uint8, device="cuda")
    off = segment_of(b.data_ptr())
    ok = on is not None and on["is_expandable"] and off is not None and not off["is_expandable"]
    detail = f"on: {on and on['is_expandable']}, off: {off and off['is_expandable']}"
    del a, b
    torch.cuda.empty_cache()
    return ok, detail


def caching_off():
    torch.cuda.empty_cache()
    stream = torch.cuda.current_stream().cuda_stream
    start = stat("requested_bytes.all.allocated")
    torch.cuda.caching_allocator_enable(False)
    try:
        p = torch.cuda.caching_allocator_alloc(MIB, stream=stream)
        off = stat("requested_bytes.all.allocated") - start
        torch.cuda.caching_allocator_delete(p)
    finally:
        torch.cuda.caching_allocator_enable(True)
    start = stat("requested_bytes.all.allocated")
    p = torch.cuda.caching_allocator_alloc(MIB, stream=stream)
    on = stat("requested_bytes.all.allocated") - start
    torch.cuda.caching_allocator_delete(p)
    return off == 0 and on == MIB, f"requested while off {off}, on {on}"


def graph_side_stream():
    before = {s["segment_pool_id"] for s in torch.cuda.memory_snapshot()}
    x = torch.randn(1 << 22, device="cuda")
    g = torch.cuda.CUDAGraph()
    s0, s1 = torch.cuda.Stream(), torch.cuda.Stream()
    s0.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s0):
        g.capture_begin()
        z = x * 2
    with torch.cuda.stream(s1):
        s1.wait_stream(s0)
        w = z + 1
    s0.wait_stream(s1)
    with torch.cuda.stream(s0):
        out = w * 3
        g.capture_end()
    torch.cuda.current_stream().wait_stream(s0)
    x.fill_(1.0)
    g.replay()
    torch.cuda.synchronize()
    right = bool(torch.all(out == 9.0))
    new = [s["segment_pool_id"] for s in torch.cuda.memory_snapshot() if s["segment_pool_id"] not in before]
    one_pool = len(new) >= 2 and len(set(new)) == 1
    del g
    return right and one_pool, f"replay right: {right}; the graph's new segments' pools: {new}"


def captured(stream, graph, body):
    """`body()` captured into `graph` on `stream`; its result (the graph's output)."""
    with torch.cuda.stream(stream):
        graph.capture_begin()
        out = body()
        graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    return out


def graph_reset_recapture():
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        a = torch.full((1000,), 1.0, device="cuda")
    g = torch.cuda.CUDAGraph()

    def add_ten(start, step):
        b = start
        for _ in range(10):
            b = b + step
        return b

    b = captured(s, g, lambda: add_ten(a, 1))
    g.replay()
    first = b.sum().item()
    g.reset()
    b = captured(s, g, lambda: add_ten(b.fill_(2.0), 2))
    g.replay()
    second = b.sum().item()
    g.reset()
    return first == 11000.0 and second == 22000.0, f"sums {first}, {second}"


check("fraction_counts_mempools", fraction_counts_mempools)
check("settings_rounding", settings_rounding)
check("settings_expandable", settings_expandable)
check("caching_off", caching_off)
check("graph_side_stream", graph_side_stream)
check("graph_reset_recapture", graph_reset_recapture)
checks.summary()
