"""Runs a torchrun workload script (`torchrun ... ddp_per_rank.py WORKLOAD.py`) and then prints
each rank's own peaks, which the workload's line (rank 0's) leaves out:
`rank_peak script=W label=L rank=R torch_max_reserved_MB=… torch_max_allocated_MB=…`."""
import os
import runpy
import sys

import torch

script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
workload = os.path.splitext(os.path.basename(script))[0]
print(
    f"rank_peak script={workload} label={os.environ.get('LABEL', '-')} rank={os.environ.get('RANK', '0')} "
    f"torch_max_reserved_MB={torch.cuda.max_memory_reserved() / 1e6:.1f} "
    f"torch_max_allocated_MB={torch.cuda.max_memory_allocated() / 1e6:.1f}",
    flush=True,
)
