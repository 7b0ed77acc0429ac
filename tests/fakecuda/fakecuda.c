/*
 * fakecuda — a CPU stand-in for the CUDA driver (built as libcuda.so.1). It holds all state;
 * cudart.c (libcudart.so.13) is a thin runtime layer over the fc_* functions here.
 *
 * What it models, because cachealloc's tests depend on it:
 *  - Device memory is host memory, counted against a capacity (FAKECUDA_CAPACITY_MB, default
 *    1024) per device; FAKECUDA_DEVICES devices (default 1). Allocations are 512-byte aligned.
 *  - Streams run *asynchronously*: every stream (and each device's legacy default stream) has a
 *    worker thread that executes its queued operations in order. Legacy semantics: an operation
 *    on the legacy stream waits for all earlier work of the device's blocking streams, and an
 *    operation on a blocking stream waits for all earlier legacy-stream work; non-blocking
 *    streams are ordered with nothing. So a caching allocator that reuses memory too early
 *    really sees the old work overwrite the new data.
 *  - cudaFree waits for the whole device first (as the real one does), then releases.
 *  - Events complete when their recording operation executes.
 *  - Stream capture (CUDA graphs): work enqueued on a capturing stream is recorded into the
 *    graph, not run; a graph launch enqueues copies of it. cudaMallocAsync on a capturing stream
 *    gives graph-owned memory (kept until the graph is destroyed), a cudaFreeAsync of it there
 *    does nothing. While a capture in global mode is under way (or one in thread-local mode on
 *    the calling thread), a "potentially unsafe" call (cudaMalloc, cudaFree, event query or
 *    synchronize, stream or device synchronize) from a thread not in relaxed mode fails with
 *    900 and invalidates the capture; work on the legacy stream while a blocking stream
 *    captures fails with 906 and invalidates it too. cudaStreamEndCapture then fails with 901.
 *
 * One global mutex guards everything (speed is irrelevant here); workers wait on one condition
 * variable that is broadcast on every completion.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define FC_EXPORT __attribute__((visibility("default")))
#define MAX_DEVICES 8
#define MAX_STREAMS 256

/* Error codes shared by the runtime (cudaError_t) and the driver (CUresult) where they agree. */
enum {
    OK = 0,
    E_INVALID_VALUE = 1,
    E_OUT_OF_MEMORY = 2,
    E_NOT_INITIALIZED = 3,
    E_INVALID_DEVICE = 101,
    E_INVALID_CONTEXT = 201,
    E_INVALID_HANDLE = 400,
    E_NOT_READY = 600,
};

typedef struct fc_op fc_op;
typedef struct fc_stream fc_stream;

typedef enum { OP_MEMSET, OP_MEMCPY, OP_HOSTFN, OP_EVENT, OP_FREE, OP_WAIT } op_kind;

enum {
    E_CAPTURE_UNSUPPORTED = 900, /* cudaErrorStreamCaptureUnsupported */
    E_CAPTURE_INVALIDATED = 901, /* cudaErrorStreamCaptureInvalidated */
    E_CAPTURE_IMPLICIT = 906,    /* cudaErrorStreamCaptureImplicit */
};
enum { MODE_GLOBAL = 0, MODE_THREAD_LOCAL = 1, MODE_RELAXED = 2 };

typedef struct fc_graph fc_graph;

typedef struct fc_event {
    int magic;
    uint64_t generation; /* bumped by each record */
    uint64_t completed_generation;
    int captured;        /* last recorded inside a capture: may not be queried */
} fc_event;

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
    char *owned[64];     /* graph-owned memory (cudaMallocAsync during the capture) */
};

typedef struct fc_alloc {
    char *ptr;
    size_t size;
    int device;
    struct fc_alloc *next;
} fc_alloc;

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_cond = PTHREAD_COND_INITIALIZER;
static int g_initialized;
static int g_devices = 1;
static size_t g_capacity = (size_t)1024 << 20;
static size_t g_used[MAX_DEVICES];
static fc_alloc *g_allocs;
static fc_stream *g_streams[MAX_STREAMS];
static int g_nstreams;
static fc_stream *g_legacy[MAX_DEVICES];
static __thread int t_device;
static __thread void *t_context;
static __thread int t_capture_mode; /* MODE_GLOBAL by default, as in CUDA */

#define STREAM_MAGIC 0x5eea
#define EVENT_MAGIC 0xe7e7

static void *worker_main(void *arg);

/* Runtime calls make the current device's context current on the calling thread, as the real
 * runtime does lazily; driver calls (cu*) need it to be current already. */
