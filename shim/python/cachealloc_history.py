"""cachealloc's Python integration for PyTorch's memory history (used by `cachealloc_memory`):
`_record_memory_history`'s settings over time, `_set_memory_metadata`, and the snapshot built
from the library's trace by the `cachealloc snapshot` command (a `--serve` process of it kept
beside the program: `Server`), with what the library knows of
each segment and, where the C++ allocator gathered them, PyTorch's own frames (Note
[PyTorch's own contexts] in `cachealloc_torch_history.h`)."""
import os
import sys

from cachealloc_common import c_functions, text, warn


def cachealloc_binary():
    """The `cachealloc` command beside the preloaded library."""
    for entry in os.environ.get("LD_PRELOAD", "").replace(":", " ").split():
        if os.path.basename(entry).startswith("libcachealloc"):
            candidate = os.path.join(os.path.dirname(os.path.abspath(entry)), "cachealloc")
            if os.access(candidate, os.X_OK):
                return candidate
    return None


class History:
    """What `_record_memory_history` asked, over time: each change with the trace's time at the
    call, which `cachealloc snapshot --history` applies (what each setting keeps, as PyTorch's
    native allocator keeps it: docs in the tool's `snapshot::history`). Before the first call
    nothing shows, as natively; a program that never calls it gets the recorder's whole
    history."""

    changes = []
    max_entries = 100_000
    # Changes passed to the tool at most (the last ones; a program that toggles its history
    # every step need not make the command line grow without end).
    keep = 4096
    # PyTorch's own `_cuda_record_memory_history` (its context recorder and the compiled
    # regions reach the C++ allocator through it: Note [PyTorch's own contexts]).
    native = None
    # PyTorch's own `_cuda_memorySnapshot` (the C++ allocator's snapshot, its contexts
    # symbolized).
    native_snapshot = None
    # Whether the program was told that its snapshots come from the pools (no trace).
    said_no_trace = False


_ENABLED = (None, "state", "all")
_CONTEXT = (None, "state", "alloc", "all")
_STACKS = ("python", "all")


#: The actions `skip_actions` may name (the entries' `action` in `device_traces`).
_ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
            "segment_map", "segment_unmap", "snapshot", "oom", "user_defined")


def record_history(enabled="all", context="all", stacks="all", max_entries=sys.maxsize, *rest, **kw):
    # PyTorch passes (clear_history, compile_context, global_record_annotations, skip_actions)
    # after max_entries.
    skip = list(rest[3] if len(rest) > 3 else kw.get("skip_actions") or [])
    for action in skip:
        if action not in _ACTIONS:
            raise RuntimeError(
                f"Invalid action {action!r} in skip_actions; expected some of: {', '.join(_ACTIONS)}"
            )
    # The values PyTorch accepts.
    for value, valid, what in (
        (enabled, _ENABLED, "enabled"),
        (context, _CONTEXT, "context"),
        (stacks, _STACKS, "stacks"),
    ):
        if value not in valid:
            choices = ", ".join(repr(v) for v in valid)
            raise RuntimeError(f"Invalid option {what}={value!r}; expected one of: {choices}")
    api = c_functions(history="cachealloc_memory_history")
    if api is None:
        return
    import ctypes

    api.history.restype = ctypes.c_uint64
    api.history.argtypes = [ctypes.c_int, ctypes.c_int]
    # Free stacks are captured only while the program keeps them (events with context="all"),
    # C++ frames while it asks for them (stacks="all", PyTorch's default, which costs natively
    # too).
    t = api.history(
        1 if enabled == "all" and context == "all" else 0,
        1 if enabled is not None and context is not None and stacks == "all" else 0,
    )
    import cachealloc_torch_allocator

    cachealloc_torch_allocator.tell_history(
        History.native, enabled, (enabled, context, stacks, max_entries, *rest), kw
    )
    if enabled is None:
        context = None
    History.changes.append((t, enabled or "none", context or "none", stacks, "+".join(skip)))
    del History.changes[: -History.keep]
    if enabled is not None and isinstance(max_entries, int) and max_entries > 0:
        History.max_entries = max_entries
    _follow_from_now()


