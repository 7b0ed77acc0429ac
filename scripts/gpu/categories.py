"""Memory by category on a GPU (issue 23): the two models of models.py (a transformers Llama,
a CNN) trained under bf16 autocast with fused AdamW, in one of three modes:

  categories.py MODEL truth STEPS OUT.json      (under the shim) at three instants of each step
      (after forward, after backward, after the optimizer's step) annotate the trace
      (`cachealloc_annotate("after_forward 3")`) and write the truth there, from the program's
      own objects: the bytes of its parameters and buffers, of the optimizer's state, of the
      `.grad`s, and of the tensors autograd saved (`saved_tensors_hooks`, during the forward;
      parameters and inputs left out). Bytes are counted per storage: what the program asked
      the allocator for, which categories_check.py compares with the requests' bytes.
  categories.py MODEL time ROUNDS LOG           (under the shim; MODEL also mlp or gpt2, as
      models.build trains them) alternate, within the process,
      step by step, the category hooks on and off (`cachealloc_categories.enable`): each round
      runs the same step both ways, each after an untimed one; writes
      `workload=MODEL label=on|off step_ms=X` per step for ratio_ci.py. `VARIANTS=off,on,py`
      adds `py`: the hooks on with the backward named by Python pre-hooks and the gradients tagged
      from Python, not from the C++ piece
      (cachealloc_backward_scopes, built first in every mode under the shim if it is not).
  categories.py MODEL profiler STEPS OUT.json   (natively) PyTorch's memory profiler on the same
      steps (`profile_memory`, `record_shapes`, `with_stack`): step time while profiling and
      not, `export_memory_timeline`'s categories at the peak, its time and its size.
"""
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import alternate, build, cnn, llama, step_fn  # noqa: E402


def storages(tensors, leave_out=()):
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.is_cuda:
            s = t.untyped_storage()
            if s.data_ptr() not in leave_out:
                seen[s.data_ptr()] = s.nbytes()
    return seen


def main():
    MODEL, MODE = sys.argv[1], sys.argv[2]
    COUNT, OUT = int(sys.argv[3]), sys.argv[4]
    torch.manual_seed(0)
    if MODEL in ("llama", "cnn"):
        model, batch, loss_of = llama() if MODEL == "llama" else cnn()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        step = step_fn(model, batch, loss_of, opt)
    else:  # mlp, gpt2: as their public scripts train them (models.build), for `time`
        step, model = build(MODEL)
    if MODE != "profiler":
        # Under the shim: the backward scopes' C++ piece, built now if it is not (else it is
        # built in the background and used from a later forward on).
        import cachealloc_backward_scopes

        cachealloc_backward_scopes.start(wait=True)
        native = cachealloc_backward_scopes.native_claim is not None
        print(f"backward scopes: {'C++' if native else 'Python'} pre-hooks")
    if MODE == "truth":
        import ctypes

        annotate = ctypes.CDLL(None).cachealloc_annotate
        annotate.argtypes = [ctypes.c_char_p]
        truths, saved = [], {}

        def pack(t):
            # The storage's address and size, not the tensor: holding it here would keep it
            # alive past the backward that frees it.
            if t.is_cuda:
                st = t.untyped_storage()
                saved[st.data_ptr()] = st.nbytes()
            return t


        def at(name, i, args):
            torch.cuda.synchronize()
            params = storages(list(model.parameters()) + list(model.buffers()))
            inputs = storages(args)
            state = storages(
                [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
            )
            grads = storages([p.grad for p in model.parameters() if p.grad is not None])
            row = {
                "annotation": f"{name} {i}",
                "parameter": sum(params.values()),
                "optimizer_state": sum(state.values()),
                "gradient": sum(grads.values()),
                "input": sum(inputs.values()),
            }
            if name == "after_forward":
                leave_out = set(params) | set(inputs)
                row["activation"] = sum(n for p, n in saved.items() if p not in leave_out)
            row["allocated"] = torch.cuda.memory_allocated()
            annotate(row["annotation"].encode())
            truths.append(row)

        for i in range(COUNT):
            step(i, pack=pack, at=at)
            saved.clear()
        torch.cuda.synchronize()
        json.dump({"model": MODEL, "truth": truths}, open(OUT, "w"), indent=1)
        print(f"OK truth {MODEL}: {len(truths)} instants")
    elif MODE == "time":
        import cachealloc_categories

        for i in range(6):
            step(i)

        def switch(label):
            if not cachealloc_categories.enable(label != "off"):
                sys.exit("FAIL: the category hooks are not installed")
            cachealloc_backward_scopes.use(label != "py")

        labels = os.environ.get("VARIANTS", "on,off").split(",")
        with open(OUT, "a") as log:
            alternate(step, COUNT, labels, switch, log, MODEL)
        print(f"OK time {MODEL}: {COUNT} rounds")
    elif MODE == "profiler":
        from torch.profiler import ProfilerActivity, profile

        for i in range(6):
            step(i)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(COUNT):
            step(i)
        torch.cuda.synchronize()
        plain_ms = (time.perf_counter() - t0) * 1000 / COUNT
        with profile(
            activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
            profile_memory=True, record_shapes=True, with_stack=True,
        ) as prof:
            t0 = time.perf_counter()
            for i in range(COUNT):
                step(i)
            torch.cuda.synchronize()
            profiled_ms = (time.perf_counter() - t0) * 1000 / COUNT
        t0 = time.perf_counter()
        path = OUT + ".timeline.json"
        prof.export_memory_timeline(path, device="cuda:0")
        export_s = time.perf_counter() - t0
        times, sizes = json.load(open(path))
        totals = [sum(s) for s in sizes]
        peak = max(range(len(totals)), key=totals.__getitem__)
        # export_memory_timeline's columns: one always 0, then torch.profiler's
        # _CATEGORY_TO_COLORS order, unknown (None) last.
        names = ["_", "PARAMETER", "OPTIMIZER_STATE", "INPUT", "TEMPORARY", "ACTIVATION",
                 "GRADIENT", "AUTOGRAD_DETAIL", "UNKNOWN"]
        at_peak = dict(zip(names, sizes[peak]))
        json.dump(
            {
                "model": MODEL, "plain_ms": plain_ms, "profiled_ms": profiled_ms,
                "export_s": export_s, "peak_bytes": totals[peak], "at_peak": at_peak,
                "timeline_bytes": os.path.getsize(path),
            },
            open(OUT, "w"), indent=1,
        )
        print(f"OK profiler {MODEL}: {plain_ms:.2f} ms plain, {profiled_ms:.2f} ms profiled")


if __name__ == "__main__":
    main()
