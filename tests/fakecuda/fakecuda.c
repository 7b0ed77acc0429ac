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
 *    fails with 901.
 *  - One default memory pool per device, whose attributes report the device's used memory.
 *  - Virtual memory management (CUDA 10.2's VMM API, which expandable segments and XLA use),
 *    with the semantics and error codes of CUDA 13.0 (driver 580) as measured on an H100
 *    (tests/programs/vmm.c passes on both). The calls need cuInit, not a current context.
 *    cuDeviceGetAttribute answers CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED (102)
 *    with 1, or 0 under FAKECUDA_NO_VMM=1 (a device without it); no other attribute.
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
 *    cuMemSetAccess grants access (READ: readable, READWRITE: writable too, for the devices
 *    together) over adjacent whole mappings, no part of one and no gap. cuMemUnmap unmaps the
 *    mappings inside a range of one reservation, which must cut none (CUDA cannot unmap part of
 *    a mapping); unmapped stretches in it are fine, so a range with nothing mapped succeeds; an
 *    unmapped range is reserved and PROT_NONE again. Like CUDA's, cuMemUnmap and cuMemRelease
 *    do not wait for queued work on the memory: such work then faults (SIGSEGV). Copies and
 *    memsets accept device ranges that run across adjacent mappings; cuMemGetAddressRange_v2
 *    and cuPointerGetAttribute answer a mapping's range (no context: NULL;
 *    CU_POINTER_ATTRIBUTE_MAPPED: 1; a buffer id per mapping), and an unmapped address of a
 *    reservation is CUDA_ERROR_NOT_FOUND for cuMemGetAddressRange_v2. VMM memory belongs to no
 *    context (a context reset leaves it alone). cuMemGetAccess and
 *    cuMemGetAllocationPropertiesFromHandle answer; shareable handles
 *    (cuMemExportToShareableHandle, cuMemImportFromShareableHandle) are not supported.
 *  - A stream handle used after cuStreamDestroy aborts with a message: the real driver's
 *    undefined behaviour (a segmentation fault on an H100), made loud.
 *  - FAKECUDA_FAULT=oom_every:N: every Nth cuMemAlloc_v2 or cuMemCreate (one count) fails with
 *    out-of-memory.
 *  - FAKECUDA_FAULT=overlap: a broken allocator that hands a live allocation out twice (see
 *    overlap_locked), for the controls of tests that must catch one.
 *  - FAKECUDA_REPORT=1: at exit, one line on stderr, "fakecuda: <n> device allocations, <m>
 *    device frees, <r> refused by FAKECUDA_FAULT, <c> physical creates, <p> physical releases"
 *    (cuMemAlloc_v2 and cuMemAllocAsync* outside captures; cuMemFree_v2 and cuMemFreeAsync*
 *    outside captures; cuMemAlloc_v2 and cuMemCreate refused by the fault; successful
 *    cuMemCreate and cuMemRelease calls), so that a test can tell a pool served requests.
 *
 * One global mutex guards everything (speed is irrelevant here); workers wait on one condition
 * variable that is broadcast on every completion.
 */
#define _GNU_SOURCE
#define __CUDA_API_VERSION_INTERNAL
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "cuda.h"

#define FC_EXPORT __attribute__((visibility("default")))
#define MAX_DEVICES 8
#define MAX_STREAMS 256
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
};

#define GRAPH_MAGIC 0x9a9a
#define MAX_GRAPH_OPS 256
struct fc_graph {
    int magic;
    int nops;
    fc_op ops[MAX_GRAPH_OPS];
    int nowned;
    char *owned[64];     /* graph-owned memory (cuMemAllocAsync during the capture) */
};

typedef struct fc_alloc {
    char *ptr;
    size_t size;
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
static unsigned long g_report_creates, g_report_releases;
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
            "%lu physical creates, %lu physical releases\n",
            __atomic_load_n(&g_report_allocs, __ATOMIC_RELAXED),
            __atomic_load_n(&g_report_frees, __ATOMIC_RELAXED),
            __atomic_load_n(&g_report_refused, __ATOMIC_RELAXED),
            __atomic_load_n(&g_report_creates, __ATOMIC_RELAXED),
            __atomic_load_n(&g_report_releases, __ATOMIC_RELAXED));
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

/* ----- streams and operations ------------------------------------------------------------ */

static int is_default_stream(CUstream handle) {
    return handle == NULL || handle == CU_STREAM_LEGACY || handle == CU_STREAM_PER_THREAD;
}

/* Resolve a stream handle: NULL, legacy (0x1) and per-thread (0x2, approximated as legacy)
 * mean the current context's device's legacy stream, which needs a current context. */
static fc_stream *stream_locked(CUstream handle, CUresult *err) {
    if (is_default_stream(handle)) {
        if (!t_ctx || t_ctx->destroyed) { *err = CUDA_ERROR_INVALID_CONTEXT; return NULL; }
        return g_legacy[t_ctx->device];
    }
    fc_stream *s = (fc_stream *)handle;
    for (int i = 0; i < g_nstreams; i++) {
        if (g_streams[i] != s || s->magic != STREAM_MAGIC) continue;
        if (s->destroyed) {
            /* A dangling handle: undefined behaviour in CUDA (on an H100, a segmentation fault in
             * cuStreamQuery or CUDA_ERROR_CONTEXT_IS_DESTROYED from cuEventRecord), made loud. */
            fprintf(stderr, "fakecuda: stream %p used after cuStreamDestroy\n", (void *)s);
            abort();
        }
        return s;
    }
    *err = CUDA_ERROR_INVALID_HANDLE;
    return NULL;
}

/* A _ptsz/_ptds call: its NULL stream is the calling thread's per-thread default stream. */
static CUstream per_thread(CUstream handle) { return handle ? handle : CU_STREAM_PER_THREAD; }

/* A potentially unsafe call while a capture forbids it: invalidate the capture(s) and fail. */
static CUresult unsafe_call_locked(void) {
    if (t_capture_mode == MODE_RELAXED) return CUDA_SUCCESS;
    int hit = 0;
    for (int i = 0; i < g_nstreams; i++) {
        fc_stream *c = g_streams[i];
        if (!c->capture) continue;
        if (c->capture_mode == MODE_GLOBAL ||
            (c->capture_mode == MODE_THREAD_LOCAL && pthread_equal(c->capture_thread, pthread_self()))) {
            c->capture_invalid = 1;
            hit = 1;
        }
    }
    return hit ? CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED : CUDA_SUCCESS;
}

static CUresult enqueue_locked(fc_stream *s, fc_op *op) {
    if (s->capture) {
        /* Recorded into the graph, not run. */
        fc_graph *g = s->capture;
        if (g->nops >= MAX_GRAPH_OPS) { free(op); return CUDA_ERROR_OUT_OF_MEMORY; }
        if (op->kind == OP_EVENT) op->event->captured = 1;
        g->ops[g->nops++] = *op;
        free(op);
        return CUDA_SUCCESS;
    }
    if (s->legacy) {
        for (int i = 0; i < g_nstreams; i++) {
            fc_stream *o = g_streams[i];
            if (o->capture && o->device == s->device && !o->nonblocking && !o->legacy) {
                o->capture_invalid = 1;
                free(op);
                return CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
            }
        }
    }
    op->ndeps = 0;
    if (s->legacy) {
        for (int i = 0; i < g_nstreams; i++) {
            fc_stream *o = g_streams[i];
            if (o != s && o->device == s->device && !o->nonblocking && !o->legacy && o->enqueued > o->completed) {
                op->dep_stream[op->ndeps] = o;
                op->dep_target[op->ndeps++] = o->enqueued;
            }
        }
    } else if (!s->nonblocking) {
        fc_stream *l = g_legacy[s->device];
        if (l->enqueued > l->completed) {
            op->dep_stream[0] = l;
            op->dep_target[0] = l->enqueued;
            op->ndeps = 1;
        }
    }
    if (op->kind == OP_EVENT) add_pending(op->event, op->event_generation);
    op->seq = ++s->enqueued;
    op->next = NULL;
    if (s->tail) s->tail->next = op; else s->head = op;
    s->tail = op;
    pthread_cond_broadcast(&g_cond);
    return CUDA_SUCCESS;
}

static fc_op *new_op(op_kind kind) {
    fc_op *op = calloc(1, sizeof *op);
    op->kind = kind;
    return op;
}

static int deps_done_locked(const fc_op *op) {
    /* A stream wait (cuStreamWaitEvent): until the event's record it waits for completes. */
    if (op->kind == OP_WAIT && record_pending(op->event, op->event_generation)) return 0;
    for (int i = 0; i < op->ndeps; i++)
        if (op->dep_stream[i]->completed < op->dep_target[i]) return 0;
    return 1;
}

static void release_alloc_locked(char *ptr);

static void *worker_main(void *arg) {
    fc_stream *s = arg;
    lock();
    for (;;) {
        while (s->head == NULL || !deps_done_locked(s->head)) pthread_cond_wait(&g_cond, &g_lock);
        fc_op *op = s->head;
        unlock();
        switch (op->kind) {
        case OP_MEMSET: memset(op->ptr, op->value, op->n); break;
        case OP_MEMCPY: memmove(op->ptr, op->src, op->n); break;
        case OP_HOSTFN: op->fn(op->arg); break;
        case OP_EVENT: break;
        case OP_FREE: break;
        case OP_WAIT: break;
        }
        lock();
        if (op->kind == OP_EVENT) forget_pending(op->event, op->event_generation);
        if (op->kind == OP_FREE) release_alloc_locked(op->ptr);
        s->head = op->next;
        if (s->head == NULL) s->tail = NULL;
        s->completed = op->seq;
        free(op);
        pthread_cond_broadcast(&g_cond);
    }
    return NULL;
}

static void wait_stream_locked(fc_stream *s) {
    uint64_t target = s->enqueued;
    while (s->completed < target) pthread_cond_wait(&g_cond, &g_lock);
}

static void wait_device_locked(int device) {
    for (int i = 0; i < g_nstreams; i++)
        if (g_streams[i]->device == device) wait_stream_locked(g_streams[i]);
}

/* Enqueue `op` on `handle`'s stream (taking the lock). */
static CUresult submit(CUstream handle, fc_op *op) {
    lock();
    CUresult err = CUDA_SUCCESS;
    fc_stream *s = stream_locked(handle, &err);
    if (!s) { unlock(); free(op); return err; }
    CUresult r = enqueue_locked(s, op);
    unlock();
    return r;
}

/* ----- memory internals ------------------------------------------------------------------- */

static fc_alloc *find_alloc_locked(const char *p, int containing) {
    for (fc_alloc *a = g_allocs; a; a = a->next)
        if (a->ptr == p || (containing && p >= a->ptr && p < a->ptr + a->size)) return a;
    return NULL;
}

static char *ptr_of(CUdeviceptr p) { return (char *)(uintptr_t)p; }
static CUdeviceptr dptr_of(const void *p) { return (CUdeviceptr)(uintptr_t)p; }

/* The VMM mapping containing p, or NULL. */
static fc_mapping *find_mapping_locked(const char *p) {
    for (fc_mapping *m = g_mappings; m; m = m->next)
        if (p >= m->ptr && p < m->ptr + m->size) return m;
    return NULL;
}

/* The reservation holding all of [p, p+n), or NULL. */
static fc_reservation *reservation_of_locked(char *p, size_t n) {
    for (fc_reservation *r = g_reservations; r; r = r->next)
        if (p >= r->base && p < r->base + r->size && n <= (size_t)(r->base + r->size - p)) return r;
    return NULL;
}

