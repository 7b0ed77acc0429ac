/*
 * fakecuda's runtime API (built as libcudart.so.13): each cuda* function checks its arguments
 * and calls the driver stand-in (fakecuda.c, libcuda.so.1), which holds all state.
 */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "cuda_runtime.h"

#define RT_EXPORT __attribute__((visibility("default")))

int fc_malloc(void **out, size_t size);
int fc_free(void *ptr);
int fc_free_async(void *ptr, void *stream);
int fc_mem_get_info(size_t *free_bytes, size_t *total);
int fc_device_count(void);
int fc_get_device(void);
int fc_set_device(int device);
int fc_device_synchronize(void);
int fc_device_reset(void);
int fc_stream_create(void **out, unsigned flags);
int fc_stream_destroy(void *stream);
int fc_stream_synchronize(void *stream);
int fc_memset_async(void *ptr, int value, size_t n, void *stream);
int fc_memcpy_async(void *dst, const void *src, size_t n, void *stream);
int fc_launch_host_func(void *stream, void (*fn)(void *), void *arg);
int fc_event_create(void **out);
int fc_event_record(void *event, void *stream);
int fc_event_query(void *event);
int fc_event_synchronize(void *event);
int fc_event_destroy(void *event);
int fc_ipc_get_handle(void *handle64, const void *ptr);
int fc_is_device_range(const void *ptr, size_t n);
const char *fc_error_text(int code);
void fc_init(void);
int fc_malloc_async(void **out, size_t size, void *stream);
int fc_stream_begin_capture(void *stream, int mode);
int fc_stream_end_capture(void *stream, void **graph);
int fc_stream_is_capturing(void *stream, int *status);
int fc_exchange_capture_mode(int *mode);
int fc_graph_launch(void *graph, void *stream);
int fc_graph_destroy(void *graph);
int fc_stream_wait_event(void *stream, void *event);

static __thread cudaError_t t_last_error;

static cudaError_t ret(int code) {
    if (code != 0) t_last_error = (cudaError_t)code;
    return (cudaError_t)code;
}

RT_EXPORT cudaError_t cudaMalloc(void **p, size_t size) { return ret(fc_malloc(p, size)); }
RT_EXPORT cudaError_t cudaFree(void *p) { fc_init(); return ret(fc_free(p)); }
RT_EXPORT cudaError_t cudaMallocAsync(void **p, size_t size, cudaStream_t s) { return ret(fc_malloc_async(p, size, s)); }
RT_EXPORT cudaError_t cudaFreeAsync(void *p, cudaStream_t s) { return ret(fc_free_async(p, s)); }
RT_EXPORT cudaError_t cudaMemGetInfo(size_t *f, size_t *t) { return ret(fc_mem_get_info(f, t)); }
RT_EXPORT cudaError_t cudaGetDeviceCount(int *n) { if (!n) return ret(1); *n = fc_device_count(); return cudaSuccess; }
RT_EXPORT cudaError_t cudaGetDevice(int *d) { if (!d) return ret(1); *d = fc_get_device(); return cudaSuccess; }
RT_EXPORT cudaError_t cudaSetDevice(int d) { return ret(fc_set_device(d)); }
RT_EXPORT cudaError_t cudaDeviceSynchronize(void) { return ret(fc_device_synchronize()); }
RT_EXPORT cudaError_t cudaDeviceReset(void) { return ret(fc_device_reset()); }
RT_EXPORT cudaError_t cudaGetLastError(void) { cudaError_t e = t_last_error; t_last_error = cudaSuccess; return e; }
RT_EXPORT cudaError_t cudaPeekAtLastError(void) { return t_last_error; }
RT_EXPORT const char *cudaGetErrorString(cudaError_t e) { return fc_error_text((int)e); }
RT_EXPORT const char *cudaGetErrorName(cudaError_t e) { return fc_error_text((int)e); }
RT_EXPORT cudaError_t cudaRuntimeGetVersion(int *v) { if (!v) return ret(1); *v = 13000; return cudaSuccess; }
RT_EXPORT cudaError_t cudaDriverGetVersion(int *v) { if (!v) return ret(1); *v = 13000; return cudaSuccess; }
RT_EXPORT cudaError_t cudaStreamCreate(cudaStream_t *s) { return ret(fc_stream_create((void **)s, 0)); }
RT_EXPORT cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned f) { return ret(fc_stream_create((void **)s, f)); }
RT_EXPORT cudaError_t cudaStreamCreateWithPriority(cudaStream_t *s, unsigned f, int p) { (void)p; return ret(fc_stream_create((void **)s, f)); }
RT_EXPORT cudaError_t cudaStreamDestroy(cudaStream_t s) { return ret(fc_stream_destroy(s)); }
RT_EXPORT cudaError_t cudaStreamSynchronize(cudaStream_t s) { return ret(fc_stream_synchronize(s)); }
RT_EXPORT cudaError_t cudaEventCreate(cudaEvent_t *e) { return ret(fc_event_create((void **)e)); }
RT_EXPORT cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned f) { (void)f; return ret(fc_event_create((void **)e)); }
RT_EXPORT cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) { return ret(fc_event_record(e, s)); }
RT_EXPORT cudaError_t cudaEventQuery(cudaEvent_t e) { return (cudaError_t)fc_event_query(e); }
RT_EXPORT cudaError_t cudaEventSynchronize(cudaEvent_t e) { return ret(fc_event_synchronize(e)); }
RT_EXPORT cudaError_t cudaEventDestroy(cudaEvent_t e) { return ret(fc_event_destroy(e)); }
RT_EXPORT cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned f) {
    (void)f;
    return ret(fc_stream_wait_event(s, e));
}

