"""Helpers shared by cachealloc's Python integration modules (`cachealloc_hooks`,
`cachealloc_memory`, `cachealloc_categories`): the configuration's switches, messages,
PyTorch's backend, the preloaded library's C API through ctypes, and Dynamo's frames."""
import os
import sys


def conf():
    return os.environ.get("CACHEALLOC_CONF", "").replace(" ", "")


def say(message):
    """A message on stderr, shown with `log:debug` (the adjustment is documented, and would
    otherwise be printed by every PyTorch program)."""
    if "log:debug" in conf():
        print(f"cachealloc: {message}", file=sys.stderr)


def warn(message):
    """A message on stderr unless `log:quiet`: something did not work."""
    if "log:quiet" not in conf():
        print(f"cachealloc: {message}", file=sys.stderr)


#: PyTorch's allocator settings variables, in PyTorch's order.
TORCH_ALLOC_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF")

#: The backend PyTorch was configured with, once cachealloc's allocator took its place (and
#: took `backend:cudaMallocAsync` out of the settings: `cachealloc_torch_allocator`).
replaced_backend = None


def torch_backend():
    """The allocator backend PyTorch was configured with."""
    if replaced_backend is not None:
        return replaced_backend
    for var in TORCH_ALLOC_VARS:
        conf = os.environ.get(var)
        if conf is not None:
            for item in conf.split(","):
                key, _, value = item.partition(":")
                if key.strip() == "backend":
                    return value.strip()
            return "native"
    return "native"


#: What the integration put in the place of PyTorch's functions and classes, in order: (owner,
#: name, PyTorch's own, or `_MISSING` where the owner had none of its own), each name once.
_replaced = []
#: (id() of a value put in, the name it was put in as) -> (the value, PyTorch's own that it
#: stands for there). The name is part of the key: one value may stand in for two of PyTorch's
#: (`MemPool` and `torch._C._MemPool`), and an import copies it under its name.
_installed = {}
_MISSING = object()
#: Whether the program installed an allocator of its own (`change_current_allocator`): the
#: integration has then stepped back (`step_back`) and replaces nothing more.
program_allocator = False


def replace(owner, name, value):
    """Put `value` in the place of `owner.name` (a module's or a class's own attribute),
    remembering PyTorch's for `step_back`: where the place holds a value put in elsewhere (an
    import copied it, `from .memory import *` in `torch.cuda`), PyTorch's own is the one that
    value stands for. Nothing once the program runs its own allocator; returns whether it
    replaced."""
    if program_allocator:
        return False
    known = [own for o, n, own in _replaced if o is owner and n == name]
    if known:
        own = known[0]
    else:
        own = vars(owner).get(name, _MISSING)
        entry = _installed.get((id(own), name))
        if entry is not None and entry[0] is own:
            own = entry[1]
        _replaced.append((owner, name, own))
    _installed[(id(value), name)] = (value, own)
    setattr(owner, name, value)
    return True


def _put_back(owner, name, own):
    if own is not _MISSING:
        setattr(owner, name, own)
    elif name in vars(owner):
        delattr(owner, name)


def step_back():
    """Give PyTorch back every function and class `replace` took the place of: the program
    installed an allocator of its own (`torch.cuda.memory.change_current_allocator`, before
    CUDA was used), so PyTorch's tensors come from it, and `torch.cuda`'s memory functions,
    `MemPool`, `record_stream` and graph captures must be PyTorch's and reach it, as natively
    (design.md, "A program's own allocator"). Copies an import made of a value put in go too.
    The library still serves and records what that allocator asks of CUDA."""
    global program_allocator
    program_allocator = True
    for owner, name, own in reversed(_replaced):
        _put_back(owner, name, own)
    for module in (sys.modules.get("torch.cuda"), sys.modules.get("torch.cuda.memory")):
        for name, value in list(vars(module).items()) if module is not None else ():
            entry = _installed.get((id(value), name))
            if entry is not None and entry[0] is value:
                _put_back(module, name, entry[1])
    _replaced.clear()
    _installed.clear()


