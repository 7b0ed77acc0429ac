/*
 * fakecuda — a CPU stand-in for the CUDA 13 driver, built as libcuda.so.1. It holds all state and
 * exports a driver API surface with CUDA's real names, signatures and values (include/cuda.h);
 * cudart.c (libcudart.so.13 and libcudart_static.a) is a runtime over it that, like the real
 * one, reaches it only through dlopen + cuGetProcAddress_v2.
 *
 * The structure a driver-boundary interposer meets, as measured on the real CUDA 13 stack:
 *  - Versioned exports: the ABI symbols (cuMemAlloc_v2, cuMemFree_v2, cuStreamDestroy_v2, ...)
 *    next to their old v1 symbols (cuMemAlloc with a 32-bit out-pointer, which here answers
 *    CUDA_ERROR_NOT_SUPPORTED and writes nothing, so that a wrong-signature substitution shows),
 *    and per-thread default stream variants (_ptsz/_ptds: a NULL stream means the per-thread
 *    default stream, approximated as the legacy stream, as CU_STREAM_PER_THREAD is).
 *  - The resolver: cuGetProcAddress_v2 (and _v2_ptsz, and the v1 cuGetProcAddress without the
 *    status argument) looks a base name up in a versioned table of (name, minimum CUDA version,
 *    per-thread or not, function) and returns the newest variant the requested version allows:
 *    "cuMemAlloc" at 3020 or later gives cuMemAlloc_v2, below it the v1 cuMemAlloc; with
 *    CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM a name that has a _ptsz/_ptds variant gives
 *    it. An unknown name is CUDA_ERROR_NOT_FOUND with CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND, a
 *    version below every variant's CUDA_ERROR_NOT_FOUND with ..._VERSION_NOT_SUFFICIENT; both
 *    set *pfn to NULL. Every pointer returned is the exported symbol of that name.
 *  - Nothing in here calls an exported cu* name: exports are thin wrappers over static
 *    functions, and the library is linked with -Bsymbolic, so an interposer exporting the same
 *    names never sees the driver's internal calls (nor the resolver's table entries).
 *
 * What it models, because cachealloc's tests depend on it:
 *  - cuInit first (CUDA_ERROR_NOT_INITIALIZED before). Contexts: one primary context per device
 *    (cuDevicePrimaryCtxRetain/Release/Reset/GetState; the handle stays the same across a
 *    reset) and non-primary ones (cuCtxCreate*, cuCtxDestroy*), each thread with one current
 *    context (cuCtxSetCurrent; it also sets the thread's device). Calls that need a context fail
 *    with CUDA_ERROR_INVALID_CONTEXT while none is current, and so does the NULL stream (which is
 *    the current context's device's legacy stream); an explicit stream handle needs none.
 *  - Device memory is host memory, counted against a capacity (FAKECUDA_CAPACITY_MB, default
 *    1024) per device; FAKECUDA_DEVICES devices (default 1). Allocations are 512-byte aligned,
 *    belong to the context current at allocation, and are released by its reset or destruction.
 *    cuMemGetAddressRange_v2 and cuPointerGetAttribute find the allocation containing any
 *    pointer inside it; each allocation has its own buffer id. Copies and memsets check that the
 *    device range lies inside one live allocation, or inside VMM mappings with access (below)
 *    (CUDA_ERROR_INVALID_VALUE otherwise).
 *  - Streams run *asynchronously*: every stream (and each device's legacy default stream) has a
 *    worker thread that executes its queued operations in order. Legacy semantics: an operation
 *    on the legacy stream waits for all earlier work of the device's blocking streams, and an
 *    operation on a blocking stream waits for all earlier legacy-stream work; non-blocking
 *    streams are ordered with nothing. So a caching allocator that reuses memory too early
 *    really sees the old work overwrite the new data.
 *  - cuMemFree_v2 waits for the whole device first (as the real one does), then releases;
 *    cuMemFreeAsync releases when the stream reaches it.
 *  - Events complete when their recording operation executes; cuStreamWaitEvent makes a stream
 *    wait on the device, not the host, for the record it saw: recording the event again before
 *    that record ran does not change what the wait waits for (an earlier fakecuda made it wait
 *    for the new record, which deadlocked a shim that recycles its events).
 *  - Stream capture (CUDA graphs): work enqueued on a capturing stream is recorded into the
 *    graph, not run; a graph launch enqueues copies of it. cuMemAllocAsync on a capturing
 *    stream gives graph-owned memory (kept until the graph is destroyed), a cuMemFreeAsync of it
 *    there does nothing. While a capture in global mode is under way (or one in thread-local
 *    mode on the calling thread), a "potentially unsafe" call (cuMemAlloc, cuMemFree, event
 *    query or synchronize, stream query or synchronize, context synchronize) from a thread not
 *    in relaxed mode fails with 900 and invalidates the capture; work on the legacy stream while
 *    a blocking stream captures fails with 906 and invalidates it too. cuStreamEndCapture then
 *    fails with 901. A stream joins a capture by waiting on an event recorded in it (its work
 *    is captured into the same graph, in enqueue order: a replay runs the graph's operations
 *    one after another); querying or synchronizing a capturing stream fails with 900 and
 *    invalidates its capture, whatever the mode. The capture ends on the stream it began on
 *    (cuStreamEndCapture on a joined stream fails with 903), which ends the joined streams'
 *    capture too; unlike CUDA, a joined stream need not have been joined back first.
 *    cuStreamGetCaptureInfo (_v2, _v3) answers the status, the capture's id and the stream's
 *    dependency nodes: each captured operation but an event record or wait is a node that
 *    depends on the stream's nodes before it, an event recorded in the capture keeps the
 *    recording stream's nodes, and a wait on it adds them to the waiting stream's (how a stream
 *    joins another back); cuGraphNodeGetDependencies (and _v2) answers a node's.
 *  - One default memory pool per device, whose attributes report the device's used memory.
 *  - Virtual memory management (CUDA 10.2's VMM API, which expandable segments and XLA use),
 *    with the semantics and error codes of CUDA 13.0 (driver 580) as measured on an H100
 *    (tests/programs/vmm.c passes on both). The calls need cuInit, not a current context.
 *    cuDeviceGetAttribute answers CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED (102)
 *    with 1, or 0 under FAKECUDA_NO_VMM=1 (a device without it), and 103 (below); no other
 *    attribute.
 *    FAKECUDA_SLOW_US makes the calls that make or unmake memory as slow as a GPU's (below).
 *    cuMemGetAllocationGranularity answers 2 MiB (minimum and recommended), or
 *    FAKECUDA_VMM_GRANULARITY_KB (a power of two of pages), for pinned memory of one of our
 *    devices; else CUDA_ERROR_INVALID_VALUE (stricter than CUDA, which answers whatever the
 *    type, location or device); Windows or fabric handles and compression:
 *    CUDA_ERROR_NOT_SUPPORTED. Sizes and addresses must be multiples of it.
 *    cuMemAddressReserve reserves a PROT_NONE, MAP_NORESERVE range (free of cost however large;
 *    aligned to the granularity or to a larger power-of-two alignment; the address is a hint);
 *    cuMemAddressFree takes a whole reservation back, and refuses while anything is mapped in
 *    it. cuMemCreate makes physical memory (an unknown device: CUDA_ERROR_INVALID_DEVICE), a
 *    memfd filled with garbage, counted against the device's capacity like cuMemAlloc_v2
 *    (cuMemGetInfo, CUDA_ERROR_OUT_OF_MEMORY, FAKECUDA_FAULT=oom_every:N); it returns to the
 *    capacity once its handles are all released (cuMemRelease; cuMemRetainAllocationHandle
 *    adds one) and no mapping of it remains; a handle released while mapped still maps it.
 *    cuMemMap maps all of the memory (an offset, or a size other than the memory's:
 *    CUDA_ERROR_NOT_SUPPORTED), granule-aligned, inside one reservation (CUDA lets a mapping
 *    run past a reservation's end, into its own slack: fakecuda refuses), over nothing mapped,
 *    with no access: touching it faults, as on a GPU, and copies and memsets refuse it, until
 *    cuMemSetAccess grants access (READ: readable, READWRITE: writable too) over adjacent whole
 *    mappings, no part of one and no gap. Host touches need some device's access (the pages'
 *    protection is the devices' together); a copy or memset needs the access of the device
 *    whose stream runs it, as a GPU's copy engine does (CUDA_ERROR_INVALID_VALUE otherwise).
 *    cuMemUnmap unmaps the mappings inside a range of one reservation, which must cut none
 *    (CUDA cannot unmap part of a mapping); unmapped stretches in it are fine, so a range with
 *    nothing mapped succeeds; an unmapped range is reserved and PROT_NONE again. Like CUDA's,
 *    cuMemUnmap and cuMemRelease do not wait for queued work on the memory: such work then
 *    faults (SIGSEGV). Copies and memsets accept device ranges that run across adjacent
 *    mappings; cuMemGetAddressRange_v2
 *    and cuPointerGetAttribute answer a mapping's range (no context: NULL;
 *    CU_POINTER_ATTRIBUTE_MAPPED: 1; a buffer id per mapping), and an unmapped address of a
 *    reservation is CUDA_ERROR_NOT_FOUND for cuMemGetAddressRange_v2. VMM memory belongs to no
 *    context (a context reset leaves it alone). cuMemGetAccess and
 *    cuMemGetAllocationPropertiesFromHandle answer. Shareable handles, POSIX file descriptors
 *    only (IPC of VMM memory): cuDeviceGetAttribute answers
 *    CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED (103) with 1;
 *    cuMemExportToShareableHandle of memory made asking for that handle type gives a new
 *    descriptor of its memfd (close-on-exec; other memory: CUDA_ERROR_INVALID_VALUE), and
 *    cuMemImportFromShareableHandle makes a new handle over the descriptor's memory (the
 *    descriptor stays the caller's), of the calling context's device (else device 0), not
 *    counted against any capacity (it is another process's). FAKECUDA_NO_POSIX_FD=1: a device
 *    without them (attribute 0, and cuMemCreate asking for them CUDA_ERROR_NOT_SUPPORTED);
 *    FAKECUDA_NO_POSIX_FD=create: the attribute says 1 yet cuMemCreate refuses them so.
 *  - A stream handle used after cuStreamDestroy aborts with a message: the real driver's
 *    undefined behaviour (a segmentation fault on an H100), made loud.
 *  - FAKECUDA_FAULT=oom_every:N: every Nth cuMemAlloc_v2 or cuMemCreate (one count) fails with
 *    out-of-memory.
 *  - FAKECUDA_FAULT=overlap: a broken allocator that hands a live allocation out twice (see
 *    overlap_locked), for the controls of tests that must catch one.
 *  - FAKECUDA_REPORT=1: at exit, one line on stderr, "fakecuda: <n> device allocations, <m>
 *    device frees, <r> refused by FAKECUDA_FAULT, <c> physical creates, <p> physical releases,
 *    <s> second mappings" (cuMemAlloc_v2 and cuMemAllocAsync* outside captures; cuMemFree_v2
 *    and cuMemFreeAsync* outside captures; cuMemAlloc_v2 and cuMemCreate refused by the fault;
 *    successful cuMemCreate and cuMemRelease calls; cuMemMap of memory already mapped
 *    elsewhere), so that a test can tell a pool served requests, or moved memory.
 *
 * One global mutex guards everything (speed is irrelevant here); workers wait on one condition
 * variable that is broadcast on every completion.
 */