RT_EXPORT cudaError_t cudaMemsetAsync(void *p, int v, size_t n, cudaStream_t s) {
    if (!fc_is_device_range(p, n)) return ret(1);
    return ret(fc_memset_async(p, v, n, s));
}
RT_EXPORT cudaError_t cudaMemset(void *p, int v, size_t n) {
    cudaError_t e = cudaMemsetAsync(p, v, n, 0);
    if (e) return e;
    return ret(fc_stream_synchronize(0));
}
RT_EXPORT cudaError_t cudaMemcpyAsync(void *d, const void *s, size_t n, enum cudaMemcpyKind k, cudaStream_t st) {
    if ((k == cudaMemcpyDeviceToHost || k == cudaMemcpyDeviceToDevice) && !fc_is_device_range(s, n)) return ret(1);
    if ((k == cudaMemcpyHostToDevice || k == cudaMemcpyDeviceToDevice) && !fc_is_device_range(d, n)) return ret(1);
    return ret(fc_memcpy_async(d, s, n, st));
}
RT_EXPORT cudaError_t cudaMemcpy(void *d, const void *s, size_t n, enum cudaMemcpyKind k) {
    cudaError_t e = cudaMemcpyAsync(d, s, n, k, 0);
    if (e) return e;
    return ret(fc_stream_synchronize(0));
}
RT_EXPORT cudaError_t cudaLaunchHostFunc(cudaStream_t s, cudaHostFn_t fn, void *arg) {
    return ret(fc_launch_host_func(s, fn, arg));
}
RT_EXPORT cudaError_t cudaIpcGetMemHandle(cudaIpcMemHandle_t *h, void *p) {
    if (!h) return ret(1);
    return ret(fc_ipc_get_handle(h->reserved, p));
}

/* ----- stream capture and graphs ----- */
RT_EXPORT cudaError_t cudaStreamBeginCapture(cudaStream_t s, enum cudaStreamCaptureMode m) { return ret(fc_stream_begin_capture(s, (int)m)); }
RT_EXPORT cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t *g) {
    if (!g) return ret(1);
    return ret(fc_stream_end_capture(s, (void **)g));
}
RT_EXPORT cudaError_t cudaStreamIsCapturing(cudaStream_t s, enum cudaStreamCaptureStatus *st) {
    if (!st) return ret(1);
    int v = 0;
    int r = fc_stream_is_capturing(s, &v);
    *st = (enum cudaStreamCaptureStatus)v;
    return ret(r);
}
RT_EXPORT cudaError_t cudaThreadExchangeStreamCaptureMode(enum cudaStreamCaptureMode *m) { return ret(fc_exchange_capture_mode((int *)m)); }
RT_EXPORT cudaError_t cudaGraphInstantiate(cudaGraphExec_t *e, cudaGraph_t g, unsigned long long flags) {
    (void)flags;
    if (!e || !g) return ret(1);
    *e = (cudaGraphExec_t)g; /* an executable is its graph here */
    return cudaSuccess;
}
RT_EXPORT cudaError_t cudaGraphLaunch(cudaGraphExec_t e, cudaStream_t s) { return ret(fc_graph_launch(e, s)); }
RT_EXPORT cudaError_t cudaGraphExecDestroy(cudaGraphExec_t e) { (void)e; return cudaSuccess; }
RT_EXPORT cudaError_t cudaGraphDestroy(cudaGraph_t g) { return ret(fc_graph_destroy(g)); }

/* ----- memory pools: one default pool per device; its statistics count this runtime's
 * allocations (cachealloc answers them itself for the pools it serves). ----- */
#define POOL_BASE 0x7000
RT_EXPORT cudaError_t cudaDeviceGetDefaultMemPool(cudaMemPool_t *p, int device) {
    if (!p || device < 0 || device >= fc_device_count()) return ret(1);
    *p = (cudaMemPool_t)(uintptr_t)(POOL_BASE + device);
    return cudaSuccess;
}
static int pool_device(cudaMemPool_t p) {
    uintptr_t v = (uintptr_t)p;
    return (v >= POOL_BASE && v < POOL_BASE + (uintptr_t)fc_device_count()) ? (int)(v - POOL_BASE) : -1;
}
RT_EXPORT cudaError_t cudaMemPoolGetAttribute(cudaMemPool_t p, enum cudaMemPoolAttr a, void *v) {
    if (pool_device(p) < 0 || !v) return ret(1);
    size_t free_bytes = 0, total = 0;
    fc_mem_get_info(&free_bytes, &total);
    switch (a) {
    case cudaMemPoolAttrReservedMemCurrent: case cudaMemPoolAttrReservedMemHigh:
    case cudaMemPoolAttrUsedMemCurrent: case cudaMemPoolAttrUsedMemHigh:
        *(unsigned long long *)v = total - free_bytes;
        return cudaSuccess;
    default:
        *(unsigned long long *)v = 0;
        return cudaSuccess;
    }
}
RT_EXPORT cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t p, enum cudaMemPoolAttr a, void *v) {
    if (pool_device(p) < 0 || !v) return ret(1);
    if ((a == cudaMemPoolAttrReservedMemHigh || a == cudaMemPoolAttrUsedMemHigh) && *(unsigned long long *)v != 0) return ret(1);
    return cudaSuccess;
}
RT_EXPORT cudaError_t cudaMemPoolTrimTo(cudaMemPool_t p, size_t keep) { (void)keep; return pool_device(p) < 0 ? ret(1) : cudaSuccess; }