/* The access every device has to a mapping, together (device memory is host memory here). */
static unsigned mapping_access(const fc_mapping *m) {
    unsigned a = 0;
    for (int i = 0; i < MAX_DEVICES; i++) a |= m->access[i];
    return a;
}

/* Whether [p, p+n) is covered by adjacent VMM mappings, each with at least the access `need`
 * (CUmemAccess_flags); with `whole`, by whole mappings only (no mapping cut at either end). */
static int mappings_cover_locked(char *p, size_t n, int whole, unsigned need) {
    if ((uintptr_t)p + n < (uintptr_t)p) return 0;
    char *cursor = p;
    do {
        fc_mapping *m = find_mapping_locked(cursor);
        if (!m || (whole && m->ptr != cursor) || (mapping_access(m) & need) != need) return 0;
        cursor = m->ptr + m->size;
    } while (cursor < p + n);
    return !whole || cursor == p + n;
}

/* Whether [p, p+n) lies inside one live allocation, or inside VMM mappings that the devices may
 * access as `need` asks (CU_MEM_ACCESS_FLAGS_PROT_READ to read, ..._READWRITE to write). */
static int device_range_locked(CUdeviceptr p, size_t n, unsigned need) {
    fc_alloc *a = find_alloc_locked(ptr_of(p), 1);
    if (a) return n <= (size_t)(a->ptr + a->size - ptr_of(p));
    return mappings_cover_locked(ptr_of(p), n, 0, need);
}

static CUresult alloc_locked(fc_ctx *ctx, size_t size, char **out) {
    int dev = ctx->device;
    size_t rounded = (size + 511) & ~(size_t)511;
    if (rounded < size || rounded > g_capacity - g_used[dev]) return CUDA_ERROR_OUT_OF_MEMORY;
    char *p = aligned_alloc(4096, (rounded + 4095) & ~(size_t)4095);
    if (!p) return CUDA_ERROR_OUT_OF_MEMORY;
    /* Fresh device memory holds garbage, not zeros. */
    memset(p, 0xA5, rounded);
    fc_alloc *a = malloc(sizeof *a);
    a->ptr = p; a->size = rounded; a->device = dev; a->ctx = ctx;
    a->buffer_id = g_next_buffer_id++;
    a->next = g_allocs;
    g_allocs = a;
    g_used[dev] += rounded;
    *out = p;
    return CUDA_SUCCESS;
}

static void release_alloc_locked(char *ptr) {
    for (fc_alloc **pp = &g_allocs; *pp; pp = &(*pp)->next) {
        if ((*pp)->ptr == ptr) {
            fc_alloc *a = *pp;
            *pp = a->next;
            g_used[a->device] -= a->size;
            free(a->ptr);
            free(a);
            return;
        }
    }
}

/* Release every allocation of a context (quadratic, which a test stand-in can afford). */
static void release_context_memory_locked(fc_ctx *ctx) {
    wait_device_locked(ctx->device);
    for (;;) {
        fc_alloc *a = g_allocs;
        while (a && a->ctx != ctx) a = a->next;
        if (!a) break;
        release_alloc_locked(a->ptr);
    }
}

static int graph_owns_locked(const void *ptr) {
    for (int i = 0; i < g_nstreams; i++) {
        fc_graph *g = g_streams[i]->capture;
        if (!g) continue;
        for (int j = 0; j < g->nowned; j++) if (g->owned[j] == ptr) return 1;
    }
    return 0;
}

/* ----- the driver's functions (static: nothing in here calls an exported name) ----------- */

static CUresult d_init(unsigned flags) {
    if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
    lock();
    init_locked();
    unlock();
    return CUDA_SUCCESS;
}

static CUresult d_device_get(CUdevice *d, int ordinal) {
    NEED_INIT();
    if (!d || !valid_device(ordinal)) return CUDA_ERROR_INVALID_DEVICE;
    *d = ordinal;
    return CUDA_SUCCESS;
}

static CUresult d_device_get_count(int *n) {
    NEED_INIT();
    if (!n) return CUDA_ERROR_INVALID_VALUE;
    *n = g_devices;
    return CUDA_SUCCESS;
}

static CUresult d_device_get_name(char *name, int len, CUdevice d) {
    NEED_INIT();
    if (!name || len <= 0 || !valid_device(d)) return CUDA_ERROR_INVALID_VALUE;
    snprintf(name, (size_t)len, "fakecuda device %d", d);
    return CUDA_SUCCESS;
}

/* cuDeviceGetAttribute: only CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED (102), which
 * is 1 unless FAKECUDA_NO_VMM=1 (a GPU or driver without it); other attributes are
 * CUDA_ERROR_INVALID_VALUE. */
static CUresult d_device_get_attribute(int *value, int attribute, CUdevice d) {
    NEED_INIT();
    if (!value || !valid_device(d)) return CUDA_ERROR_INVALID_VALUE;
    if (attribute != 102) return CUDA_ERROR_INVALID_VALUE;
    const char *off = getenv("FAKECUDA_NO_VMM");
    *value = off && *off == '1' ? 0 : 1;
    return CUDA_SUCCESS;
}

static CUresult d_device_total_mem(size_t *bytes, CUdevice d) {
    NEED_INIT();
    if (!bytes || !valid_device(d)) return CUDA_ERROR_INVALID_VALUE;
    *bytes = g_capacity;
    return CUDA_SUCCESS;
}

/* ----- contexts ----- */

static CUresult d_primary_retain(CUcontext *ctx, CUdevice d) {
    NEED_INIT();
    if (!ctx) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_device(d)) return CUDA_ERROR_INVALID_DEVICE;
    lock();
    g_primary[d].refcount++;
    g_primary[d].active = 1;
    *ctx = (CUcontext)&g_primary[d];
    unlock();
    return CUDA_SUCCESS;
}

/* Reset: all of the primary context's memory goes; the handle stays valid (inactive until the
 * next retain; calls made in it meanwhile still work, which the real driver need not allow). */
static void primary_reset_locked(CUdevice d) {
    release_context_memory_locked(&g_primary[d]);
    g_primary[d].refcount = 0;
    g_primary[d].active = 0;
}

static CUresult d_primary_release(CUdevice d) {
    NEED_INIT();
    if (!valid_device(d)) return CUDA_ERROR_INVALID_DEVICE;
    lock();
    if (g_primary[d].refcount == 0) { unlock(); return CUDA_ERROR_INVALID_CONTEXT; }
    if (--g_primary[d].refcount == 0) primary_reset_locked(d);
    unlock();
    return CUDA_SUCCESS;
}

static CUresult d_primary_reset(CUdevice d) {
    NEED_INIT();
    if (!valid_device(d)) return CUDA_ERROR_INVALID_DEVICE;
    lock();
    primary_reset_locked(d);
    unlock();
    return CUDA_SUCCESS;
}

static CUresult d_primary_get_state(CUdevice d, unsigned *flags, int *active) {
    NEED_INIT();
    if (!flags || !active) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_device(d)) return CUDA_ERROR_INVALID_DEVICE;
    lock();
    *flags = g_primary[d].flags;
    *active = g_primary[d].active;
    unlock();
    return CUDA_SUCCESS;
}

/* A non-primary context of device d, made current on the calling thread. */
static CUresult d_ctx_create(CUcontext *pctx, unsigned flags, CUdevice d) {
    NEED_INIT();
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_device(d)) return CUDA_ERROR_INVALID_DEVICE;
    lock();
    if (g_ncontexts >= MAX_CONTEXTS) { unlock(); return CUDA_ERROR_OUT_OF_MEMORY; }
    fc_ctx *c = calloc(1, sizeof *c);
    *c = (fc_ctx){.magic = CTX_MAGIC, .device = d, .flags = flags};
    g_contexts[g_ncontexts++] = c;
    unlock();
    t_ctx = c;
    *pctx = (CUcontext)c;
    return CUDA_SUCCESS;
}

static CUresult d_ctx_destroy(CUcontext handle) {
    NEED_INIT();
    lock();
    fc_ctx *c = ctx_lookup_locked(handle);
    if (!c || c->primary) { unlock(); return CUDA_ERROR_INVALID_CONTEXT; }
    release_context_memory_locked(c);
    c->destroyed = 1;
    unlock();
    if (t_ctx == c) t_ctx = NULL;
    return CUDA_SUCCESS;
}

static CUresult d_ctx_get_current(CUcontext *ctx) {
    NEED_INIT();
    if (!ctx) return CUDA_ERROR_INVALID_VALUE;
    *ctx = (CUcontext)t_ctx;
    return CUDA_SUCCESS;
}

static CUresult d_ctx_set_current(CUcontext handle) {
    NEED_INIT();
    if (handle == NULL) { t_ctx = NULL; return CUDA_SUCCESS; }
    lock();
    fc_ctx *c = ctx_lookup_locked(handle);
    unlock();
    if (!c) return CUDA_ERROR_INVALID_CONTEXT;
    t_ctx = c;
    return CUDA_SUCCESS;
}

static CUresult d_ctx_get_device(CUdevice *d) {
    NEED_INIT();
    if (!d) return CUDA_ERROR_INVALID_VALUE;
    NEED_CONTEXT();
    *d = t_ctx->device;
    return CUDA_SUCCESS;
}

static CUresult d_ctx_synchronize(void) {
    NEED_CONTEXT();
    lock();
    CUresult r = unsafe_call_locked();
    if (r == CUDA_SUCCESS) wait_device_locked(t_ctx->device);
    unlock();
    return r;
}

/* ----- memory ----- */

/* FAKECUDA_FAULT=overlap: a broken allocator, for the tests' controls. Every second
 * cuMemAlloc_v2 that fits in the previous allocation hands out that allocation's address again
 * while it is still live (a later free of such a duplicate is accepted and does nothing), so a
 * test that writes a pattern per allocation must see a foreign byte. */
#define MAX_DUPLICATES 4096
static char *g_last_alloc;
static size_t g_last_size;
static unsigned long g_fault_allocs;
static char *g_duplicates[MAX_DUPLICATES];

static int fault_overlap(void) {
    static int mode = -1;
    if (mode < 0) {
        const char *f = getenv("FAKECUDA_FAULT");
        mode = f && strcmp(f, "overlap") == 0;
    }
    return mode;
}

/* Under the lock: a duplicate of the last allocation, or NULL. */
static char *overlap_locked(size_t size) {
    if (!fault_overlap() || !g_last_alloc || size > g_last_size || ++g_fault_allocs % 2) return NULL;
    for (int i = 0; i < MAX_DUPLICATES; i++)
        if (!g_duplicates[i]) { g_duplicates[i] = g_last_alloc; return g_last_alloc; }
    return NULL;
}

/* Under the lock: whether `p` is an outstanding duplicate (then forgotten). */
static int forget_duplicate_locked(char *p) {
    for (int i = 0; fault_overlap() && i < MAX_DUPLICATES; i++)
        if (g_duplicates[i] == p) { g_duplicates[i] = NULL; return 1; }
    return 0;
}

/* FAKECUDA_FAULT=oom_every:N: every Nth cuMemAlloc_v2 or cuMemCreate (one count) fails with
 * CUDA_ERROR_OUT_OF_MEMORY although the memory is there (a device shared with other processes,
 * fragmentation). */
