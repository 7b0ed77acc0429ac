"""The time torch.compile takes to compile, a workload of compile time alone (issue 25): a
`torch.compile(mode="reduce-overhead")` MultiheadAttention called with six input shapes, so that
Dynamo, Inductor and CUDA graph trees record six graphs — the workload of PyTorch's
`test_skip_if_dynamic_shape_limit_reached2` without its debugging asserts (whose slow memory
snapshots under the shim were first taken for a cost of compilation: BENCHMARKS.md, "Memory
snapshots, not Python stacks, in a compile-bound graph tree test"). Inductor's caches are the
caller's to point at a fresh directory (`TORCHINDUCTOR_CACHE_DIR`), or compilation is skipped.
Prints one line:
    workload=compile_mha label=L compile_s=X allocations=N
(`allocations`: torch.cuda.memory_stats' allocation count, which the shim fills too.)"""
import os
import time

import torch

label = os.environ.get("LABEL", "-")


class Mod(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(embed_dim=3, num_heads=3, device="cuda")

    def forward(self, q, k, v):
        return self.attn(q, k, v)


def main():
    torch.manual_seed(0)
    mod = torch.compile(Mod(), mode="reduce-overhead")
    torch.cuda.synchronize()
    start = time.perf_counter()
    for batch in range(10, 40, 10):
        for length in range(10, 30, 10):
            q = torch.rand((batch, length, 3), device="cuda")
            for _ in range(3):
                mod(q, q, q)
    torch.cuda.synchronize()
    took = time.perf_counter() - start
    count = torch.cuda.memory_stats().get("allocation.all.allocated", 0)
    print(f"workload=compile_mha label={label} compile_s={took:.2f} allocations={count}")


if __name__ == "__main__":
    main()
