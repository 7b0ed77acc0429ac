"""PyTorch's memory-history settings as `_snapshot()` shows them under the shim, part of
python_integration.py (which calls `check_history_settings` with its stand-in torch and the
runtime's library): what PyTorch's own tests (test_memory_plots_*, the snapshot tests) check of
the settings, of `skip_actions` and of `_set_memory_metadata`; and, with `trace:off`, the
snapshot read from the library's pools instead (`check_pool_snapshot`)."""
import ctypes
import sys


def fail(why):
    print(f"FAIL: {why}")
    sys.exit(1)


def check_history_settings(torch, glob):
    """What `_record_memory_history`'s settings keep in `_snapshot()`, as PyTorch's own tests
    (test_memory_plots_*) check them: no stacks with context=None, free stacks only with
    context="all", the history cleared by enabled=None, no events with enabled="state"."""
    import json

    record = torch._C._cuda_record_memory_history

    def malloc():
        p = ctypes.c_void_p()
        if glob.cudaMalloc(ctypes.byref(p), 4096) != 0:
            fail("cudaMalloc failed")
        return p

    def should_capture1():
        return malloc()

    def should_not_capture():
        return malloc()

    def should_capture2():
        return malloc()

    def thefree(p):
        glob.cudaFree(p)

    def snapshot_text(part):
        return json.dumps(torch._C._cuda_memorySnapshot(None)[part])

    # PyTorch's test_memory_plots_free_stack, with its default stacks="all".
    for context in ("alloc", "all", "state"):
        record("all", context, "all", 1000)

        def thealloc_torch():
            return malloc()

        def thefree_torch(p):
            glob.cudaFree(p)

        thefree_torch(thealloc_torch())
        text_all = json.dumps(torch._C._cuda_memorySnapshot(None))
        if ("thefree_torch" in text_all) != (context == "all") or (
            "thealloc_torch" in text_all
        ) != (context != "state"):
            fail(f"test_memory_plots_free_stack with context={context}: {text_all}")
        record(None, None, "all", 1000)

    record("all", "all", "python", 1000)
    kept = should_capture1()
    record("all", None, "python", 1000)
    hidden = should_not_capture()
    record("all", "all", "python", 1000)
    also_kept = should_capture2()
    thefree(hidden)
    traces = snapshot_text("device_traces")
    for name, shown in (("should_capture1", True), ("should_not_capture", False),
                        ("should_capture2", True), ("thefree", True)):
        if (name in traces) != shown:
            fail(f"with the settings of PyTorch's test_memory_plots_history_context, "
                 f"{name} {'is missing from' if shown else 'is in'} the history")

    def thealloc():
        return malloc()

    def thefree_alloc_context(p):
        glob.cudaFree(p)

    record(None, None, "python", 1000)
    record("all", "alloc", "python", 1000)
    thefree_alloc_context(thealloc())
    traces = snapshot_text("device_traces")
    if "should_capture1" in traces or "thealloc" not in traces or "thefree_alloc_context" in traces:
        fail(f"enabled=None did not clear the history, or context='alloc' kept a free stack: {traces}")

    def segment_without_context():
        p = ctypes.c_void_p()
        if glob.cudaMalloc(ctypes.byref(p), 320 << 20) != 0:
            fail("cudaMalloc of a new segment failed")
        return p

    # PyTorch's test_memory_snapshot_skip_actions: the skipped actions are left out of the
    # events recorded while the setting is in force, the others stay.
    record(None, None, "python", 1000)
    record("all", "all", "python", 1000, False, False, False, ["free_requested", "free_completed"])
    glob.cudaFree(malloc())
    actions = {e["action"] for t in torch._C._cuda_memorySnapshot(None)["device_traces"] for e in t}
    if "alloc" not in actions or actions & {"free_requested", "free_completed"}:
        fail(f"skip_actions=['free_requested', 'free_completed'] left the actions {actions}")
    try:
        record("all", "all", "python", 1000, False, False, False, ["frees"])
        fail("an unknown action in skip_actions was accepted")
    except RuntimeError as e:
        if "free_requested" not in str(e):
            fail(f"the refusal of an unknown action does not name the valid ones: {e}")

    # PyTorch's test_memory_plots_metadata: the events recorded while the program's memory
    # metadata is set carry it as user_metadata; those after it is cleared carry "".
    record(None, None, "python", 1000)
    torch._C._cuda_setMemoryMetadata("metadata test")
    record("all", "alloc", "python", 1000)
    glob.cudaFree(malloc())
    torch._C._cuda_setMemoryMetadata("")
    if torch._C._cuda_getMemoryMetadata() != "":
        fail("_cuda_getMemoryMetadata does not answer what was set last")
    events = [e for t in torch._C._cuda_memorySnapshot(None)["device_traces"] for e in t]
    if not events or any(e.get("user_metadata") != "metadata test" for e in events):
        fail(f"events recorded under metadata lack it: {[e.get('user_metadata') for e in events]}")
    glob.cudaFree(malloc())
    events = [e for t in torch._C._cuda_memorySnapshot(None)["device_traces"] for e in t]
    if events[-1].get("user_metadata") != "":
        fail(f"an event after the metadata was cleared carries {events[-1].get('user_metadata')!r}")

    # PyTorch's test_memory_compile_regions: each entry names the compiled region it was
    # recorded in ("N/A" outside any). The C++ allocator for PyTorch keeps the regions
    # PyTorch tells it; here (no C++ allocator) its list is stood in, with the trace's times.
    import cachealloc_torch_allocator

    now = glob.cachealloc_trace_time
    now.restype = ctypes.c_uint64
    record(None, None, "python", 1000)
    record("all", "all", "python", 1000, False, True)  # compile_context=True
    outside = malloc()
    regions = [(now(), "Torch-Compiled Region: 0/0")]
    inside = malloc()
    regions.append((now(), "N/A"))
    after_region = malloc()
    told = cachealloc_torch_allocator.compile_regions
    cachealloc_torch_allocator.compile_regions = lambda: regions
    try:
        entries = [e for t in torch._C._cuda_memorySnapshot(None)["device_traces"] for e in t]
    finally:
        cachealloc_torch_allocator.compile_regions = told
    named = {e["addr"]: e.get("compile_context") for e in entries if e["action"] == "alloc"}
    expected = {outside.value: "N/A", inside.value: "Torch-Compiled Region: 0/0", after_region.value: "N/A"}
    if any(named.get(addr) != region for addr, region in expected.items()):
        fail(f"compile_context of the allocations: {named}, expected {expected}")
    if any("compile_context" not in e for e in entries):
        fail("an entry lacks compile_context (PyTorch writes it on every entry)")
    for p in (outside, inside, after_region):
        glob.cudaFree(p)
    # With the C++ allocator installed, PyTorch's own _cuda_record_memory_history is called
    # with the program's arguments (its context recorder and compiled regions reach the
    # allocator: Note [PyTorch's own contexts]), and at enabled=None to take them back — once,
    # not for a history that was never passed on.
    calls = []
    installed = cachealloc_torch_allocator._installed
    cachealloc_torch_allocator._installed = True
    try:
        tell = cachealloc_torch_allocator.tell_history

        def native(*args, **kw):
            calls.append(args)

        tell(native, None, (None, None, "python", 10), {})
        tell(native, "all", ("all", "all", "python", 10, False, False), {})
        tell(native, "state", ("state", "all", "python", 10, False, True), {})
        tell(native, None, (None, None, "python", 10), {})
        tell(native, None, (None, None, "python", 10), {})
    finally:
        cachealloc_torch_allocator._installed = installed
    expected = [("all", "all", "python", 10, False, False), ("state", "all", "python", 10, False, True),
                (None, None, "python", 10)]
    if calls != expected:
        fail(f"PyTorch's own _cuda_record_memory_history was called {calls}, expected {expected}")

    check_pytorch_frames(torch, glob, record, malloc)

    # PyTorch's test_memory_plots: a free block shows the size requested of the block freed
    # last inside it, as PyTorch's merged free block keeps the freed one's.
    record(None, None, "python", 1000)
    record("all", "all", "python", 1000)
    odd = ctypes.c_void_p()
    if glob.cudaMalloc(ctypes.byref(odd), 12345) != 0:
        fail("cudaMalloc of 12345 bytes failed")
    glob.cudaFree(odd)
    free_blocks = [b for seg in torch._C._cuda_memorySnapshot(None)["segments"] for b in seg["blocks"]
                   if b["state"] == "inactive" and b["address"] <= odd.value < b["address"] + b["size"]]
    if [b["requested_size"] for b in free_blocks] != [12345]:
        fail(f"the free block holding a freed 12345-byte request shows {free_blocks}")

    # PyTorch's test_memory_plots with context=None: no stack anywhere, segments' included.
    record(None, None, "python", 1000)
    record("all", None, "python", 1000)
    big = segment_without_context()
    if "segment_without_context" in json.dumps(torch._C._cuda_memorySnapshot(None)):
        fail("context=None showed the stack of a segment allocated meanwhile")
    glob.cudaFree(big)

    def state_alloc():
        return malloc()

    record("state", "state", "python", 1000)
    live = state_alloc()
    snapshot = torch._C._cuda_memorySnapshot(None)
    if any(snapshot["device_traces"]):
        fail("enabled='state' kept events")
    blocks = json.dumps(snapshot["segments"])
    if "state_alloc" not in blocks or "should_capture1" not in blocks:
        fail("context='state' lost the stacks of live blocks")

    # PyTorch's test_memory_plots_free_stack with context="state": a segment none of whose
    # blocks is live shows no stack (PyTorch's segments do not keep it).
    def segment_then_free():
        p = ctypes.c_void_p()
        # Larger than any segment cached so far: a new one.
        if glob.cudaMalloc(ctypes.byref(p), 410 << 20) != 0:
            fail("cudaMalloc of a new segment failed")
        glob.cudaFree(p)

    segment_then_free()
    if "segment_then_free" in json.dumps(torch._C._cuda_memorySnapshot(None)):
        fail("a cached segment with no live block shows the stack that allocated it")

    def with_cpp_frames():
        return malloc()

    def python_frames_only():
        return malloc()

    def native_frames(name):
        entries = [e for trace in torch._C._cuda_memorySnapshot(None)["device_traces"]
                   for e in trace if e["action"] == "alloc"
                   and any(f["name"].endswith(name) for f in e["frames"])]
        if len(entries) != 1:
            fail(f"no single alloc entry of {name}: {entries}")
        return [f for f in entries[0]["frames"] if not f["filename"].endswith(".py")]

    record("all", "alloc", "all", 1000)
    cpp = with_cpp_frames()
    if not native_frames("with_cpp_frames"):
        fail("stacks='all' recorded no native frames")
    record("all", "alloc", "python", 1000)
    python_only = python_frames_only()
    if native_frames("python_frames_only"):
        fail("stacks='python' showed native frames")
    glob.cudaFree(cpp)
    glob.cudaFree(python_only)

    def empty_cache():
        glob.cachealloc_empty_cache()

    record("all", "all", "python", 1000)
    for p in (kept, also_kept, live):
        glob.cudaFree(p)
    empty_cache()
    frees = [e for trace in torch._C._cuda_memorySnapshot(None)["device_traces"] for e in trace
             if e["action"] == "segment_free"]
    if not frees or not any(f["name"].endswith("empty_cache") for e in frees for f in e["frames"]):
        fail(f"empty_cache's segment frees have not its stack with context='all': {frees}")
    record(None, None, "python", 1000)


