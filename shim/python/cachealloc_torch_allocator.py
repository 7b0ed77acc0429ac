"""cachealloc's C++ allocator for PyTorch: built against the headers of the PyTorch in use,
loaded, and installed in the place of PyTorch's `cudaMallocAsync` backend when `torch.cuda` is
imported, before CUDA is first used (`cachealloc_torch_allocator.cpp`, Note [Graph trees under
the shim]). With it, CUDA graph trees (`torch.compile(mode="reduce-overhead")`'s default) work
on the library's pools.

The build runs once per PyTorch build, compiler and sources (the `.cpp` and its headers):
about six seconds, with one message, into `$XDG_CACHE_HOME/cachealloc/torch-allocator/<hash>/`
(else `~/.cache/…`);
processes that start together wait for one build (a file lock). It needs a C++ compiler
(`$CXX`, else `c++` or `g++`) and CUDA's runtime headers with their `crt/` directory (a CUDA
toolkit: `$CUDA_HOME`, `/usr/local/cuda`; or the `nvidia-cuda-runtime` and `nvidia-cuda-crt`
wheels). Without them, or when the build fails, the backend stays, with one message saying
why, and graph trees are turned off (`cachealloc_hooks`); a failed build is not tried again
(its compiler output stays in `build.log` of that directory: remove it to try again).
`torch_allocator:off` in `CACHEALLOC_CONF` keeps the backend.
"""
import ctypes
import os
import sys

import cachealloc_common
import cachealloc_torch_build
from cachealloc_common import TORCH_ALLOC_VARS, conf, say, warn

SOURCE = "cachealloc_torch_allocator.cpp"
#: The headers it includes (beside it): part of what the build's cache key hashes.
HEADERS = ("cachealloc_torch_history.h", "cachealloc_torch_library.h", "cachealloc_torch_trackers.h")

#: Whether the allocator was installed in this process.
_installed = False
#: The loaded allocator library (ctypes), once installed.
_library = None


def installed():
    return _installed


def tell_history(record_history, enabled, args, kw):
    """The program's `_record_memory_history(*args, **kw)`, passed on to PyTorch's own
    `_cuda_record_memory_history` (`record_history`) as the Python integration's call. PyTorch
    then gives this allocator its context recorder (which it runs only where the trace is blind:
    Note [PyTorch's own contexts]) and, with `compile_context=True`, installs the callbacks
    that tell it each compiled region a thread enters and leaves (Note [Compile regions]);
    `enabled=None` takes both back, as natively. Without the allocator, or if PyTorch refuses,
    the history is the trace's alone (the snapshot's entries then say "N/A" for regions)."""
    global _history_told
    if record_history is None or not _installed or (enabled is None and not _history_told):
        return
    source = getattr(_library, "cachealloc_torch_history_source", None)
    if source is not None:
        source.restype = None
        source.argtypes = [ctypes.c_int]
        source(1)
    try:
        record_history(*args, **kw)
    except Exception as e:  # the program's history still works, from the trace
        warn(f"PyTorch's own history contexts and compiled regions are not recorded: {e}")
        return
    finally:
        if source is not None:
            source(0)
    _history_told = enabled is not None


#: Whether the program's history settings were passed on to PyTorch's (`tell_history`).
_history_told = False


def history_contexts():
    """How many of PyTorch's own contexts the allocator holds (Note [PyTorch's own contexts]):
    0 without the allocator."""
    if _library is None:
        return 0
    count = _library.cachealloc_torch_history_contexts
    count.restype = ctypes.c_size_t
    count.argtypes = []
    return count()


def compile_regions():
    """The compiled regions the program's threads entered and left while PyTorch told the
    allocator (`_record_memory_history(compile_context=True)`): `[(trace time, innermost
    region or "N/A"), …]` in order (Note [Compile regions]); empty without the allocator."""
    if _library is None:
        return []
    get = _library.cachealloc_torch_compile_regions
    get.restype = ctypes.c_size_t
    get.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    size = get(None, 0)
    buffer = ctypes.create_string_buffer(size + 1)
    size = min(get(buffer, size), size)
    changes = []
    for line in buffer.raw[:size].decode("utf-8", "replace").splitlines():
        t, _, region = line.partition("\t")
        if t.isdigit():
            changes.append((int(t), region))
    return changes


def wanted():
    """Whether `CACHEALLOC_CONF` leaves `torch_allocator` on (the library validated it)."""
    for item in conf().split(","):
        key, _, value = item.partition(":")
        if key == "torch_allocator" and value.lower() in ("off", "false", "0", "no"):
            return False
    return True