static int fault_oom_now_locked(void) {
    static long every = -1;
    static unsigned long attempts;
    if (every < 0) {
        const char *f = getenv("FAKECUDA_FAULT");
        every = f && strncmp(f, "oom_every:", 10) == 0 ? atol(f + 10) : 0;
    }
    return every > 0 && ++attempts % (unsigned long)every == 0;
}

static CUresult d_mem_alloc(CUdeviceptr *dptr, size_t size) {
    NEED_CONTEXT();
    if (!dptr || size == 0) return CUDA_ERROR_INVALID_VALUE;
    lock();
    CUresult r = unsafe_call_locked();
    if (r == CUDA_SUCCESS && fault_oom_now_locked()) {
        r = CUDA_ERROR_OUT_OF_MEMORY;
        count(&g_report_refused);
    }
    char *p = r == CUDA_SUCCESS ? overlap_locked(size) : NULL;
    if (r == CUDA_SUCCESS && !p) {
        r = alloc_locked(t_ctx, size, &p);
        if (r == CUDA_SUCCESS && fault_overlap()) { g_last_alloc = p; g_last_size = size; }
    }
    unlock();
    if (r != CUDA_SUCCESS) return r;
    count(&g_report_allocs);
    *dptr = dptr_of(p);
    return CUDA_SUCCESS;
}

static CUresult d_mem_free(CUdeviceptr ptr) {
    NEED_CONTEXT();
    if (!ptr) return CUDA_SUCCESS;
    lock();
    CUresult r = unsafe_call_locked();
    if (r != CUDA_SUCCESS) { unlock(); return r; }
    if (forget_duplicate_locked(ptr_of(ptr))) { unlock(); return CUDA_SUCCESS; }
    fc_alloc *a = find_alloc_locked(ptr_of(ptr), 0);
    if (!a) { unlock(); return CUDA_ERROR_INVALID_VALUE; }
    if (ptr_of(ptr) == g_last_alloc) g_last_alloc = NULL;
    /* A real cuMemFree waits for the device before it releases the memory. */
    wait_device_locked(a->device);
    release_alloc_locked(ptr_of(ptr));
    unlock();
    count(&g_report_frees);
    return CUDA_SUCCESS;
}

/* Stream-ordered allocation is immediate here; on a capturing stream the memory belongs to the
 * graph. */
static CUresult d_mem_alloc_async(CUdeviceptr *dptr, size_t size, CUstream handle) {
    NEED_CONTEXT();
    if (!dptr || size == 0) return CUDA_ERROR_INVALID_VALUE;
    lock();
    CUresult r = CUDA_SUCCESS;
    fc_stream *s = stream_locked(handle, &r);
    if (!s) { unlock(); return r; }
    fc_ctx *ctx = t_ctx->device == s->device ? t_ctx : &g_primary[s->device];
    char *p = NULL;
    r = alloc_locked(ctx, size, &p);
    int captured = s->capture != NULL;
    if (r == CUDA_SUCCESS && captured) {
        fc_graph *g = s->capture;
        if (g->nowned < 64) g->owned[g->nowned++] = p;
    }
    unlock();
    if (r != CUDA_SUCCESS) return r;
    if (!captured) count(&g_report_allocs);
    *dptr = dptr_of(p);
    return CUDA_SUCCESS;
}

static CUresult d_mem_free_async(CUdeviceptr ptr, CUstream handle) {
    NEED_CONTEXT();
    lock();
    fc_alloc *a = find_alloc_locked(ptr_of(ptr), 0);
    CUresult err = CUDA_SUCCESS;
    fc_stream *s = stream_locked(handle, &err);
    if (a && s && s->capture) {
        /* A free node: graph-owned memory stays for the replays; anything else is an error. */
        int owned = graph_owns_locked(ptr_of(ptr));
        unlock();
        return owned ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    }
    if (!a) { unlock(); return CUDA_ERROR_INVALID_VALUE; }
    if (!s) { unlock(); return err; }
    fc_op *op = new_op(OP_FREE);
    op->ptr = ptr_of(ptr);
    CUresult r = enqueue_locked(s, op);
    unlock();
    if (r == CUDA_SUCCESS) count(&g_report_frees);
    return r;
}

static CUresult d_mem_get_info(size_t *free_bytes, size_t *total) {
    NEED_CONTEXT();
    lock();
    if (free_bytes) *free_bytes = g_capacity - g_used[t_ctx->device];
    if (total) *total = g_capacity;
    unlock();
    return CUDA_SUCCESS;
}

/* An allocation's range; inside a VMM mapping, the mapping's (as CUDA answers). */
static CUresult d_mem_get_address_range(CUdeviceptr *base, size_t *size, CUdeviceptr ptr) {
    NEED_CONTEXT();
    lock();
    fc_alloc *a = find_alloc_locked(ptr_of(ptr), 1);
    fc_mapping *m = a ? NULL : find_mapping_locked(ptr_of(ptr));
    if (!a && !m) {
        /* An unmapped address of a reservation is not found (CUDA 13.0, measured). */
        CUresult r = reservation_of_locked(ptr_of(ptr), 1) ? CUDA_ERROR_NOT_FOUND : CUDA_ERROR_INVALID_VALUE;
        unlock();
        return r;
    }
    if (base) *base = dptr_of(a ? a->ptr : m->ptr);
    if (size) *size = a ? a->size : m->size;
    unlock();
    return CUDA_SUCCESS;
}

static CUresult d_pointer_get_attribute(void *data, CUpointer_attribute attr, CUdeviceptr ptr) {
    NEED_INIT();
    if (!data) return CUDA_ERROR_INVALID_VALUE;
    lock();
    fc_alloc *a = find_alloc_locked(ptr_of(ptr), 1);
    CUresult r = CUDA_SUCCESS;
    fc_mapping *m = a ? NULL : find_mapping_locked(ptr_of(ptr));
    if (m) switch (attr) {
    /* VMM memory belongs to no context. */
    case CU_POINTER_ATTRIBUTE_CONTEXT: *(CUcontext *)data = NULL; break;
    case CU_POINTER_ATTRIBUTE_MEMORY_TYPE: *(unsigned int *)data = CU_MEMORYTYPE_DEVICE; break;
    case CU_POINTER_ATTRIBUTE_DEVICE_POINTER: *(CUdeviceptr *)data = ptr; break;
    case CU_POINTER_ATTRIBUTE_BUFFER_ID: *(unsigned long long *)data = m->buffer_id; break;
    case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: *(int *)data = m->phys->device; break;
    case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR: *(CUdeviceptr *)data = dptr_of(m->ptr); break;
    case CU_POINTER_ATTRIBUTE_RANGE_SIZE: *(size_t *)data = m->size; break;
    case CU_POINTER_ATTRIBUTE_MAPPED: *(int *)data = 1; break;
    default: r = CUDA_ERROR_INVALID_VALUE; break;
    }
    else if (!a) r = CUDA_ERROR_INVALID_VALUE;
    else switch (attr) {
    case CU_POINTER_ATTRIBUTE_CONTEXT: *(CUcontext *)data = (CUcontext)a->ctx; break;
    case CU_POINTER_ATTRIBUTE_MEMORY_TYPE: *(unsigned int *)data = CU_MEMORYTYPE_DEVICE; break;
    case CU_POINTER_ATTRIBUTE_DEVICE_POINTER: *(CUdeviceptr *)data = ptr; break;
    case CU_POINTER_ATTRIBUTE_BUFFER_ID: *(unsigned long long *)data = a->buffer_id; break;
    case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: *(int *)data = a->device; break;
    case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR: *(CUdeviceptr *)data = dptr_of(a->ptr); break;
    case CU_POINTER_ATTRIBUTE_RANGE_SIZE: *(size_t *)data = a->size; break;
    default: r = CUDA_ERROR_INVALID_VALUE; break;
    }
    unlock();
    return r;
}

/* The base of the allocation containing ptr, as a real IPC handle refers to it. */
static CUresult d_ipc_get_mem_handle(CUipcMemHandle *handle, CUdeviceptr ptr) {
    NEED_CONTEXT();
    if (!handle) return CUDA_ERROR_INVALID_VALUE;
    lock();
    fc_alloc *a = find_alloc_locked(ptr_of(ptr), 1);
    if (!a) { unlock(); return CUDA_ERROR_INVALID_VALUE; }
    memset(handle->reserved, 0, sizeof handle->reserved);
    memcpy(handle->reserved, &a->ptr, sizeof a->ptr);
    memcpy(handle->reserved + 8, &a->size, sizeof a->size);
    unlock();
    return CUDA_SUCCESS;
}

/* A copy or memset: the device ranges given must lie inside live allocations. */
static CUresult d_copy_async(CUdeviceptr dst, int dst_device, CUdeviceptr src, int src_device, size_t n,
                             CUstream handle) {
    NEED_INIT();
    lock();
    if ((src_device && !device_range_locked(src, n, CU_MEM_ACCESS_FLAGS_PROT_READ)) ||
        (dst_device && !device_range_locked(dst, n, CU_MEM_ACCESS_FLAGS_PROT_READWRITE))) {
        unlock();
        return CUDA_ERROR_INVALID_VALUE;
    }
    unlock();
    fc_op *op = new_op(OP_MEMCPY);
    op->ptr = ptr_of(dst); op->src = ptr_of(src); op->n = n;
    return submit(handle, op);
}

static CUresult d_memset_async(CUdeviceptr dst, unsigned char value, size_t n, CUstream handle) {
    NEED_INIT();
    lock();
    int ok = device_range_locked(dst, n, CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    unlock();
    if (!ok) return CUDA_ERROR_INVALID_VALUE;
    fc_op *op = new_op(OP_MEMSET);
    op->ptr = ptr_of(dst); op->value = value; op->n = n;
    return submit(handle, op);
}

/* The synchronous forms: enqueued on the (legacy or per-thread) default stream, then waited for. */
static CUresult wait_default_stream(CUstream handle) {
    lock();
    CUresult r = CUDA_SUCCESS;
    fc_stream *s = stream_locked(handle, &r);
    if (s) wait_stream_locked(s);
    unlock();
    return r;
}

static CUresult d_copy_sync(CUdeviceptr dst, int dst_device, CUdeviceptr src, int src_device, size_t n,
                            CUstream handle) {
    CUresult r = d_copy_async(dst, dst_device, src, src_device, n, handle);
    return r != CUDA_SUCCESS ? r : wait_default_stream(handle);
}

static CUresult d_memset_sync(CUdeviceptr dst, unsigned char value, size_t n, CUstream handle) {
    CUresult r = d_memset_async(dst, value, n, handle);
    return r != CUDA_SUCCESS ? r : wait_default_stream(handle);
}

static CUresult d_launch_host_func(CUstream handle, CUhostFn fn, void *arg) {
    NEED_INIT();
    if (!fn) return CUDA_ERROR_INVALID_VALUE;
    fc_op *op = new_op(OP_HOSTFN);
    op->fn = fn; op->arg = arg;
    return submit(handle, op);
}

/* ----- memory pools: one default pool per device ----- */

#define POOL_BASE 0x7000
static int pool_device(CUmemoryPool pool) {
    uintptr_t v = (uintptr_t)pool;
    return (v >= POOL_BASE && v < POOL_BASE + (uintptr_t)g_devices) ? (int)(v - POOL_BASE) : -1;
}

static CUresult d_default_mem_pool(CUmemoryPool *pool, CUdevice d) {
    NEED_INIT();
    if (!pool) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_device(d)) return CUDA_ERROR_INVALID_DEVICE;
    *pool = (CUmemoryPool)(uintptr_t)(POOL_BASE + d);
    return CUDA_SUCCESS;
}