def check_pytorch_frames(torch, glob, record, malloc):
    """Where the C++ allocator for PyTorch holds PyTorch's own contexts (TorchScript, anomaly
    mode: Note [PyTorch's own contexts]), `_snapshot()` takes PyTorch's frames and
    `forward_frames` for the same block and the same events (action and address, the last
    ones paired first), and keeps the trace's frames where PyTorch has none or the settings
    keep none. PyTorch's own snapshot and the allocator's count are stood in here (no C++
    allocator over fakecuda)."""
    import cachealloc_history
    import cachealloc_torch_allocator

    record(None, None, "python", 1000)
    record("all", "all", "python", 1000)
    live, freed, other = malloc(), malloc(), malloc()
    glob.cudaFree(freed)
    script = [{"name": "foo", "filename": "<script>", "line": 1}]
    forward = ["  File \"model.py\", line 7, in forward"]
    theirs = {
        "segments": [{"blocks": [
            {"address": live.value, "state": "active_allocated", "frames": script},
            {"address": other.value, "state": "active_allocated", "frames": []},
        ]}],
        "device_traces": [[
            {"action": "alloc", "addr": freed.value, "frames": script},
            {"action": "alloc", "addr": live.value, "frames": [], "forward_frames": forward},
            {"action": "free_requested", "addr": freed.value, "frames": script},
        ]],
    }
    native, count = cachealloc_history.History.native_snapshot, cachealloc_torch_allocator.history_contexts
    cachealloc_history.History.native_snapshot = lambda pool=None: theirs
    cachealloc_torch_allocator.history_contexts = lambda: 3
    try:
        ours = torch._C._cuda_memorySnapshot(None)
    finally:
        cachealloc_history.History.native_snapshot = native
        cachealloc_torch_allocator.history_contexts = count
    blocks = {b["address"]: b for seg in ours["segments"] for b in seg["blocks"]}
    if blocks[live.value]["frames"] != script:
        fail(f"the live block did not take PyTorch's frames: {blocks[live.value]['frames']}")
    if not blocks[other.value]["frames"] or blocks[other.value]["frames"] == script:
        fail("a block PyTorch has no frames for lost the trace's")
    events = {(e["action"], e["addr"]): e for t in ours["device_traces"] for e in t}
    alloc_live = events[("alloc", live.value)]
    if alloc_live.get("forward_frames") != forward or not alloc_live["frames"] or alloc_live["frames"] == script:
        fail(f"a backward op's event: forward_frames {alloc_live.get('forward_frames')}, frames "
             f"{alloc_live['frames']} (the trace's frames stay beside PyTorch's forward traceback)")
    for key in (("alloc", freed.value), ("free_requested", freed.value)):
        if events[key]["frames"] != script:
            fail(f"the event {key} did not take PyTorch's frames")
    completed = events.get(("free_completed", freed.value))
    if completed is None or completed["frames"] == script:
        fail(f"an event PyTorch did not record took frames, or the free did not complete: {completed}")
    if "forward_frames" in events[("alloc", other.value)]:
        fail("an event PyTorch did not record took forward_frames")
    glob.cudaFree(live)
    glob.cudaFree(other)


