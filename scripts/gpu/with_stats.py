"""Run a Python workload (path and arguments as given) in this process, then print the device
memory in use at exit (from the driver) and, when the shim is loaded, the peak allocated and
reserved memory of its pool on device 0, read through its C API. Usage: python3 with_stats.py workload.py [args]"""
import ctypes
import json
import runpy
import sys


def device_used_mb():
    """Device memory in use by everything on the GPU, from the driver (libcuda's cuMemGetInfo is
    not interposed): compares the shim, which pools every cudaMalloc of the process, fairly with
    PyTorch native, whose own counter misses the allocations of other libraries."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    if cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)) != 0:
        return None
    return (total.value - free.value) / 1e6


def report():
    used = device_used_mb()
    if used is not None:
        print(f"device_used_at_exit_MB={used:.1f}", flush=True)
    try:
        f = ctypes.CDLL(None).cachealloc_stats_json
    except AttributeError:
        return
    f.restype = ctypes.c_size_t
    f.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    need = f(None, 0)
    buf = ctypes.create_string_buffer(need)
    f(buf, need)
    stats = json.loads(buf.value)["devices"].get("0")
    if stats:
        print(f"cachealloc_peak_reserved_MB={stats['reserved_bytes.all.peak'] / 1e6:.1f} "
              f"cachealloc_peak_alloc_MB={stats['allocated_bytes.all.peak'] / 1e6:.1f} "
              f"cachealloc_device_allocs={stats['num_device_alloc']} cachealloc_fence_waits={stats['num_fence_waits']}",
              flush=True)


sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
report()
