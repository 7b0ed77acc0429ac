"""How the category hooks (`cachealloc_categories`) name modules in backward: the output of a
module whose children have children (a decoder layer) has its autograd node *claimed*, and
when backward reaches the node, the thread running it is in that module (design.md, "Memory by
category and module").

A claim is a C++ pre-hook on the node (`cachealloc_torch_scopes.cpp`, Note [Backward scopes
in C++]) with no Python call on either side, or, until that piece is loaded or without it, a
Python pre-hook (`register_prehook`) that writes the autograd thread's scope slot.

`start()` is called by `cachealloc_categories` when a model's first forward begins (PyTorch is
imported by then: `forward_begins`). A piece built before for this PyTorch is loaded at once; otherwise a
process of its own builds it (about five seconds, once per PyTorch build and compiler:
`cachealloc_torch_build.py`; it finishes even if the program ends first) while the program
runs with the Python pre-hooks, and the forward after the build has ended loads it (`poll`).
It needs only a C++ compiler and PyTorch's headers. Without them, or if the build fails, the
Python pre-hooks stay, with one message saying why.
"""
import ctypes
import os
import sys

import cachealloc_torch_build
from cachealloc_common import say, warn

SOURCE = "cachealloc_torch_scopes.cpp"
TARGET = "libcachealloc_torch_scopes.so"

#: `cachealloc_torch_claim(tensor._cdata, scope)` once the piece is loaded, else None.
native_claim = None
#: `cachealloc_torch_tag_gradients(device, impls, count, category)` once the piece is loaded,
#: else None: tags the `.grad`s of the tensors of `device` whose `_cdata` are the `count` words
#: at `impls`.
native_tag_gradients = None
#: Whether the integration uses it when loaded (a benchmark's switch: `use(False)`).
wanted = True
_backward_end = None
_started = False
#: (build arguments, library path, log path) while a background build is awaited.
_pending = None


def start(wait=False):
    """Load the piece, or have it built in the background (`wait`: build it now, as a benchmark
    or check that must measure it does); never raises, runs once."""
    global _started, _pending
    if _started:
        return
    _started = True
    torch = sys.modules.get("torch")
    torch_c = sys.modules.get("torch._C")
    if torch is None or torch_c is None:
        return
    try:
        torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
        abi = getattr(torch_c, "_GLIBCXX_USE_CXX11_ABI", True)
        how = _how(torch_dir, abi)
        if wait or cachealloc_torch_build.built(*how):
            _load(*how)
        else:
            _pending = (how, *cachealloc_torch_build.build_detached(*how))
    except Exception as e:
        warn(f"the backward's module names stay with Python pre-hooks: {e}")


def poll():
    """At a forward's start: load the piece once its background build has ended (and say so
    if it failed). A file's existence, checked once a forward while it is pending."""
    global _pending
    if _pending is None:
        return
    how, target, log = _pending
    if os.path.isfile(target):
        _pending = None
        _load(*how)
    elif os.path.isfile(log):
        _pending = None
        warn(f"the backward's module names stay with Python pre-hooks: its build failed ({log})")


def _how(torch_dir, abi):
    flags = cachealloc_torch_build.torch_flags(torch_dir, abi)
    libraries = cachealloc_torch_build.torch_libraries(torch_dir, ["c10", "torch_cpu"])
    return torch_dir, SOURCE, (), flags, libraries, TARGET, "its backward scopes for PyTorch"


def _load(*how):
    global native_claim, native_tag_gradients, _backward_end
    try:
        library = ctypes.PyDLL(cachealloc_torch_build.build(*how))
        if library.cachealloc_torch_scopes_load() != 0:
            raise RuntimeError("the preloaded library has no scope slots")
        fn = library.cachealloc_torch_claim
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint]
        end = library.cachealloc_torch_backward_end
        end.restype = ctypes.c_size_t
        end.argtypes = []
        grads = library.cachealloc_torch_tag_gradients
        grads.restype = ctypes.c_int64
        grads.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    except Exception as e:
        warn(f"the backward's module names stay with Python pre-hooks: {e}")
        return
    _backward_end = end
    native_tag_gradients = grads
    native_claim = fn
    say("names the backward's modules from C++ pre-hooks")


def claim(s, t, sid, output):
    """The autograd node of `output` (its first tensor) names module `sid` in backward, unless
    an inner module's claimed the node: through the C++ piece's pre-hook when the forward began
    with it loaded (`s.native_claim`), else a Python one. `s` is the hooks' state, `t` the
    thread's."""
    tensor = s.tensor
    if not isinstance(output, tensor):
        if isinstance(output, (tuple, list)):
            output = output[0] if output else None
        elif hasattr(output, "values"):
            # A dict, or transformers' ModelOutput: its first tensor (the loss, when given).
            output = next((v for v in output.values() if isinstance(v, tensor)), None)
        if not isinstance(output, tensor):
            return
    claimed = t.claimed
    if claimed is None:
        return  # not in a forward the hooks began (a recomputation in backward)
    native = s.native_claim
    if native is not None:
        native(output._cdata, sid)
        return
    node = output.grad_fn
    # The nodes claimed in this forward, held until its end: PyTorch's Python object for an
    # autograd node lives only while referenced, and the next one made can take its address,
    # so an `id` could make a later module's node look claimed already.
    if node is not None and node not in claimed:
        claimed.add(node)
        hook = s.prehooks.get(sid)
        if hook is None:
            hook = s.prehooks[sid] = _python_prehook(s, sid)
        node.register_prehook(hook)


def _python_prehook(s, sid):
    """A pre-hook of a module's output's autograd node: the autograd thread is in the module."""
    threads, slots = s.threads, s.backward_slots

    def enter(grad_outputs):
        try:
            slot = threads.slot
        except AttributeError:
            slot = s.thread()[1]
        slot.value = sid
        slots[id(slot)] = slot

    return enter


def forward_begins():
    """A model's forward begins (the hooks' phase turns to forward): `start` the first time,
    `poll` while a build is awaited; returns the C++ claim function when the piece is loaded
    and wanted, else None (the Python pre-hooks then)."""
    if not _started:
        start()
    if _pending is not None:
        poll()
    return native_claim if wanted else None


def tag_gradients_fn():
    """`native_tag_gradients` when the piece is loaded and wanted, else None."""
    return native_tag_gradients if wanted else None


def backward_end():
    """`backward()` returned: the autograd threads' slots the C++ hooks wrote go back to none."""
    if _backward_end is not None:
        _backward_end()


def use(on):
    """Use the C++ hooks when loaded (True, the default) or the Python ones: between steps, for
    a benchmark that alternates them in one process."""
    global wanted
    wanted = bool(on)