#define _GNU_SOURCE
#define __CUDA_API_VERSION_INTERNAL
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cuda.h"

#define FC_EXPORT __attribute__((visibility("default")))
#define MAX_DEVICES 8
#define MAX_STREAMS 256
#define MAX_CAP_DEPS 16 /* dependency nodes kept per stream, event or node in a capture */
#define MAX_CONTEXTS 64
#define DRIVER_VERSION 13000

enum { MODE_GLOBAL = 0, MODE_THREAD_LOCAL = 1, MODE_RELAXED = 2 };

typedef struct fc_op fc_op;
typedef struct fc_stream fc_stream;
typedef struct fc_graph fc_graph;

typedef enum { OP_MEMSET, OP_MEMCPY, OP_HOSTFN, OP_EVENT, OP_FREE, OP_WAIT } op_kind;

#define CTX_MAGIC 0xc7c7
typedef struct fc_ctx {
    int magic;
    int device;
    int primary;
    int refcount;  /* primary: retains since the last reset */
    int active;    /* primary: retained since the last reset */
    int destroyed; /* non-primary: cuCtxDestroy ran (kept allocated, never reused) */
    unsigned flags;
    /* cuCtxEnablePeerAccess: this context may use the memory of these devices' contexts (a
     * record only: fakecuda's devices all see host memory; mapped memory still needs
     * cuMemSetAccess for each device, which cuMemGetAccess reports). */
    unsigned char peer[MAX_DEVICES];
} fc_ctx;

