"""The category hooks' host cost on a machine without a GPU (issue 23's target: a step with the
hooks on at most 1.02x the step without them). Run by scripts/bench-categories, under
LD_PRELOAD=libcachealloc.so over fakecuda, with PyTorch's CPU allocator replaced by one that
takes its memory from cudaMalloc (bench_categories_allocator.cc): every CPU tensor is a block of
the shim's, so each allocation of the step goes through the shim's allocation path as on a GPU
(its record, its Python stack, its thread's scope).

The model is scripts/gpu/models.py's Llama (transformers' LlamaForCausalLM, 8 layers, trained
with fused AdamW, the loss kept and the outputs dropped before backward) with tiny dimensions
(hidden 64, 4 heads, MLP 176, vocabulary 1024, batch 2, sequence lengths cycling 16..64), so
that the step is short and bound by the host, as the GPU's is. In float32: the GPU run trains
under bf16 autocast, which a CPU without bf16 instructions emulates slowly (`--autocast` to
have it anyway).

The hooks only tag CUDA tensors; here the tensors are CPU tensors in the shim's blocks of device
0, so by default (`--gpu-tags`) the hooks' tag path is made to take them for device 0's (the
same Python operations and the same `cachealloc_tag` calls as on a GPU); `--no-gpu-tags` leaves
the hooks as they are (no tags at all).

    bench_categories.py ALLOCATOR ROUNDS LOG [--variants off,on,...] [--profile STEPS]
        [--tags] [--threads N] [--autocast] [--baseline-hooks FILE] [--model llama|mlp] [--plain]

`--plain`: the steps under the configuration the process was started with, nothing switched
(under `trace:off` or `categories:off` no hooks are installed; where they are, they are on and
take the CPU tensors for device 0's as `--gpu-tags` says): for comparing processes. A paused trace
with the hooks off (`off+notrace`) is not the trace turned off: on the mlp it ran ~6 % slower
than a `trace:off` process (BENCHMARKS.md, tenth session), so in-process ratios understate
what turning the trace and hooks off by configuration saves.

Each round runs the same step once per variant (in the variants' order on even rounds, the
reverse on odd ones), each timed step after an untimed one (a switch patches classes, and
Python's caches take a step to re-warm); appends `workload=… label=… round=… step_ms=…
cpu_ms=… main_ms=… set=…` lines to LOG (wall time; the process's CPU time, the trace's writer
thread included, which here shares the one core; the main thread's CPU time alone, as on a GPU
machine, where the writer has a core of its own; scripts/gpu/ratio_ci.py reads any of them;
`set`: this process, a random name, so that an interval over several processes' lines
resamples the processes)
and prints, for each variant against `off` (`off+nostacks` for a `+nostacks` one; else the
first), the median per-round ratio and the median per-round difference in µs, each with a 95 %
bootstrap interval. Variants: off, on (all hooks), and as diagnostics: no_backward_scopes,
py_backward_scopes (backward named, and gradients tagged, from Python even where the C++ piece
is loaded),
no_tags, no_phases, only_modules, only_optimizer, no_backward (no backward phase, no
gradients' tags), inert (every wrapper and hook installed but doing nothing, as inside
torch.compile's tracing), empty (global module hooks that do nothing: PyTorch's slow path),
and any of them with `+nostacks` (stack capture paused, `cachealloc_stacks_pause`: the
interplay of the hooks with the Python stack walk) or `+notrace` (the allocation records
paused, stacks included, `cachealloc_trace_pause`: `--variants on+notrace,on` is the trace's
own cost, issue 25's in-process measurement), and `base` (with `--baseline-hooks FILE`:
that version of cachealloc_categories.py, e.g. an earlier commit's, all on; `on` is then also
compared with it). `--profile STEPS`: cProfile of STEPS steps with the hooks on, then off.
`--tags`: what the tag path costs by itself (µs per call)."""
import argparse
import ctypes
import random
import statistics
import sys
import time

import torch
import torch.nn.modules.module as module_module