def _follow_from_now():
    """Have the snapshot server follow the trace with the settings just changed, so that the
    program's first snapshot, perhaps hours later, finds the walk done (a change the server
    hears of only at the next snapshot would come after records it had walked, and start its
    walk over). Quiet where there is no trace or command: the snapshot will say so."""
    if not Server.enabled:
        return
    trace = Server.following()
    if trace is None:  # no server yet in this process: the trace's path, by a flush
        api = c_functions(flush="cachealloc_trace_flush")
        if api is None:
            return
        import ctypes

        api.flush.restype = ctypes.c_size_t
        api.flush.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
        trace = text(api.flush)
    tool = cachealloc_binary()
    if trace and tool is not None:
        try:
            Server.ask(tool, trace, _request(include_traces=True))
        except RuntimeError as e:
            warn(f"the snapshot server does not follow the trace: {e}")


def _request(include_traces, output=None):
    """A request to the snapshot server (the tool's `snapshot::serve`) for the program's
    history settings so far: a snapshot to `output`, or, without one, following the trace."""
    events = min(History.max_entries, 10_000_000) if include_traces else 0
    history = ",".join(":".join(str(part) for part in change) for change in History.changes)
    request = {"events": events, "history": history or None}
    if output is not None:
        request["output"] = output
    return request


class Metadata:
    """What `_set_memory_metadata` set, over time: each text with the trace's time at the call,
    which `cachealloc snapshot --metadata` puts on the events recorded from then on (as
    `user_metadata`, as PyTorch's native allocator does)."""

    changes = []
    current = ""
    keep = 4096


def set_metadata(metadata):
    import ctypes

    api = c_functions(now="cachealloc_trace_time")
    if api is None:
        return
    api.now.restype = ctypes.c_uint64
    api.now.argtypes = []
    Metadata.current = str(metadata)
    Metadata.changes.append((api.now(), Metadata.current))
    del Metadata.changes[: -Metadata.keep]


def get_metadata():
    return Metadata.current


def record_history_legacy(enabled, record_context=True, trace_alloc_max_entries=1,
                           trace_alloc_record_context=False, record_context_cpp=False, *rest, **kw):
    """`_record_memory_history(True, …)`, PyTorch's older form, in the newer one's terms."""
    if not enabled:
        return record_history(None, None, "python")
    context = "alloc" if trace_alloc_record_context else ("state" if record_context else None)
    return record_history(
        "all" if trace_alloc_max_entries > 1 else "state",
        context,
        "all" if record_context_cpp else "python",
        max(trace_alloc_max_entries, 1),
    )


class NoTrace(RuntimeError):
    """There is no trace to build a snapshot from, or no `cachealloc` command to build it."""


class Server:
    """`cachealloc snapshot TRACE --serve`, kept beside the program from its first snapshot, or
    from its first `_record_memory_history` call, on: it follows the trace as the program
    writes it, so a snapshot walks only the records written since the server last looked (the
    tool's `snapshot::serve`), where a command run for each would walk the whole trace. A
    forked child starts its own. A server that dies or garbles its answer is started again,
    once; failing twice, the command serves this snapshot and every later one. It ends when
    the program does (its input closes)."""

    enabled = True
    process = None
    pid = None
    lock = None
    trace = None

    @classmethod
    def following(cls):
        """The trace this process's server follows, if it has one running."""
        if cls.pid == os.getpid() and cls.process is not None and cls.process.poll() is None:
            return cls.trace
        return None

    @classmethod
    def ask(cls, tool, trace, request):
        """Have the server write the snapshot `request` asks for; False if no server could."""
        import json
        import subprocess
        import threading

        if cls.lock is None or cls.pid != os.getpid():
            cls.lock, cls.process, cls.pid = threading.Lock(), None, os.getpid()
        with cls.lock:
            for _ in range(2):
                if cls.process is None:
                    cls.trace = trace
                    try:
                        cls.process = subprocess.Popen(
                            [tool, "snapshot", trace, "--serve"],
                            stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL,
                            text=True,
                        )
                    except OSError:
                        break
                try:
                    cls.process.stdin.write(json.dumps(request) + "\n")
                    cls.process.stdin.flush()
                    answer = cls.process.stdout.readline().strip()
                except (OSError, ValueError):
                    answer = ""
                if answer == "ok":
                    return True
                if answer.startswith("error: "):
                    raise RuntimeError(f"cachealloc snapshot failed: {answer[7:]}")
                cls.process.kill()
                cls.process.wait()
                cls.process = None
            cls.enabled = False
            return False