static void runtime_touch(void) {
    if (!t_context) t_context = (void *)(uintptr_t)(0x1000 + t_device);
}

static void lock(void) { pthread_mutex_lock(&g_lock); }
static void unlock(void) { pthread_mutex_unlock(&g_lock); }

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
    for (int i = 0; i < g_devices; i++) g_legacy[i] = new_stream_locked(i, 0, 1);
    pthread_atfork(NULL, NULL, after_fork_child);
    g_initialized = 1;
}

FC_EXPORT void fc_init(void) {
    lock();
    init_locked();
    unlock();
}

/* ----- streams and operations ------------------------------------------------------------ */

/* Resolve a stream handle: NULL, legacy (0x1) and per-thread (0x2, approximated as legacy)
 * mean the current device's legacy stream. */
static fc_stream *resolve_locked(void *handle) {
    init_locked();
    if (handle == NULL || handle == (void *)0x1 || handle == (void *)0x2) return g_legacy[t_device];
    fc_stream *s = handle;
    for (int i = 0; i < g_nstreams; i++)
        if (g_streams[i] == s && s->magic == STREAM_MAGIC && !s->destroyed) return s;
    return NULL;
}

/* A potentially unsafe call while a capture forbids it: invalidate the capture(s) and fail. */
static int unsafe_call_locked(void) {
    if (t_capture_mode == MODE_RELAXED) return OK;
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
    return hit ? E_CAPTURE_UNSUPPORTED : OK;
}

static int unsafe_call(void) {
    lock();
    int r = unsafe_call_locked();
    unlock();
    return r;
}