def check_pool_snapshot(torch, glob, live):
    """With no trace (`trace:off`) `memory_snapshot()` comes from the library's pools: PyTorch's
    structure, the live block at `live` allocated, a freed one inactive, no history; the
    segments tile their blocks and add up to the reserved bytes (an expandable segment shows
    its mapped runs only, as PyTorch shows its own)."""

    def snapshot():
        return torch._C._cuda_memorySnapshot(None)

    def state_of(address):
        return [b["state"] for seg in snapshot()["segments"] for b in seg["blocks"] if b["address"] == address]

    freed = ctypes.c_void_p()
    if glob.cudaMalloc(ctypes.byref(freed), 8192) != 0:
        fail("cudaMalloc failed")
    if state_of(freed.value) != ["active_allocated"]:
        fail(f"a live block shows as {state_of(freed.value)}")
    glob.cudaFree(freed)
    if state_of(freed.value) != ["inactive"]:
        fail(f"a freed block shows as {state_of(freed.value)}")
    # A new segment, expandable (empty_cache first, and larger than the free rest of the live
    # block's segment: no cached block may serve it).
    default_pool = ctypes.c_void_p()
    glob.cudaDeviceGetDefaultMemPool(ctypes.byref(default_pool), 0)
    glob.cudaMemPoolTrimTo(default_pool, ctypes.c_size_t(0))
    mapped = ctypes.c_void_p()
    torch._C._cuda_cudaCachingAllocator_set_allocator_settings("expandable_segments:True")
    if glob.cudaMalloc(ctypes.byref(mapped), 24 << 20) != 0:
        fail("cudaMalloc of an expandable block failed")
    torch._C._cuda_cudaCachingAllocator_set_allocator_settings("")
    taken = snapshot()
    if taken["device_traces"] != [[]]:
        fail(f"a snapshot without a trace has history: {taken['device_traces']}")
    segments = taken["segments"]
    for seg in segments:
        blocks = seg["blocks"]
        ends = [b["address"] + b["size"] for b in blocks]
        if [b["address"] for b in blocks] != [seg["address"]] + ends[:-1] or \
                ends[-1] != seg["address"] + seg["total_size"]:
            fail(f"a segment's blocks do not tile it: {seg}")
        allocated = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
        if seg["allocated_size"] != allocated or seg["frames"] or seg["device"] != 0:
            fail(f"a segment's facts: {seg}")
    live_blocks = [b for seg in segments for b in seg["blocks"] if b["address"] == live]
    if len(live_blocks) != 1 or live_blocks[0]["state"] != "active_allocated" or live_blocks[0]["size"] < 3 << 20:
        fail(f"the snapshot does not hold the live block at {live:#x}")
    holder = [seg for seg in segments if seg["address"] <= mapped.value < seg["address"] + seg["total_size"]]
    if len(holder) != 1 or not holder[0]["is_expandable"] or holder[0]["segment_pool_id"] != (0, 0):
        fail(f"the expandable block's segment: {holder}")
    # The library's own count of the device's memory (PyTorch's `memory_stats()` counts only
    # PyTorch's allocations).
    import json

    stats = ctypes.CDLL(None).cachealloc_stats_json
    stats.restype = ctypes.c_size_t
    stats.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    buf = ctypes.create_string_buffer(1 << 16)
    stats(buf, len(buf))
    reserved = json.loads(buf.value)["devices"]["0"]["reserved_bytes.all.current"]
    if sum(seg["total_size"] for seg in segments) != reserved:
        fail(f"the segments add up to {sum(seg['total_size'] for seg in segments)} bytes, "
             f"{reserved} are reserved (unmapped address space shown?)")
    glob.cudaFree(mapped)
