"""The Python integration's IPC of CUDA tensors, under LD_PRELOAD=libcachealloc.so over fakecuda
(no torch needed: a stand-in torch package made here, with the parts of torch.storage and
torch.cuda the integration calls). A block allocated through the runtime is shared with
UntypedStorage._share_cuda_ (replaced by the integration) and received by this script run again
in a child process with _new_shared_cuda, as torch.multiprocessing does: the child reads the
parent's bytes and writes its own, which the parent sees; the parent frees the block while the
child holds it, and it is not handed out again; once the child let go of the storage (after
waiting for its stream), the next allocation takes it back. The sender records an IPC event
instead of waiting for its stream, the receiver's stream waits on it, and the sender keeps it
until the receiver has let go.
With CACHEALLOC_CONF=expandable_segments:True the block lies in an expandable segment and the
share tuple carries its description instead of a 64-byte IPC handle.
Usage: python_ipc.py [BYTES]. Prints "OK python_ipc"."""
import ctypes
import gc
import json
import os
import subprocess
import sys
import tempfile


def fail(why):
    print(f"FAIL: {why}", flush=True)
    sys.exit(1)


# The stand-in's torch.cuda: a stream whose waits the test watches, and IPC events in Python
# (fakecuda runs every copy at once, so an event's order is not what is checked here, but that
# the sender records one instead of waiting, the receiver's stream waits on it, and the sender
# keeps it until the receiver has let go).
STAND_IN_CUDA = """
import contextlib, ctypes, os, weakref
def device(index):
    return contextlib.nullcontext()
on_synchronize = None  # the test's probe, called at each stream synchronization
waited = []  # the handles of the IPC events a stream waited on
live_events = weakref.WeakSet()
_made = [0]
class Event:
    def __init__(self, interprocess=False, handle=None):
        assert interprocess or handle is not None, "an IPC event not made interprocess"
        self.handle, self.recorded = handle, None
        live_events.add(self)
    def record(self, stream=None):
        self.recorded = stream
    def ipc_handle(self):
        assert self.recorded is not None, "the IPC handle of an event never recorded"
        if self.handle is None:
            _made[0] += 1
            self.handle = f"{os.getpid()}:{_made[0]}".encode().ljust(64, b"\\0")
        return self.handle
    @classmethod
    def from_ipc_handle(cls, device, handle):
        return cls(handle=bytes(handle))
class _Stream:
    def synchronize(self):
        assert ctypes.CDLL(None).cudaDeviceSynchronize() == 0
        if on_synchronize is not None:
            on_synchronize()
    def wait_event(self, event):
        waited.append(event.handle)
def current_stream(device=None):
    return _Stream()
"""


def stand_in_torch():
    """A torch package with what the integration's IPC calls, first on sys.path."""
    root = tempfile.mkdtemp()
    os.makedirs(os.path.join(root, "torch", "cuda"))
    with open(os.path.join(root, "torch", "__init__.py"), "w") as f:
        f.write(
            "import torch.cuda\n"
            "class _Tensor:\n"
            "    def __init__(self, obj):\n        self.obj = obj\n"
            "    def untyped_storage(self):\n"
            "        from torch.storage import UntypedStorage\n"
            "        address, _ = self.obj.__cuda_array_interface__['data']\n"
            "        (size,) = self.obj.__cuda_array_interface__['shape']\n"
            "        return UntypedStorage(address, size, keep=self.obj)\n"
            "def as_tensor(obj, device=None):\n    return _Tensor(obj)\n"
        )
    with open(os.path.join(root, "torch", "cuda", "__init__.py"), "w") as f:
        f.write(STAND_IN_CUDA)
    with open(os.path.join(root, "torch", "storage.py"), "w") as f:
        f.write(
            "class _Device:\n    index = 0\n"
            "class UntypedStorage:\n"
            "    device = _Device()\n"
            "    def __init__(self, address, size, keep=None):\n"
            "        self._address, self._size, self._keep = address, size, keep\n"
            "    def data_ptr(self):\n        return self._address\n"
            "    def nbytes(self):\n        return self._size\n"
            "    def _share_cuda_(self, *args):\n        raise RuntimeError('native')\n"
            "    @classmethod\n"
            "    def _new_shared_cuda(cls, *args):\n        raise RuntimeError('native')\n"
        )
    sys.path.insert(0, root)


ctypes.CDLL("libcudart.so.13", mode=ctypes.RTLD_GLOBAL)
cuda = ctypes.CDLL(None)
cuda.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
cuda.cudaFree.argtypes = [ctypes.c_void_p]
cuda.cudaMemset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
cuda.cudaMemcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def malloc(size):
    ptr = ctypes.c_void_p()
    if cuda.cudaMalloc(ctypes.byref(ptr), size) != 0:
        fail("cudaMalloc failed")
    return ptr.value


def holds(address, value, size):
    host = ctypes.create_string_buffer(size)
    if cuda.cudaMemcpy(host, ctypes.c_void_p(address), size, 2) != 0:  # device to host
        fail("cudaMemcpy failed")
    return host.raw == bytes([value]) * size


def fill(address, value, size):
    if cuda.cudaMemset(ctypes.c_void_p(address), value, size) != 0 or cuda.cudaDeviceSynchronize() != 0:
        fail("cudaMemset failed")


# Where the library keeps its IPC counter files.
files = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
stand_in_torch()
import torch  # noqa: E402
import torch.storage  # noqa: E402