static int enqueue_locked(fc_stream *s, fc_op *op) {
    if (s->capture) {
        /* Recorded into the graph, not run. */
        fc_graph *g = s->capture;
        if (g->nops >= MAX_GRAPH_OPS) { free(op); return E_OUT_OF_MEMORY; }
        if (op->kind == OP_EVENT) op->event->captured = 1;
        g->ops[g->nops++] = *op;
        free(op);
        return OK;
    }
    if (s->legacy) {
        for (int i = 0; i < g_nstreams; i++) {
            fc_stream *o = g_streams[i];
            if (o->capture && o->device == s->device && !o->nonblocking && !o->legacy) {
                o->capture_invalid = 1;
                free(op);
                return E_CAPTURE_IMPLICIT;
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
    op->seq = ++s->enqueued;
    op->next = NULL;
    if (s->tail) s->tail->next = op; else s->head = op;
    s->tail = op;
    pthread_cond_broadcast(&g_cond);
    return OK;
}

static fc_op *new_op(op_kind kind) {
    fc_op *op = calloc(1, sizeof *op);
    op->kind = kind;
    return op;
}

static int deps_done_locked(const fc_op *op) {
    /* A stream wait (cudaStreamWaitEvent): until the event's record it waits for completes. */
    if (op->kind == OP_WAIT && op->event->completed_generation < op->event_generation) return 0;
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
        if (op->kind == OP_EVENT && op->event->generation == op->event_generation)
            op->event->completed_generation = op->event_generation;
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

FC_EXPORT int fc_stream_create(void **out, unsigned flags) {
    runtime_touch();
    if (!out) return E_INVALID_VALUE;
    lock();
    init_locked();
    fc_stream *s = new_stream_locked(t_device, flags & 1, 0);
    unlock();
    if (!s) return E_OUT_OF_MEMORY;
    *out = s;
    return OK;
}

FC_EXPORT int fc_stream_destroy(void *handle) {
    lock();
    fc_stream *s = resolve_locked(handle);
    if (!s || s->legacy) { unlock(); return E_INVALID_HANDLE; }
    /* Work already queued still runs, as with the real API. */
    s->destroyed = 1;
    unlock();
    return OK;
}

FC_EXPORT int fc_stream_synchronize(void *handle) {
    lock();
    if (unsafe_call_locked()) { unlock(); return E_CAPTURE_UNSUPPORTED; }
    fc_stream *s = resolve_locked(handle);
    if (!s) { unlock(); return E_INVALID_HANDLE; }
    wait_stream_locked(s);
    unlock();
    return OK;
}

FC_EXPORT int fc_device_synchronize(void) {
    runtime_touch();
    lock();
    init_locked();
    if (unsafe_call_locked()) { unlock(); return E_CAPTURE_UNSUPPORTED; }
    wait_device_locked(t_device);
    unlock();
    return OK;
}

static int submit(void *handle, fc_op *op) {
    lock();
    fc_stream *s = resolve_locked(handle);
    if (!s) { unlock(); free(op); return E_INVALID_HANDLE; }
    int r = enqueue_locked(s, op);
    unlock();
    return r;
}

FC_EXPORT int fc_memset_async(void *ptr, int value, size_t n, void *stream) {
    fc_op *op = new_op(OP_MEMSET);
    op->ptr = ptr; op->value = value; op->n = n;
    return submit(stream, op);
}

FC_EXPORT int fc_memcpy_async(void *dst, const void *src, size_t n, void *stream) {
    fc_op *op = new_op(OP_MEMCPY);
    op->ptr = dst; op->src = src; op->n = n;
    return submit(stream, op);
}

FC_EXPORT int fc_launch_host_func(void *stream, void (*fn)(void *), void *arg) {
    if (!fn) return E_INVALID_VALUE;
    fc_op *op = new_op(OP_HOSTFN);
    op->fn = fn; op->arg = arg;
    return submit(stream, op);
}

/* ----- memory ------------------------------------------------------------------------------ */

static fc_alloc *find_alloc_locked(const char *p, int containing) {
    for (fc_alloc *a = g_allocs; a; a = a->next)
        if (a->ptr == p || (containing && p >= a->ptr && p < a->ptr + a->size)) return a;
    return NULL;
}

/* Device memory for cudaMalloc and for graph-owned allocations. */
static int malloc_locked(void **out, size_t size);

FC_EXPORT int fc_malloc(void **out, size_t size) {
    runtime_touch();
    if (!out) return E_INVALID_VALUE;
    lock();
    init_locked();
    if (unsafe_call_locked()) { unlock(); return E_CAPTURE_UNSUPPORTED; }
    int r = malloc_locked(out, size);
    unlock();
    return r;
}

/* cudaMallocAsync: stream-ordered allocation is immediate here; on a capturing stream the memory
 * belongs to the graph. */
FC_EXPORT int fc_malloc_async(void **out, size_t size, void *stream) {
    runtime_touch();
    if (!out) return E_INVALID_VALUE;
    lock();
    init_locked();
    fc_stream *s = resolve_locked(stream);
    if (!s) { unlock(); return E_INVALID_HANDLE; }
    int r = malloc_locked(out, size);
    if (r == OK && s->capture && *out) {
        fc_graph *g = s->capture;
        if (g->nowned < 64) g->owned[g->nowned++] = *out;
    }
    unlock();
    return r;
}

static int malloc_locked(void **out, size_t size) {
    int dev = t_device;
    size_t rounded = (size + 511) & ~(size_t)511;
    if (size == 0) { *out = NULL; return OK; }
    if (rounded < size || rounded > g_capacity - g_used[dev]) { return E_OUT_OF_MEMORY; }
    char *p = aligned_alloc(4096, (rounded + 4095) & ~(size_t)4095);
    if (!p) { return E_OUT_OF_MEMORY; }
    /* Fresh device memory holds garbage, not zeros. */
    memset(p, 0xA5, rounded);
    fc_alloc *a = malloc(sizeof *a);
    a->ptr = p; a->size = rounded; a->device = dev; a->next = g_allocs;
    g_allocs = a;
    g_used[dev] += rounded;
    *out = p;
    return OK;
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

static int graph_owns_locked(const void *ptr) {
    for (int i = 0; i < g_nstreams; i++) {
        fc_graph *g = g_streams[i]->capture;
        if (!g) continue;
        for (int j = 0; j < g->nowned; j++) if (g->owned[j] == ptr) return 1;
    }
    return 0;
}

FC_EXPORT int fc_free(void *ptr) {
    if (!ptr) return OK;
    lock();
    if (unsafe_call_locked()) { unlock(); return E_CAPTURE_UNSUPPORTED; }
    fc_alloc *a = find_alloc_locked(ptr, 0);
    if (!a) { unlock(); return E_INVALID_VALUE; }
    /* A real cudaFree waits for the device before it releases the memory. */
    wait_device_locked(a->device);
    release_alloc_locked(ptr);
    unlock();
    return OK;
}

FC_EXPORT int fc_free_async(void *ptr, void *stream) {
    lock();
    fc_alloc *a = find_alloc_locked(ptr, 0);
    fc_stream *s = resolve_locked(stream);
    if (a && s && s->capture) {
        /* A free node: graph-owned memory stays for the replays; anything else is an error. */
        int owned = graph_owns_locked(ptr);
        unlock();
        return owned ? OK : E_INVALID_VALUE;
    }
    unlock();
    if (!a) return E_INVALID_VALUE;
    fc_op *op = new_op(OP_FREE);
    op->ptr = ptr;
    return submit(stream, op);
}

FC_EXPORT int fc_mem_get_info(size_t *free_bytes, size_t *total) {
    runtime_touch();
    lock();
    init_locked();
    if (free_bytes) *free_bytes = g_capacity - g_used[t_device];
    if (total) *total = g_capacity;
    unlock();
    return OK;
}

/* Whether [ptr, ptr+n) lies inside one live allocation (for the runtime's argument checks). */
FC_EXPORT int fc_is_device_range(const void *ptr, size_t n) {
    lock();
    fc_alloc *a = find_alloc_locked(ptr, 1);
    int ok = a && (const char *)ptr + n <= a->ptr + a->size;
    unlock();
    return ok;
}

/* The base of the allocation containing ptr, as a real IPC handle refers to it. */
FC_EXPORT int fc_ipc_get_handle(void *handle64, const void *ptr) {
    lock();
    fc_alloc *a = find_alloc_locked(ptr, 1);
    if (!a) { unlock(); return E_INVALID_VALUE; }
    memset(handle64, 0, 64);
    memcpy(handle64, &a->ptr, sizeof a->ptr);
    memcpy((char *)handle64 + 8, &a->size, sizeof a->size);
    unlock();
    return OK;
}

FC_EXPORT int fc_device_reset(void) {
    lock();
    init_locked();
    int dev = t_device;
    wait_device_locked(dev);
    /* Release every allocation of the device (quadratic, which a test stand-in can afford). */
    for (;;) {
        fc_alloc *a = g_allocs;
        while (a && a->device != dev) a = a->next;
        if (!a) break;
        release_alloc_locked(a->ptr);
    }
    unlock();
    return OK;
}

/* ----- devices and contexts --------------------------------------------------------------- */

FC_EXPORT int fc_device_count(void) {
    lock();
    init_locked();
    int n = g_devices;
    unlock();
    return n;
}

FC_EXPORT int fc_get_device(void) { return t_device; }

FC_EXPORT int fc_set_device(int device) {
    if (device < 0 || device >= fc_device_count()) return E_INVALID_DEVICE;
    t_device = device;
    t_context = (void *)(uintptr_t)(0x1000 + device);
    return OK;
}

/* ----- events ------------------------------------------------------------------------------ */

FC_EXPORT int fc_event_create(void **out) {
    if (!out) return E_INVALID_VALUE;
    fc_event *e = calloc(1, sizeof *e);
    e->magic = EVENT_MAGIC;
    *out = e;
    return OK;
}

static fc_event *event_of(void *handle) {
    fc_event *e = handle;
    return (e && e->magic == EVENT_MAGIC) ? e : NULL;
}

FC_EXPORT int fc_event_record(void *handle, void *stream) {
    fc_event *e = event_of(handle);
    if (!e) return E_INVALID_HANDLE;
    fc_op *op = new_op(OP_EVENT);
    lock();
    fc_stream *s = resolve_locked(stream);
    if (!s) { unlock(); free(op); return E_INVALID_HANDLE; }
    op->event = e;
    op->event_generation = ++e->generation;
    e->captured = 0;
    int r = enqueue_locked(s, op);
    unlock();
    return r;
}

/* cudaStreamWaitEvent / cuStreamWaitEvent: the stream's later work waits on the device for the
 * event's latest record; nothing waits on the host. */
FC_EXPORT int fc_stream_wait_event(void *stream, void *handle) {
    fc_event *e = event_of(handle);
    if (!e) return E_INVALID_HANDLE;
    fc_op *op = new_op(OP_WAIT);
    lock();
    fc_stream *s = resolve_locked(stream);
    if (!s) { unlock(); free(op); return E_INVALID_HANDLE; }
    op->event = e;
    op->event_generation = e->generation;
    int r = enqueue_locked(s, op);
    unlock();
    return r;
}

/* ----- stream capture and graphs ----------------------------------------------------------- */

FC_EXPORT int fc_stream_begin_capture(void *handle, int mode) {
    lock();
    fc_stream *s = resolve_locked(handle);
    if (!s) { unlock(); return E_INVALID_HANDLE; }
    if (s->legacy || s->capture || mode < MODE_GLOBAL || mode > MODE_RELAXED) { unlock(); return E_INVALID_VALUE; }
    s->capture = calloc(1, sizeof *s->capture);
    s->capture->magic = GRAPH_MAGIC;
    s->capture_mode = mode;
    s->capture_thread = pthread_self();
    s->capture_invalid = 0;
    unlock();
    return OK;
}

FC_EXPORT int fc_stream_end_capture(void *handle, void **graph) {
    lock();
    fc_stream *s = resolve_locked(handle);
    if (!s || !s->capture) { unlock(); return E_INVALID_VALUE; }
    fc_graph *g = s->capture;
    int invalid = s->capture_invalid;
    s->capture = NULL;
    unlock();
    if (invalid) { *graph = NULL; return E_CAPTURE_INVALIDATED; }
    *graph = g;
    return OK;
}

FC_EXPORT int fc_stream_is_capturing(void *handle, int *status) {
    lock();
    fc_stream *s = resolve_locked(handle);
    if (!s) { unlock(); return E_INVALID_HANDLE; }
    *status = !s->capture ? 0 : s->capture_invalid ? 2 : 1;
    unlock();
    return OK;
}

FC_EXPORT int fc_exchange_capture_mode(int *mode) {
    if (!mode) return E_INVALID_VALUE;
    int old = t_capture_mode;
    t_capture_mode = *mode;
    *mode = old;
    return OK;
}

FC_EXPORT int fc_graph_launch(void *graph, void *stream) {
    fc_graph *g = graph;
    if (!g || g->magic != GRAPH_MAGIC) return E_INVALID_HANDLE;
    lock();
    fc_stream *s = resolve_locked(stream);
    if (!s) { unlock(); return E_INVALID_HANDLE; }
    for (int i = 0; i < g->nops; i++) {
        fc_op *op = new_op(g->ops[i].kind);
        *op = g->ops[i];
        if (op->kind == OP_EVENT) op->event_generation = ++op->event->generation;
        int r = enqueue_locked(s, op);
        if (r != OK) { unlock(); return r; }
    }
    unlock();
    return OK;
}

FC_EXPORT int fc_graph_destroy(void *graph) {
    fc_graph *g = graph;
    if (!g || g->magic != GRAPH_MAGIC) return E_INVALID_HANDLE;
    lock();
    for (int i = 0; i < g->nowned; i++) release_alloc_locked(g->owned[i]);
    g->magic = 0;
    unlock();
    return OK;
}

FC_EXPORT int fc_event_query(void *handle) {
    fc_event *e = event_of(handle);
    if (!e) return E_INVALID_HANDLE;
    lock();
    if (e->captured || unsafe_call_locked()) { unlock(); return E_CAPTURE_UNSUPPORTED; }
    int done = e->completed_generation == e->generation;
    unlock();
    return done ? OK : E_NOT_READY;
}

FC_EXPORT int fc_event_synchronize(void *handle) {
    fc_event *e = event_of(handle);
    if (!e) return E_INVALID_HANDLE;
    lock();
    if (e->captured || unsafe_call_locked()) { unlock(); return E_CAPTURE_UNSUPPORTED; }
    while (e->completed_generation != e->generation) pthread_cond_wait(&g_cond, &g_lock);
    unlock();
    return OK;
}

FC_EXPORT int fc_event_destroy(void *handle) {
    fc_event *e = event_of(handle);
    if (!e) return E_INVALID_HANDLE;
    /* Kept allocated (but invalid) so that a queued record of it stays harmless. */
    e->magic = 0;
    return OK;
}

/* ----- the driver API (cu*) that cachealloc uses through cudarc ----------------------------- */

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUevent;
typedef void *CUstream;

FC_EXPORT CUresult cuInit(unsigned flags) { (void)flags; fc_init(); return OK; }
FC_EXPORT CUresult cuDriverGetVersion(int *v) { if (!v) return E_INVALID_VALUE; *v = 13000; return OK; }
FC_EXPORT CUresult cuDeviceGetCount(int *n) { if (!n) return E_INVALID_VALUE; *n = fc_device_count(); return OK; }
FC_EXPORT CUresult cuDeviceGet(CUdevice *d, int ordinal) {
    if (!d || ordinal < 0 || ordinal >= fc_device_count()) return E_INVALID_DEVICE;
    *d = ordinal;
    return OK;
}
FC_EXPORT CUresult cuDeviceGetName(char *name, int len, CUdevice d) {
    if (!name || len <= 0 || d < 0 || d >= fc_device_count()) return E_INVALID_VALUE;
    snprintf(name, (size_t)len, "fakecuda device %d", d);
    return OK;
}
FC_EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice d) {
    if (!bytes || d < 0 || d >= fc_device_count()) return E_INVALID_VALUE;
    lock();
    init_locked();
    *bytes = g_capacity;
    unlock();
    return OK;
}
FC_EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice d) {
    if (!ctx || d < 0 || d >= fc_device_count()) return E_INVALID_DEVICE;
    *ctx = (void *)(uintptr_t)(0x1000 + d);
    return OK;
}
FC_EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) { (void)d; return OK; }
FC_EXPORT CUresult cuCtxGetCurrent(CUcontext *ctx) { if (!ctx) return E_INVALID_VALUE; *ctx = t_context; return OK; }
FC_EXPORT CUresult cuCtxSetCurrent(CUcontext ctx) {
    uintptr_t v = (uintptr_t)ctx;
    if (ctx == NULL) { t_context = NULL; return OK; }
    if (v < 0x1000 || v >= 0x1000 + (uintptr_t)fc_device_count()) return E_INVALID_CONTEXT;
    t_context = ctx;
    t_device = (int)(v - 0x1000);
    return OK;
}
FC_EXPORT CUresult cuCtxGetDevice(CUdevice *d) {
    if (!d) return E_INVALID_VALUE;
    if (!t_context) return E_INVALID_CONTEXT;
    *d = (int)((uintptr_t)t_context - 0x1000);
    return OK;
}
/* Driver calls need a current context, as with the real driver. */
#define NEED_CONTEXT() do { if (!t_context) return E_INVALID_CONTEXT; } while (0)
FC_EXPORT CUresult cuEventCreate(CUevent *e, unsigned flags) { (void)flags; NEED_CONTEXT(); return fc_event_create(e); }
FC_EXPORT CUresult cuEventRecord(CUevent e, CUstream s) { NEED_CONTEXT(); return fc_event_record(e, s); }
FC_EXPORT CUresult cuEventQuery(CUevent e) { return fc_event_query(e); }
FC_EXPORT CUresult cuEventSynchronize(CUevent e) { return fc_event_synchronize(e); }
FC_EXPORT CUresult cuEventDestroy_v2(CUevent e) { return fc_event_destroy(e); }
FC_EXPORT CUresult cuStreamSynchronize(CUstream s) { return fc_stream_synchronize(s); }
FC_EXPORT CUresult cuStreamQuery(CUstream handle) {
    lock();
    if (unsafe_call_locked()) { unlock(); return E_CAPTURE_UNSUPPORTED; }
    fc_stream *s = resolve_locked(handle);
    int r = !s ? E_INVALID_HANDLE : s->completed == s->enqueued ? OK : E_NOT_READY;
    unlock();
    return r;
}
FC_EXPORT CUresult cuStreamWaitEvent(CUstream s, CUevent e, unsigned flags) { (void)flags; NEED_CONTEXT(); return fc_stream_wait_event(s, e); }
FC_EXPORT CUresult cuThreadExchangeStreamCaptureMode(int *mode) { return fc_exchange_capture_mode(mode); }
FC_EXPORT CUresult cuStreamIsCapturing(CUstream s, int *status) { return status ? fc_stream_is_capturing(s, status) : E_INVALID_VALUE; }

static const char *error_text(int code) {
    switch (code) {
    case OK: return "no error";
    case E_INVALID_VALUE: return "invalid argument";
    case E_OUT_OF_MEMORY: return "out of memory";
    case E_NOT_INITIALIZED: return "initialization error";
    case E_INVALID_DEVICE: return "invalid device ordinal";
    case E_INVALID_CONTEXT: return "invalid device context";
    case E_INVALID_HANDLE: return "invalid resource handle";
    case E_NOT_READY: return "device not ready";
    case E_CAPTURE_UNSUPPORTED: return "operation not permitted when stream is capturing";
    case E_CAPTURE_INVALIDATED: return "operation failed due to a previous error during capture";
    case E_CAPTURE_IMPLICIT: return "operation would make the legacy stream depend on a capturing blocking stream";
    default: return "unknown error";
    }
}
FC_EXPORT const char *fc_error_text(int code) { return error_text(code); }
FC_EXPORT CUresult cuGetErrorString(CUresult r, const char **s) { if (!s) return E_INVALID_VALUE; *s = error_text(r); return OK; }
FC_EXPORT CUresult cuGetErrorName(CUresult r, const char **s) { if (!s) return E_INVALID_VALUE; *s = error_text(r); return OK; }
