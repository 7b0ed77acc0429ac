"""cachealloc's view of a PyTorch program for memory by category and module: what the tools
need to sort each allocation into PyTorch's memory profiler's categories (parameter, optimizer
state, input, temporary, activation, gradient, autograd detail) and name the `nn.Module` that
made it, for the whole run, without a profiler.

Installed by `cachealloc_hooks` when the program imports `torch.nn.modules.module` and
`torch.optim.optimizer` (`categories:off` or `trace:off` in `CACHEALLOC_CONF` leave them alone).
It observes; it changes no result, no autograd graph and no module's state, and holds no tensor
or module alive:

* `nn.Module._call_impl`, what every `module(...)` runs, is wrapped: a stack of modules per
  thread, and the innermost one's path written to the thread's *scope slot* in the library
  (`cachealloc_scope_slot`: a store, no call; the library says it in the trace before the
  thread's next allocation), the root named by its class
  (`LlamaForCausalLM.model.layers.3.mlp.down_proj`). The outermost module's entry and exit are
  the forward phase (`cachealloc_phase_set`). Its positional tensor arguments are tagged
  inputs, and its parameters and buffers are tagged when first seen and whenever they move
  (`cachealloc_tag`). A leaf module only sets the slot around its call; a module inside
  another (a decoder layer, its attention block and MLP: most wrapped calls) pushes and pops
  its scope inline, with no further Python call unless it claims a node (below). Not global
  module hooks: with any global hook PyTorch takes its slow path for every module call, which
  alone cost 1.8 % of a Llama step (design.md, Note [Categories by lifetime]); and not
  per-module hooks, which `torch.save(model)` would pickle.
* For the backward pass, the output of a module whose children have children (a decoder
  layer, not its MLP) gets, on its autograd node, a pre-hook (the innermost such module claims
  it) that names the module on the autograd thread when backward reaches it: a C++ pre-hook
  when `cachealloc_backward_scopes` has its C++ piece, else a Python one (whose nodes are held
  until the outermost module returns: a forward's graph, which its output holds).
* `backward()` (wrapped by `cachealloc_hooks`) is the backward phase; afterwards the known
  parameters' `.grad`s are tagged gradients.
* Global optimizer step hooks mark the optimizer phase, count steps, and tag the optimizer's
  state tensors (again when their number changes) and its parameters.
* Inside `torch.compile`'s tracing the wrapper and hooks do nothing (nothing is traced into a
  graph); compiled regions are then one scope, their categories still right by tags and
  lifetimes. The wrapper's first lines, which Dynamo traces, read only what is fixed before
  any module is called (torch's functions, taken when `torch.compiler` is imported).

What a hook cannot tell (temporaries, activations) the tools find from lifetimes: see
design.md, Note [Categories by lifetime].
"""
import array
import ctypes
import sys
import threading
import weakref

import cachealloc_backward_scopes
import cachealloc_common
from cachealloc_backward_scopes import claim as _claim

PHASE_NONE, PHASE_FORWARD, PHASE_BACKWARD, PHASE_OPTIMIZER = 0, 1, 2, 3
TAG_PARAMETER, TAG_OPTIMIZER_STATE, TAG_GRADIENT, TAG_INPUT = 1, 2, 3, 4


class _Api:
    """The library's calls (`_api()` is None when the library is not preloaded)."""

    def __init__(self, lib):
        self.define = lib.cachealloc_scope_define
        self.define.restype = ctypes.c_uint
        self.define.argtypes = [ctypes.c_char_p]
        self._slot = lib.cachealloc_scope_slot
        self._slot.restype = ctypes.c_void_p
        self._slot.argtypes = []
        self.phase = lib.cachealloc_phase_set
        self.phase.restype = ctypes.c_int
        self.phase.argtypes = [ctypes.c_uint, ctypes.c_uint64]
        self._tag = lib.cachealloc_tag
        self._tag.restype = ctypes.c_int
        self._tag.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_void_p, ctypes.c_size_t]
        self.hide_code = lib.cachealloc_python_hide_code
        self.hide_code.restype = ctypes.c_int
        self.hide_code.argtypes = [ctypes.c_size_t]

    def slot(self):
        """The calling thread's scope slot in the library: its `.value` is the thread's scope."""
        return ctypes.c_uint32.from_address(self._slot())

    def tag(self, category, tensors):
        """Tag the blocks of the CUDA tensors among `tensors`, grouped by device."""
        by_device = {}
        for t in tensors:
            if t is not None:
                device = _device_of(t)
                if device >= 0:
                    try:
                        pointer = t.data_ptr()
                    except RuntimeError:
                        continue  # no storage of its own: a fake or functional tensor
                    by_device.setdefault(device, []).append(pointer)
        for device, pointers in by_device.items():
            self.tag_pointers(category, device, pointers)

    def tag_pointers(self, category, device, pointers):
        """Tag the blocks of `device` holding `pointers` (an `array` of 64-bit words: a tenth of
        the time of a ctypes array built from the list, for a model's gradients)."""
        words = array.array("Q", pointers)
        self._tag(device, category, words.buffer_info()[0], len(words))