parser = argparse.ArgumentParser()
parser.add_argument("allocator")
parser.add_argument("rounds", type=int)
parser.add_argument("log")
parser.add_argument("--variants", default="off,on")
parser.add_argument("--model", choices=["llama", "mlp"], default="llama")
parser.add_argument("--profile", type=int, default=0)
parser.add_argument("--tags", action="store_true")
parser.add_argument("--threads", type=int, default=1)
parser.add_argument("--gpu-tags", action=argparse.BooleanOptionalAction, default=True)
parser.add_argument("--workload", default="llama-tiny")
parser.add_argument("--autocast", action="store_true")
parser.add_argument("--baseline-hooks")
parser.add_argument("--plain", action="store_true")
args = parser.parse_args()
torch.set_num_threads(args.threads)

lib = ctypes.CDLL(None)
if not hasattr(lib, "cachealloc_scope_slot"):
    sys.exit("FAIL: run under LD_PRELOAD=libcachealloc.so (scripts/bench-categories does)")
if ctypes.CDLL(args.allocator).bench_shim_cpu_allocator(1) != 0:
    sys.exit("FAIL: no cudaMalloc for the CPU allocator")
lib.cachealloc_stacks_pause.argtypes = [ctypes.c_int]
lib.cachealloc_trace_pause.argtypes = [ctypes.c_int]
lib.cachealloc_annotate.argtypes = [ctypes.c_char_p]

import cachealloc_backward_scopes  # noqa: E402
import cachealloc_categories as cc  # noqa: E402

hooks = cc._state is not None and bool(cc._installers)
if not hooks and not args.plain:
    sys.exit("FAIL: the category hooks are not installed (categories:off?)")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

# --baseline-hooks FILE: another version of cachealloc_categories.py (an earlier commit's),
# the variant `base`, in the same process. Its module-registration hook patches the model's
# classes as they are built (ours is off meanwhile: a class patched by one is left alone by the
# other); ours then patches them too, and each version's `enable` switches its own.
base = None
if args.baseline_hooks:
    import importlib.util

    import torch.optim.optimizer as optimizer_module

    spec = importlib.util.spec_from_file_location("cachealloc_categories_base", args.baseline_hooks)
    base = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = base  # the hooks look themselves up there (Dynamo's skip list)
    spec.loader.exec_module(base)
    cc.enable(False)
    base.install_module_hooks(module_module)
    base.install_optimizer_hooks(optimizer_module)

torch.manual_seed(0)
config = LlamaConfig(
    hidden_size=64, intermediate_size=176, num_hidden_layers=8, num_attention_heads=4,
    num_key_value_heads=4, vocab_size=1024, max_position_embeddings=256,
)
if args.model == "llama":
    model = LlamaForCausalLM(config)
else:  # scripts/gpu/models.py's mlp, smaller: eight blocks of leaf modules in a Sequential
    block = lambda: torch.nn.Sequential(  # noqa: E731
        torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64), torch.nn.LayerNorm(64)
    )
    model = torch.nn.Sequential(*[block() for _ in range(8)])
if base is not None:
    base.enable(False)
    cc._state.enabled = True
    ours = [
        h for h in module_module._global_module_registration_hooks.values()
        if getattr(h, "__globals__", {}).get("__name__") == cc.__name__
    ]
    for m in model.modules():
        if m._modules:
            ours[0](m, None, None)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=args.model == "llama")
lengths = [16, 32, 24, 64, 40, 48]


def step(i):
    if args.model == "mlp":
        x = torch.randn(4 * (1 + i % 4), 64)
        loss = torch.nn.functional.mse_loss(model(x), x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return
    ids = torch.randint(0, config.vocab_size, (2, lengths[i % len(lengths)]))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.autocast):
        out = model(ids, labels=ids)
        loss = out.loss
    del out  # the loss kept, the outputs dropped, as transformers' Trainer does
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    del loss


# The tag path as on a GPU: these CPU tensors are blocks of device 0 of the shim's.
def device_of(t):
    if t.is_cuda:
        return t.get_device()
    return 0 if t.device.type == "cpu" else -1


def gpu_like_tag(self, category, tensors):
    """`_Api.tag` of versions without `_device_of` (before 2026-11-26), CPU tensors as device
    0's."""
    by_device = {}
    for t in tensors:
        if t is not None:
            by_device.setdefault(device_of(t), []).append(t.data_ptr())
    for device, pointers in by_device.items():
        if device >= 0:
            self.tag_pointers(category, device, pointers)


def gpu_like(module):
    if hasattr(module, "_device_of"):
        module._device_of = device_of
    else:
        module._Api.tag = gpu_like_tag


