"""Cost of a cudaMalloc+cudaFree pair made from Python through ctypes, at a given Python stack
depth. Run it under LD_PRELOAD=libcachealloc.so with different `stacks` settings and compare:
the difference is what capturing the stack adds per allocation (frees capture none).

    python3 bench_python_stacks.py [DEPTH=30] [PAIRS=20000] [REPEATS=7]

Prints one line: `depth D pairs N median_ns M min_ns m` (per pair, over REPEATS timed runs)."""
import ctypes
import statistics
import sys
import time

ctypes.CDLL("libcudart.so.13", mode=ctypes.RTLD_GLOBAL)
cuda = ctypes.CDLL(None)  # resolves through the preloaded shim; the call releases the GIL
cuda.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
cuda.cudaFree.argtypes = [ctypes.c_void_p]


def pairs(n):
    p = ctypes.c_void_p()
    ref = ctypes.byref(p)
    malloc, free = cuda.cudaMalloc, cuda.cudaFree
    start = time.perf_counter_ns()
    for _ in range(n):
        malloc(ref, 1 << 20)
        free(p)
    return time.perf_counter_ns() - start


def at_depth(depth, fn, *args):
    if depth <= 1:
        return fn(*args)
    return at_depth(depth - 1, fn, *args)


def main():
    depth = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 20000
    repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 7
    at_depth(depth, pairs, n // 10)  # warm up: pools, interned stacks
    # The frames below at_depth (main, <module>) count too: subtract them from the depth asked.
    times = [at_depth(depth - 2, pairs, n) / n for _ in range(repeats)]
    print(f"depth {depth} pairs {n} median_ns {statistics.median(times):.0f} min_ns {min(times):.0f}")


if __name__ == "__main__":
    main()