typedef struct fc_event {
    int magic;
    uint64_t generation; /* bumped by each record */
    /* The records enqueued and not yet run, by generation: a stream wait waits for the record
     * it saw (not a later one, as CUDA: an event may be recorded again before its last record
     * ran, and waits made before then must not wait for the new record). */
    uint64_t *pending;
    int npending, cap_pending;
    int captured;        /* last recorded inside a capture: may not be queried */
    fc_graph *capture;   /* that capture (a stream waiting on the event joins it) */
    int ncap_deps;       /* the recording stream's dependency nodes then */
    fc_op *cap_deps[MAX_CAP_DEPS];
} fc_event;

/* Under the lock: whether record `generation` of `e` is enqueued and has not run. */
static int record_pending(const fc_event *e, uint64_t generation) {
    for (int i = 0; i < e->npending; i++)
        if (e->pending[i] == generation) return 1;
    return 0;
}

static void add_pending(fc_event *e, uint64_t generation) {
    if (e->npending == e->cap_pending) {
        e->cap_pending = e->cap_pending ? 2 * e->cap_pending : 4;
        e->pending = realloc(e->pending, (size_t)e->cap_pending * sizeof *e->pending);
    }
    e->pending[e->npending++] = generation;
}

static void forget_pending(fc_event *e, uint64_t generation) {
    for (int i = 0; i < e->npending; i++)
        if (e->pending[i] == generation) { e->pending[i] = e->pending[--e->npending]; return; }
}

