"""A multi-stream single-GPU workload: two side streams produce activations (matmuls and a
GELU) that the main stream consumes, with `record_stream` telling the allocator about the
cross-stream use, and tensors of varying size freed on both sides. Prints one line of results:
`workload=multistream label=L step_ms=X loss=Y torch_max_reserved_MB=Z`; `loss` is a checksum
that must not change with the allocator.
"""
import os, time, torch

torch.manual_seed(0)
dev = "cuda"
D = 2048
w_side = [torch.randn(D, D, device=dev) / D ** 0.5 for _ in range(2)]
w_main = torch.randn(D, D, device=dev) / D ** 0.5
side = [torch.cuda.Stream() for _ in range(2)]
main = torch.cuda.current_stream()
gen = torch.Generator(device=dev).manual_seed(1)


def step(i):
    rows = 256 * (1 + i % 4)
    x = torch.randn(rows, D, device=dev, generator=gen)
    produced = []
    for s, w in zip(side, w_side):
        s.wait_stream(main)  # x is ready
        with torch.cuda.stream(s):
            h = torch.nn.functional.gelu(x @ w)
            tmp = h * 0.5  # a side-stream temporary, freed on the side stream
            h = h + tmp
        main.wait_stream(s)
        h.record_stream(main)  # used on main below, freed while main may still run
        produced.append(h)
        x.record_stream(s)
    out = sum(p @ w_main for p in produced)
    checksum = out.float().pow(2).mean()
    del produced, out
    return checksum


for i in range(5):
    step(i)
torch.cuda.synchronize()
n = int(os.environ.get("STEPS", "200"))
acc = torch.zeros((), device=dev)
t = time.perf_counter()
for i in range(n):
    acc += step(i)
torch.cuda.synchronize()
dt = time.perf_counter() - t
print(f"workload=multistream label={os.environ.get('LABEL', '-')} step_ms={dt / n * 1e3:.3f} "
      f"loss={acc.item() / n:.6f} torch_max_reserved_MB={torch.cuda.max_memory_reserved() / 1e6:.1f}")