storage = torch.storage.UntypedStorage
if not getattr(storage, "_cachealloc_ipc", False):
    fail("the integration did not replace UntypedStorage's IPC methods")

if len(sys.argv) > 1 and sys.argv[1] == "receive":
    shared = json.loads(sys.argv[2])
    shared[1] = bytes.fromhex(shared[1])
    shared[4] = shared[4].encode()
    shared[6] = bytes.fromhex(shared[6])
    size = shared[2]
    received = storage._new_shared_cuda(*shared)
    if torch.cuda.waited != [shared[6]]:
        fail(f"the receiver's stream waited on {torch.cuda.waited}, not the sender's event")
    if not holds(received.data_ptr(), 0x3C, size):
        fail("the receiver does not see the sender's bytes")
    fill(received.data_ptr(), 0x7E, size)
    print("wrote", flush=True)
    sys.stdin.readline()
    # The storage's end must wait for the receiver's stream before it releases the sender's
    # counter (after it, the sender may hand the block to new work): the wait sees the
    # counter still held.
    counter = os.open(os.path.join(files, shared[4].decode()), os.O_RDONLY)
    waits = []

    def held():
        return int.from_bytes(os.pread(counter, 8, 8 * shared[5]), "little", signed=True)

    torch.cuda.on_synchronize = lambda: waits.append(held())
    del received
    gc.collect()  # the storage's end closes the mapping and releases the sender's counter
    if waits != [1] or held() != 0:
        fail(f"the receiver's stream waits saw the counter at {waits}, then {held()}")
    print("OK python_ipc receiver", flush=True)
    sys.exit(0)

size = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
expandable = "expandable_segments:True" in os.environ.get("CACHEALLOC_CONF", "")
first, block, other = malloc(4096), malloc(size), malloc(size)
fill(block, 0x3C, size)
# A sharer killed before it could remove its counter file left one (no process holds its lock):
# the first share of a process sweeps such files away.
stale = os.path.join(files, f"cachealloc-ipc-{4000000000 + os.getpid()}-0")
with open(stale, "wb") as f:
    f.write(bytes(8))

def sender_waits():
    fail("the sender waited for its stream (PyTorch sends an event instead)")


torch.cuda.on_synchronize = sender_waits
shared = list(storage(block, size)._share_cuda_())
if os.path.exists(stale):
    fail("a dead sharer's counter file was left in place")


def live(event_handle):
    gc.collect()
    return any(e.handle == event_handle for e in torch.cuda.live_events)


event_handle = shared[6]
if shared[7] is not True or not isinstance(event_handle, bytes) or not live(event_handle):
    fail(f"the share carries no event the sender keeps: {shared[6:]}")
handle = shared[1]
if expandable != (len(handle) != 64):
    fail(f"a share tuple with a handle of {len(handle)} bytes (expandable segments: {expandable})")
if not expandable and size == 4096 and shared[3] != block - first:
    fail(f"offset {shared[3]} of a block {block - first} bytes into its segment")
shared[1] = handle.hex()
shared[4] = shared[4].decode()
shared[6] = event_handle.hex()
child = subprocess.Popen(
    [sys.executable, __file__, "receive", json.dumps(shared)],
    stdin=subprocess.PIPE,
    stdout=subprocess.PIPE,
    text=True,
)
if child.stdout.readline().strip() != "wrote":
    fail("the receiver died before writing")
if not holds(block, 0x7E, size):
    fail("the sender does not see the receiver's bytes")
if not live(event_handle):
    fail("the sender let go of the event its receiver may still open")
if cuda.cudaFree(ctypes.c_void_p(block)) != 0:  # the receiver still holds it
    fail("cudaFree of a shared block failed")
again = malloc(size)
if again == block:
    fail("a block another process holds was handed out again")
child.stdin.write("go\n")
child.stdin.flush()
said = child.stdout.read()
if child.wait() != 0 or "OK python_ipc receiver" not in said:
    fail(f"the receiver failed: {said}")
# The receiver has let go: the next allocation, with no free before it, takes the block back
# before any new memory is reserved (PyTorch collects its limbo before its allocator grows).
if malloc(size) != block:
    fail("the block let go of did not serve the next allocation")
# The receiver has let go: the next share drops the first one's event, and keeps its own.
next_event = storage(malloc(size), size)._share_cuda_()[6]
if live(event_handle) or not live(next_event):
    fail("a released share's event was kept, or a held one's dropped")
# CUDA limits interprocess events: with as many kept as PyTorch keeps at most, the next share
# synchronizes its stream instead, as PyTorch's does.
limit = sys.modules["cachealloc_hooks"]._MAX_SENT_EVENTS
syncs = []
torch.cuda.on_synchronize = lambda: syncs.append(1)
for i in range(limit):
    with_event = storage(malloc(4096), 4096)._share_cuda_()[7]
    if with_event != (i < limit - 1) or len(syncs) != (i == limit - 1):
        fail(f"share {i + 2} with {limit} events allowed: event {with_event}, waits {len(syncs)}")


# A share looks at a few kept events, never at all of them: with the limit's worth held, a
# look at each would cost every share a call into the library per event.
class CountingApi:
    looks = 0

    def sent_released(self, name, slot):
        CountingApi.looks += 1
        return 0


held = sys.modules["cachealloc_hooks"]._SentEvents(CountingApi())
for i in range(limit):
    held.keep(b"counter", i, None)
if held.room() or not 0 < CountingApi.looks <= 8:
    fail(f"a share with {limit} events held looked at {CountingApi.looks} of them")
print("OK python_ipc", flush=True)
