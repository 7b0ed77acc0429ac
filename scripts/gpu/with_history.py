"""Run a Python workload (path and arguments as given) with PyTorch's own allocation recorder on:
torch.cuda.memory._record_memory_history(stacks="python"), the anchor for cachealloc's trace with
Python stacks. Usage: python3 with_history.py workload.py [args]"""
import runpy
import sys

import torch

torch.cuda.memory._record_memory_history(stacks="python")
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