/* The pool's statistics count all of the device's memory (cachealloc answers them itself for
 * the pools it serves). */
static CUresult d_mem_pool_get_attribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value) {
    NEED_INIT();
    int d = pool_device(pool);
    if (d < 0 || !value) return CUDA_ERROR_INVALID_VALUE;
    switch (attr) {
    case CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT: case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH:
    case CU_MEMPOOL_ATTR_USED_MEM_CURRENT: case CU_MEMPOOL_ATTR_USED_MEM_HIGH:
        lock();
        *(cuuint64_t *)value = g_used[d];
        unlock();
        return CUDA_SUCCESS;
    case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD:
        *(cuuint64_t *)value = 0;
        return CUDA_SUCCESS;
    case CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES:
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC:
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES:
        *(int *)value = 0;
        return CUDA_SUCCESS;
    }
    return CUDA_ERROR_INVALID_VALUE;
}

static CUresult d_mem_pool_set_attribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value) {
    NEED_INIT();
    if (pool_device(pool) < 0 || !value) return CUDA_ERROR_INVALID_VALUE;
    /* Only a reset of the high-water marks (to 0) is allowed for them. */
    if ((attr == CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH || attr == CU_MEMPOOL_ATTR_USED_MEM_HIGH) &&
        *(cuuint64_t *)value != 0)
        return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}

static CUresult d_mem_pool_trim_to(CUmemoryPool pool, size_t keep) {
    (void)keep;
    NEED_INIT();
    return pool_device(pool) < 0 ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}

/* ----- virtual memory management (cuMemCreate, cuMemAddressReserve, cuMemMap, ...) ----- */

/* The granularity of physical memory, mappings and reservations: 2 MiB, as on NVIDIA GPUs, or
 * FAKECUDA_VMM_GRANULARITY_KB (a power of two, and a multiple of the page size; a value that is
 * not is refused with a warning and the default kept). */
static size_t vmm_granularity(void) {
    static size_t granularity;
    size_t g = __atomic_load_n(&granularity, __ATOMIC_RELAXED);
    if (g) return g;
    g = (size_t)2 << 20;
    const char *e = getenv("FAKECUDA_VMM_GRANULARITY_KB");
    if (e) {
        long kb = atol(e);
        size_t bytes = kb > 0 ? (size_t)kb << 10 : 0;
        size_t page = (size_t)sysconf(_SC_PAGESIZE);
        if (bytes && (bytes & (bytes - 1)) == 0 && bytes % page == 0) g = bytes;
        else fprintf(stderr, "fakecuda: FAKECUDA_VMM_GRANULARITY_KB=%s ignored (not a power of two of pages)\n", e);
    }
    __atomic_store_n(&granularity, g, __ATOMIC_RELAXED);
    return g;
}

/* Pinned device memory of a device of ours (else `bad_device`); POSIX file descriptor handles
 * may be asked for (never exported here), the other kinds and compression are not supported. */
static CUresult check_alloc_prop(const CUmemAllocationProp *prop, CUresult bad_device) {
    if (!prop || prop->type != CU_MEM_ALLOCATION_TYPE_PINNED || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_device(prop->location.id)) return bad_device;
    switch (prop->requestedHandleTypes) {
    case CU_MEM_HANDLE_TYPE_NONE: case CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR: break;
    case CU_MEM_HANDLE_TYPE_WIN32: case CU_MEM_HANDLE_TYPE_WIN32_KMT: case CU_MEM_HANDLE_TYPE_FABRIC:
        return CUDA_ERROR_NOT_SUPPORTED;
    default: return CUDA_ERROR_INVALID_VALUE;
    }
    if (prop->allocFlags.compressionType != CU_MEM_ALLOCATION_COMP_NONE) return CUDA_ERROR_NOT_SUPPORTED;
    return CUDA_SUCCESS;
}

static int vmm_aligned(uintptr_t v) { return v % vmm_granularity() == 0; }

static CUresult d_mem_get_granularity(size_t *granularity, const CUmemAllocationProp *prop,
                                      CUmemAllocationGranularity_flags option) {
    NEED_INIT();
    if (!granularity) return CUDA_ERROR_INVALID_VALUE;
    if (option != CU_MEM_ALLOC_GRANULARITY_MINIMUM && option != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)
        return CUDA_ERROR_INVALID_VALUE;
    /* (Stricter than CUDA 13.0's, which answers whatever the type, location or device.) */
    CUresult r = check_alloc_prop(prop, CUDA_ERROR_INVALID_VALUE);
    if (r != CUDA_SUCCESS) return r;
    *granularity = vmm_granularity();
    return CUDA_SUCCESS;
}

/* A PROT_NONE, MAP_NORESERVE range: free of cost however large. `addr` is a hint, taken when
 * that range is free and aligned. */
