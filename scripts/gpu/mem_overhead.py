"""Where a process's device memory goes, stage by stage: device memory in use (NVML, the same
measure with and without the shim) against what the allocator holds (the shim's pool when it is
loaded, else PyTorch's reserved memory), after CUDA's start-up, the model, the first forward
pass (cuBLAS), the first step (the autograd thread's cuBLAS), the training steps,
`empty_cache`, and a first `torch.cuda.Stream()` (PyTorch's stream pool: 32 streams of each
priority, built at the first request for one; PyTorch's `cudaMallocAsync` backend, the shim's
route, requests one at its first allocation). The difference, "outside", is memory no
allocator counter shows: the context, loaded kernels, streams, libraries' own `cudaMalloc`s
when PyTorch's allocator is the one counting.

  python3 mem_overhead.py                                  # PyTorch native
  LD_PRELOAD=.../libcachealloc.so python3 mem_overhead.py  # the shim (CACHEALLOC_CONF as wished)

Prints one line per stage: `stage=… used_MB=… pool_MB=… outside_MB=…`, then `label=…`."""
import ctypes
import json
import os

import torch
import torch.nn as nn


class _Memory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


_nvml = ctypes.CDLL("libnvidia-ml.so.1")
_handle = ctypes.c_void_p()
assert _nvml.nvmlInit_v2() == 0 and _nvml.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(_handle)) == 0


def device_used():
    memory = _Memory()
    assert _nvml.nvmlDeviceGetMemoryInfo(_handle, ctypes.byref(memory)) == 0
    return memory.total - memory.free


def shim_reserved():
    """The shim's pool on device 0, or None without the shim."""
    try:
        f = ctypes.CDLL(None).cachealloc_stats_json
    except AttributeError:
        return None
    f.restype = ctypes.c_size_t
    f.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    buf = ctypes.create_string_buffer(f(None, 0))
    f(buf, len(buf))
    stats = json.loads(buf.value)["devices"].get("0", {})
    return stats.get("reserved_bytes.all.current", 0)


before = device_used()


def stage(name):
    torch.cuda.synchronize()
    used = device_used() - before
    pool = shim_reserved()
    pool = torch.cuda.memory_reserved() if pool is None else pool
    print(f"stage={name} used_MB={used / 1e6:.1f} pool_MB={pool / 1e6:.1f} "
          f"outside_MB={(used - pool) / 1e6:.1f} torch_reserved_MB={torch.cuda.memory_reserved() / 1e6:.1f}",
          flush=True)


torch.cuda.init()
torch.empty(1, device="cuda")
stage("context")
torch.manual_seed(0)
model = nn.Sequential(*[nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024),
                                      nn.LayerNorm(1024)) for _ in range(8)]).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
stage("model")
x = torch.randn(64, 1024, device="cuda")
with torch.no_grad():
    model(x)
stage("forward")


def step(bs):
    x = torch.randn(bs, 1024, device="cuda")
    y = torch.randn(bs, 1024, device="cuda")
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss


step(64)
stage("first_step")
for i in range(40):
    step(64 * (1 + i % 4))
stage("train")
torch.cuda.empty_cache()
stage("empty_cache")
torch.cuda.Stream()
stage("stream_pool")
print(f"label={os.environ.get('LABEL', '-')} context_used_before_MB={before / 1e6:.1f}")
