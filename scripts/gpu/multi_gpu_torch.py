"""One PyTorch process on two GPUs, as model-parallel and DataParallel programs use them: the
memory API per device, copies and streams across devices, an out-of-memory error on the second
device, and DataParallel training. Run natively and under the shim: the printed lines (results
and memory figures) must agree. Each check prints "ok NAME" or "FAIL NAME: why"; the last line is
"OK multi_gpu_torch.py" when every check passed, or "OK multi_gpu_torch.py (skipped ...)" with
fewer than two GPUs."""
import sys
import torch
import torch.nn as nn

if torch.cuda.device_count() < 2:
    print("OK multi_gpu_torch.py (skipped: needs two GPUs)")
    raise SystemExit(0)

failed = []


def check(name, condition, why=""):
    print(("ok   " if condition else "FAIL ") + name + ("" if condition else f": {why}"), flush=True)
    if not condition:
        failed.append(name)


MiB = 1 << 20
torch.manual_seed(0)

# The memory API, per device: each device counts its own tensors only.
base = [torch.cuda.memory_allocated(d) for d in (0, 1)]
a0 = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda:0")
a1 = torch.empty(96 * MiB, dtype=torch.uint8, device="cuda:1")
got = [torch.cuda.memory_allocated(d) - base[d] for d in (0, 1)]
check("memory_allocated per device", got == [64 * MiB, 96 * MiB], f"{got}")
check("memory_reserved covers allocated",
      all(torch.cuda.memory_reserved(d) >= torch.cuda.memory_allocated(d) for d in (0, 1)))
torch.cuda.reset_peak_memory_stats(1)
peak1 = torch.cuda.max_memory_allocated(1)
check("reset_peak_memory_stats on device 1", peak1 == torch.cuda.memory_allocated(1),
      f"peak {peak1}, allocated {torch.cuda.memory_allocated(1)}")
del a0, a1
torch.cuda.empty_cache()
check("empty_cache releases both devices' cached memory",
      all(torch.cuda.memory_reserved(d) - torch.cuda.memory_allocated(d) < 64 * MiB for d in (0, 1)),
      f"{[(torch.cuda.memory_reserved(d), torch.cuda.memory_allocated(d)) for d in (0, 1)]}")

# Model parallel: activations cross devices both ways, with a side stream on device 1.
x = torch.randn(512, 1024, device="cuda:0")
w1 = torch.randn(1024, 1024, device="cuda:1")
side = torch.cuda.Stream(device=1)
with torch.cuda.stream(side):
    h = x.to("cuda:1", non_blocking=True) @ w1
    h.record_stream(side)
torch.cuda.current_stream(1).wait_stream(side)
y = (h.relu().t().to("cuda:0") @ x).sum()
ref = ((x.cpu() @ w1.cpu()).relu().t() @ x.cpu()).sum()
check("model-parallel result", torch.allclose(y.cpu(), ref, rtol=1e-3), f"{y.item()} vs {ref.item()}")

# An impossible request on device 1 raises torch.OutOfMemoryError; the program goes on.
try:
    torch.empty(torch.cuda.get_device_properties(1).total_memory * 2, dtype=torch.uint8, device="cuda:1")
    check("out of memory on device 1", False, "no error")
except torch.OutOfMemoryError:
    check("out of memory on device 1", True)
z = torch.ones(8 * MiB, device="cuda:1")
check("device 1 after the OOM", z.sum().item() == 8 * MiB)

# DataParallel: replicas on both devices, scatter and gather through device 0.
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)).cuda(0)
dp = nn.DataParallel(model, device_ids=[0, 1])
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
for step in range(5):
    inp = torch.randn(128, 256, device="cuda:0")
    loss = dp(inp).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
print(f"dataparallel_loss={loss.item():.6f}", flush=True)
check("DataParallel trains", torch.isfinite(loss).item())
torch.cuda.synchronize(0)
torch.cuda.synchronize(1)
print("OK multi_gpu_torch.py" if not failed else f"FAIL multi_gpu_torch.py: {failed}")
sys.exit(1 if failed else 0)