struct fc_op {
    op_kind kind;
    uint64_t seq;
    /* Streams this op must wait for, and how far: legacy-stream semantics. */
    int ndeps;
    fc_stream *dep_stream[MAX_STREAMS];
    uint64_t dep_target[MAX_STREAMS];
    void *ptr;
    const void *src;
    size_t n;
    int value;
    void (*fn)(void *);
    void *arg;
    fc_event *event;
    uint64_t event_generation;
    /* As a node of a captured graph: the nodes it depends on. */
    int nparents;
    fc_op *parents[MAX_CAP_DEPS];
    fc_op *next;
};

struct fc_stream {
    int magic;
    int device;
    int nonblocking;
    int legacy;
    int destroyed;
    uint64_t enqueued, completed;
    fc_op *head, *tail;
    pthread_t worker;
    fc_graph *capture;   /* the graph being captured, or NULL */
    int capture_mode;
    pthread_t capture_thread;
    int capture_invalid;
    int capture_joined;  /* joined the capture through an event (it began on another stream) */
    int ncap_deps;       /* the nodes its next captured operation depends on */
    fc_op *cap_deps[MAX_CAP_DEPS];
};

#define GRAPH_MAGIC 0x9a9a
#define MAX_GRAPH_OPS 256
struct fc_graph {
    int magic;
    uint64_t capture_id; /* the capture that made it (cuStreamGetCaptureInfo's id) */
    int nops;
    fc_op ops[MAX_GRAPH_OPS];
    int nowned;
    char *owned[64];     /* graph-owned memory (cuMemAllocAsync during the capture) */
};

