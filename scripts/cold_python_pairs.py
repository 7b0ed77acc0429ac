"""The Python side of scripts/bench-cold-lines: cold_pairs.c's step (16 stream-ordered
allocations of a fixed sequence of sizes, then their 16 frees, the caches evicted between any
two calls), made through ctypes from DEPTH nested Python functions, each its own code object, as
a model's stack is; so that the stack capture's lines are counted as a real step meets them.

    python3 cold_python_pairs.py STEPS EVICT_BYTES DEPTH EVICT_LIB

EVICT_LIB: a shared library with `void evict(char *buf, size_t bytes)` that reads every line of
`buf` (bench-cold-lines builds it; a memset could bypass the caches). Prints `OK cold_python_pairs`."""
import ctypes
import sys

steps, evict_bytes, depth = (int(a) for a in sys.argv[1:4])
helper = ctypes.CDLL(sys.argv[4])
helper.evict.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
buf = ctypes.create_string_buffer(evict_bytes + 64)
ctypes.CDLL("libcudart.so.13", mode=ctypes.RTLD_GLOBAL)
cuda = ctypes.CDLL(None)  # through the preloaded shim
cuda.cudaMallocAsync.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_void_p]
cuda.cudaFreeAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
SIZES = [65536, 262144, 1048576, 4194304, 512, 8192, 2097152, 131072,
         786432, 3145728, 16384, 1536, 524288, 65536, 1048576, 24576]


def run():
    pointers = [ctypes.c_void_p() for _ in SIZES]
    evict, malloc, free = helper.evict, cuda.cudaMallocAsync, cuda.cudaFreeAsync
    for _ in range(steps):
        for p, size in zip(pointers, SIZES):
            evict(buf, evict_bytes)
            if malloc(ctypes.byref(p), size, None) != 0:
                sys.exit("cudaMallocAsync failed")
        for p in pointers:
            evict(buf, evict_bytes)
            if free(p, None) != 0:
                sys.exit("cudaFreeAsync failed")


# DEPTH distinct functions, f0 calling f1 … calling run: distinct code objects on the stack.
source = "\n".join(f"def f{i}():\n    return f{i + 1}()" for i in range(depth - 1))
source += f"\ndef f{depth - 1}():\n    return run()\n"
exec(compile(source, "cold_python_frames", "exec"))
f0()  # noqa: F821 (defined by the exec)
print("OK cold_python_pairs")