static CUresult d_address_reserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                  unsigned long long flags) {
    NEED_INIT();
    if (!ptr || size == 0 || flags != 0 || !vmm_aligned(size) || (alignment & (alignment - 1)) != 0)
        return CUDA_ERROR_INVALID_VALUE;
    size_t align = alignment > vmm_granularity() ? alignment : vmm_granularity();
    const int mflags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;
    char *p = NULL;
    if (addr && addr % align == 0) {
        void *hint = mmap(ptr_of(addr), size, PROT_NONE, mflags | MAP_FIXED_NOREPLACE, -1, 0);
        if (hint != MAP_FAILED && hint != ptr_of(addr)) munmap(hint, size); /* an old kernel's hint */
        else if (hint != MAP_FAILED) p = hint;
    }
    if (!p) {
        if (size > SIZE_MAX - align) return CUDA_ERROR_OUT_OF_MEMORY;
        size_t total = size + align;
        char *raw = mmap(NULL, total, PROT_NONE, mflags, -1, 0);
        if (raw == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
        p = (char *)(((uintptr_t)raw + align - 1) & ~(uintptr_t)(align - 1));
        if (p > raw) munmap(raw, (size_t)(p - raw));
        if (raw + total > p + size) munmap(p + size, (size_t)(raw + total - (p + size)));
    }
    fc_reservation *r = malloc(sizeof *r);
    r->base = p;
    r->size = size;
    lock();
    r->next = g_reservations;
    g_reservations = r;
    unlock();
    *ptr = dptr_of(p);
    return CUDA_SUCCESS;
}

/* A whole reservation, with nothing mapped in it any more. */
static CUresult d_address_free(CUdeviceptr ptr, size_t size) {
    NEED_INIT();
    lock();
    fc_reservation **pp = &g_reservations;
    while (*pp && !((*pp)->base == ptr_of(ptr) && (*pp)->size == size)) pp = &(*pp)->next;
    fc_reservation *r = *pp;
    int mapped = 0;
    for (fc_mapping *m = g_mappings; r && m; m = m->next)
        if (m->ptr >= r->base && m->ptr < r->base + r->size) mapped = 1;
    if (!r || mapped) { unlock(); return CUDA_ERROR_INVALID_VALUE; }
    *pp = r->next;
    munmap(r->base, r->size);
    unlock();
    free(r);
    return CUDA_SUCCESS;
}

static fc_physical *find_physical_locked(CUmemGenericAllocationHandle handle) {
    for (fc_physical *ph = g_physical; ph; ph = ph->next)
        if (ph->handle == handle) return ph;
    return NULL;
}

/* Physical memory is gone once no handle and no mapping of it remain. */
static void physical_maybe_free_locked(fc_physical *ph) {
    if (ph->handles > 0 || ph->mappings > 0) return;
    for (fc_physical **pp = &g_physical; *pp; pp = &(*pp)->next) {
        if (*pp == ph) { *pp = ph->next; break; }
    }
    g_used[ph->device] -= ph->size;
    close(ph->fd);
    free(ph);
}

/* Physical memory: counted against the device's capacity like cuMemAlloc_v2, and refused by
 * FAKECUDA_FAULT=oom_every:N in the same count. */
static CUresult d_mem_create(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                             unsigned long long flags) {
    NEED_INIT();
    if (!handle || size == 0 || flags != 0) return CUDA_ERROR_INVALID_VALUE;
    CUresult r = check_alloc_prop(prop, CUDA_ERROR_INVALID_DEVICE);
    if (r != CUDA_SUCCESS) return r;
    if (!vmm_aligned(size)) return CUDA_ERROR_INVALID_VALUE;
    int dev = prop->location.id;
    lock();
    if (fault_oom_now_locked()) {
        unlock();
        count(&g_report_refused);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (size > g_capacity - g_used[dev]) { unlock(); return CUDA_ERROR_OUT_OF_MEMORY; }
    int fd = memfd_create("fakecuda-vmm", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)size) != 0) {
        if (fd >= 0) close(fd);
        unlock();
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    /* Fresh device memory holds garbage, not zeros. */
    void *fill = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (fill == MAP_FAILED) { close(fd); unlock(); return CUDA_ERROR_OUT_OF_MEMORY; }
    memset(fill, 0xA5, size);
    munmap(fill, size);
    fc_physical *ph = calloc(1, sizeof *ph);
    ph->handle = g_next_handle++;
    ph->fd = fd;
    ph->size = size;
    ph->device = dev;
    ph->handle_types = prop->requestedHandleTypes;
    ph->handles = 1;
    ph->next = g_physical;
    g_physical = ph;
    g_used[dev] += size;
    *handle = ph->handle;
    unlock();
    count(&g_report_creates);
    return CUDA_SUCCESS;
}

/* The memory itself lives on while mapped. */
static CUresult d_mem_release(CUmemGenericAllocationHandle handle) {
    NEED_INIT();
    lock();
    fc_physical *ph = find_physical_locked(handle);
    if (!ph || ph->handles == 0) { unlock(); return CUDA_ERROR_INVALID_VALUE; }
    ph->handles--;
    physical_maybe_free_locked(ph);
    unlock();
    count(&g_report_releases);
    return CUDA_SUCCESS;
}

/* Granule-aligned, inside one reservation, over nothing mapped; no access until
 * cuMemSetAccess. As CUDA 13.0 does (measured), a mapping maps all of its memory: an offset or
 * a size other than the memory's is CUDA_ERROR_NOT_SUPPORTED (checked before the overlap). A
 * handle released while its memory is still mapped elsewhere may be mapped again. */
static CUresult d_mem_map(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                          unsigned long long flags) {
    NEED_INIT();
    if (size == 0 || flags != 0 || !vmm_aligned(ptr) || !vmm_aligned(size)) return CUDA_ERROR_INVALID_VALUE;
    char *p = ptr_of(ptr);
    lock();
    fc_physical *ph = find_physical_locked(handle);
    CUresult r = CUDA_SUCCESS;
    if (!ph || !reservation_of_locked(p, size)) r = CUDA_ERROR_INVALID_VALUE;
    else if (offset != 0 || size != ph->size) r = CUDA_ERROR_NOT_SUPPORTED;
    for (fc_mapping *m = g_mappings; r == CUDA_SUCCESS && m; m = m->next)
        if (m->ptr < p + size && p < m->ptr + m->size) r = CUDA_ERROR_INVALID_VALUE;
    if (r == CUDA_SUCCESS && mmap(p, size, PROT_NONE, MAP_SHARED | MAP_FIXED, ph->fd, 0) == MAP_FAILED)
        r = CUDA_ERROR_OUT_OF_MEMORY;
    if (r != CUDA_SUCCESS) { unlock(); return r; }
    fc_mapping *m = calloc(1, sizeof *m);
    m->ptr = p;
    m->size = size;
    m->phys = ph;
    m->buffer_id = g_next_buffer_id++;
    m->next = g_mappings;
    g_mappings = m;
    ph->mappings++;
    unlock();
    return CUDA_SUCCESS;
}

/* Every mapping inside the range, which must lie in one reservation and cut no mapping (CUDA
 * cannot unmap part of one); unmapped stretches in it are fine, as with CUDA 13.0 (measured),
 * so a range with nothing mapped succeeds. An unmapped range is reserved and PROT_NONE again.
 * Work still queued on it is not waited for (nor is it by CUDA): it faults. */
static CUresult d_mem_unmap(CUdeviceptr ptr, size_t size) {
    NEED_INIT();
    char *p = ptr_of(ptr);
    lock();
    int ok = size != 0 && reservation_of_locked(p, size) != NULL;
    for (fc_mapping *m = g_mappings; ok && m; m = m->next) {
        int overlaps = m->ptr < p + size && p < m->ptr + m->size;
        if (overlaps && (m->ptr < p || m->ptr + m->size > p + size)) ok = 0;
    }
    if (!ok) { unlock(); return CUDA_ERROR_INVALID_VALUE; }
    for (fc_mapping **pp = &g_mappings; *pp;) {
        fc_mapping *m = *pp;
        if (m->ptr < p || m->ptr >= p + size) { pp = &m->next; continue; }
        *pp = m->next;
        mmap(m->ptr, m->size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
        m->phys->mappings--;
        physical_maybe_free_locked(m->phys);
        free(m);
    }
    unlock();
    return CUDA_SUCCESS;
}

static int valid_location(const CUmemLocation *loc) {
    return loc && loc->type == CU_MEM_LOCATION_TYPE_DEVICE && valid_device(loc->id);
}

static int prot_of(unsigned access) {
    return access == CU_MEM_ACCESS_FLAGS_PROT_READWRITE ? PROT_READ | PROT_WRITE
         : access == CU_MEM_ACCESS_FLAGS_PROT_READ ? PROT_READ : PROT_NONE;
}

/* Over adjacent whole mappings only, no part of one and no gap (as CUDA 13.0 requires,
 * measured). The host protection is what the devices together may do. */
static CUresult d_mem_set_access(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count) {
    NEED_INIT();
    if (!desc || count == 0 || size == 0) return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < count; i++) {
        CUmemAccess_flags f = desc[i].flags;
        if (!valid_location(&desc[i].location) ||
            (f != CU_MEM_ACCESS_FLAGS_PROT_NONE && f != CU_MEM_ACCESS_FLAGS_PROT_READ &&
             f != CU_MEM_ACCESS_FLAGS_PROT_READWRITE))
            return CUDA_ERROR_INVALID_VALUE;
    }
    char *p = ptr_of(ptr);
    lock();
    if (!mappings_cover_locked(p, size, 1, 0)) { unlock(); return CUDA_ERROR_INVALID_VALUE; }
    for (fc_mapping *m = g_mappings; m; m = m->next) {
        if (m->ptr < p || m->ptr >= p + size) continue;
        for (size_t i = 0; i < count; i++) m->access[desc[i].location.id] = (unsigned char)desc[i].flags;
        mprotect(m->ptr, m->size, prot_of(mapping_access(m)));
    }
    unlock();
    return CUDA_SUCCESS;
}

static CUresult d_mem_get_access(unsigned long long *flags, const CUmemLocation *location, CUdeviceptr ptr) {
    NEED_INIT();
    if (!flags || !valid_location(location)) return CUDA_ERROR_INVALID_VALUE;
    lock();
    fc_mapping *m = find_mapping_locked(ptr_of(ptr));
    if (m) *flags = m->access[location->id];
    unlock();
    return m ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* The handle of the memory mapped at any address of a mapping; one more cuMemRelease owed. */
static CUresult d_retain_allocation_handle(CUmemGenericAllocationHandle *handle, void *addr) {
    NEED_INIT();
    if (!handle) return CUDA_ERROR_INVALID_VALUE;
    lock();
    fc_mapping *m = find_mapping_locked(addr);
    if (m) {
        m->phys->handles++;
        *handle = m->phys->handle;
    }
    unlock();
    return m ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

static CUresult d_allocation_properties(CUmemAllocationProp *prop, CUmemGenericAllocationHandle handle) {
    NEED_INIT();
    if (!prop) return CUDA_ERROR_INVALID_VALUE;
    lock();
    fc_physical *ph = find_physical_locked(handle);
    if (ph && ph->handles > 0) {
        memset(prop, 0, sizeof *prop);
        prop->type = CU_MEM_ALLOCATION_TYPE_PINNED;
        prop->requestedHandleTypes = ph->handle_types;
        prop->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        prop->location.id = ph->device;
    }
    unlock();
    return ph && ph->handles > 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* ----- streams ----- */

static CUresult d_stream_create(CUstream *out, unsigned flags) {
    NEED_CONTEXT();
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    lock();
    fc_stream *s = new_stream_locked(t_ctx->device, flags & CU_STREAM_NON_BLOCKING, 0);
    unlock();
    if (!s) return CUDA_ERROR_OUT_OF_MEMORY;
    *out = (CUstream)s;
    return CUDA_SUCCESS;
}

static CUresult d_stream_destroy(CUstream handle) {
    NEED_INIT();
    if (is_default_stream(handle)) return CUDA_ERROR_INVALID_HANDLE;
    lock();
    CUresult err = CUDA_SUCCESS;
    fc_stream *s = stream_locked(handle, &err);
    if (!s) { unlock(); return err; }
    /* Work already queued still runs, as with the real API. */
    s->destroyed = 1;
    unlock();
    return CUDA_SUCCESS;
}

static CUresult d_stream_synchronize(CUstream handle) {
    NEED_INIT();
    lock();
    CUresult r = unsafe_call_locked();
    if (r != CUDA_SUCCESS) { unlock(); return r; }
    fc_stream *s = stream_locked(handle, &r);
    if (s) wait_stream_locked(s);
    unlock();
    return r;
}

static CUresult d_stream_query(CUstream handle) {
    NEED_INIT();
    lock();
    CUresult r = unsafe_call_locked();
    if (r != CUDA_SUCCESS) { unlock(); return r; }
    fc_stream *s = stream_locked(handle, &r);
    if (s) r = s->completed == s->enqueued ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
    unlock();
    return r;
}

/* ----- events ----- */

static fc_event *event_of(CUevent handle) {
    fc_event *e = (fc_event *)handle;
    return (e && e->magic == EVENT_MAGIC) ? e : NULL;
}

static CUresult d_event_create(CUevent *out, unsigned flags) {
    (void)flags;
    NEED_CONTEXT();
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    fc_event *e = calloc(1, sizeof *e);
    e->magic = EVENT_MAGIC;
    *out = (CUevent)e;
    return CUDA_SUCCESS;
}

static CUresult d_event_record(CUevent handle, CUstream stream) {
    NEED_CONTEXT();
    fc_event *e = event_of(handle);
    if (!e) return CUDA_ERROR_INVALID_HANDLE;
    fc_op *op = new_op(OP_EVENT);
    lock();
    CUresult r = CUDA_SUCCESS;
    fc_stream *s = stream_locked(stream, &r);
    if (!s) { unlock(); free(op); return r; }
    op->event = e;
    op->event_generation = ++e->generation;
    e->captured = 0;
    r = enqueue_locked(s, op);
    unlock();
    return r;
}

/* The stream's later work waits on the device for the event's latest record; nothing waits on
 * the host. */
static CUresult d_stream_wait_event(CUstream stream, CUevent handle, unsigned flags) {
    (void)flags;
    NEED_CONTEXT();
    fc_event *e = event_of(handle);
    if (!e) return CUDA_ERROR_INVALID_HANDLE;
    fc_op *op = new_op(OP_WAIT);
    lock();
    CUresult r = CUDA_SUCCESS;
    fc_stream *s = stream_locked(stream, &r);
    if (!s) { unlock(); free(op); return r; }
    op->event = e;
    op->event_generation = e->generation;
    r = enqueue_locked(s, op);
    unlock();
    return r;
}

static CUresult d_event_query(CUevent handle) {
    NEED_INIT();
    fc_event *e = event_of(handle);
    if (!e) return CUDA_ERROR_INVALID_HANDLE;
    lock();
    if (e->captured || unsafe_call_locked()) { unlock(); return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED; }
    int done = !record_pending(e, e->generation);
    unlock();
    return done ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

static CUresult d_event_synchronize(CUevent handle) {
    NEED_INIT();
    fc_event *e = event_of(handle);
    if (!e) return CUDA_ERROR_INVALID_HANDLE;
    lock();
    if (e->captured || unsafe_call_locked()) { unlock(); return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED; }
    while (record_pending(e, e->generation)) pthread_cond_wait(&g_cond, &g_lock);
    unlock();
    return CUDA_SUCCESS;
}

static CUresult d_event_destroy(CUevent handle) {
    NEED_INIT();
    fc_event *e = event_of(handle);
    if (!e) return CUDA_ERROR_INVALID_HANDLE;
    /* Kept allocated (but invalid) so that a queued record of it stays harmless. */
    e->magic = 0;
    return CUDA_SUCCESS;
}

/* ----- stream capture and graphs ----- */

static CUresult d_begin_capture(CUstream handle, int mode) {
    NEED_INIT();
    lock();
    CUresult r = CUDA_SUCCESS;
    fc_stream *s = stream_locked(handle, &r);
    if (!s) { unlock(); return r; }
    if (s->legacy || s->capture || mode < MODE_GLOBAL || mode > MODE_RELAXED) {
        unlock();
        return CUDA_ERROR_INVALID_VALUE;
    }
    s->capture = calloc(1, sizeof *s->capture);
    s->capture->magic = GRAPH_MAGIC;
    s->capture_mode = mode;
    s->capture_thread = pthread_self();
    s->capture_invalid = 0;
    unlock();
    return CUDA_SUCCESS;
}

static CUresult d_end_capture(CUstream handle, CUgraph *graph) {
    NEED_INIT();
    if (!graph) return CUDA_ERROR_INVALID_VALUE;
    lock();
    CUresult r = CUDA_SUCCESS;
    fc_stream *s = stream_locked(handle, &r);
    if (!s || !s->capture) { unlock(); return CUDA_ERROR_INVALID_VALUE; }
    fc_graph *g = s->capture;
    int invalid = s->capture_invalid;
    s->capture = NULL;
    unlock();
    if (invalid) { *graph = NULL; return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED; }
    *graph = (CUgraph)g;
    return CUDA_SUCCESS;
}

static CUresult d_is_capturing(CUstream handle, CUstreamCaptureStatus *status) {
    NEED_INIT();
    if (!status) return CUDA_ERROR_INVALID_VALUE;
    lock();
    CUresult r = CUDA_SUCCESS;
    fc_stream *s = stream_locked(handle, &r);
    if (s)
        *status = !s->capture ? CU_STREAM_CAPTURE_STATUS_NONE
                : s->capture_invalid ? CU_STREAM_CAPTURE_STATUS_INVALIDATED
                : CU_STREAM_CAPTURE_STATUS_ACTIVE;
    unlock();
    return r;
}

static CUresult d_exchange_capture_mode(CUstreamCaptureMode *mode) {
    if (!mode) return CUDA_ERROR_INVALID_VALUE;
    int old = t_capture_mode;
    t_capture_mode = (int)*mode;
    *mode = (CUstreamCaptureMode)old;
    return CUDA_SUCCESS;
}

static fc_graph *graph_of(void *handle) {
    fc_graph *g = handle;
    return (g && g->magic == GRAPH_MAGIC) ? g : NULL;
}

/* An executable graph is its graph here. */
static CUresult d_graph_instantiate(CUgraphExec *exec, CUgraph graph, unsigned long long flags) {
    (void)flags;
    NEED_INIT();
    if (!exec || !graph) return CUDA_ERROR_INVALID_VALUE;
    if (!graph_of(graph)) return CUDA_ERROR_INVALID_HANDLE;
    *exec = (CUgraphExec)graph;
    return CUDA_SUCCESS;
}

static CUresult d_graph_launch(CUgraphExec exec, CUstream handle) {
    NEED_INIT();
    fc_graph *g = graph_of(exec);
    if (!g) return CUDA_ERROR_INVALID_HANDLE;
    lock();
    CUresult r = CUDA_SUCCESS;
    fc_stream *s = stream_locked(handle, &r);
    if (!s) { unlock(); return r; }
    for (int i = 0; i < g->nops; i++) {
        fc_op *op = new_op(g->ops[i].kind);
        *op = g->ops[i];
        if (op->kind == OP_EVENT) op->event_generation = ++op->event->generation;
        r = enqueue_locked(s, op);
        if (r != CUDA_SUCCESS) break;
    }
    unlock();
    return r;
}

static CUresult d_graph_destroy(CUgraph graph) {
    NEED_INIT();
    fc_graph *g = graph_of(graph);
    if (!g) return CUDA_ERROR_INVALID_HANDLE;
    lock();
    for (int i = 0; i < g->nowned; i++) release_alloc_locked(g->owned[i]);
    g->magic = 0;
    unlock();
    return CUDA_SUCCESS;
}

/* ----- errors ----- */

static const char *error_text(CUresult code) {
    switch (code) {
    case CUDA_SUCCESS: return "no error";
    case CUDA_ERROR_INVALID_VALUE: return "invalid argument";
    case CUDA_ERROR_OUT_OF_MEMORY: return "out of memory";
    case CUDA_ERROR_NOT_INITIALIZED: return "initialization error";
    case CUDA_ERROR_DEINITIALIZED: return "driver shutting down";
    case CUDA_ERROR_INVALID_DEVICE: return "invalid device ordinal";
    case CUDA_ERROR_INVALID_CONTEXT: return "invalid device context";
    case CUDA_ERROR_INVALID_HANDLE: return "invalid resource handle";
    case CUDA_ERROR_NOT_FOUND: return "named symbol not found";
    case CUDA_ERROR_NOT_READY: return "device not ready";
    case CUDA_ERROR_NOT_SUPPORTED: return "operation not supported";
    case CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED: return "operation not permitted when stream is capturing";
    case CUDA_ERROR_STREAM_CAPTURE_INVALIDATED: return "operation failed due to a previous error during capture";
    case CUDA_ERROR_STREAM_CAPTURE_IMPLICIT: return "operation would make the legacy stream depend on a capturing blocking stream";
    case CUDA_ERROR_UNKNOWN: return "unknown error";
    }
    return NULL;
}

static const char *error_name(CUresult code) {
    switch (code) {
    case CUDA_SUCCESS: return "CUDA_SUCCESS";
    case CUDA_ERROR_INVALID_VALUE: return "CUDA_ERROR_INVALID_VALUE";
    case CUDA_ERROR_OUT_OF_MEMORY: return "CUDA_ERROR_OUT_OF_MEMORY";
    case CUDA_ERROR_NOT_INITIALIZED: return "CUDA_ERROR_NOT_INITIALIZED";
    case CUDA_ERROR_DEINITIALIZED: return "CUDA_ERROR_DEINITIALIZED";
    case CUDA_ERROR_INVALID_DEVICE: return "CUDA_ERROR_INVALID_DEVICE";
    case CUDA_ERROR_INVALID_CONTEXT: return "CUDA_ERROR_INVALID_CONTEXT";
    case CUDA_ERROR_INVALID_HANDLE: return "CUDA_ERROR_INVALID_HANDLE";
    case CUDA_ERROR_NOT_FOUND: return "CUDA_ERROR_NOT_FOUND";
    case CUDA_ERROR_NOT_READY: return "CUDA_ERROR_NOT_READY";
    case CUDA_ERROR_NOT_SUPPORTED: return "CUDA_ERROR_NOT_SUPPORTED";
    case CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED: return "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED";
    case CUDA_ERROR_STREAM_CAPTURE_INVALIDATED: return "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED";
    case CUDA_ERROR_STREAM_CAPTURE_IMPLICIT: return "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT";
    case CUDA_ERROR_UNKNOWN: return "CUDA_ERROR_UNKNOWN";
    }
    return NULL;
}

/* An unknown code: CUDA_ERROR_INVALID_VALUE and a NULL string, as with the real driver. */
static CUresult d_error_string(CUresult code, const char **s, int name) {
    if (!s) return CUDA_ERROR_INVALID_VALUE;
    *s = name ? error_name(code) : error_text(code);
    return *s ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* ----- the resolver ----- */

static CUresult d_get_proc_address(const char *symbol, void **pfn, int version, cuuint64_t flags,
                                   CUdriverProcAddressQueryResult *status);

/* ========================================================================================== */
/* The exported driver API: thin wrappers over the static functions above.                   */
/* ========================================================================================== */

FC_EXPORT CUresult cuInit(unsigned int flags) { return d_init(flags); }
FC_EXPORT CUresult cuDriverGetVersion(int *v) {
    if (!v) return CUDA_ERROR_INVALID_VALUE;
    *v = DRIVER_VERSION;
    return CUDA_SUCCESS;
}
FC_EXPORT CUresult cuGetErrorString(CUresult r, const char **s) { return d_error_string(r, s, 0); }
FC_EXPORT CUresult cuGetErrorName(CUresult r, const char **s) { return d_error_string(r, s, 1); }

FC_EXPORT CUresult cuDeviceGet(CUdevice *d, int ordinal) { return d_device_get(d, ordinal); }
FC_EXPORT CUresult cuDeviceGetCount(int *n) { return d_device_get_count(n); }
FC_EXPORT CUresult cuDeviceGetName(char *name, int len, CUdevice d) { return d_device_get_name(name, len, d); }
FC_EXPORT CUresult cuDeviceGetAttribute(int *value, int attribute, CUdevice d) {
    return d_device_get_attribute(value, attribute, d);
}
FC_EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice d) { return d_device_total_mem(bytes, d); }

FC_EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice d) { return d_primary_retain(ctx, d); }
FC_EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) { return d_primary_release(d); }
FC_EXPORT CUresult cuDevicePrimaryCtxRelease(CUdevice d) { return d_primary_release(d); }
FC_EXPORT CUresult cuDevicePrimaryCtxReset_v2(CUdevice d) { return d_primary_reset(d); }
FC_EXPORT CUresult cuDevicePrimaryCtxReset(CUdevice d) { return d_primary_reset(d); }
/* FAKECUDA_WITHOUT_PRIMARY_CTX_STATE builds a driver lacking this function, which cachealloc
 * needs and the runtime does not (a test of the shim's passthrough). */
#ifndef FAKECUDA_WITHOUT_PRIMARY_CTX_STATE
FC_EXPORT CUresult cuDevicePrimaryCtxGetState(CUdevice d, unsigned int *flags, int *active) {
    return d_primary_get_state(d, flags, active);
}
#endif
FC_EXPORT CUresult cuCtxCreate(CUcontext *pctx, unsigned int flags, CUdevice d) { return d_ctx_create(pctx, flags, d); }
FC_EXPORT CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice d) { return d_ctx_create(pctx, flags, d); }
/* With execution-affinity or CIG parameters: not supported (the empty forms are plain creates). */
FC_EXPORT CUresult cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *params, int n, unsigned int flags, CUdevice d) {
    if (n < 0 || (n > 0 && !params)) return CUDA_ERROR_INVALID_VALUE;
    if (n > 0) return CUDA_ERROR_NOT_SUPPORTED;
    return d_ctx_create(pctx, flags, d);
}
FC_EXPORT CUresult cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *params, unsigned int flags, CUdevice d) {
    if (params && (params->numExecAffinityParams != 0 || params->cigParams)) return CUDA_ERROR_NOT_SUPPORTED;
    return d_ctx_create(pctx, flags, d);
}
FC_EXPORT CUresult cuCtxDestroy_v2(CUcontext ctx) { return d_ctx_destroy(ctx); }
FC_EXPORT CUresult cuCtxDestroy(CUcontext ctx) { return d_ctx_destroy(ctx); }
FC_EXPORT CUresult cuCtxGetCurrent(CUcontext *ctx) { return d_ctx_get_current(ctx); }
FC_EXPORT CUresult cuCtxSetCurrent(CUcontext ctx) { return d_ctx_set_current(ctx); }
FC_EXPORT CUresult cuCtxGetDevice(CUdevice *d) { return d_ctx_get_device(d); }
FC_EXPORT CUresult cuCtxSynchronize(void) { return d_ctx_synchronize(); }

