"""NCCL's registration of PyTorch's memory, natively and under the shim (same command; two
GPUs): what `ProcessGroupNCCL` does with the allocator's trace trackers.

* `MODE=pool` (default): a `MemPool` over NCCL's own allocator (`backend.mem_allocator`,
  `ncclMemAlloc`), a tensor in it, `backend.register_mem_pool(pool)` (registers the pool's
  segments and attaches the trackers), then a tensor large enough for a new segment of the pool,
  which only the trackers tell NCCL of; an all-reduce of both; `deregister_mem_pool` (which
  deregisters every segment of the pool's snapshot: one NCCL was never told of is an error);
  then the pool goes. This is how Megatron's NCCL user buffers and symmetric memory use it.
* `MODE=all`: `TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1` in the ranks' environment from
  their start (the shim then keeps PyTorch's memory in fixed segments), every segment registered
  with the communicator: tensors made before and after the process group, all-reduced, freed and
  given back (`empty_cache`: each segment deregistered before it is freed).

Each rank prints `nccl label=L mode=M rank=R check=NAME ok=True|False detail=...`; the parent
prints `nccl label=L mode=M passed=N/M`. NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=REG lines that
mention registration are counted per rank (`registrations=`), for comparison between sides.
"""
import os
import sys
import tempfile
import traceback
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import run_ranks  # noqa: E402

warnings.simplefilter("ignore")
label = os.environ.get("LABEL", "-")
MODE = os.environ.get("MODE", "pool")
MiB = 1 << 20


def report(rank, name, ok, detail=""):
    print(f"nccl label={label} mode={MODE} rank={rank} check={name} ok={ok} detail={detail}", flush=True)
    return ok


def pool_mode(rank, device, results):
    backend = dist.group.WORLD._get_backend(device)
    pool = torch.cuda.MemPool(backend.mem_allocator)
    with torch.cuda.use_mem_pool(pool):
        small = torch.full((MiB,), float(rank + 1), device=device)
    backend.register_mem_pool(pool)
    with torch.cuda.use_mem_pool(pool):
        # A new segment of the pool, told to NCCL only by the trackers.
        large = torch.full((64 * MiB,), float(rank + 1), device=device)
    dist.all_reduce(small)
    dist.all_reduce(large)
    torch.cuda.synchronize(device)
    want = float(sum(range(1, dist.get_world_size() + 1)))
    results.append(report(rank, "all_reduce", bool((small == want).all() and (large == want).all()),
                          f"{small[0].item()} {large[-1].item()} want {want}"))
    try:
        backend.deregister_mem_pool(pool)
        results.append(report(rank, "deregister", True))
    except Exception as e:  # NCCL was not told of a segment it is asked to let go of
        results.append(report(rank, "deregister", False, repr(e)[:300]))
    del small, large, pool
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()


def all_mode(rank, device, results):
    before = [torch.full((3 * MiB,), float(rank), device=device) for _ in range(4)]
    dist.barrier()
    after = [torch.full((40 * MiB,), float(rank), device=device) for _ in range(3)]
    for t in before + after:
        dist.all_reduce(t)
    torch.cuda.synchronize(device)
    want = float(sum(range(dist.get_world_size())))
    ok = all(bool((t == want).all()) for t in before + after)
    results.append(report(rank, "all_reduce", ok))
    del before, after
    torch.cuda.synchronize(device)
    try:
        torch.cuda.empty_cache()  # every freed segment deregistered before it is freed
        more = torch.full((80 * MiB,), 1.0, device=device)
        dist.all_reduce(more)
        torch.cuda.synchronize(device)
        results.append(report(rank, "free_and_again", bool((more == 2.0).all())))
    except Exception as e:
        results.append(report(rank, "free_and_again", False, repr(e)[:300]))


def run(rank, world, init_file, out_dir):
    os.environ.setdefault("NCCL_DEBUG", "INFO")
    os.environ.setdefault("NCCL_DEBUG_SUBSYS", "REG")
    os.environ["NCCL_DEBUG_FILE"] = os.path.join(out_dir, f"nccl.{rank}.log")
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    results = []
    try:
        dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                device_id=device)
        (pool_mode if MODE == "pool" else all_mode)(rank, device, results)
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        results.append(report(rank, "ran", False, traceback.format_exc()[-400:].replace("\n", " | ")))
    with open(os.environ["NCCL_DEBUG_FILE"], errors="replace") as f:
        lines = [line for line in f if "egist" in line]
    print(f"nccl label={label} mode={MODE} rank={rank} registrations={len(lines)} "
          f"sample={lines[0].strip()[-160:] if lines else ''}", flush=True)
    # NCCL says so for each buffer registered (NCCL_DEBUG_SUBSYS=REG); none: the memory was not.
    results.append(report(rank, "nccl_registered", bool(lines), f"{len(lines)} lines"))
    sys.exit(0 if results and all(results) else 1)


def main():
    if MODE == "all":
        # Set for the whole process, as a launcher sets it: the shim reads it when it starts.
        os.environ["TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK"] = "1"
    out_dir = tempfile.mkdtemp(prefix="nccl-reg-")
    return run_ranks(f"nccl label={label} mode={MODE}", run, (os.path.join(out_dir, "init"), out_dir))


if __name__ == "__main__":
    sys.exit(main())
