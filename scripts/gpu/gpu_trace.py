"""PyTorch's GPU trace and CUDA Sanitizer, natively and under the shim (same command; issue 22):
PyTorch's own allocator tells the GPU trace of each allocation and free, and CUDA Sanitizer
(`torch.cuda._sanitizer`) follows memory through it.

* `memory_callbacks`: `torch.cuda._gpu_trace`'s memory callbacks hear a tensor's allocation
  and its free, with its `data_ptr()`.
* `sanitizer_quiet_on_reuse`: with CUDA Sanitizer on, tensors made and dropped in turn on the
  default stream and on a side stream, with no synchronization the sanitizer sees (a host
  synchronization would order every stream after the synchronized one): no race is reported.
  The shim hands a block freed on one stream to the other once the work on it has run, which
  it learns from events of its own; a sanitizer that never heard of the free and the new
  allocation would take the new tensor's first write for a race with the old one's. (PyTorch's
  own allocator never reuses a block across streams.)
* `sanitizer_reports_a_race`: a write on a side stream to a tensor the default stream is still
  writing, without synchronization, is reported (the sanitizer is really on).

Prints `gpu_trace label=L check=NAME ok=True|False detail=...` per check and a last
`gpu_trace label=L passed=N/M`.
"""
import os
import sys
import time
import warnings

import torch
import torch.cuda._gpu_trace as gpu_trace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import Checks  # noqa: E402

checks = Checks("gpu_trace")
check = checks.check

warnings.simplefilter("ignore")


def memory_callbacks():
    torch._C._activate_gpu_trace()
    allocated, freed = [], []
    gpu_trace.register_callback_for_memory_allocation(allocated.append)
    gpu_trace.register_callback_for_memory_deallocation(freed.append)
    t = torch.empty(10, 4, device="cuda")
    pointer = t.data_ptr()
    del t
    ok = pointer in allocated and pointer in freed
    return ok, f"pointer {pointer:#x}: allocations heard {len(allocated)}, frees heard {len(freed)}"


def sanitizer_quiet_on_reuse():
    from torch.cuda._sanitizer import CUDASanitizerErrors, enable_cuda_sanitizer

    enable_cuda_sanitizer()
    side = torch.cuda.Stream()
    seen = set()
    reused = 0
    try:
        for _ in range(50):
            a = torch.ones(1 << 20, device="cuda")
            a.add_(1)
            seen.add(a.data_ptr())
            del a
            time.sleep(0.002)  # the work done: the shim may reuse its block on the side stream
            with torch.cuda.stream(side):
                b = torch.ones(1 << 20, device="cuda")
                b.mul_(2)
                reused += b.data_ptr() in seen
                seen.add(b.data_ptr())
                del b
            time.sleep(0.002)
    except CUDASanitizerErrors as e:
        return False, f"a race reported: {str(e).splitlines()[0][:150]}"
    return True, f"no race reported; side-stream tensors at an address used before: {reused} of 50"


def sanitizer_reports_a_race():
    from torch.cuda._sanitizer import CUDASanitizerErrors

    side = torch.cuda.Stream()
    a = torch.ones(1 << 22, device="cuda")
    a.mul_(3)
    try:
        with torch.cuda.stream(side):
            a.add_(1)  # no wait for the default stream's write
    except CUDASanitizerErrors:
        return True, "reported"
    return False, "not reported"


check("memory_callbacks", memory_callbacks)
check("sanitizer_quiet_on_reuse", sanitizer_quiet_on_reuse)
check("sanitizer_reports_a_race", sanitizer_reports_a_race)
checks.summary()
