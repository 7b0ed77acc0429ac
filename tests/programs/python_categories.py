"""The Python integration's view of a program for memory by category (cachealloc_categories),
run under LD_PRELOAD=libcachealloc.so over fakecuda with a stand-in torch made here: the parts
of PyTorch's API the integration uses (nn.Module's `_call_impl` and module-registration hook,
autograd nodes' pre-hooks, `torch.autograd.backward`, the optimizer's step hooks), with tensors
whose storage is cudaMalloc'd. A small model (Net: a Block of two Linears, and a Linear head)
trains three steps, the third recomputing its Block during backward (activation
checkpointing), then a Stack of two Layers runs a forward; each kind of allocation has its own
size, so the trace can be checked (tests/tests/python.rs):

    input 3072, Linear outputs 32768, the Block's temporary 1024, weights 65536,
    backward's temporaries 5120, gradients 65536 (like the weights), optimizer state 131072,
    the optimizer's temporary 2048, the recomputation's input 3584; the Stack's input 4096,
    its outputs 4608.

Here it checks what the trace cannot show: the model's results are unchanged, each claiming
module's node gets its pre-hook, the hooks keep nothing alive, a pickled model names nothing of
cachealloc's, and `enable(False)` gives the classes back their own `_call_impl`. Usage:
python_categories.py. Prints "OK python_categories".
"""
import gc
import os
import pickle
import sys
import tempfile
import types
import weakref