def _device_of(t):
    """The device whose blocks hold tensor `t` (-1: not a CUDA tensor)."""
    return t.get_device() if t.is_cuda else -1


def _api():
    try:
        return _Api(ctypes.CDLL(None))
    except (OSError, AttributeError):
        return None


class _State:
    """What the hooks remember: module paths, roots and their parameters (weakly), the phase."""

    def __init__(self, api):
        self.api = api
        self.is_grad_enabled = self.tensor = None
        self.threads = threading.local()
        # id(module) -> (weak ref, scope id, leaf, claims: see scope_of); module -> its path.
        self.scopes = {}
        self.paths = weakref.WeakKeyDictionary()
        # id(root module) -> (weak ref, first parameter's address, its CUDA parameters as
        # _Gradients); id(optimizer) -> (weak ref, number of state entries
        # tagged). Plain dicts, emptied by the weak refs' callbacks: a WeakKeyDictionary's
        # lookups and iteration are Python code, a step's hot path.
        self.roots = {}
        self.optimizers = {}
        self.phase = PHASE_NONE
        self.step = 0
        self.lock = threading.Lock()
        self.enabled = True
        # Whether a module's output's autograd node names it in backward, and how: the C++
        # piece's claim function (cachealloc_backward_scopes), else Python pre-hooks, made once
        # per scope (scope id -> hook).
        self.backward_scopes = True
        self.native_claim = None
        self.prehooks = {}
        # The scope slots backward's pre-hooks wrote (autograd's threads'), cleared at its end.
        self.backward_slots = {}

    def is_compiling(self):
        """Whether torch.compile is tracing: for a torch without `torch.compiler` only (else
        `take_torch` has replaced it when `torch.compiler` was imported)."""
        self.take_torch()
        return self.is_compiling()

    def take_torch(self):
        """`is_compiling`, `is_grad_enabled` and `tensor` become torch's, before any module is
        called: a first call traced by Dynamo that set them would change what Dynamo guarded on
        and recompile the function (PyTorch's test_no_rerecord_with_mark_static_address)."""
        torch = sys.modules["torch"]
        # (While `torch.compiler` is being imported, torch has no attribute for it yet.)
        compiler = sys.modules.get("torch.compiler") or getattr(torch, "compiler", None)
        self.is_compiling = getattr(compiler, "is_compiling", None) or _never
        self.is_grad_enabled = torch.is_grad_enabled
        self.tensor = torch.Tensor

    def thread(self):
        """The calling thread's module stack and scope slot, made at its first use."""
        t = self.threads
        t.stack = []
        t.slot = self.api.slot()
        t.claimed = None
        return t.stack, t.slot

    def slot(self):
        try:
            return self.threads.slot
        except AttributeError:
            return self.thread()[1]

    def set_phase(self, phase):
        self.phase = phase
        self.api.phase(phase, self.step)

    # Module paths.

    def scope_of(self, module, stack):
        """(weak ref, scope id, leaf, claims) of `module`, naming its subtree when first seen:
        `leaf`, it has no children; `claims`, when a child of it has children of its own, its
        scope id, with which its output's autograd node names it in backward (a decoder layer
        claims, its MLP does not: a pre-hook costs on the autograd thread, so backward is named
        at the coarser grain), else None."""
        if stack:
            parent = stack[-1][0]
            prefix = self.paths.get(parent, type(parent).__name__)
            prefix += "." + _child_name(parent, module)
        else:
            prefix = type(module).__name__
        with self.lock:
            for name, sub in module.named_modules(remove_duplicate=True):
                known = self.scopes.get(id(sub))
                if known is not None and known[0]() is sub:
                    continue
                path = prefix + "." + name if name else prefix
                self.paths[sub] = path
                key = id(sub)
                ref = weakref.ref(sub, lambda _, key=key, scopes=self.scopes: scopes.pop(key, None))
                leaf = not sub._modules
                sid = self.api.define(path.encode())
                claims = None
                if any(c is not None and c._modules for c in sub._modules.values()):
                    claims = sid
                self.scopes[key] = (ref, sid, leaf, claims)
        return self.scopes[id(module)]

    # Parameters.

    def tag_parameters(self, root):
        """Tag `root`'s parameters and buffers when first seen or moved."""
        params = list(root.parameters()) + list(root.buffers())
        first = params[0].data_ptr() if params else 0
        known = self.roots.get(id(root))
        if known is not None and known[0]() is root and known[1] == first:
            return
        cuda = [p for p in root.parameters() if _device_of(p) >= 0]
        self.roots[id(root)] = (_weak(root, self.roots), first, _Gradients(cuda))
        self.api.tag(TAG_PARAMETER, params)

    def first_parameter_moved(self, root):
        """Whether `root` is new, or its first parameter (`root.parameters()`'s) moved."""
        known = self.roots.get(id(root))
        if known is None or known[0]() is not root:
            return True
        p = _first_parameter(root)
        return p is not None and p.data_ptr() != known[1]

    def tag_gradients(self):
        """Tag the `.grad`s of the roots' CUDA parameters: one call per root and device, from
        C++ when the piece is loaded (Note [Gradients' tags in C++]), else from here."""
        native = cachealloc_backward_scopes.tag_gradients_fn()
        by_device = {}
        for _, _, grads in list(self.roots.values()):
            for device, (refs, impls) in grads.by_device.items():
                if native is not None and grads.live[0]:
                    address, count = impls.buffer_info()
                    if native(device, address, count, TAG_GRADIENT) >= 0:
                        continue
                pointers = [
                    g.data_ptr()
                    for r in refs
                    if (p := r()) is not None and (g := p.grad) is not None
                ]
                if pointers:
                    by_device.setdefault(device, []).extend(pointers)
        for device, pointers in by_device.items():
            self.api.tag_pointers(TAG_GRADIENT, device, pointers)