FC_EXPORT CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total) { return d_mem_get_info(free_bytes, total); }
FC_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t size) { return d_mem_alloc(dptr, size); }
FC_EXPORT CUresult cuMemFree_v2(CUdeviceptr ptr) { return d_mem_free(ptr); }
FC_EXPORT CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr ptr) {
    return d_mem_get_address_range(base, size, ptr);
}
/* The v1 symbols with 32-bit device pointers or sizes: they cannot address this device's
 * memory; CUDA_ERROR_NOT_SUPPORTED, and nothing written. */
FC_EXPORT CUresult cuDeviceTotalMem(unsigned int *bytes, CUdevice d) { (void)bytes; (void)d; return CUDA_ERROR_NOT_SUPPORTED; }
FC_EXPORT CUresult cuMemGetInfo(unsigned int *f, unsigned int *t) { (void)f; (void)t; return CUDA_ERROR_NOT_SUPPORTED; }
FC_EXPORT CUresult cuMemAlloc(CUdeviceptr_v1 *dptr, unsigned int size) { (void)dptr; (void)size; return CUDA_ERROR_NOT_SUPPORTED; }
FC_EXPORT CUresult cuMemFree(CUdeviceptr_v1 ptr) { (void)ptr; return CUDA_ERROR_NOT_SUPPORTED; }
FC_EXPORT CUresult cuMemGetAddressRange(CUdeviceptr_v1 *base, unsigned int *size, CUdeviceptr_v1 ptr) {
    (void)base; (void)size; (void)ptr;
    return CUDA_ERROR_NOT_SUPPORTED;
}
FC_EXPORT CUresult cuPointerGetAttribute(void *data, CUpointer_attribute attr, CUdeviceptr ptr) {
    return d_pointer_get_attribute(data, attr, ptr);
}
FC_EXPORT CUresult cuIpcGetMemHandle(CUipcMemHandle *handle, CUdeviceptr ptr) { return d_ipc_get_mem_handle(handle, ptr); }