root = tempfile.mkdtemp()
files = {
    "torch/__init__.py": '''
import ctypes, types, weakref
ctypes.CDLL("libcudart.so.13", mode=ctypes.RTLD_GLOBAL)
_rt = ctypes.CDLL(None)
_rt.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
_rt.cudaFree.argtypes = [ctypes.c_void_p]
class Tensor:
    is_cuda = True
    def __init__(self, nbytes, param=False):
        p = ctypes.c_void_p()
        if _rt.cudaMalloc(ctypes.byref(p), nbytes) != 0:
            raise RuntimeError("cudaMalloc")
        self._ptr, self.nbytes, self.param = p.value, nbytes, param
        self.grad = None
        self._node = None
    @property
    def grad_fn(self):
        """As PyTorch's: the node's Python object, made when asked for, alive only while
        someone holds it (the node keeps a weak reference), so that a later node's object can
        take its address."""
        node = self._node
        if node is None:
            return None
        obj = node.py() if node.py is not None else None
        if obj is None:
            obj = NodeObject(node)
            node.py = weakref.ref(obj)
        return obj
    @grad_fn.setter
    def grad_fn(self, node):
        self._node = node
    def data_ptr(self):
        return self._ptr
    def get_device(self):
        return 0
    def __del__(self):
        _rt.cudaFree(self._ptr)
    def __reduce__(self):
        return (Tensor, (self.nbytes, self.param))
class NodeObject:
    # Padded to a size of its own (past pymalloc's 512 bytes: malloc's), so that the next one
    # made takes the address of the last one freed, as PyTorch's node objects can.
    __slots__ = ("node", "__weakref__") + tuple(f"_pad{i}" for i in range(70))
    def __init__(self, node):
        self.node = node
    def register_prehook(self, fn):
        self.node.register_prehook(fn)
_grad = [True]
def is_grad_enabled():
    return _grad[0]
from torch import nn, optim, autograd
from torch import compiler  # late in torch's import, as PyTorch's
''',
    "torch/compiler/__init__.py": "def is_compiling():\n    return False\n",
    "torch/nn/__init__.py": "from torch.nn.modules.module import Module\n",
    "torch/nn/modules/__init__.py": "",
    "torch/nn/modules/module.py": '''
import torch
_registration_hooks = []
def register_module_module_registration_hook(hook):
    _registration_hooks.append(hook)
class Module:
    def __init__(self):
        object.__setattr__(self, "_modules", {})
        object.__setattr__(self, "_parameters", {})
    def __setattr__(self, name, value):
        if isinstance(value, Module):
            for hook in _registration_hooks:
                hook(self, name, value)
            self._modules[name] = value
        elif isinstance(value, torch.Tensor) and value.param:
            self._parameters[name] = value
        object.__setattr__(self, name, value)
    def named_modules(self, memo=None, prefix="", remove_duplicate=True):
        yield prefix, self
        for name, m in self._modules.items():
            yield from m.named_modules(prefix=prefix + ("." if prefix else "") + name)
    def parameters(self):
        for _, m in self.named_modules():
            yield from m._parameters.values()
    def buffers(self):
        return iter(())
    def _call_impl(self, *args, **kwargs):
        return self.forward(*args, **kwargs)
    def __call__(self, *args, **kwargs):
        return self._call_impl(*args, **kwargs)
''',
    "torch/autograd/__init__.py": '''
import torch
_graph = []
class Node:
    """An autograd node: what backward runs, holding what the forward saved."""
    def __init__(self, saved):
        self.saved, self.prehooks, self.py = saved, [], None
        _graph.append(self)
    def register_prehook(self, fn):
        self.prehooks.append(fn)
    def run(self):
        for hook in self.prehooks:
            hook((None,))
        temporary = torch.Tensor(5120)
        del temporary
        self.saved = None
recompute = []  # what backward runs after its first node (activation checkpointing's)
def backward(loss, params=()):
    first = True
    while _graph:
        _graph.pop().run()
        if first:
            first = False
            while recompute:
                recompute.pop()()
    for p in params:
        p.grad = torch.Tensor(p.nbytes)
def grad(*args):
    return None
''',
    "torch/optim/__init__.py": "from torch.optim.optimizer import Optimizer\n",
    "torch/optim/optimizer.py": '''
import torch
_pre, _post = [], []
class _Handle:
    def __init__(self, hooks, hook):
        self.hooks, self.hook = hooks, hook
    def remove(self):
        self.hooks.remove(self.hook)
def register_optimizer_step_pre_hook(hook):
    _pre.append(hook)
    return _Handle(_pre, hook)
def register_optimizer_step_post_hook(hook):
    _post.append(hook)
    return _Handle(_post, hook)
class Optimizer:
    def __init__(self, params):
        self.param_groups = [{"params": list(params)}]
        self.state = {}
    def step(self):
        for hook in _pre:
            hook(self, (), {})
        temporary = torch.Tensor(2048)
        for p in self.param_groups[0]["params"]:
            if p not in self.state:
                self.state[p] = {"exp_avg": torch.Tensor(2 * p.nbytes)}
        del temporary
        for hook in _post:
            hook(self, (), {})
    def zero_grad(self):
        for p in self.param_groups[0]["params"]:
            p.grad = None
''',
}
for name, text in files.items():
    path = os.path.join(root, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
sys.path.insert(0, root)

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.autograd import Node  # noqa: E402


def fail(why):
    print(f"FAIL: {why}")
    sys.exit(1)


class Linear(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.Tensor(65536, param=True)

    def forward(self, x):
        out = torch.Tensor(32768)
        out.grad_fn = Node(saved=x)
        return out


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = Linear()
        self.fc2 = Linear()

    def forward(self, x):
        h = self.fc1(x)
        temporary = torch.Tensor(1024)
        del temporary
        return self.fc2(h)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer0 = Block()
        self.head = Linear()

    def forward(self, x):
        return self.head(self.layer0(x))


net = Net()
params = list(net.parameters())
# The hooks' state took torch's functions when torch.compiler was imported, before any module is
# called: a first call traced by torch.compile must not change what Dynamo guards on.
if "categories:off" not in os.environ.get("CACHEALLOC_CONF", ""):
    taken = vars(sys.modules["cachealloc_categories"]._state)
    if taken.get("is_compiling") is not torch.compiler.is_compiling or taken.get("tensor") is not torch.Tensor:
        fail("the hooks' state did not take torch's functions before the first module call")
opt = torch.optim.Optimizer(params)
outputs = []
for step in range(2):
    x = torch.Tensor(3072)
    loss = net(x)
    outputs.append(type(loss).__name__)
    torch.autograd.backward(loss, params)
    del loss
    opt.step()
    opt.zero_grad()
    del x

# A third step whose backward recomputes the Block (activation checkpointing): a forward inside
# the backward, on an input of its own size.
x = torch.Tensor(3072)
loss = net(x)
torch.autograd.recompute.append(lambda block=net.layer0: block(torch.Tensor(3584)))
torch.autograd.backward(loss, params)
del loss
opt.step()
opt.zero_grad()
del x

if outputs != ["Tensor", "Tensor"]:
    fail(f"the model's results changed: {outputs}")
if "categories:off" in os.environ.get("CACHEALLOC_CONF", ""):
    categories = sys.modules.get("cachealloc_categories")
    if categories is not None and categories._state is not None:
        fail("categories:off, yet the categories hooks were installed")
    if "_call_impl" in Net.__dict__:
        fail("categories:off, yet a class was patched")
    print("OK python_categories")
    sys.exit(0)
import cachealloc_categories  # noqa: E402

if "_call_impl" not in Net.__dict__ or "_call_impl" not in Block.__dict__:
    fail("the classes with children have no scoped _call_impl")
if "_call_impl" in Linear.__dict__:
    fail("a leaf class was patched")
if b"cachealloc" in pickle.dumps(net):
    fail("a pickled model names cachealloc")


# Two modules that claim nodes, one after the other (a forward, of its own sizes: input 4096,
# outputs 4608): each one's node gets its pre-hook, though the first node's Python object is
# gone, and its address free, by the time the second is made (as in PyTorch).
class Leaf(nn.Module):
    def forward(self, x):
        out = torch.Tensor(4608)
        out.grad_fn = Node(saved=None)
        return out


class Inner(nn.Module):
    def __init__(self, leaf=None):
        super().__init__()
        self.leaf = leaf if leaf is not None else Leaf()

    def forward(self, x):
        return self.leaf(x)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Inner()

    def forward(self, x):
        return self.inner(x)


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = Layer()
        self.b = Layer()

    def forward(self, x):
        return self.b(self.a(x))


made = len(torch.autograd._graph)
out = Stack()(torch.Tensor(4096))
hooks = [len(node.prehooks) for node in torch.autograd._graph[made:]]
if hooks != [1, 1]:
    fail(f"each Layer's output node gets one pre-hook (the Stack's is the second's): {hooks}")
del out, torch.autograd._graph[made:]


# A model traced rather than run (Inductor lowering a graph with fake tensors, `make_fx`): an
# input with no storage of its own, whose `data_ptr()` raises as a fake or functional tensor's
# does, is left untagged, and the program goes on; under a tracing dispatch mode (this torch's
# `_C` says so, as PyTorch's does for its fake, functional and proxy modes) the outermost module
# begins no phase. Nothing is allocated here, so the trace's checks are not touched.
class NoStorage(torch.Tensor):
    def __init__(self):
        self.nbytes, self.param, self.grad, self._node, self._ptr = 0, False, None, None, None

    def data_ptr(self):
        raise RuntimeError("Cannot access data pointer of Tensor (e.g. FakeTensor)")

    def __del__(self):
        pass


phases = []


class Probe(nn.Module):
    def forward(self, x):
        phases.append(cachealloc_categories._state.phase)
        return x


traced = Inner(Probe())
traced(NoStorage())
modes = {}
torch._C = types.SimpleNamespace(
    _TorchDispatchModeKey=types.SimpleNamespace(FAKE="fake", FUNCTIONAL="functional", PROXY="proxy"),
    _get_dispatch_mode=modes.get,
)
modes["fake"] = object()
traced(NoStorage())
del modes["fake"]
if phases != [cachealloc_categories.PHASE_FORWARD, cachealloc_categories.PHASE_NONE]:
    fail(f"a run begins the forward phase, a traced call none: {phases}")
if not cachealloc_categories.enable(False):
    fail("enable(False) found no hooks")
if "_call_impl" in Net.__dict__ or "_call_impl" in Block.__dict__:
    fail("enable(False) left a class patched")
cachealloc_categories.enable(True)
if "_call_impl" not in Net.__dict__:
    fail("enable(True) did not patch again")
# The hooks keep nothing alive: the model and its tensors go when the program lets go.
alive = weakref.ref(net)
del net, params, opt
gc.collect()
if alive() is not None:
    fail("the model outlived the program's references")
print("OK python_categories")