class _Gradients:
    """A root's CUDA parameters, for their `.grad`s' tags: `by_device[device]` is (weak
    references to them, an `array` of their `_cdata` words for the C++ piece); `live[0]` is
    cleared by the references' callbacks when one of them dies (its word is then not read)."""

    def __init__(self, params):
        self.live = live = [True]

        def dead(_):
            live[0] = False

        self.by_device = {}
        for p in params:
            refs, impls = self.by_device.setdefault(_device_of(p), ([], array.array("Q")))
            refs.append(weakref.ref(p, dead))
            impls.append(getattr(p, "_cdata", 0))  # 0: skipped (not PyTorch's tensor)


def _weak(obj, table):
    """A weak reference to `obj` that takes its entry out of `table` (by `id`) when it goes."""
    key = id(obj)

    def gone(ref):
        if table.get(key, (None,))[0] is ref:
            del table[key]

    return weakref.ref(obj, gone)


def _first_parameter(module):
    """`next(module.parameters(), None)` without its generators (depth first, in registration
    order, as `named_modules` walks): a root's step starts with it."""
    pending = [module]
    while pending:
        m = pending.pop()
        for p in m._parameters.values():
            if p is not None:
                return p
        pending.extend(c for c in reversed(m._modules.values()) if c is not None)
    return None


def _never():
    """`is_compiling` of a torch without `torch.compiler` (before 2.1): never."""
    return False


def _child_name(parent, module):
    for name, sub in parent._modules.items():
        if sub is module:
            return name
    return type(module).__name__


def _tensors(values):
    tensor = sys.modules["torch"].Tensor
    return [v for v in values if isinstance(v, tensor)]


_state = None


