"""torch.cuda.MemPool as programs use it, natively and under the shim (same command): a model's
forward pass inside use_mem_pool, a pool of the program's own allocator (a
CUDAPluggableAllocator built here with nvcc), a CUDA graph captured into a MemPool, nested pools
and threads. Each check compares with what PyTorch's own allocator must give.

Prints one line per check, `mem_pools label=L check=NAME ok=True|False detail=...`, and a last
`mem_pools label=L passed=N/M`. MODEL=gpt2 (default: a transformers GPT-2 of 4 layers, random
weights) or mlp.
"""
import ctypes
import os
import sys
import subprocess
import tempfile
import threading
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import Checks  # noqa: E402

checks = Checks("mem_pools")
check = checks.check

warnings.simplefilter("ignore")
MIB = 1 << 20



def pool_blocks(pool):
    return {b["address"] for s in pool.snapshot() for b in s["blocks"] if b["state"] == "active_allocated"}


def model():
    torch.manual_seed(0)
    if os.environ.get("MODEL", "gpt2") == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        m = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=512, n_head=8)).cuda().eval()
        x = torch.randint(0, 50257, (4, 128), device="cuda")
        return (lambda: m(x).logits), "gpt2"
    m = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)]).cuda().eval()
    x = torch.randn(64, 1024, device="cuda")
    return (lambda: m(x)), "mlp"


def forward_in_pool():
    run, name = model()
    with torch.no_grad():
        expected = run().float()
        pool = torch.cuda.MemPool()
        before = torch.cuda.memory_reserved()
        with torch.cuda.use_mem_pool(pool):
            got = run()
        inside = {got.data_ptr()}
        same = torch.equal(got.float(), expected)
        held = pool_blocks(pool)
        count_inside = pool.use_count()
    ok = same and got.data_ptr() in held and count_inside == 1
    detail = f"{name} equal={same} output_in_pool={got.data_ptr() in held} pool_blocks={len(held)} use_count={count_inside} reserved_growth={(torch.cuda.memory_reserved() - before) // MIB}MiB"
    del got, pool, inside
    return ok, detail


ALLOCATOR = r"""
#include <cuda_runtime_api.h>
#include <stddef.h>
extern "C" {
int allocs = 0, frees = 0;
void* my_alloc(size_t size, int device, void* stream) { void* p = 0; allocs++; return cudaMalloc(&p, size) == cudaSuccess ? p : 0; }
void my_free(void* p, size_t size, int device, void* stream) { frees++; cudaFree(p); }
}
"""


def pluggable_pool():
    d = tempfile.mkdtemp()
    src, so = os.path.join(d, "alloc.cu"), os.path.join(d, "liballoc.so")
    open(src, "w").write(ALLOCATOR)
    subprocess.run(["nvcc", "-shared", "-Xcompiler", "-fPIC", "-cudart", "shared", "-o", so, src], check=True)
    lib = ctypes.CDLL(so)
    allocs, frees = ctypes.c_int.in_dll(lib, "allocs"), ctypes.c_int.in_dll(lib, "frees")
    allocator = torch.cuda.memory.CUDAPluggableAllocator(so, "my_alloc", "my_free")
    pool = torch.cuda.MemPool(allocator.allocator())
    with torch.cuda.use_mem_pool(pool):
        x = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    value_ok = float(x.sum()) == float(sum(range(1 << 20)))
    in_pool = x.data_ptr() in pool_blocks(pool)
    a_after = allocs.value
    del pool
    f_alive = frees.value
    del x
    torch.cuda.empty_cache()
    f_after = frees.value
    ok = value_ok and in_pool and a_after >= 1 and f_alive == 0 and f_after == a_after
    return ok, f"values_ok={value_ok} in_pool={in_pool} allocs={a_after} frees_while_alive={f_alive} frees_after={f_after}"


def graph_into_mem_pool():
    pool = torch.cuda.MemPool()
    static_in = torch.randn(256, 256, device="cuda")
    w = torch.randn(256, 256, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            (static_in @ w).relu()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool.id):
        static_out = (static_in @ w).relu()
    captured_in_pool = static_out.data_ptr() in pool_blocks(pool)
    errors = 0
    for _ in range(3):
        static_in.copy_(torch.randn_like(static_in))
        eager = [torch.randn(256, 256, device="cuda") for _ in range(8)]  # eager work between replays
        g.replay()
        errors += int(not torch.allclose(static_out, (static_in @ w).relu()))
        del eager
    ok = captured_in_pool and errors == 0
    del g
    return ok, f"output_in_pool={captured_in_pool} wrong_replays={errors}"


def nested_and_threads():
    p1, p2 = torch.cuda.MemPool(), torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(p1):
        a = torch.empty(4 * MIB, device="cuda", dtype=torch.uint8)
        with torch.cuda.use_mem_pool(p2):
            b = torch.empty(4 * MIB, device="cuda", dtype=torch.uint8)
        c = torch.empty(4 * MIB, device="cuda", dtype=torch.uint8)
    other = []

    def side():
        other.append(torch.empty(4 * MIB, device="cuda", dtype=torch.uint8))

    with torch.cuda.use_mem_pool(p1):
        t = threading.Thread(target=side)
        t.start()
        t.join()
    b1, b2 = pool_blocks(p1), pool_blocks(p2)
    ok = {a.data_ptr(), c.data_ptr()} <= b1 and b.data_ptr() in b2 and b.data_ptr() not in b1 \
        and other[0].data_ptr() not in b1 | b2
    return ok, f"p1={len(b1)} p2={len(b2)} other_thread_outside={other[0].data_ptr() not in b1 | b2}"


def stats_count_pools():
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        x = torch.empty(64 * MIB, device="cuda", dtype=torch.uint8)
    grew = torch.cuda.memory_allocated() - before
    del x, pool
    return grew >= 64 * MIB, f"memory_allocated grew by {grew // MIB} MiB"


torch.cuda.init()
check("forward_in_pool", forward_in_pool)
check("pluggable_allocator_pool", pluggable_pool)
check("graph_captured_into_mem_pool", graph_into_mem_pool)
check("nested_pools_and_threads", nested_and_threads)
check("stats_count_pools", stats_count_pools)
checks.summary()