typedef struct fc_alloc {
    char *ptr;
    size_t size;
    /* Allocations of IPC_MIN bytes or more are a shared mapping of a memfd (another process
     * opens it through /proc/PID/fd for cuIpcOpenMemHandle); -1 for the others. */
    int fd;
    /* Mapped from another process by cuIpcOpenMemHandle (not counted against the capacity). */
    int imported;
    int device;
    fc_ctx *ctx;
    unsigned long long buffer_id;
    struct fc_alloc *next;
} fc_alloc;

/* Virtual memory management. Physical memory (cuMemCreate) is a memfd, counted against its
 * device's capacity until it is both released and unmapped; a reservation
 * (cuMemAddressReserve) is a PROT_NONE anonymous mapping; a mapping (cuMemMap) maps a range of
 * the memfd over part of a reservation, PROT_NONE until cuMemSetAccess. */
typedef struct fc_physical {
    CUmemGenericAllocationHandle handle; /* never reused */
    int fd;
    size_t size;
    int device;
    CUmemAllocationHandleType handle_types;
    int handles;  /* cuMemCreate and cuMemRetainAllocationHandle, less cuMemRelease */
    int mappings; /* live cuMemMap ranges of it */
    int imported; /* cuMemImportFromShareableHandle: another process's memory, not counted here */
    struct fc_physical *next;
} fc_physical;

typedef struct fc_reservation {
    char *base;
    size_t size;
    struct fc_reservation *next;
} fc_reservation;

typedef struct fc_mapping {
    char *ptr;
    size_t size;
    fc_physical *phys;
    unsigned char access[MAX_DEVICES]; /* CUmemAccess_flags of each device */
    unsigned long long buffer_id;
    struct fc_mapping *next;
} fc_mapping;

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_cond = PTHREAD_COND_INITIALIZER;
static int g_initialized;
static int g_devices = 1;
static size_t g_capacity = (size_t)1024 << 20;
/* Allocations from this size up can be shared with other processes (cuIpcOpenMemHandle). */
#define IPC_MIN ((size_t)1 << 20)
static size_t g_used[MAX_DEVICES];
static fc_alloc *g_allocs;
static fc_physical *g_physical;
static fc_reservation *g_reservations;
static fc_mapping *g_mappings;
static CUmemGenericAllocationHandle g_next_handle = 0x100001;
static unsigned long long g_next_buffer_id = 1;
static fc_stream *g_streams[MAX_STREAMS];
static int g_nstreams;
static fc_stream *g_legacy[MAX_DEVICES];
static fc_ctx g_primary[MAX_DEVICES];
static fc_ctx *g_contexts[MAX_CONTEXTS];
static int g_ncontexts;
static unsigned long g_report_allocs, g_report_frees, g_report_refused;
static unsigned long g_report_creates, g_report_releases, g_report_second_mappings;
static __thread fc_ctx *t_ctx;
static __thread int t_capture_mode; /* MODE_GLOBAL by default, as in CUDA */

#define STREAM_MAGIC 0x5eea
#define EVENT_MAGIC 0xe7e7

static void *worker_main(void *arg);

static void lock(void) { pthread_mutex_lock(&g_lock); }
static void unlock(void) { pthread_mutex_unlock(&g_lock); }

static int initialized(void) { return __atomic_load_n(&g_initialized, __ATOMIC_ACQUIRE); }

/* Driver calls need cuInit first; most also need a current (live) context. */
#define NEED_INIT() do { if (!initialized()) return CUDA_ERROR_NOT_INITIALIZED; } while (0)
#define NEED_CONTEXT() do { \
        NEED_INIT(); \
        if (!t_ctx || t_ctx->destroyed) return CUDA_ERROR_INVALID_CONTEXT; \
    } while (0)

static void count(unsigned long *counter) { __atomic_fetch_add(counter, 1, __ATOMIC_RELAXED); }

