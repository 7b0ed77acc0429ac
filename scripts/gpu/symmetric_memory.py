"""PyTorch's symmetric memory (`torch.distributed._symmetric_memory`), natively and under the
shim, two ranks on two GPUs, the same command for both sides.

Symmetric memory is not served by the caching allocator: PyTorch's CUDA backend makes it with
the driver's virtual memory calls (`cuMemCreate`, exported to the peers as file descriptors)
and, with `get_mem_pool`, hands it out through a `MemPool` over its own allocator, which under
the shim is the C++ allocator's foreign-allocator pool. A user who preloads must keep it, and
the pools' own tensors around it must be left alone. Checks, each rank:

* `empty_rendezvous`: `empty` + `rendezvous`, each rank writes its buffer, a barrier, each
  reads its peer's through `get_buffer`;
* `one_shot_all_reduce`: `torch.ops.symm_mem.one_shot_all_reduce` over the same buffer (peer
  loads; no multicast, which the machines keep off);
* `mem_pool`: where `get_mem_pool` exists, a tensor allocated in the symmetric pool with
  `use_mem_pool`, rendezvoused and read by the peer as above;
* `pools_untouched`: ordinary tensors made before and between keep their values.

Each rank prints `symm label=L rank=R check=NAME ok=True|False|skip detail=...`; the parent
prints `symm label=L passed=N/M` (ranks whose checks all passed or skipped).
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
N = 1 << 20


def report(rank, name, ok, detail=""):
    print(f"symm label={label} rank={rank} check={name} ok={ok} detail={detail}", flush=True)
    return ok is not False


def check(results, rank, name, fn):
    try:
        ok, detail = fn()
    except Exception:
        ok, detail = False, traceback.format_exc()[-500:].replace("\n", " | ")
    results.append(report(rank, name, ok, detail))


def exchange(symm_mem, tensor, rank, peer, group_name):
    """Rendezvous `tensor`, write this rank's mark, read the peer's through its buffer."""
    handle = symm_mem.rendezvous(tensor, group_name)
    tensor.fill_(float(rank + 1))
    torch.cuda.synchronize()
    handle.barrier()
    seen = handle.get_buffer(peer, tensor.shape, tensor.dtype).clone()
    handle.barrier()
    torch.cuda.synchronize()
    return bool((seen == float(peer + 1)).all()), f"peer's first {seen[0].item()}"


def run(rank, world, init_file):
    import torch.distributed._symmetric_memory as symm_mem

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    results = []
    try:
        dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank,
                                world_size=world, device_id=device)
        group_name = dist.group.WORLD.group_name
        peer = 1 - rank
        before = torch.arange(N, device=device, dtype=torch.float32)
        buf = symm_mem.empty(N, dtype=torch.float32, device=device)
        between = torch.full((4 * N,), 7.0, device=device)
        check(results, rank, "empty_rendezvous", lambda: exchange(symm_mem, buf, rank, peer, group_name))

        def all_reduce():
            buf.fill_(float(rank + 1))
            out = torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group_name)
            torch.cuda.synchronize()
            want = float(sum(range(1, world + 1)))
            return bool((out == want).all()), f"{out[0].item()} want {want}"

        check(results, rank, "one_shot_all_reduce", all_reduce)

        def mem_pool():
            if not hasattr(symm_mem, "get_mem_pool"):
                return "skip", "no get_mem_pool in this torch"
            pool = symm_mem.get_mem_pool(device)
            with torch.cuda.use_mem_pool(pool):
                x = torch.empty(2 * N, dtype=torch.float32, device=device)
            ok, detail = exchange(symm_mem, x, rank, peer, group_name)
            del x
            return ok, detail

        check(results, rank, "mem_pool", mem_pool)
        check(results, rank, "pools_untouched", lambda: (
            bool((before == torch.arange(N, device=device, dtype=torch.float32)).all()
                 and (between == 7.0).all()), ""))
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        results.append(report(rank, "ran", False, traceback.format_exc()[-500:].replace("\n", " | ")))
    sys.exit(0 if results and all(results) else 1)


def main():
    init_file = os.path.join(tempfile.mkdtemp(prefix="symm-"), "init")
    return run_ranks(f"symm label={label}", run, (init_file,), timeout=200)


if __name__ == "__main__":
    sys.exit(main())