def c_functions(**names):
    """The preloaded library's functions `names` (short name -> `cachealloc_…` symbol) as a
    namespace of ctypes functions, or None when the library is not there."""
    import ctypes
    import types

    try:
        lib = ctypes.CDLL(None)
        return types.SimpleNamespace(**{short: getattr(lib, symbol) for short, symbol in names.items()})
    except (OSError, AttributeError):
        return None


def text(fn, *args):
    """The text a `cachealloc_*` function writes into a buffer ("" when it writes none)."""
    import ctypes

    size = 1 << 16
    while True:
        buf = ctypes.create_string_buffer(size)
        need = fn(*args, buf, size)
        if need <= size:
            return buf.value.decode() if need else ""
        size = need


def pool_key(pool):
    """The library's id for PyTorch's pool handle (a pair of integers, never (0, 0))."""
    first, second = pool
    return ((int(first) & 0xFFFFFFFF) << 32) | (int(second) & 0xFFFFFFFF)


def dynamo_skips_frames_of(module, compiled_callees=()):
    """Mark every code object of `module`'s functions and methods (nested ones included) so
    that torch.compile's Dynamo never compiles one of their frames as a frame of its own,
    while still tracing through them inside a compiled frame: what PyTorch does for its own
    `_call_impl`. Nor does it compile what they call (bookkeeping: PyTorch's `named_modules`,
    weak references), except from the functions named in `compiled_callees` (a wrapper of
    `_call_impl`, whose callee is the module's forward): these run where Dynamo's frame
    callback is active too, as when compiled autograd calls its compiled graph. Once per
    module; a PyTorch without Dynamo's frame strategies is left as it is."""
    if module.__name__ in _dynamo_skipped:
        return
    try:
        from torch._C._dynamo import eval_frame

        action, strategy_of = eval_frame._FrameAction, eval_frame._FrameExecStrategy
        set_code_exec_strategy = eval_frame.set_code_exec_strategy
    except Exception:
        return
    _dynamo_skipped.add(module.__name__)
    skip_all = strategy_of(action.SKIP, action.SKIP)
    skip_own = strategy_of(action.SKIP, action.DEFAULT)
    pending = []
    for value in list(vars(module).values()):
        if getattr(value, "__module__", None) != module.__name__:
            continue
        if isinstance(value, type):
            pending += [f.__code__ for f in vars(value).values() if hasattr(f, "__code__")]
        elif hasattr(value, "__code__"):
            pending.append(value.__code__)
    while pending:
        code = pending.pop()
        set_code_exec_strategy(code, skip_own if code.co_name in compiled_callees else skip_all)
        pending += [c for c in code.co_consts if isinstance(c, type(code))]


#: The modules `dynamo_skips_frames_of` has marked.
_dynamo_skipped = set()


def torch_traces_not_runs():
    """Whether PyTorch is tracing rather than running the calling code: a fake, functional or
    proxy dispatch mode is active (Inductor lowering a graph's subgraphs, `make_fx`), with fake
    tensors and no torch.compile frame on the stack, and no memory is allocated. The category
    hooks ask it where a module starts a thread's module stack or is new (then there is no
    phase to begin and no tensor to tag), not at every module call."""
    try:
        torch_c = sys.modules["torch"]._C
        keys, get = torch_c._TorchDispatchModeKey, torch_c._get_dispatch_mode
    except AttributeError:
        return False
    return any(get(k) is not None for k in (keys.FAKE, keys.FUNCTIONAL, keys.PROXY))


class Restore:
    """A handle that gives a class back the attribute it had (its own, or inherited) in place
    of the one patched in (`cachealloc_categories`' `_call_impl`)."""

    def __init__(self, owner, name, original):
        self.owner, self.name, self.original = owner, name, original
        self.had_own = name in owner.__dict__

    def remove(self):
        if self.had_own:
            setattr(self.owner, self.name, self.original)
        else:
            delattr(self.owner, self.name)