def snapshot_from_trace(flush, include_traces=True):
    """PyTorch's snapshot built by `cachealloc snapshot` from the trace, flushed first (its
    `device_traces` empty unless `include_traces`), by the program's snapshot server (`Server`)
    or else the command; raises `NoTrace` when that cannot be (the caller then reads the pools:
    `cachealloc_memory`)."""
    import pickle
    import subprocess
    import tempfile

    trace = text(flush)
    if not trace:
        raise NoTrace("CACHEALLOC_CONF has trace:off, or the trace could not be written")
    tool = cachealloc_binary()
    if tool is None:
        raise NoTrace("the `cachealloc` command was not found beside the preloaded library")
    with tempfile.TemporaryDirectory() as scratch:
        out = os.path.join(scratch, "snapshot.pickle")
        texts = []
        import json
        import cachealloc_torch_allocator

        for flag, changes in (
            ("--metadata", Metadata.changes),
            ("--compile-context", cachealloc_torch_allocator.compile_regions()),
        ):
            if changes:
                path = os.path.join(scratch, flag.strip("-") + ".json")
                with open(path, "w") as f:
                    json.dump(changes, f)
                texts += [flag, path]
        request = _request(include_traces, out)
        for flag, path in zip(texts[::2], texts[1::2]):  # --metadata, --compile-context
            request[flag.strip("-").replace("-", "_")] = path
        if not (Server.enabled and Server.ask(tool, trace, request)):
            history = request["history"]
            done = subprocess.run(
                [tool, "snapshot", trace, "--events", str(request["events"]), "-o", out]
                + (["--history", history] if history else [])
                + texts,
                capture_output=True,
                text=True,
            )
            if done.returncode != 0:
                raise RuntimeError(f"cachealloc snapshot failed: {done.stderr.strip()}")
        with open(out, "rb") as f:
            snapshot = pickle.load(f)
    return snapshot


def with_library_facts(snapshot):
    """`snapshot` with what the library knows of each segment and the trace does not say: its
    pool (`segment_pool_id`: a graph pool's or a MemPool's id) and whether it is expandable (the
    program may switch expandable segments at run time)."""
    import ctypes
    import json

    api = c_functions(segments="cachealloc_segments_json")
    if api is None:
        return snapshot
    api.segments.restype = ctypes.c_size_t
    api.segments.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
    spans = {}
    for device in {s.get("device", 0) for s in snapshot.get("segments", [])}:
        spans[device] = json.loads(text(api.segments, int(device)) or "[]")
    for segment in snapshot.get("segments", []):
        address = segment.get("address", 0)
        for start, size, first, second, expandable in spans.get(segment.get("device", 0), []):
            if start <= address < start + size:
                segment["segment_pool_id"] = (first, second)
                segment["is_expandable"] = bool(expandable)
                break
    return snapshot


def with_pytorch_frames(snapshot):
    """`snapshot` with PyTorch's own frames where the C++ allocator gathered them (Note
    [PyTorch's own contexts]: TorchScript's frames, anomaly mode's `forward_frames`): each
    allocated block and each history entry that has frames in `snapshot` (the program's
    settings keep them) takes PyTorch's frames and forward traceback, where PyTorch's snapshot
    has them for the same block (its address) or entry (the same action on the same address,
    the last ones paired first)."""
    import cachealloc_torch_allocator

    native = History.native_snapshot
    if native is None or cachealloc_torch_allocator.history_contexts() == 0:
        return snapshot
    try:
        theirs = native(None)
    except Exception as e:  # the trace's frames stay
        warn(f"PyTorch's own frames are not in the snapshot: {e}")
        return snapshot

    def gathered(item):
        return item.get("frames") or item.get("forward_frames")

    def take(ours, their):
        # A backward op's event on autograd's thread has no Python frames of PyTorch's: the
        # trace's (the backward's caller) stay beside its forward traceback.
        if their.get("frames"):
            ours["frames"] = their["frames"]
        if their.get("forward_frames"):
            ours["forward_frames"] = their["forward_frames"]

    blocks = {
        b.get("address"): b
        for segment in theirs.get("segments", [])
        for b in segment.get("blocks", [])
        if b.get("state") == "active_allocated" and gathered(b)
    }
    for segment in snapshot.get("segments", []):
        for b in segment.get("blocks", []):
            their = blocks.get(b.get("address"))
            if their is not None and b.get("state") == "active_allocated" and b.get("frames"):
                take(b, their)
    for ours, their in zip(snapshot.get("device_traces", []), theirs.get("device_traces", [])):
        waiting = {}
        for entry in their:
            if gathered(entry):
                waiting.setdefault((entry.get("action"), entry.get("addr")), []).append(entry)
        for entry in reversed(ours):
            queue = waiting.get((entry.get("action"), entry.get("addr")))
            if queue and entry.get("frames"):
                take(entry, queue.pop())
    return snapshot