__attribute__((destructor)) static void report_at_exit(void) {
    const char *report = getenv("FAKECUDA_REPORT");
    if (!report || strcmp(report, "1") != 0) return;
    fprintf(stderr,
            "fakecuda: %lu device allocations, %lu device frees, %lu refused by FAKECUDA_FAULT, "
            "%lu physical creates, %lu physical releases, %lu second mappings\n",
            __atomic_load_n(&g_report_allocs, __ATOMIC_RELAXED),
            __atomic_load_n(&g_report_frees, __ATOMIC_RELAXED),
            __atomic_load_n(&g_report_refused, __ATOMIC_RELAXED),
            __atomic_load_n(&g_report_creates, __ATOMIC_RELAXED),
            __atomic_load_n(&g_report_releases, __ATOMIC_RELAXED),
            __atomic_load_n(&g_report_second_mappings, __ATOMIC_RELAXED));
}

static void after_fork_child(void) {
    /* The child has no worker threads; it may only ask for memory info (cachealloc's fork
     * test). Reset the lock so that a fork while a parent thread held it cannot deadlock. */
    pthread_mutex_init(&g_lock, NULL);
    pthread_cond_init(&g_cond, NULL);
}

static fc_stream *new_stream_locked(int device, int nonblocking, int legacy) {
    if (g_nstreams >= MAX_STREAMS) return NULL;
    fc_stream *s = calloc(1, sizeof *s);
    s->magic = STREAM_MAGIC;
    s->device = device;
    s->nonblocking = nonblocking;
    s->legacy = legacy;
    g_streams[g_nstreams++] = s;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_create(&s->worker, &attr, worker_main, s);
    pthread_attr_destroy(&attr);
    return s;
}

static void init_locked(void) {
    if (g_initialized) return;
    const char *d = getenv("FAKECUDA_DEVICES");
    if (d && atoi(d) > 0 && atoi(d) <= MAX_DEVICES) g_devices = atoi(d);
    const char *c = getenv("FAKECUDA_CAPACITY_MB");
    if (c && atol(c) > 0) g_capacity = (size_t)atol(c) << 20;
    for (int i = 0; i < g_devices; i++) {
        g_legacy[i] = new_stream_locked(i, 0, 1);
        g_primary[i] = (fc_ctx){.magic = CTX_MAGIC, .device = i, .primary = 1};
    }
    pthread_atfork(NULL, NULL, after_fork_child);
    __atomic_store_n(&g_initialized, 1, __ATOMIC_RELEASE);
}

static int valid_device(CUdevice d) { return d >= 0 && d < g_devices; }

/* A context handle of ours: a primary context, or a live non-primary one. */
static fc_ctx *ctx_lookup_locked(CUcontext handle) {
    fc_ctx *c = (fc_ctx *)handle;
    for (int i = 0; i < g_devices; i++)
        if (c == &g_primary[i]) return c;
    for (int i = 0; i < g_ncontexts; i++)
        if (c == g_contexts[i] && !c->destroyed) return c;
    return NULL;
}

/* The rest of the driver, in parts included here (one translation unit: everything above is
 * shared with them, and their functions stay static). */
/* FAKECUDA_SLOW_US=N: the calls that make or unmake memory (cuMemAlloc*, cuMemCreate,
 * cuMemMap, cuMemSetAccess, cuMemUnmap) first sleep N microseconds, outside the lock, as a GPU's
 * driver takes tens of microseconds for them: the windows between threads are then as wide as
 * on a GPU. */
static void slow_call(void) {
    static long us = -1;
    long v = __atomic_load_n(&us, __ATOMIC_RELAXED);
    if (v < 0) {
        const char *e = getenv("FAKECUDA_SLOW_US");
        v = e ? atol(e) : 0;
        if (v < 0) v = 0;
        __atomic_store_n(&us, v, __ATOMIC_RELAXED);
    }
    if (v > 0) usleep((useconds_t)v);
}

#include "fakecuda_streams.inc"
#include "fakecuda_contexts_memory.inc"
#include "fakecuda_vmm.inc"
#include "fakecuda_streams_events_graphs.inc"
#include "fakecuda_exports.inc"