FC_EXPORT CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) {
    return d_copy_sync(dst, 1, dptr_of(src), 0, n, NULL);
}
FC_EXPORT CUresult cuMemcpyHtoD_v2_ptds(CUdeviceptr dst, const void *src, size_t n) {
    return d_copy_sync(dst, 1, dptr_of(src), 0, n, CU_STREAM_PER_THREAD);
}
FC_EXPORT CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) {
    return d_copy_sync(dptr_of(dst), 0, src, 1, n, NULL);
}
FC_EXPORT CUresult cuMemcpyDtoH_v2_ptds(void *dst, CUdeviceptr src, size_t n) {
    return d_copy_sync(dptr_of(dst), 0, src, 1, n, CU_STREAM_PER_THREAD);
}
FC_EXPORT CUresult cuMemsetD8_v2(CUdeviceptr dst, unsigned char uc, size_t n) { return d_memset_sync(dst, uc, n, NULL); }
FC_EXPORT CUresult cuMemsetD8_v2_ptds(CUdeviceptr dst, unsigned char uc, size_t n) {
    return d_memset_sync(dst, uc, n, CU_STREAM_PER_THREAD);
}
FC_EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream s) {
    return d_copy_async(dst, 1, dptr_of(src), 0, n, s);
}
FC_EXPORT CUresult cuMemcpyHtoDAsync_v2_ptsz(CUdeviceptr dst, const void *src, size_t n, CUstream s) {
    return d_copy_async(dst, 1, dptr_of(src), 0, n, per_thread(s));
}
FC_EXPORT CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream s) {
    return d_copy_async(dptr_of(dst), 0, src, 1, n, s);
}
FC_EXPORT CUresult cuMemcpyDtoHAsync_v2_ptsz(void *dst, CUdeviceptr src, size_t n, CUstream s) {
    return d_copy_async(dptr_of(dst), 0, src, 1, n, per_thread(s));
}
FC_EXPORT CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
    return d_copy_async(dst, 1, src, 1, n, s);
}
FC_EXPORT CUresult cuMemcpyDtoDAsync_v2_ptsz(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
    return d_copy_async(dst, 1, src, 1, n, per_thread(s));
}
/* Unified addressing: either side may be host or device memory; nothing is checked. */
FC_EXPORT CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
    return d_copy_async(dst, 0, src, 0, n, s);
}
FC_EXPORT CUresult cuMemcpyAsync_ptsz(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
    return d_copy_async(dst, 0, src, 0, n, per_thread(s));
}
FC_EXPORT CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char uc, size_t n, CUstream s) {
    return d_memset_async(dst, uc, n, s);
}
FC_EXPORT CUresult cuMemsetD8Async_ptsz(CUdeviceptr dst, unsigned char uc, size_t n, CUstream s) {
    return d_memset_async(dst, uc, n, per_thread(s));
}
FC_EXPORT CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t size, CUstream s) { return d_mem_alloc_async(dptr, size, s); }
FC_EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t size, CUstream s) {
    return d_mem_alloc_async(dptr, size, per_thread(s));
}
FC_EXPORT CUresult cuMemFreeAsync(CUdeviceptr ptr, CUstream s) { return d_mem_free_async(ptr, s); }
FC_EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr ptr, CUstream s) { return d_mem_free_async(ptr, per_thread(s)); }
FC_EXPORT CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool, CUdevice d) { return d_default_mem_pool(pool, d); }
FC_EXPORT CUresult cuMemPoolGetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value) {
    return d_mem_pool_get_attribute(pool, attr, value);
}
FC_EXPORT CUresult cuMemPoolSetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value) {
    return d_mem_pool_set_attribute(pool, attr, value);
}
FC_EXPORT CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t keep) { return d_mem_pool_trim_to(pool, keep); }

FC_EXPORT CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
                                                 CUmemAllocationGranularity_flags option) {
    return d_mem_get_granularity(granularity, prop, option);
}
FC_EXPORT CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                       unsigned long long flags) {
    return d_address_reserve(ptr, size, alignment, addr, flags);
}
FC_EXPORT CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) { return d_address_free(ptr, size); }
FC_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                               unsigned long long flags) {
    return d_mem_create(handle, size, prop, flags);
}
FC_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle) { return d_mem_release(handle); }
FC_EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                            unsigned long long flags) {
    return d_mem_map(ptr, size, offset, handle, flags);
}
FC_EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) { return d_mem_unmap(ptr, size); }
FC_EXPORT CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count) {
    return d_mem_set_access(ptr, size, desc, count);
}
FC_EXPORT CUresult cuMemGetAccess(unsigned long long *flags, const CUmemLocation *location, CUdeviceptr ptr) {
    return d_mem_get_access(flags, location, ptr);
}
FC_EXPORT CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr) {
    return d_retain_allocation_handle(handle, addr);
}
FC_EXPORT CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop, CUmemGenericAllocationHandle handle) {
    return d_allocation_properties(prop, handle);
}
/* Shareable handles (IPC of VMM memory): not supported. */
FC_EXPORT CUresult cuMemExportToShareableHandle(void *shareable, CUmemGenericAllocationHandle handle,
                                                CUmemAllocationHandleType type, unsigned long long flags) {
    (void)shareable; (void)handle; (void)type; (void)flags;
    return initialized() ? CUDA_ERROR_NOT_SUPPORTED : CUDA_ERROR_NOT_INITIALIZED;
}
FC_EXPORT CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *os_handle,
                                                  CUmemAllocationHandleType type) {
    (void)handle; (void)os_handle; (void)type;
    return initialized() ? CUDA_ERROR_NOT_SUPPORTED : CUDA_ERROR_NOT_INITIALIZED;
}

FC_EXPORT CUresult cuStreamCreate(CUstream *s, unsigned int flags) { return d_stream_create(s, flags); }
FC_EXPORT CUresult cuStreamCreateWithPriority(CUstream *s, unsigned int flags, int priority) {
    (void)priority;
    return d_stream_create(s, flags);
}
FC_EXPORT CUresult cuStreamDestroy_v2(CUstream s) { return d_stream_destroy(s); }
FC_EXPORT CUresult cuStreamDestroy(CUstream s) { return d_stream_destroy(s); }
FC_EXPORT CUresult cuStreamSynchronize(CUstream s) { return d_stream_synchronize(s); }
FC_EXPORT CUresult cuStreamSynchronize_ptsz(CUstream s) { return d_stream_synchronize(per_thread(s)); }
FC_EXPORT CUresult cuStreamQuery(CUstream s) { return d_stream_query(s); }
FC_EXPORT CUresult cuStreamQuery_ptsz(CUstream s) { return d_stream_query(per_thread(s)); }
FC_EXPORT CUresult cuStreamWaitEvent(CUstream s, CUevent e, unsigned int flags) { return d_stream_wait_event(s, e, flags); }
FC_EXPORT CUresult cuStreamWaitEvent_ptsz(CUstream s, CUevent e, unsigned int flags) {
    return d_stream_wait_event(per_thread(s), e, flags);
}
FC_EXPORT CUresult cuLaunchHostFunc(CUstream s, CUhostFn fn, void *arg) { return d_launch_host_func(s, fn, arg); }
FC_EXPORT CUresult cuLaunchHostFunc_ptsz(CUstream s, CUhostFn fn, void *arg) {
    return d_launch_host_func(per_thread(s), fn, arg);
}

FC_EXPORT CUresult cuEventCreate(CUevent *e, unsigned int flags) { return d_event_create(e, flags); }
FC_EXPORT CUresult cuEventRecord(CUevent e, CUstream s) { return d_event_record(e, s); }
FC_EXPORT CUresult cuEventRecord_ptsz(CUevent e, CUstream s) { return d_event_record(e, per_thread(s)); }
FC_EXPORT CUresult cuEventQuery(CUevent e) { return d_event_query(e); }
FC_EXPORT CUresult cuEventSynchronize(CUevent e) { return d_event_synchronize(e); }
FC_EXPORT CUresult cuEventDestroy_v2(CUevent e) { return d_event_destroy(e); }
FC_EXPORT CUresult cuEventDestroy(CUevent e) { return d_event_destroy(e); }

FC_EXPORT CUresult cuStreamBeginCapture_v2(CUstream s, CUstreamCaptureMode mode) { return d_begin_capture(s, (int)mode); }
FC_EXPORT CUresult cuStreamBeginCapture_v2_ptsz(CUstream s, CUstreamCaptureMode mode) {
    return d_begin_capture(per_thread(s), (int)mode);
}
/* The CUDA 10.0 form, without a mode: global. */
FC_EXPORT CUresult cuStreamBeginCapture(CUstream s) { return d_begin_capture(s, MODE_GLOBAL); }
FC_EXPORT CUresult cuStreamBeginCapture_ptsz(CUstream s) { return d_begin_capture(per_thread(s), MODE_GLOBAL); }
FC_EXPORT CUresult cuStreamEndCapture(CUstream s, CUgraph *g) { return d_end_capture(s, g); }
FC_EXPORT CUresult cuStreamEndCapture_ptsz(CUstream s, CUgraph *g) { return d_end_capture(per_thread(s), g); }
FC_EXPORT CUresult cuStreamIsCapturing(CUstream s, CUstreamCaptureStatus *status) { return d_is_capturing(s, status); }
FC_EXPORT CUresult cuStreamIsCapturing_ptsz(CUstream s, CUstreamCaptureStatus *status) {
    return d_is_capturing(per_thread(s), status);
}
FC_EXPORT CUresult cuThreadExchangeStreamCaptureMode(CUstreamCaptureMode *mode) { return d_exchange_capture_mode(mode); }
FC_EXPORT CUresult cuGraphInstantiateWithFlags(CUgraphExec *exec, CUgraph g, unsigned long long flags) {
    return d_graph_instantiate(exec, g, flags);
}
FC_EXPORT CUresult cuGraphLaunch(CUgraphExec exec, CUstream s) { return d_graph_launch(exec, s); }
FC_EXPORT CUresult cuGraphLaunch_ptsz(CUgraphExec exec, CUstream s) { return d_graph_launch(exec, per_thread(s)); }
FC_EXPORT CUresult cuGraphExecDestroy(CUgraphExec exec) { (void)exec; return CUDA_SUCCESS; }
FC_EXPORT CUresult cuGraphDestroy(CUgraph g) { return d_graph_destroy(g); }

FC_EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, cuuint64_t flags,
                                       CUdriverProcAddressQueryResult *status) {
    return d_get_proc_address(symbol, pfn, version, flags, status);
}
FC_EXPORT CUresult cuGetProcAddress_v2_ptsz(const char *symbol, void **pfn, int version, cuuint64_t flags,
                                            CUdriverProcAddressQueryResult *status) {
    return d_get_proc_address(symbol, pfn, version, flags, status);
}
FC_EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, cuuint64_t flags) {
    return d_get_proc_address(symbol, pfn, version, flags, NULL);
}

/* ========================================================================================== */
/* The resolver's table: base name, the CUDA version that introduced this variant, whether it */
/* is the per-thread default stream variant, and the exported function.                       */
/* ========================================================================================== */

typedef struct {
    const char *name;
    int version;
    int per_thread;
    void *fn;
} proc_entry;

#define PROC(name, version, fn) { name, version, 0, (void *)(fn) }
#define PROC_PT(name, version, fn) { name, version, 1, (void *)(fn) }

