"""Run a Python workload (path and arguments as given) in this process, then print the device
memory in use at exit (from the driver) and, when the shim is loaded, the peak allocated and
reserved memory of its pool on device 0, read through its C API. Usage: python3 with_stats.py workload.py [args]"""
import ctypes
import json
import runpy
import sys


def device_used_mb():
    """Device memory in use by everything on the GPU, from NVML (the shim interposes the
    driver's cuMemGetInfo, not NVML): compares the shim, which pools every allocation of the
    process, fairly with PyTorch native, whose own counter misses the allocations of other
    libraries."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None

    class Memory(ctypes.Structure):
        _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]

    device, memory = ctypes.c_void_p(), Memory()
    if nvml.nvmlInit_v2() != 0 or nvml.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(device)) != 0:
        return None
    if nvml.nvmlDeviceGetMemoryInfo(device, ctypes.byref(memory)) != 0:
        return None
    return (memory.total - memory.free) / 1e6


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
