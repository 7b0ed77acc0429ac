"""CUDA's own IPC calls on PyTorch's tensors, as vLLM's and SGLang's custom all-reduce make them
(each buffer a CUDA graph captured: `cuPointerGetAttribute(RANGE_START_ADDR)` for the
allocation's base, `cudaIpcGetMemHandle` of the base, the pointer's offset beside it; the other
process `cudaIpcOpenMemHandle` and the offset), natively and under the shim, same command.

Tensors: a small one (inside a segment natively), a large one, one made inside a CUDA graph's
capture (a graph pool's), each at an offset into its storage (a view). A spawned receiver (under
the shim too: it inherits `LD_PRELOAD`) opens each handle, checks the sender's bytes, writes its
own and closes it; the sender then sees them. Checks print as
`cuda_ipc label=L check=NAME ok=True|False detail=...`, then `cuda_ipc label=L passed=N/M`.
`RECEIVER_DEVICE=1` (two GPUs): the receiver opens the handles from device 1, as each rank of a
custom all-reduce opens its peers' buffers from its own GPU (peer access between the devices).
"""
import ctypes
import multiprocessing as mp
import os
import sys
import traceback

import torch

label = os.environ.get("LABEL", "-")
RECEIVER_DEVICE = int(os.environ.get("RECEIVER_DEVICE", "0"))
RANGE_START_ADDR = 11


class IpcHandle(ctypes.Structure):
    """`cudaIpcMemHandle_t`, passed by value to `cudaIpcOpenMemHandle`."""

    _fields_ = [("reserved", ctypes.c_byte * 64)]


def libs():
    """The runtime's and the driver's functions as the program's own code reaches them: through
    the process's global scope, where a preloaded library comes first."""
    ctypes.CDLL("libcudart.so.13", mode=ctypes.RTLD_GLOBAL)
    ctypes.CDLL("libcuda.so.1", mode=ctypes.RTLD_GLOBAL)
    g = ctypes.CDLL(None)
    g.cuPointerGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
    g.cudaIpcGetMemHandle.argtypes = [ctypes.POINTER(IpcHandle), ctypes.c_void_p]
    g.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), IpcHandle, ctypes.c_uint]
    g.cudaIpcCloseMemHandle.argtypes = [ctypes.c_void_p]
    g.cudaMemcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    g.cudaMemset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    return g


def report(name, ok, detail=""):
    print(f"cuda_ipc label={label} check={name} ok={ok} detail={detail}", flush=True)
    return bool(ok)


def receiver(items, answers):
    g = libs()
    torch.cuda.init()
    torch.cuda.set_device(RECEIVER_DEVICE)
    g.cudaSetDevice(RECEIVER_DEVICE)
    for name, handle, offset, nbytes, value in items:
        try:
            base = ctypes.c_void_p()
            code = g.cudaIpcOpenMemHandle(ctypes.byref(base), IpcHandle.from_buffer_copy(handle), 1)
            if code != 0:
                answers.put((name, False, f"cudaIpcOpenMemHandle returned {code}"))
                continue
            host = (ctypes.c_ubyte * nbytes)()
            at = base.value + offset
            g.cudaMemcpy(host, ctypes.c_void_p(at), nbytes, 2)
            seen = set(bytes(host))
            g.cudaMemset(ctypes.c_void_p(at), 0x7E, nbytes)
            torch.cuda.synchronize()
            closed = g.cudaIpcCloseMemHandle(base)
            answers.put((name, seen == {value} and closed == 0, f"bytes seen {sorted(seen)[:4]}, close {closed}"))
        except Exception:
            answers.put((name, False, traceback.format_exc()[-300:].replace("\n", " | ")))


def main():
    g = libs()
    torch.cuda.init()
    dev = torch.device("cuda")
    tensors = {}
    tensors["small"] = torch.full((1 << 18,), 0x11, dtype=torch.uint8, device=dev)[4096:]
    tensors["large"] = torch.full((64 << 20,), 0x22, dtype=torch.uint8, device=dev)[1 << 20:]
    static_in = torch.zeros(1 << 20, dtype=torch.uint8, device=dev)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        static_in + 0x33
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = static_in + 0x33
    graph.replay()
    tensors["graph"] = out[512:]
    torch.cuda.synchronize()
    values = {"small": 0x11, "large": 0x22, "graph": 0x33}
    results, items = [], []
    for name, t in tensors.items():
        ptr = t.data_ptr()
        base = ctypes.c_uint64()
        code = g.cuPointerGetAttribute(ctypes.byref(base), RANGE_START_ADDR, ptr)
        handle, again = IpcHandle(), IpcHandle()
        code2 = g.cudaIpcGetMemHandle(ctypes.byref(handle), ctypes.c_void_p(base.value)) if code == 0 else -1
        g.cudaIpcGetMemHandle(ctypes.byref(again), ctypes.c_void_p(base.value))
        ok = code == 0 and code2 == 0 and bytes(handle) == bytes(again)
        results.append(report(f"{name}_handle", ok, f"range start {code}, handle {code2}, offset {ptr - base.value}, "
                                                    f"shim's {bytes(handle)[:8] == b'cacheIPC'}"))
        if ok:
            items.append((name, bytes(handle), ptr - base.value, t.numel(), values[name]))
    ctx = mp.get_context("spawn")
    answers = ctx.Queue()
    child = ctx.Process(target=receiver, args=(items, answers))
    child.start()
    for _ in items:
        name, ok, detail = answers.get(timeout=120)
        results.append(report(f"{name}_received", ok, detail))
    child.join(60)
    for name, t in tensors.items():
        if any(i[0] == name for i in items):
            results.append(report(f"{name}_written_back", bool((t == 0x7E).all()), ""))
    del graph
    print(f"cuda_ipc label={label} passed={sum(results)}/{len(results)}", flush=True)
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