def gpu_like_roots(module):
    """The roots' parameters as device 0's in versions without `_device_of`, so that their
    gradients are tagged."""
    if not hasattr(module, "_device_of"):
        for root, (first, refs) in list(module._state.roots.items()):
            module._state.roots[root] = (first, [(r, max(d, 0)) for r, d in refs])


if hooks:
    hook_versions = [cc] + ([base] if base is not None else [])
    if args.gpu_tags:
        for version in hook_versions:
            gpu_like(version)

    api = cc._state.api
    real_phase, real_tag = api.phase, api._tag
    real_backward_begin, real_backward_end = cc.backward_begin, cc.backward_end
    cc._state.is_compiling()  # its first call puts torch's function in its place
    real_is_compiling = cc._state.is_compiling
    # The backward scopes' C++ piece, built now if it is not (it would otherwise be built in the
    # background during the first rounds, and used from the next forward on).
    cachealloc_backward_scopes.start(wait=True)
    native = cachealloc_backward_scopes.native_claim
    print(f"backward scopes: {'C++' if native else 'Python'} pre-hooks")
print(f"parameters: {sum(1 for _ in model.parameters())}")  # each gradient is tagged


def nothing(*_):
    return 0


def empty_hooks():
    return [
        module_module.register_module_forward_pre_hook(lambda m, a: None),
        module_module.register_module_forward_hook(lambda m, a, o: None, always_call=True),
    ]


def switch(label):
    if args.plain:
        return lambda: None
    name, _, extra = label.partition("+")
    lib.cachealloc_stacks_pause(1 if extra == "nostacks" else 0)
    lib.cachealloc_trace_pause(1 if extra == "notrace" else 0)
    parts = {"only_modules": ["module"], "only_optimizer": ["optimizer"]}.get(name)
    if base is not None:
        base.enable(False)
    cc.enable(name not in ("off", "empty", "base"), parts)
    if name == "base":
        base.enable(True)
    cc._state.backward_scopes = name != "no_backward_scopes"
    cachealloc_backward_scopes.use(name != "py_backward_scopes")
    api.phase = nothing if name == "no_phases" else real_phase
    api._tag = nothing if name == "no_tags" else real_tag
    cc.backward_begin = (lambda: None) if name == "no_backward" else real_backward_begin
    cc.backward_end = real_backward_end
    if name == "base":  # what cachealloc_hooks' backward() calls
        cc.backward_begin, cc.backward_end = base.backward_begin, base.backward_end
    # As inside torch.compile's tracing: every wrapper and hook installed, doing nothing.
    cc._state.is_compiling = (lambda: True) if name == "inert" else real_is_compiling
    handles = empty_hooks() if name == "empty" else []
    return lambda: [h.remove() for h in handles]


