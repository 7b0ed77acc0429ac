"""Where a share's time goes on the sender (issue 22): each part of what the Python integration
does for `UntypedStorage._share_cuda_()`, timed alone over distinct 1 MiB tensors, beside the
whole share, natively and under the shim.

    [LD_PRELOAD=…/libcachealloc.so] LABEL=shim python3 scripts/gpu/ipc_share_parts.py [SHARES]

Parts, microseconds per call (SHARES calls each, default 400, on tensors never shared before;
the stream idle): `whole` (`_share_cuda_()`), `event` (an interprocess event made, recorded on
the current stream and its IPC handle taken: what PyTorch's sender does too), `guard` (`with
torch.cuda.device(d)`), and under the shim `library` (`cachealloc_ipc_share_desc` through
ctypes with its buffers: the library's part, the export of mapped memory or the segment's IPC
handle and the counter), and `buffers` (the ctypes buffers alone). Prints one line,
`ipc_parts label=… whole_us=… event_us=… guard_us=… [library_us=… buffers_us=…]`.
PARTS=whole,library (names separated by commas) times only those: a profiler's run; with
READY=PATH the script writes PATH once the tensors of its last part are made, then waits a
second before timing it (a profiler attaches meanwhile: `perf record -p`).
Every share is kept (nothing is received), as in `ipc_share_cost.py`."""
import ctypes
import os
import sys
import time

import torch

label = os.environ.get("LABEL", "?")
shares = int(sys.argv[1]) if len(sys.argv) > 1 else 400
device = torch.device("cuda")
kept = []
wanted = set(os.environ.get("PARTS", "whole,event,guard,library,buffers").split(","))


def fresh(n):
    return [torch.empty(1 << 20, dtype=torch.uint8, device=device) for _ in range(n)]


def per_call_us(fn, items):
    torch.cuda.synchronize()
    if os.environ.get("READY"):
        with open(os.environ["READY"], "w") as ready:
            ready.write(str(os.getpid()))
        time.sleep(1)
    start = time.perf_counter()
    for item in items:
        kept.append(fn(item))
    return (time.perf_counter() - start) / len(items) * 1e6


fresh(1)[0].untyped_storage()._share_cuda_()  # the first share's set-up, untimed
parts = {}
if "whole" in wanted:
    parts["whole"] = per_call_us(lambda t: t.untyped_storage()._share_cuda_(), fresh(shares))


def event(_):
    e = torch.cuda.Event(interprocess=True)
    e.record(torch.cuda.current_stream())
    return e, e.ipc_handle()


if "event" in wanted:
    parts["event"] = per_call_us(event, range(shares))


def guard(_):
    with torch.cuda.device(0):
        pass


if "guard" in wanted:
    parts["guard"] = per_call_us(guard, range(shares))

hooks = sys.modules.get("cachealloc_hooks")
api = hooks._ipc_api() if hooks is not None else None
if api is not None:

    def library(t):
        counter = ctypes.create_string_buffer(128)
        slot = ctypes.c_uint64()
        desc = ctypes.create_string_buffer(4096)
        need = api.share_desc(t.data_ptr(), desc, 4096, counter, 128, ctypes.byref(slot))
        assert 0 < need <= 4096, need
        return t, desc.raw[:need]

    def buffers(_):
        counter = ctypes.create_string_buffer(128)
        slot = ctypes.c_uint64()
        desc = ctypes.create_string_buffer(4096)
        return counter, slot, desc

    if "library" in wanted:
        parts["library"] = per_call_us(library, fresh(shares))
    if "buffers" in wanted:
        parts["buffers"] = per_call_us(buffers, range(shares))

print(
    f"ipc_parts label={label} shares={shares} "
    + " ".join(f"{name}_us={us:.2f}" for name, us in parts.items()),
    flush=True,
)
