"""What sending a CUDA tensor to another process costs the sender (issue 22): the time of
`UntypedStorage._share_cuda_()`, what `torch.multiprocessing` calls for each CUDA tensor it
puts on a queue, natively and under the shim, with the stream idle and with work queued on it.

    [LD_PRELOAD=…/libcachealloc.so] LABEL=shim python3 scripts/gpu/ipc_share_cost.py [SHARES]

Idle: SHARES (default 2 000) shares of distinct 1 MiB tensors, nothing queued; microseconds per
share. Busy: 9 shares, each just after `torch.cuda._sleep` queued BUSY_MS (default 20) ms of
work on the current stream; the median milliseconds of the share call. PyTorch records an IPC
event on the stream for the receiver to wait on, so its sender does not wait for the device
while fewer than 1 000 of its events are alive (then it synchronizes, as the shim does: keep
SHARES under that to compare the events); a sender that synchronized at every share would wait
out the queued work in every busy share.
Nothing is received: the shares' blocks stay held, as a sender's are until its receivers let
go. Prints one line, `ipc_share label=… idle_us=… busy_ms=… busy_queued_ms=…`."""
import os
import statistics
import sys
import time

import torch

label = os.environ.get("LABEL", "?")
shares = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
busy_ms = float(os.environ.get("BUSY_MS", "20"))
device = torch.device("cuda")

tensors = [torch.empty(1 << 20, dtype=torch.uint8, device=device) for _ in range(shares)]
tensors[0].untyped_storage()._share_cuda_()  # the first share's set-up, untimed
torch.cuda.synchronize()
start = time.perf_counter()
for t in tensors[1:]:
    t.untyped_storage()._share_cuda_()
idle_us = (time.perf_counter() - start) / (shares - 1) * 1e6
torch.cuda.synchronize()

# Cycles of the GPU's clock for BUSY_MS: measured, not assumed.
probe = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
probe[0].record()
torch.cuda._sleep(10_000_000)
probe[1].record()
torch.cuda.synchronize()
cycles_per_ms = 10_000_000 / probe[0].elapsed_time(probe[1])

busy = []
for _ in range(9):
    t = torch.empty(1 << 20, dtype=torch.uint8, device=device)
    torch.cuda._sleep(int(busy_ms * cycles_per_ms))
    start = time.perf_counter()
    t.untyped_storage()._share_cuda_()
    busy.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize()
    tensors.append(t)
print(
    f"ipc_share label={label} shares={shares} idle_us={idle_us:.2f} "
    f"busy_ms={statistics.median(busy):.3f} busy_queued_ms={busy_ms:g}",
    flush=True,
)