def bootstrap(values, stat=statistics.median, n=10_000):
    rng = random.Random(0)
    boots = sorted(stat(rng.choices(values, k=len(values))) for _ in range(n))
    return boots[n // 40 - 1], boots[n - n // 40 - 1]


def summarize(rows, labels, field):
    times = {}
    for d in rows:
        if d.get("workload") == args.workload and field in d:
            times.setdefault(d["label"], []).append(float(d[field]))
    pairs = []
    for label in labels:
        # Against the same variant's `off` (with the same `+…`), else the first variant.
        suffix = label.partition("+")[1:]
        anchor = "off" + "".join(suffix)
        anchor = anchor if anchor in labels else labels[0]
        if label == anchor:
            print(f"{label}: median {statistics.median(times[label]):.3f} ms")
        else:
            pairs.append((anchor, label))
    if "base" in labels and "on" in labels:
        pairs.append(("base", "on"))
    for anchor, label in pairs:
        a, b = times[anchor], times[label]
        k = min(len(a), len(b))
        ratios = [b[i] / a[i] for i in range(k)]
        diffs = [(b[i] - a[i]) * 1000 for i in range(k)]
        lo, hi = bootstrap(ratios)
        dlo, dhi = bootstrap(diffs)
        print(
            f"{label}: median {statistics.median(b):.3f} ms, ratio {statistics.median(ratios):.4f}"
            f" [{lo:.4f}, {hi:.4f}], added {statistics.median(diffs):+.0f} us [{dlo:+.0f}, {dhi:+.0f}]"
            f" over {anchor} ({k} rounds)"
        )


labels = ["plain"] if args.plain else args.variants.split(",")
if "base" in labels and base is None:
    sys.exit("FAIL: the variant `base` needs --baseline-hooks FILE")
for i in range(6):
    for label in labels if "base" in labels else ["on"]:
        switch(label)
        step(i)
if args.gpu_tags:
    for version in (hook_versions if hooks else []):
        gpu_like_roots(version)
switch("on")

if args.tags:
    s = cc._state
    step(0)  # gradients to tag
    loss = model(torch.randint(0, config.vocab_size, (2, 16)), labels=None).logits.sum()
    loss.backward()
    del loss
    params = list(model.parameters())
    grads = [p.grad.data_ptr() for p in params]
    n = 2000

    def per_call(fn):
        best = []
        for _ in range(7):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            best.append((time.perf_counter() - t0) / n * 1e6)
        return statistics.median(best)

    print(f"tags: {len(params)} parameters")
    print(f"tags: tag_gradients() {per_call(s.tag_gradients):.2f} us a call (Python and C)")
    print(f"tags: tag_pointers(gradients) {per_call(lambda: api.tag_pointers(3, 0, grads)):.2f} us")
    array = (ctypes.c_uint64 * len(grads))(*grads)
    c_only = per_call(lambda: real_tag(0, 3, array, len(grads)))
    print(f"tags: cachealloc_tag({len(grads)}) {c_only:.2f} us (C only)")
    one = (ctypes.c_uint64 * 1)(grads[0])
    print(f"tags: cachealloc_tag(1) {per_call(lambda: real_tag(0, 3, one, 1)):.2f} us")
    ids = [torch.randint(0, 10, (2, 16))]
    print(f"tags: api.tag(INPUT, 1 tensor) {per_call(lambda: api.tag(4, ids)):.2f} us")
    print(f"tags: phase_set {per_call(lambda: real_phase(0, 0)):.2f} us")
    model.zero_grad(set_to_none=True)

if args.rounds:
    # This process's name in the log, so that scripts/gpu/ratio_ci.py's interval over a log of
    # several processes resamples the processes before their rounds.
    process = f"{random.SystemRandom().getrandbits(32):08x}"
    with open(args.log, "a") as log:
        for r in range(args.rounds):
            for label in labels if r % 2 == 0 else labels[::-1]:
                done = switch(label)
                step(r)
                m0, c0, t0 = time.thread_time(), time.process_time(), time.perf_counter()
                step(r)
                ms = (time.perf_counter() - t0) * 1000
                cpu = (time.process_time() - c0) * 1000
                main = (time.thread_time() - m0) * 1000
                done()
                print(
                    f"workload={args.workload} label={label} round={r} step_ms={ms:.4f} "
                    f"cpu_ms={cpu:.4f} main_ms={main:.4f} set={process}",
                    file=log,
                )
    rows = [dict(x.split("=", 1) for x in line.split()) for line in open(args.log)]
    for field in ("step_ms", "cpu_ms", "main_ms"):
        print(f"{field}:")
        summarize(rows, labels, field)


if args.profile:
    import cProfile
    import pstats

    calls, cumulative = {}, {}
    for label in ("on", "off"):
        switch(label)
        step(0)
        profile = cProfile.Profile()
        profile.enable()
        for i in range(args.profile):
            step(i)
        profile.disable()
        print(f"--- profile, hooks {label}")
        stats = pstats.Stats(profile)
        stats.sort_stats("tottime").print_stats(30)
        calls[label] = {k: v[1] for k, v in stats.stats.items()}
        cumulative[label] = {k: v[3] for k, v in stats.stats.items()}
    print("--- functions whose call counts differ (on - off, per step), and their cumulative time on")
    keys = set(calls["on"]) | set(calls["off"])
    differ = [(calls["on"].get(k, 0) - calls["off"].get(k, 0), k) for k in keys]
    for d, k in sorted((d, k) for d, k in differ if d):
        cum = cumulative["on"].get(k, 0) / args.profile * 1e6
        print(f"{d / args.profile:+8.1f} calls {cum:8.1f} us  {k[2]} {k[0]}:{k[1]}")

switch("on")
lib.cachealloc_annotate(b"bench_categories done")
print("OK bench_categories")
