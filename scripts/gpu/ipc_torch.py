"""CUDA tensors sent to another process with torch.multiprocessing, natively and under the shim
(same command): a producer sends tensors (whole allocations and views into larger ones) through
a queue, the consumer checks their values, writes into one (the producer sees it), and lets go;
the producer frees its tensors while the consumer still holds them, then checks that memory is
reused once the consumer is done (no leak across 200 round trips).

With expandable segments (`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` natively,
`CACHEALLOC_CONF=expandable_segments:True` under the shim) the same checks run on tensors that
live in mapped memory, shared through POSIX file descriptors; EXPANDABLE=1 adds a check that the
producer's tensor really lies in mapped memory (its range is not a `cudaMalloc` allocation:
`cuMemGetAddressRange` then names a mapping, which `cuPointerGetAttribute`'s MAPPED says).

With CONSUMER_DEVICE=1 (two GPUs) the consumer runs on GPU 1: it copies each tensor it receives
from the producer's GPU 0 to its own device before checking it, and its write back is a copy from
GPU 1 into the producer's memory (CONSUMER_COPY=0: it reads them where they lie instead).

Prints one line per check, `ipc label=L check=NAME ok=True|False detail=...`, and a last
`ipc label=L passed=N/M`.
"""
import os
import sys
import warnings

import torch
import torch.multiprocessing as mp

warnings.simplefilter("ignore")
label = os.environ.get("LABEL", "-")
ROUNDS = 200


CONSUMER_DEVICE = int(os.environ.get("CONSUMER_DEVICE", "0"))


COPY = os.environ.get("CONSUMER_COPY", "1") != "0"


def mine(t):
    """The received tensor on the consumer's own device (a copy across GPUs where they differ;
    with CONSUMER_COPY=0 the tensor itself, read where it lies)."""
    return t.to(f"cuda:{CONSUMER_DEVICE}") if COPY else t


def consumer(queue, done, results):
    torch.cuda.set_device(CONSUMER_DEVICE)
    torch.cuda.init()
    ok = True
    # 1. Values and a write back.
    t, expected = queue.get()
    ok &= bool(torch.equal(mine(t).cpu(), expected))
    if CONSUMER_DEVICE == t.device.index:
        t.mul_(2)
    else:
        t.copy_(mine(t) * 2)
    torch.cuda.synchronize(t.device)
    torch.cuda.synchronize()
    del t
    done.put("wrote")
    # 2. Views into one allocation.
    views = queue.get()
    ok &= all(float(mine(v).sum()) == float(i) * v.numel() for i, v in enumerate(views))
    del views
    done.put("views")
    # 3. Many round trips: hold each tensor until the next arrives.
    held = None
    for i in range(ROUNDS):
        t = queue.get()
        ok &= float(mine(t)[0, 0]) == float(i)
        held = t
    del held, t
    torch.cuda.synchronize()
    done.put("rounds")
    results.put(ok)


def mapped(address):
    """Whether `address` lies in memory mapped with CUDA's virtual memory API."""
    import ctypes

    cuda = ctypes.CDLL("libcuda.so.1")
    value = ctypes.c_int(0)
    CU_POINTER_ATTRIBUTE_MAPPED = 13
    code = cuda.cuPointerGetAttribute(ctypes.byref(value), CU_POINTER_ATTRIBUTE_MAPPED, ctypes.c_uint64(address))
    return code == 0 and value.value == 1


def main():
    mp.set_start_method("spawn", force=True)
    results = []

    def check(name, ok, detail=""):
        results.append(bool(ok))
        print(f"ipc label={label} check={name} ok={bool(ok)} detail={detail}", flush=True)

    if CONSUMER_DEVICE >= torch.cuda.device_count():
        print(f"ipc label={label} passed=0/0 skipped: no GPU {CONSUMER_DEVICE}", flush=True)
        return 0
    queue, done, out = mp.Queue(), mp.Queue(), mp.Queue()
    if os.environ.get("EXPANDABLE"):
        x = torch.ones(1 << 20, device="cuda")
        check("in_mapped_memory", mapped(x.data_ptr()), f"{x.data_ptr():#x}")
        del x
    p = mp.Process(target=consumer, args=(queue, done, out))
    p.start()
    try:
        x = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
        queue.put((x, x.cpu()))
        check("consumer_sees_values", done.get(timeout=60) == "wrote")
        check("producer_sees_consumer_write", torch.equal(x.cpu(), torch.arange(1 << 20, dtype=torch.float32) * 2))
        base = torch.zeros(8, 1024, device="cuda")
        for i in range(8):
            base[i].fill_(i)
        queue.put([base[i] for i in range(8)])
        check("views_into_one_allocation", done.get(timeout=60) == "views")
        torch.cuda.synchronize()
        reserved_before = torch.cuda.memory_reserved()
        for i in range(ROUNDS):
            t = torch.full((256, 1024), float(i), device="cuda")
            queue.put(t)
            del t  # freed here while the consumer may still hold it
        check("round_trips", done.get(timeout=120) == "rounds")
        consumer_ok = out.get(timeout=60)
        check("consumer_checks", consumer_ok)
        p.join(timeout=60)
        check("consumer_exit", p.exitcode == 0, f"exitcode={p.exitcode}")
        torch.cuda.synchronize()
        # Once the consumer let go, the blocks return: allocating again reserves nothing new.
        again = [torch.full((256, 1024), 1.0, device="cuda") for _ in range(ROUNDS)]
        growth = torch.cuda.memory_reserved() - reserved_before
        check("memory_returns", growth <= 256 * 1024 * 4 * ROUNDS, f"reserved growth {growth >> 20} MiB")
        del again
    finally:
        if p.is_alive():
            p.kill()
    print(f"ipc label={label} passed={sum(results)}/{len(results)}", flush=True)
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
