"""cachealloc under a Python host, through ctypes: the hooks, the C API and the environment the
constructor set. Run under LD_PRELOAD=libcachealloc.so with fakecuda (or real CUDA) on the
library path. Prints "OK ctypes" on success."""
import ctypes
import json
import os
import sys

# Load the runtime into the global scope, then resolve names globally, as the dynamic linker
# does for a program linked against it: the preloaded shim comes first.
ctypes.CDLL("libcudart.so.13", mode=ctypes.RTLD_GLOBAL)
glob = ctypes.CDLL(None)

glob.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
glob.cudaFree.argtypes = [ctypes.c_void_p]
glob.cachealloc_stats_json.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
glob.cachealloc_stats_json.restype = ctypes.c_size_t
glob.cachealloc_version.restype = ctypes.c_char_p
glob.cachealloc_torch_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
glob.cachealloc_torch_malloc.restype = ctypes.c_void_p
glob.cachealloc_torch_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]


def fail(why):
    print(f"FAIL: {why}")
    sys.exit(1)


def stats():
    need = glob.cachealloc_stats_json(None, 0)
    buf = ctypes.create_string_buffer(need)
    glob.cachealloc_stats_json(buf, need)
    return json.loads(buf.value)


# What the constructor left for PyTorch: argv[1] is PYTORCH_CUDA_ALLOC_CONF, argv[2]
# PYTORCH_NO_CUDA_MEMORY_CACHING ("unset": absent).
expected = {
    "PYTORCH_CUDA_ALLOC_CONF": sys.argv[1] if len(sys.argv) > 1 else "backend:cudaMallocAsync",
    "PYTORCH_NO_CUDA_MEMORY_CACHING": sys.argv[2] if len(sys.argv) > 2 else "unset",
}
for var, want in expected.items():
    if os.environ.get(var, "unset") != want:
        fail(f"{var} is {os.environ.get(var)!r}, expected {want!r}")
# argv[3] "environment-only": the shim passes everything through; only its environment counts.
if len(sys.argv) > 3 and sys.argv[3] == "environment-only":
    print("OK ctypes")
    sys.exit(0)

version = glob.cachealloc_version().decode()
if not version:
    fail("empty version")

ptrs = []
for size in (1000, 4096, 3 << 20):
    p = ctypes.c_void_p()
    if glob.cudaMalloc(ctypes.byref(p), size) != 0 or not p.value:
        fail(f"cudaMalloc({size}) failed")
    ptrs.append(p.value)

s = stats()["devices"]["0"]
if s["allocated_bytes.all.current"] != 1024 + 4096 + (3 << 20):
    fail(f"allocated_bytes.all.current = {s['allocated_bytes.all.current']}")
if s["requested_bytes.all.current"] != 1000 + 4096 + (3 << 20):
    fail(f"requested_bytes.all.current = {s['requested_bytes.all.current']}")

for p in ptrs:
    if glob.cudaFree(ctypes.c_void_p(p)) != 0:
        fail("cudaFree failed")
again = ctypes.c_void_p()
glob.cudaMalloc(ctypes.byref(again), 4096)
if again.value not in ptrs:
    fail("a freed block was not reused")
glob.cudaFree(again)

# The PyTorch pluggable-allocator pair.
t = glob.cachealloc_torch_malloc(8192, 0, None)
if not t:
    fail("cachealloc_torch_malloc failed")
glob.cachealloc_torch_free(t, 8192, 0, None)

# The C++ allocator for PyTorch's free: the library's own blocks, and only those.
glob.cudaMallocAsync.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_void_p]
glob.cachealloc_free_async.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
glob.cachealloc_free_async.restype = ctypes.c_int
a = ctypes.c_void_p()
if glob.cudaMallocAsync(ctypes.byref(a), 1 << 20, None) != 0 or not a.value:
    fail("cudaMallocAsync failed")
if stats()["devices"]["0"]["allocated_bytes.all.current"] != 1 << 20:
    fail("cudaMallocAsync's block not counted")
if glob.cachealloc_free_async(a, None) != 0:
    fail("cachealloc_free_async of a pooled block did not free it")
if stats()["devices"]["0"]["allocated_bytes.all.current"] != 0:
    fail("cachealloc_free_async left the block allocated")
if glob.cachealloc_free_async(a, None) != 1:
    fail("a second cachealloc_free_async of the block was not refused")
for other in (None, 0x1000):
    if glob.cachealloc_free_async(other, None) != -1:
        fail(f"cachealloc_free_async({other}) did not answer 'not pooled'")

glob.cachealloc_annotate.argtypes = [ctypes.c_char_p]
if glob.cachealloc_annotate(b"after the frees") != 0 or glob.cachealloc_annotate(None) == 0:
    fail("cachealloc_annotate")

s = stats()["devices"]["0"]
if s["allocated_bytes.all.current"] != 0 or s["allocated_bytes.all.peak"] < (3 << 20):
    fail(f"stats after frees: {s['allocated_bytes.all.current']} current, {s['allocated_bytes.all.peak']} peak")
if glob.cachealloc_empty_cache() != 0:
    fail("empty_cache failed")
if stats()["devices"]["0"]["reserved_bytes.all.current"] != 0:
    fail("empty_cache left reserved memory")
print(f"OK ctypes (cachealloc {version})")