static const proc_entry g_procs[] = {
    PROC("cuInit", 2000, cuInit),
    PROC("cuDriverGetVersion", 2020, cuDriverGetVersion),
    PROC("cuGetErrorString", 6000, cuGetErrorString),
    PROC("cuGetErrorName", 6000, cuGetErrorName),
    PROC("cuGetProcAddress", 11030, cuGetProcAddress),
    PROC("cuGetProcAddress", 12000, cuGetProcAddress_v2),
    PROC_PT("cuGetProcAddress", 12000, cuGetProcAddress_v2_ptsz),

    PROC("cuDeviceGet", 2000, cuDeviceGet),
    PROC("cuDeviceGetCount", 2000, cuDeviceGetCount),
    PROC("cuDeviceGetName", 2000, cuDeviceGetName),
    PROC("cuDeviceGetAttribute", 2000, cuDeviceGetAttribute),
    PROC("cuDeviceTotalMem", 2000, cuDeviceTotalMem),
    PROC("cuDeviceTotalMem", 3020, cuDeviceTotalMem_v2),

    PROC("cuDevicePrimaryCtxRetain", 7000, cuDevicePrimaryCtxRetain),
    PROC("cuDevicePrimaryCtxRelease", 7000, cuDevicePrimaryCtxRelease),
    PROC("cuDevicePrimaryCtxRelease", 11000, cuDevicePrimaryCtxRelease_v2),
    PROC("cuDevicePrimaryCtxReset", 7000, cuDevicePrimaryCtxReset),
    PROC("cuDevicePrimaryCtxReset", 11000, cuDevicePrimaryCtxReset_v2),
#ifndef FAKECUDA_WITHOUT_PRIMARY_CTX_STATE
    PROC("cuDevicePrimaryCtxGetState", 7000, cuDevicePrimaryCtxGetState),
#endif
    PROC("cuCtxCreate", 2000, cuCtxCreate),
    PROC("cuCtxCreate", 3020, cuCtxCreate_v2),
    PROC("cuCtxCreate", 11040, cuCtxCreate_v3),
    PROC("cuCtxCreate", 12050, cuCtxCreate_v4),
    PROC("cuCtxDestroy", 2000, cuCtxDestroy),
    PROC("cuCtxDestroy", 4000, cuCtxDestroy_v2),
    PROC("cuCtxGetCurrent", 4000, cuCtxGetCurrent),
    PROC("cuCtxSetCurrent", 4000, cuCtxSetCurrent),
    PROC("cuCtxGetDevice", 2000, cuCtxGetDevice),
    PROC("cuCtxSynchronize", 2000, cuCtxSynchronize),

    PROC("cuMemGetInfo", 2000, cuMemGetInfo),
    PROC("cuMemGetInfo", 3020, cuMemGetInfo_v2),
    PROC("cuMemAlloc", 2000, cuMemAlloc),
    PROC("cuMemAlloc", 3020, cuMemAlloc_v2),
    PROC("cuMemFree", 2000, cuMemFree),
    PROC("cuMemFree", 3020, cuMemFree_v2),
    PROC("cuMemGetAddressRange", 2000, cuMemGetAddressRange),
    PROC("cuMemGetAddressRange", 3020, cuMemGetAddressRange_v2),
    PROC("cuPointerGetAttribute", 4000, cuPointerGetAttribute),
    PROC("cuIpcGetMemHandle", 4010, cuIpcGetMemHandle),
    PROC("cuMemcpyHtoD", 3020, cuMemcpyHtoD_v2),
    PROC_PT("cuMemcpyHtoD", 7000, cuMemcpyHtoD_v2_ptds),
    PROC("cuMemcpyDtoH", 3020, cuMemcpyDtoH_v2),
    PROC_PT("cuMemcpyDtoH", 7000, cuMemcpyDtoH_v2_ptds),
    PROC("cuMemsetD8", 3020, cuMemsetD8_v2),
    PROC_PT("cuMemsetD8", 7000, cuMemsetD8_v2_ptds),
    PROC("cuMemcpyHtoDAsync", 3020, cuMemcpyHtoDAsync_v2),
    PROC_PT("cuMemcpyHtoDAsync", 7000, cuMemcpyHtoDAsync_v2_ptsz),
    PROC("cuMemcpyDtoHAsync", 3020, cuMemcpyDtoHAsync_v2),
    PROC_PT("cuMemcpyDtoHAsync", 7000, cuMemcpyDtoHAsync_v2_ptsz),
    PROC("cuMemcpyDtoDAsync", 3020, cuMemcpyDtoDAsync_v2),
    PROC_PT("cuMemcpyDtoDAsync", 7000, cuMemcpyDtoDAsync_v2_ptsz),
    PROC("cuMemcpyAsync", 4000, cuMemcpyAsync),
    PROC_PT("cuMemcpyAsync", 7000, cuMemcpyAsync_ptsz),
    PROC("cuMemsetD8Async", 3020, cuMemsetD8Async),
    PROC_PT("cuMemsetD8Async", 7000, cuMemsetD8Async_ptsz),
    PROC("cuMemAllocAsync", 11020, cuMemAllocAsync),
    PROC_PT("cuMemAllocAsync", 11020, cuMemAllocAsync_ptsz),
    PROC("cuMemFreeAsync", 11020, cuMemFreeAsync),
    PROC_PT("cuMemFreeAsync", 11020, cuMemFreeAsync_ptsz),
    PROC("cuDeviceGetDefaultMemPool", 11020, cuDeviceGetDefaultMemPool),
    PROC("cuMemPoolGetAttribute", 11020, cuMemPoolGetAttribute),
    PROC("cuMemPoolSetAttribute", 11020, cuMemPoolSetAttribute),
    PROC("cuMemPoolTrimTo", 11020, cuMemPoolTrimTo),
    PROC("cuMemGetAllocationGranularity", 10020, cuMemGetAllocationGranularity),
    PROC("cuMemAddressReserve", 10020, cuMemAddressReserve),
    PROC("cuMemAddressFree", 10020, cuMemAddressFree),
    PROC("cuMemCreate", 10020, cuMemCreate),
    PROC("cuMemRelease", 10020, cuMemRelease),
    PROC("cuMemMap", 10020, cuMemMap),
    PROC("cuMemUnmap", 10020, cuMemUnmap),
    PROC("cuMemSetAccess", 10020, cuMemSetAccess),
    PROC("cuMemGetAccess", 10020, cuMemGetAccess),
    PROC("cuMemRetainAllocationHandle", 11000, cuMemRetainAllocationHandle),
    PROC("cuMemGetAllocationPropertiesFromHandle", 10020, cuMemGetAllocationPropertiesFromHandle),
    PROC("cuMemExportToShareableHandle", 10020, cuMemExportToShareableHandle),
    PROC("cuMemImportFromShareableHandle", 10020, cuMemImportFromShareableHandle),

    PROC("cuStreamCreate", 2000, cuStreamCreate),
    PROC("cuStreamCreateWithPriority", 5050, cuStreamCreateWithPriority),
    PROC("cuStreamDestroy", 2000, cuStreamDestroy),
    PROC("cuStreamDestroy", 4000, cuStreamDestroy_v2),
    PROC("cuStreamSynchronize", 2000, cuStreamSynchronize),
    PROC_PT("cuStreamSynchronize", 7000, cuStreamSynchronize_ptsz),
    PROC("cuStreamQuery", 2000, cuStreamQuery),
    PROC_PT("cuStreamQuery", 7000, cuStreamQuery_ptsz),
    PROC("cuStreamWaitEvent", 3020, cuStreamWaitEvent),
    PROC_PT("cuStreamWaitEvent", 7000, cuStreamWaitEvent_ptsz),
    PROC("cuLaunchHostFunc", 10000, cuLaunchHostFunc),
    PROC_PT("cuLaunchHostFunc", 10000, cuLaunchHostFunc_ptsz),
    PROC("cuEventCreate", 2000, cuEventCreate),
    PROC("cuEventRecord", 2000, cuEventRecord),
    PROC_PT("cuEventRecord", 7000, cuEventRecord_ptsz),
    PROC("cuEventQuery", 2000, cuEventQuery),
    PROC("cuEventSynchronize", 2000, cuEventSynchronize),
    PROC("cuEventDestroy", 2000, cuEventDestroy),
    PROC("cuEventDestroy", 4000, cuEventDestroy_v2),

    PROC("cuStreamBeginCapture", 10000, cuStreamBeginCapture),
    PROC_PT("cuStreamBeginCapture", 10000, cuStreamBeginCapture_ptsz),
    PROC("cuStreamBeginCapture", 10010, cuStreamBeginCapture_v2),
    PROC_PT("cuStreamBeginCapture", 10010, cuStreamBeginCapture_v2_ptsz),
    PROC("cuStreamEndCapture", 10000, cuStreamEndCapture),
    PROC_PT("cuStreamEndCapture", 10000, cuStreamEndCapture_ptsz),
    PROC("cuStreamIsCapturing", 10000, cuStreamIsCapturing),
    PROC_PT("cuStreamIsCapturing", 10000, cuStreamIsCapturing_ptsz),
    PROC("cuThreadExchangeStreamCaptureMode", 10010, cuThreadExchangeStreamCaptureMode),
    PROC("cuGraphInstantiateWithFlags", 11040, cuGraphInstantiateWithFlags),
    PROC("cuGraphLaunch", 10000, cuGraphLaunch),
    PROC_PT("cuGraphLaunch", 10000, cuGraphLaunch_ptsz),
    PROC("cuGraphExecDestroy", 10000, cuGraphExecDestroy),
    PROC("cuGraphDestroy", 10000, cuGraphDestroy),
};

/* cuGetProcAddress: the newest variant of `symbol` that `version` allows, the per-thread one
 * where flags ask for it and the name has one. */
static CUresult d_get_proc_address(const char *symbol, void **pfn, int version, cuuint64_t flags,
                                   CUdriverProcAddressQueryResult *status) {
    if (!symbol || !pfn) return CUDA_ERROR_INVALID_VALUE;
    *pfn = NULL;
    cuuint64_t mode = flags & (CU_GET_PROC_ADDRESS_LEGACY_STREAM | CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM);
    if (flags != mode || mode == (CU_GET_PROC_ADDRESS_LEGACY_STREAM | CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM))
        return CUDA_ERROR_INVALID_VALUE;
    /* Asking for a version newer than the driver is an error of its own (as documented). */
    if (version > DRIVER_VERSION) return CUDA_ERROR_INVALID_VALUE;
    const size_t n = sizeof g_procs / sizeof g_procs[0];
    int named = 0, has_per_thread = 0;
    for (size_t i = 0; i < n; i++) {
        if (strcmp(g_procs[i].name, symbol) != 0) continue;
        named = 1;
        has_per_thread |= g_procs[i].per_thread;
    }
    if (!named) {
        if (status) *status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
        return CUDA_ERROR_NOT_FOUND;
    }
    int per_thread = mode == CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM && has_per_thread;
    const proc_entry *best = NULL;
    for (size_t i = 0; i < n; i++) {
        const proc_entry *e = &g_procs[i];
        if (strcmp(e->name, symbol) != 0 || e->per_thread != per_thread || e->version > version) continue;
        if (!best || e->version > best->version) best = e;
    }
    if (!best) {
        if (status) *status = CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT;
        return CUDA_ERROR_NOT_FOUND;
    }
    *pfn = best->fn;
    if (status) *status = CU_GET_PROC_ADDRESS_SUCCESS;
    return CUDA_SUCCESS;
}
