"""The demo's PyTorch workload: a small MLP trained on varying batch sizes (so allocation sizes
vary like a real job's). Prints one line: step time, final loss, and cachealloc's pool figures
when the shim is loaded. Usage: python3 scripts/demo_train.py [steps]"""
import ctypes
import json
import os
import sys
import time

import torch
import torch.nn as nn

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 100
torch.manual_seed(0)
model = nn.Sequential(*[nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024), nn.LayerNorm(1024))
                        for _ in range(6)]).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)


def step(batch):
    x = torch.randn(batch, 1024, device="cuda")
    loss = nn.functional.mse_loss(model(x), torch.randn_like(x))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss


for i in range(5):
    step(64 * (1 + i % 4))
torch.cuda.synchronize()
start = time.perf_counter()
for i in range(steps):
    loss = step(64 * (1 + i % 4))
torch.cuda.synchronize()
elapsed = time.perf_counter() - start
line = f"label={os.environ.get('LABEL', '-')} step_ms={elapsed / steps * 1e3:.3f} loss={loss.item():.6f}"
try:
    stats_json = ctypes.CDLL(None).cachealloc_stats_json
    stats_json.restype = ctypes.c_size_t
    stats_json.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    buf = ctypes.create_string_buffer(stats_json(None, 0))
    stats_json(buf, len(buf))
    s = json.loads(buf.value)["devices"]["0"]
    line += (f" pool_peak_reserved_MB={s['reserved_bytes.all.peak'] / 1e6:.1f}"
             f" served_from_cache={s['num_cache_hits']} device_allocs={s['num_device_alloc']}")
except (AttributeError, KeyError):
    line += f" torch_peak_reserved_MB={torch.cuda.max_memory_reserved() / 1e6:.1f}"
print(line, flush=True)
