"""A program that brings its own allocator: `torch.cuda.memory.change_current_allocator` with a
`CUDAPluggableAllocator`, as RMM's `rmm_torch_allocator` and unified-memory "spill to host"
recipes do, natively and under the shim (same command).

The program's allocator (built here with nvcc, the CUDA runtime shared so that the shim sees its
calls) counts its calls and serves each request by `ALLOC`:

* `plain`: `cudaMalloc`/`cudaFree` (under the shim, served by the library's pools);
* `async`: `cudaMallocAsync`/`cudaFreeAsync` on PyTorch's stream (the library's pools);
* `managed`: `cudaMallocManaged`/`cudaFree` (passed to CUDA: unified memory is not pooled).

Checks (`allocator label=L alloc=A check=NAME ok=True|False detail=...`, then `passed=N/M`):

* `swap`: the swap succeeds before CUDA is used (natively and under the shim: the shim's own
  allocator for PyTorch is installed but not yet initialized, so the program's replaces it);
* `used`: PyTorch's tensors come from the program's allocator (its call count moved);
* `compute`: a small MLP's forward and backward on the GPU match the CPU's;
* `stats_as_pytorchs`: `memory_allocated()` answers as PyTorch's does with a pluggable
  allocator (it raises that such an allocator keeps no statistics): under the shim, the Python
  integration has given PyTorch its own functions back;
* `freed`: once a second round's tensors are gone, every pointer the allocator gave for them
  was given back (a pluggable allocator is not cached by PyTorch; the first round leaves what
  PyTorch keeps, cuBLAS's workspaces);
* `transformers_model`: a small transformers GPT-2 (2 layers, random weights, seeded) trains
  three steps with AdamW on the GPU, its tensors from the program's allocator, and its losses
  match the same steps on the CPU (where transformers is missing it is not run and not
  counted, and an `info=transformers_model` line says so);
* `late_swap_refused` (a second process): after CUDA is used, the swap raises, as natively.

Also printed, not judged (compare the sides' lines): what `MemPool()`, `_snapshot()` and a CUDA
graph's capture do with the program's allocator in place.
"""
import ctypes
import os
import subprocess
import sys
import tempfile
import warnings

warnings.simplefilter("ignore")
label = os.environ.get("LABEL", "-")
ALLOC = os.environ.get("ALLOC", "plain")

SOURCE = r"""
#include <cuda_runtime.h>
#include <sys/types.h>
#include <stdio.h>
static long mallocs, frees;
extern "C" {
long program_mallocs() { return mallocs; }
long program_frees() { return frees; }
void* program_malloc(ssize_t size, int device, cudaStream_t stream) {
  void* p = nullptr;
  cudaError_t e;
#if defined(ALLOC_ASYNC)
  e = cudaMallocAsync(&p, size, stream);
#elif defined(ALLOC_MANAGED)
  e = cudaMallocManaged(&p, size, cudaMemAttachGlobal);
#else
  e = cudaMalloc(&p, size);
#endif
  if (e != cudaSuccess) { fprintf(stderr, "program_malloc: %s\n", cudaGetErrorString(e)); return nullptr; }
  __atomic_add_fetch(&mallocs, 1, __ATOMIC_RELAXED);
  return p;
}
void program_free(void* ptr, ssize_t size, int device, cudaStream_t stream) {
#if defined(ALLOC_ASYNC)
  cudaFreeAsync(ptr, stream);
#else
  cudaFree(ptr);
#endif
  __atomic_add_fetch(&frees, 1, __ATOMIC_RELAXED);
}
}
"""


def report(name, ok, detail=""):
    print(f"allocator label={label} alloc={ALLOC} check={name} ok={ok} detail={detail}", flush=True)
    return ok


def build():
    d = tempfile.mkdtemp(prefix="program-allocator-")
    src, out = os.path.join(d, "alloc.cu"), os.path.join(d, "alloc.so")
    with open(src, "w") as f:
        f.write(SOURCE)
    define = {"async": ["-DALLOC_ASYNC"], "managed": ["-DALLOC_MANAGED"]}.get(ALLOC, [])
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    subprocess.run(["nvcc", "-shared", "-Xcompiler", "-fPIC", "-cudart", "shared", *define, "-o", out, src],
                   check=True, env=env)
    return out


def late(lib_path):
    import torch
    torch.ones(1, device="cuda")
    try:
        torch.cuda.memory.change_current_allocator(
            torch.cuda.memory.CUDAPluggableAllocator(lib_path, "program_malloc", "program_free"))
        return report("late_swap_refused", False, "the swap was accepted after CUDA was used")
    except RuntimeError as e:
        return report("late_swap_refused", True, str(e)[:120])