def _make_call_impl(original):
    """`nn.Module._call_impl` (what `module(...)` runs) with scopes. A module seen before that
    is a leaf only sets its thread's scope slot around the call; one inside another module (a
    decoder layer, its attention block and MLP: most wrapped calls) pushes and pops its scope,
    and claims its output's autograd node, inline; the outermost module, or one not seen
    before, goes through `_enter` and `_leave`. Every Python operation here counts: in a
    training step the objects it touches are out of the CPU's caches, a microsecond or more
    each (BENCHMARKS.md, "the hooks' host cost on CPU"). Inside torch.compile's tracing it is
    the original."""
    s = _state
    scopes, threads = s.scopes, s.threads

    def _call_impl(self, *args, **kwargs):
        if s.is_compiling():
            return original(self, *args, **kwargs)
        entry = scopes.get(id(self))
        if entry is not None and entry[0]() is self:
            try:
                slot = threads.slot
            except AttributeError:
                slot = s.thread()[1]
            outer = slot.value
            if entry[2]:
                slot.value = entry[1]
                try:
                    return original(self, *args, **kwargs)
                finally:
                    slot.value = outer
            stack = threads.stack
            if stack:
                # What `_enter` and `_leave` do for a module inside another, without them.
                claims = entry[3]
                item = (self, entry[1], None, claims, outer)
                stack.append(item)
                slot.value = entry[1]
                output = None
                try:
                    output = original(self, *args, **kwargs)
                    return output
                finally:
                    if stack and stack[-1] is item:
                        stack.pop()
                        if claims is not None and output is not None and s.backward_scopes:
                            if s.is_grad_enabled():
                                _claim(s, threads, claims, output)
                        slot.value = outer
                    else:
                        _leave(s, threads, self, output)
        if cachealloc_common.torch_traces_not_runs():
            return original(self, *args, **kwargs)
        t = _enter(s, self, entry, args)
        output = None
        try:
            output = original(self, *args, **kwargs)
            return output
        finally:
            _leave(s, t, self, output)

    _call_impl._cachealloc_original = original
    # Stacks leave this frame out: a program's stacks are the same with the wrapper as without.
    _state.api.hide_code(id(_call_impl.__code__))
    # No frame of this module is compiled alone: after a graph break inside a module Dynamo
    # compiles each frame it meets above it, and the wrapper's (or `_enter`'s) would be one
    # compiled region more than natively (PyTorch's test_memory_compile_regions).
    cachealloc_common.dynamo_skips_frames_of(sys.modules[__name__], ("_call_impl",))
    return _call_impl


def _enter(s, module, entry, args):
    """A module is called that needs the thread's module stack: push its scope; returns the
    thread's state. The outermost one on its thread begins the forward phase: between steps it
    also tags the inputs, and the parameters when new or moved; inside a backward it is a
    recomputation (activation checkpointing), a forward that gives the phase back to the
    backward at its end."""
    t = s.threads
    try:
        stack, slot = t.stack, t.slot
    except AttributeError:
        stack, slot = s.thread()
    if entry is None or entry[0]() is not module:
        entry = s.scope_of(module, stack)
    resume = None  # the phase to put back when this module returns
    if not stack:
        if s.phase == PHASE_NONE:
            resume = PHASE_NONE
            s.set_phase(PHASE_FORWARD)
            if s.first_parameter_moved(module):
                s.tag_parameters(module)
            s.api.tag(TAG_INPUT, [a for a in args if isinstance(a, s.tensor)])
            t.claimed = set()
            s.native_claim = cachealloc_backward_scopes.forward_begins()
        elif s.phase == PHASE_BACKWARD:
            resume = PHASE_BACKWARD
            s.set_phase(PHASE_FORWARD)
    # With the scope the thread was in (for the outermost, in a backward, the module a node
    # named): back in it at the end.
    stack.append((module, entry[1], resume, entry[3], slot.value))
    slot.value = entry[1]
    return t


def _leave(s, t, module, output):
    """The module returned (or raised: `output` None): pop the thread's stack to it (an entry
    above it, whose leave was skipped, goes with it), then `_left`."""
    stack = t.stack
    while stack:
        item = stack.pop()
        if item[0] is module:
            _left(s, t, t.slot, item, output)
            return
    t.slot.value = 0


def _left(s, t, slot, item, output):
    """The module of stack entry `item`, popped, returned: its output's autograd node, unless
    an inner module's claimed it, names it in backward; the thread is back in the scope the
    module was called in; the outermost one ends the forward phase."""
    _, _, resume, claims, outer = item
    if claims is not None and output is not None and s.backward_scopes and s.is_grad_enabled():
        _claim(s, t, claims, output)
    slot.value = outer
    if resume is not None and not t.stack:
        s.set_phase(resume)
        t.claimed = None


def backward_begin():
    """The program calls `backward()`: the backward phase, until `backward_end`. Returns what
    `backward_end` needs."""
    s = _state
    if s is None or not s.enabled or s.is_compiling():
        return None
    previous = s.phase
    if previous != PHASE_BACKWARD:
        s.set_phase(PHASE_BACKWARD)
    return previous, s.slot().value


