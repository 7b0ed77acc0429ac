"""Backward-pass attribution under LD_PRELOAD=libcachealloc.so (no torch needed): a stand-in
`torch.autograd.backward` allocates on a native thread that Python never saw, as PyTorch's
autograd engine does. With the Python integration, that allocation's stack is the stack of the
Python code that called backward(). Usage: python_backward.py LIBDIR. Prints "OK python_backward"."""
import ctypes
import os
import sys
import tempfile

BYTES = 777_216  # the allocation to find in the trace

helper = ctypes.CDLL(os.path.join(sys.argv[1], "libnative_thread.so"))
root = tempfile.mkdtemp()
package = os.path.join(root, "torch", "autograd")
os.makedirs(package)
open(os.path.join(root, "torch", "__init__.py"), "w").close()
with open(os.path.join(package, "__init__.py"), "w") as f:
    f.write(
        "import ctypes, os, sys\n"
        "def backward(bytes):\n"
        f"    return ctypes.CDLL(os.path.join({sys.argv[1]!r}, 'libnative_thread.so')).alloc_on_native_thread(ctypes.c_size_t(bytes))\n"
        "def grad(*a):\n"
        "    return None\n"
    )
sys.path.insert(0, root)

import torch.autograd  # noqa: E402


def train_step():
    return torch.autograd.backward(BYTES)


if train_step() != 0:
    print("FAIL: the native thread's allocation failed")
    sys.exit(1)
print("OK python_backward")
