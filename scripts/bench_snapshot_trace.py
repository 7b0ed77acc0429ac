"""A trace for `scripts/bench-snapshot`: N allocations through ctypes (over fakecuda, under the
shim) from 50-54-frame Python stacks, 200 live at a time, in seven sizes.
Usage: bench_snapshot_trace.py N"""
import ctypes
import sys

ctypes.CDLL("libcudart.so.13", mode=ctypes.RTLD_GLOBAL)
lib = ctypes.CDLL(None)
lib.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
lib.cudaFree.argtypes = [ctypes.c_void_p]
live = []


def leaf(i):
    p = ctypes.c_void_p()
    if lib.cudaMalloc(ctypes.byref(p), 512 * (1 + i % 7)) != 0:
        raise SystemExit("cudaMalloc failed")
    live.append(p.value)
    if len(live) > 200:
        lib.cudaFree(live.pop(0))


def deep(depth, i):
    if depth == 0:
        return leaf(i)
    return deep(depth - 1, i)


for i in range(int(sys.argv[1])):
    deep(50 + i % 5, i)
