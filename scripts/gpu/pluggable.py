"""The pluggable-allocator entry into PyTorch, as a measured alternative to the route the shim
rides (issue 25): with `ROUTE=pluggable` in the environment and the shim preloaded,
`use_if_asked()` hands PyTorch's tensors to the library's `cachealloc_torch_malloc` /
`cachealloc_torch_free` through `torch.cuda.memory.CUDAPluggableAllocator`, before CUDA starts.
Run it with `CACHEALLOC_CONF=...,torch_caching:keep` so that the library leaves PyTorch's
backend alone. Only a measurement probe: on this entry PyTorch gives the allocator no
`record_stream` and no graph-pool calls."""
import os

import torch


def use_if_asked():
    """Switch PyTorch to the library's pluggable pair when ROUTE=pluggable."""
    if os.environ.get("ROUTE") != "pluggable":
        return
    lib = os.environ["LD_PRELOAD"].split(":")[0]
    allocator = torch.cuda.memory.CUDAPluggableAllocator(
        lib, "cachealloc_torch_malloc", "cachealloc_torch_free"
    )
    torch.cuda.memory.change_current_allocator(allocator)