def _cuda_include():
    """A directory with CUDA's `cuda_runtime.h` and the `crt/` headers it includes, or None."""
    candidates = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(os.path.join(os.environ[var], "include"))
    candidates.append("/usr/local/cuda/include")
    try:
        import nvidia

        for root in nvidia.__path__:
            for name in sorted(os.listdir(root)):
                candidates.append(os.path.join(root, name, "include"))
    except Exception:
        pass
    for directory in candidates:
        if os.path.isfile(os.path.join(directory, "cuda_runtime.h")) and os.path.isfile(
            os.path.join(directory, "crt", "host_config.h")
        ):
            return directory
    return None


def _build(torch_dir, abi):
    """The path of the built library, building it if needed; raises with the reason."""
    cuda_include = _cuda_include()
    if cuda_include is None:
        raise RuntimeError(
            "no CUDA runtime headers with crt/ ($CUDA_HOME, /usr/local/cuda, or the "
            "nvidia-cuda-runtime and nvidia-cuda-crt wheels)"
        )
    flags = cachealloc_torch_build.torch_flags(torch_dir, abi) + ["-I", cuda_include]
    # torch_cpu: anomaly mode's flag and TorchScript's call stack (cachealloc_torch_history.h).
    libraries = cachealloc_torch_build.torch_libraries(torch_dir, ["c10", "c10_cuda", "torch_cpu"])
    return cachealloc_torch_build.build(
        torch_dir, SOURCE, HEADERS, flags, libraries, "libcachealloc_torch_allocator.so",
        "its allocator for PyTorch",
    )


def _backend_named_by_shim():
    """Whether `backend:cudaMallocAsync` is in PyTorch's settings because the shim put it there
    (it names the variable it changed), and no other of PyTorch's variables names a backend
    (the program's own choice, which PyTorch then reads)."""
    var = os.environ.get("CACHEALLOC_ADDED_TORCH_BACKEND")
    if var is None or "backend:cudaMallocAsync" not in os.environ.get(var, "").replace(" ", ""):
        return False
    for other in TORCH_ALLOC_VARS:
        if other != var and "backend:" in os.environ.get(other, "").replace(" ", ""):
            return False
    return True


def _take_backend_out_of_settings():
    """PyTorch checks, whenever it parses its allocator settings again (at CUDA's
    initialization), that the backend they name is the allocator in place; the installed one
    is not the `cudaMallocAsync` backend the shim named (so that PyTorch's tensors reach it), so
    the name goes. A child process's shim names it again, for its own PyTorch to start on it."""
    cachealloc_common.replaced_backend = cachealloc_common.torch_backend()
    for var in TORCH_ALLOC_VARS:
        value = os.environ.get(var)
        if value is None:
            continue
        rest = [
            item for item in value.split(",")
            if item.strip() and item.replace(" ", "") != "backend:cudaMallocAsync"
        ]
        if rest:
            os.environ[var] = ",".join(rest)
        else:
            del os.environ[var]


def install():
    """Build, load and install the allocator (see the module's docs). Called when `torch.cuda`
    has been imported; never raises."""
    global _installed, _library
    if _installed or not wanted():
        return
    torch_c = sys.modules.get("torch._C")
    if torch_c is None or not hasattr(torch_c, "_cuda_getAllocatorBackend"):
        return  # a PyTorch without CUDA
    try:
        torch_dir = os.path.dirname(os.path.abspath(sys.modules["torch"].__file__))
        library = ctypes.CDLL(_build(torch_dir, getattr(torch_c, "_GLIBCXX_USE_CXX11_ABI", True)))
        chosen_by_shim = _backend_named_by_shim()
        install_allocator = library.cachealloc_torch_allocator_install
        install_allocator.restype = ctypes.c_int
        install_allocator.argtypes = [ctypes.c_char_p]
        code = install_allocator(b"native" if chosen_by_shim else b"cudaMallocAsync")
    except Exception as e:
        warn(f"PyTorch's cudaMallocAsync backend stays, without CUDA graph trees: {e}")
        return
    if code == 0:
        _installed = True
        _library = library
        import cachealloc_memory

        cachealloc_memory.use_pytorchs_mem_pools(library)
        if chosen_by_shim:
            _take_backend_out_of_settings()
        say("installed its allocator for PyTorch (CUDA graph trees served)")
    elif code == 1:
        warn("PyTorch's CUDA allocator was in use before cachealloc could install its own; the "
             "cudaMallocAsync backend stays, without CUDA graph trees")
    else:
        warn("the preloaded library lacks the C API of its PyTorch allocator; the "
             "cudaMallocAsync backend stays, without CUDA graph trees")
