"""The allocation-heavy workloads of models.py (issue 25) as a plain training run, for
comparing configurations process by process (natively, under the shim, with expandable
segments): `train_models.py MODEL` (llama, cnn, mlp or gpt2: models.build) trains 6 warm-up
steps and STEPS (env, default 24) timed ones, each step synchronized, and prints one line
    workload=MODEL_train label=$LABEL step_ms=X torch_max_reserved_MB=R torch_max_allocated_MB=A param_sum=S
(`step_ms`: the median step; peaks over the whole run, from torch.cuda's memory API;
`param_sum`: the sum of the trained parameters, to 6 significant digits, which runs under
different allocators must agree on)."""
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import build, timed  # noqa: E402
from pluggable import use_if_asked  # noqa: E402

use_if_asked()  # ROUTE=pluggable: see pluggable.py
MODEL = sys.argv[1]
STEPS = int(os.environ.get("STEPS", "24"))
torch.manual_seed(0)
step, model = build(MODEL)
for i in range(6):
    step(i)
times = []
for i in range(STEPS):
    times.append(timed(step, i))
mb = 1 << 20
param_sum = sum(p.detach().double().sum().item() for p in model.parameters())
try:
    reserved, allocated = torch.cuda.max_memory_reserved(), torch.cuda.max_memory_allocated()
except RuntimeError:  # ROUTE=pluggable: PyTorch keeps no statistics for a pluggable allocator
    reserved = allocated = -mb
print(
    f"workload={MODEL}_train label={os.environ.get('LABEL', '-')} "
    f"step_ms={statistics.median(times):.4f} "
    f"torch_max_reserved_MB={reserved / mb:.1f} "
    f"torch_max_allocated_MB={allocated / mb:.1f} "
    f"param_sum={param_sum:.6g}"
)
