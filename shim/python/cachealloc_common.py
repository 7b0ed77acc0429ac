"""Helpers shared by cachealloc's Python integration modules (`cachealloc_hooks`,
`cachealloc_memory`): the configuration's switches, messages, PyTorch's backend, and the
preloaded library's C API through ctypes."""
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
