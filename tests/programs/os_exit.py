"""A Python host that ends with os._exit while blocks are live: no atexit handler runs (so no
exit summary), and the exit code must be the program's own. Allocates through ctypes under
LD_PRELOAD=libcachealloc.so with fakecuda (or real CUDA) on the library path. Usage:
os_exit.py CODE. Prints "OK os_exit" and the stats JSON's allocation count before it exits."""
import ctypes
import json
import os
import sys

ctypes.CDLL("libcudart.so.13", mode=ctypes.RTLD_GLOBAL)
glob = ctypes.CDLL(None)
glob.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
glob.cudaFree.argtypes = [ctypes.c_void_p]
glob.cachealloc_stats_json.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
glob.cachealloc_stats_json.restype = ctypes.c_size_t

live = []
for i in range(1000):
    p = ctypes.c_void_p()
    if glob.cudaMalloc(ctypes.byref(p), 4096 + (i % 7) * 65536) != 0:
        print(f"FAIL: cudaMalloc {i}")
        sys.exit(1)
    if i % 2:
        glob.cudaFree(p)
    else:
        live.append(p)
need = glob.cachealloc_stats_json(None, 0)
buf = ctypes.create_string_buffer(need)
glob.cachealloc_stats_json(buf, need)
stats = json.loads(buf.value)
print(f"allocations {stats['devices']['0']['allocation.all.allocated']}")
print("OK os_exit", flush=True)
os._exit(int(sys.argv[1]))
