"""JAX with XLA's platform allocator (`XLA_PYTHON_CLIENT_ALLOCATOR=platform`: no BFC arena,
every buffer a driver allocation). Prints `workload=jax step_ms=X checksum=Y`; the checksum must
not change with the allocator."""
import os
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

key = jax.random.PRNGKey(0)
total = 0.0
t0 = time.perf_counter()
for i in range(100):
    n = 256 + (i % 8) * 128
    x = jax.random.normal(jax.random.fold_in(key, i), (n, n), dtype=jnp.float32)
    total += float(jnp.tanh(x @ x.T / n).sum())
step_ms = (time.perf_counter() - t0) * 1000 / 100
print(f"workload=jax jax={jax.__version__} step_ms={step_ms:.3f} checksum={total:.6e}")
