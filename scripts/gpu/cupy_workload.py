"""CuPy with its memory pool off (`cupy.cuda.set_allocator(None)`): every array is a
`cudaMalloc`/`cudaFree` of the CUDA runtime that CuPy's modules link statically, which reaches
the driver only through `cuGetProcAddress`. Prints `workload=cupy step_ms=X checksum=Y`; the
checksum must not change with the allocator."""
import time

import cupy as cp

cp.cuda.set_allocator(None)
total = 0.0
t0 = time.perf_counter()
for i in range(300):
    n = 1000 + (i * 7919) % 200000
    a = cp.arange(n, dtype=cp.float64)
    total += float((a * 2 + 1).sum())
    m = cp.ones((64 + i % 64, 128), dtype=cp.float64) * (i % 5)
    total += float((m @ m.T).sum())
cp.cuda.Device().synchronize()
step_ms = (time.perf_counter() - t0) * 1000 / 300
print(f"workload=cupy cupy={cp.__version__} step_ms={step_ms:.3f} checksum={total:.10e}")