def backward_end(previous, gradients=True):
    """`backward()` returned: tag the known parameters' gradients, put back the phase."""
    s = _state
    if s is None or previous is None:
        return
    phase, scope = previous
    # The threads that ran backward leave its modules (they are idle now); the caller is back
    # where it was.
    for slot in s.backward_slots.values():
        slot.value = 0
    s.backward_slots.clear()
    cachealloc_backward_scopes.backward_end()
    s.slot().value = scope
    if gradients:
        s.tag_gradients()
    if phase != PHASE_BACKWARD:
        s.set_phase(phase)


def _optimizer_pre(optimizer, args, kwargs):
    s = _state
    if not s.is_compiling():
        s.set_phase(PHASE_OPTIMIZER)


def _optimizer_post(optimizer, args, kwargs):
    s = _state
    if s.is_compiling():
        return
    count = len(optimizer.state)
    known = s.optimizers.get(id(optimizer))
    if known is None or known[0]() is not optimizer or known[1] != count:
        s.optimizers[id(optimizer)] = (_weak(optimizer, s.optimizers), count)
        state = []
        for per_param in optimizer.state.values():
            if isinstance(per_param, dict):
                state.extend(_tensors(per_param.values()))
        s.api.tag(TAG_OPTIMIZER_STATE, state)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        s.api.tag(TAG_PARAMETER, _tensors(params))
    s.step += 1
    s.set_phase(PHASE_NONE)


def wanted(conf):
    """Whether the hooks should be installed under the configuration text `conf`."""
    return "categories:off" not in conf and "trace:off" not in conf


def _ensure_state():
    global _state
    if _state is None:
        api = _api()
        if api is None:
            return None
        _state = _State(api)
    return _state


_installers = {}
_handles = []


def torch_compiler_imported():
    """`torch.compiler` is imported: the state takes torch's functions (`_State.take_torch`)."""
    if _state is not None and "is_compiling" not in vars(_state):
        _state.take_torch()


def install_module_hooks(module_module):
    """Give scopes to the classes of modules with children (`torch.nn.modules.module` just
    loaded): each class gets a `_call_impl` of its own when one of its instances gains its
    first child (a global module-registration hook, run only while models are built). Leaf
    classes (`Linear`, `Conv2d`, norms: most module calls) keep PyTorch's, at no cost."""
    if _ensure_state() is None:
        return False
    # The registration hook below runs inside PyTorch's own code too, torch.compile's included
    # (compiled autograd wraps its graph in a module while Dynamo is active): Dynamo must not
    # compile its frame, nor any other of this module's, as one of its own (PyTorch's
    # test_compiled_autograd_static_input_params), nor what they call: only the wrapper's
    # callee, the module's forward (scripts/gpu/compiled_model.py).
    cachealloc_common.dynamo_skips_frames_of(sys.modules[__name__], ("_call_impl",))
    patched = []  # (class, the _call_impl it had)

    def patch(cls):
        inherited = cls._call_impl
        if getattr(inherited, "_cachealloc_original", None) is not None:
            return  # the class, or a base class, has scopes already
        patched.append((cls, inherited))
        wrap(cls, inherited)

    def wrap(cls, inherited):
        restore = cachealloc_common.Restore(cls, "_call_impl", inherited)
        cls._call_impl = _make_call_impl(inherited)
        _handles.append(restore)

    def on_child(module, name, submodule):
        if _state.enabled:
            patch(type(module))
        return None

    def install():
        for cls, inherited in patched:
            wrap(cls, inherited)
        return []

    module_module.register_module_module_registration_hook(on_child)
    _installers["module"] = install
    return True


def install_optimizer_hooks(optimizer_module):
    """Register the global optimizer step hooks (`torch.optim.optimizer` just loaded)."""
    if _ensure_state() is None:
        return False

    def install():
        return [
            optimizer_module.register_optimizer_step_pre_hook(_optimizer_pre),
            optimizer_module.register_optimizer_step_post_hook(_optimizer_post),
        ]

    _installers["optimizer"] = install
    _handles.extend(install())
    return True


def enable(on, parts=None):
    """Turn the hooks off (removed, as if never installed) or back on, between steps: what a
    benchmark alternates within one process to measure their cost. `parts` (with `on`) keeps
    only some on: "module", "optimizer" (a diagnostic of where the cost goes). Returns whether
    they were installed at all."""
    s = _state
    if s is None or not _installers:
        return False
    while _handles:
        _handles.pop().remove()
    if s.phase != PHASE_NONE:
        s.set_phase(PHASE_NONE)
    if on:
        for name, install in _installers.items():
            if parts is None or name in parts:
                _handles.extend(install())
    s.enabled = on
    return True