def _capture(torch):
    """A CUDA graph captured and replayed: what PyTorch does with the program's allocator."""
    x = torch.ones(1024, device="cuda")
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        (x * 2).sum()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        y = x * 2
    g.replay()
    torch.cuda.synchronize()
    return y.sum().item()


def transformers_model(torch, counts):
    """Three AdamW steps of a small transformers GPT-2 on the GPU (the program's allocator
    serving it) and on the CPU: whether the losses are the same (None: transformers missing)."""
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        print(f"allocator label={label} alloc={ALLOC} info=transformers_model value=not run (no transformers)")
        return None
    config = GPT2Config(n_layer=2, n_head=4, n_embd=128, vocab_size=1000, n_positions=128,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    cpu_model = GPT2LMHeadModel(config)
    gpu_model = GPT2LMHeadModel(config).cuda()
    gpu_model.load_state_dict(cpu_model.state_dict())
    ids = torch.randint(0, 1000, (4, 64))
    before = counts.program_mallocs()
    losses = []
    for model, device in ((gpu_model, "cuda"), (cpu_model, "cpu")):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
        run = []
        for _ in range(3):
            loss = model(ids.to(device), labels=ids.to(device)).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            run.append(loss.item())
        losses.append(run)
    served = counts.program_mallocs() - before
    same = all(abs(a - b) <= 1e-3 * abs(b) for a, b in zip(*losses))
    return report("transformers_model", same and served > 0,
                  f"gpu {[round(x, 5) for x in losses[0]]} cpu {[round(x, 5) for x in losses[1]]} "
                  f"program mallocs {served}")


def main():
    lib_path = os.environ.get("PROGRAM_ALLOCATOR") or build()
    if os.environ.get("LATE") == "1":
        return 0 if late(lib_path) else 1
    import torch
    results = []
    try:
        allocator = torch.cuda.memory.CUDAPluggableAllocator(lib_path, "program_malloc", "program_free")
        torch.cuda.memory.change_current_allocator(allocator)
        results.append(report("swap", True))
    except Exception as e:
        results.append(report("swap", False, repr(e)[:300]))
        return 1
    counts = ctypes.CDLL(lib_path)
    counts.program_mallocs.restype = counts.program_frees.restype = ctypes.c_long

    def live():
        return counts.program_mallocs() - counts.program_frees()

    def train_once():
        torch.manual_seed(0)
        layers = (torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 64))
        model_cpu, x_cpu = torch.nn.Sequential(*layers), torch.randn(32, 256)
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 64)).cuda()
        model.load_state_dict(model_cpu.state_dict())
        model(x_cpu.cuda()).square().sum().backward()
        model_cpu(x_cpu).square().sum().backward()
        torch.cuda.synchronize()
        used = live()
        same = all(torch.allclose(p.grad.cpu(), q.grad, rtol=1e-3, atol=1e-4)
                   for p, q in zip(model.parameters(), model_cpu.parameters()))
        return used, same

    # A first round leaves what PyTorch keeps for good (cuBLAS's and cuBLASLt's workspaces):
    # the baseline of what stays once the second round's tensors are gone.
    train_once()
    import gc
    gc.collect()
    torch.cuda.synchronize()
    baseline = live()
    used, same = train_once()
    results.append(report("used", used > baseline, f"mallocs={counts.program_mallocs()} live={used}"))
    results.append(report("compute", same))
    # PyTorch's memory functions describe PyTorch's allocator, now the program's: natively they
    # raise that a pluggable allocator keeps no statistics; so must they under the shim.
    try:
        value = torch.cuda.memory_allocated()
        results.append(report("stats_as_pytorchs", False, f"memory_allocated() answered {value}"))
    except RuntimeError as e:
        results.append(report("stats_as_pytorchs", "CUDAPluggableAllocator" in str(e), str(e)[:100]))
    gc.collect()
    torch.cuda.synchronize()
    results.append(report("freed", live() == baseline,
                          f"live={live()} baseline={baseline} mallocs={counts.program_mallocs()}"))
    model = transformers_model(torch, counts)
    if model is not None:
        results.append(model)
    for name, fn in (("mem_pool", lambda: torch.cuda.MemPool().id),
                     ("snapshot", lambda: len(torch.cuda.memory._snapshot()["segments"])),
                     ("graph", lambda: _capture(torch))):
        try:
            print(f"allocator label={label} alloc={ALLOC} info={name} value={fn()}", flush=True)
        except Exception as e:
            print(f"allocator label={label} alloc={ALLOC} info={name} raised={type(e).__name__}: "
                  f"{str(e)[:100]}", flush=True)
    env = dict(os.environ, LATE="1", PROGRAM_ALLOCATOR=lib_path)
    late_run = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=120)
    print(late_run.stdout, end="", flush=True)
    results.append(late_run.returncode == 0)
    print(f"allocator label={label} alloc={ALLOC} passed={sum(map(bool, results))}/{len(results)}", flush=True)
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
