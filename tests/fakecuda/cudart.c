/*
 * fakecuda's runtime API, built twice: the shared libcudart.so.13 and the static
 * libcudart_static.a (compiled with -fvisibility=hidden and CUDART_STATIC, so that its cuda*
 * functions stay local to the program that links it, like nvcc's default static cudart).
 *
 * Like the real CUDA 13 runtime, it has no link-time dependency on the driver: at the first
 * runtime call (pthread_once) it does dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL), looks up
 * cuGetProcAddress_v2 with dlsym and resolves every driver entry point it uses through it, by
 * base name and the CUDA version of the ABI it was written against ("cuMemAlloc" at 3020 gives
 * cuMemAlloc_v2, "cuMemAllocAsync" at 11020 gives cuMemAllocAsync, ...), with the default
 * (legacy stream) flags; the static flavour passes no status pointer, as the real static runtime
 * does. Only if the driver lacks cuGetProcAddress_v2 does it dlsym the versioned names. Then
 * cuInit(0). Nothing here calls an exported cu* or cuda* name: the exports are wrappers over
 * static functions and the driver is only called through the resolved pointers (the shared
 * library is also linked with -Bsymbolic and -z defs).
 *
 * Each cuda* function checks its arguments and calls the driver (fakecuda.c, which holds all
 * state); driver errors are returned unchanged (CUresult and cudaError_t agree on every code
 * used here) and kept as the thread's last error. Contexts as in the real runtime: cudaSetDevice
 * retains the device's primary context and makes it current; cudaGetDevice gives the current
 * context's device if one is current (else the thread's device, 0 by default); every other call
 * first makes the thread's device's primary context current if no context is (and retains a
 * primary context again after cudaDeviceReset reset it). cudaGetDriverEntryPoint[ByVersion]
 * hand requests to the resolved cuGetProcAddress_v2 (cudaGetDriverEntryPoint at version 13000).
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "cuda.h"
#include "cuda_runtime.h"

#ifdef CUDART_STATIC
#define RT_EXPORT /* hidden (-fvisibility=hidden): local to the program */
#else
#define RT_EXPORT __attribute__((visibility("default")))
#endif

#define RUNTIME_VERSION 13000
#define MAX_DEVICES 8

/* Every driver function the runtime calls: the exported (versioned) name, which is also the
 * fallback for dlsym, the base name to resolve and the CUDA version to resolve it at. */
#define DRIVER_API(X) \
    X(cuInit, "cuInit", 2000) \
    X(cuDriverGetVersion, "cuDriverGetVersion", 2020) \
    X(cuDeviceGetCount, "cuDeviceGetCount", 2000) \
    X(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", 7000) \
    X(cuDevicePrimaryCtxReset_v2, "cuDevicePrimaryCtxReset", 11000) \
    X(cuCtxGetCurrent, "cuCtxGetCurrent", 4000) \
    X(cuCtxSetCurrent, "cuCtxSetCurrent", 4000) \
    X(cuCtxGetDevice, "cuCtxGetDevice", 2000) \
    X(cuDeviceCanAccessPeer, "cuDeviceCanAccessPeer", 4000) \
    X(cuCtxEnablePeerAccess, "cuCtxEnablePeerAccess", 4000) \
    X(cuCtxSynchronize, "cuCtxSynchronize", 2000) \
    X(cuMemAlloc_v2, "cuMemAlloc", 3020) \
    X(cuMemFree_v2, "cuMemFree", 3020) \
    X(cuMemGetInfo_v2, "cuMemGetInfo", 3020) \
    X(cuMemAllocAsync, "cuMemAllocAsync", 11020) \
    X(cuMemFreeAsync, "cuMemFreeAsync", 11020) \
    X(cuMemsetD8Async, "cuMemsetD8Async", 3020) \
    X(cuMemcpyAsync, "cuMemcpyAsync", 4000) \
    X(cuMemcpyHtoDAsync_v2, "cuMemcpyHtoDAsync", 3020) \
    X(cuMemcpyDtoHAsync_v2, "cuMemcpyDtoHAsync", 3020) \
    X(cuMemcpyDtoDAsync_v2, "cuMemcpyDtoDAsync", 3020) \
    X(cuLaunchHostFunc, "cuLaunchHostFunc", 10000) \
    X(cuIpcGetMemHandle, "cuIpcGetMemHandle", 4010) \
    X(cuIpcOpenMemHandle_v2, "cuIpcOpenMemHandle", 11000) \
    X(cuIpcCloseMemHandle, "cuIpcCloseMemHandle", 4010) \
    X(cuStreamCreate, "cuStreamCreate", 2000) \
    X(cuStreamCreateWithPriority, "cuStreamCreateWithPriority", 5050) \
    X(cuStreamDestroy_v2, "cuStreamDestroy", 4000) \
    X(cuStreamSynchronize, "cuStreamSynchronize", 2000) \
    X(cuStreamWaitEvent, "cuStreamWaitEvent", 3020) \
    X(cuEventCreate, "cuEventCreate", 2000) \
    X(cuEventRecord, "cuEventRecord", 2000) \
    X(cuEventQuery, "cuEventQuery", 2000) \
    X(cuEventSynchronize, "cuEventSynchronize", 2000) \
    X(cuEventDestroy_v2, "cuEventDestroy", 4000) \
    X(cuStreamBeginCapture_v2, "cuStreamBeginCapture", 10010) \
    X(cuStreamEndCapture, "cuStreamEndCapture", 10000) \
    X(cuStreamIsCapturing, "cuStreamIsCapturing", 10000) \
    X(cuThreadExchangeStreamCaptureMode, "cuThreadExchangeStreamCaptureMode", 10010) \
    X(cuGraphInstantiateWithFlags, "cuGraphInstantiateWithFlags", 11040) \
    X(cuGraphLaunch, "cuGraphLaunch", 10000) \
    X(cuGraphExecDestroy, "cuGraphExecDestroy", 10000) \
    X(cuGraphDestroy, "cuGraphDestroy", 10000) \
    X(cuDeviceGetDefaultMemPool, "cuDeviceGetDefaultMemPool", 11020) \
    X(cuMemPoolGetAttribute, "cuMemPoolGetAttribute", 11020) \
    X(cuMemPoolSetAttribute, "cuMemPoolSetAttribute", 11020) \
    X(cuMemPoolTrimTo, "cuMemPoolTrimTo", 11020) \
    X(cuMemPoolSetAccess, "cuMemPoolSetAccess", 11020)

/* The resolved driver functions, typed from cuda.h's declarations (never called by name). */
static struct {
#define X(fn, name, version) __typeof__(fn) *fn;
    DRIVER_API(X)
#undef X
} drv;

typedef CUresult (*get_proc_fn)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);
static get_proc_fn g_get_proc; /* the driver's cuGetProcAddress_v2 */
static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static cudaError_t g_init_error;

static void *resolve(void *driver, const char *name, int version, const char *exported) {
    void *fn = NULL;
    if (!g_get_proc) return dlsym(driver, exported);
#ifdef CUDART_STATIC
    CUresult r = g_get_proc(name, &fn, version, CU_GET_PROC_ADDRESS_DEFAULT, NULL);
#else
    CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SUCCESS;
    CUresult r = g_get_proc(name, &fn, version, CU_GET_PROC_ADDRESS_DEFAULT, &status);
    if (status != CU_GET_PROC_ADDRESS_SUCCESS) r = CUDA_ERROR_NOT_FOUND;
#endif
    return r == CUDA_SUCCESS ? fn : NULL;
}

static void load_driver(void) {
    void *driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!driver) { g_init_error = cudaErrorInsufficientDriver; return; }
    void *get_proc = dlsym(driver, "cuGetProcAddress_v2");
    memcpy(&g_get_proc, &get_proc, sizeof get_proc);
    int missing = 0;
#define X(fn, name, version) { \
        void *p = resolve(driver, name, version, #fn); \
        missing |= p == NULL; \
        memcpy(&drv.fn, &p, sizeof p); \
    }
    DRIVER_API(X)
#undef X
    if (missing) { g_init_error = cudaErrorInsufficientDriver; return; }
    g_init_error = (cudaError_t)drv.cuInit(0);
}

/* The driver, loaded and initialized once. */
static cudaError_t driver(void) {
    pthread_once(&g_once, load_driver);
    return g_init_error;
}

static __thread cudaError_t t_last_error;

static cudaError_t ret(int code) {
    if (code != cudaSuccess) t_last_error = (cudaError_t)code;
    return (cudaError_t)code;
}

/* ----- devices and contexts ----- */

static __thread int t_device; /* the thread's device while no context is current */
static pthread_mutex_t g_ctx_lock = PTHREAD_MUTEX_INITIALIZER;
static CUcontext g_primary[MAX_DEVICES];
static int g_retained[MAX_DEVICES]; /* the runtime holds a reference on the primary context */

static cudaError_t retain_primary(int device, CUcontext *ctx) {
    if (device < 0 || device >= MAX_DEVICES) return cudaErrorInvalidDevice;
    pthread_mutex_lock(&g_ctx_lock);
    CUresult r = CUDA_SUCCESS;
    if (!__atomic_load_n(&g_retained[device], __ATOMIC_ACQUIRE)) {
        r = drv.cuDevicePrimaryCtxRetain(&g_primary[device], device);
        if (r == CUDA_SUCCESS) __atomic_store_n(&g_retained[device], 1, __ATOMIC_RELEASE);
    }
    if (r == CUDA_SUCCESS) *ctx = g_primary[device];
    pthread_mutex_unlock(&g_ctx_lock);
    return (cudaError_t)r;
}

/* Before a runtime call: the thread's device's primary context is made current if no context
 * is; a primary context that cudaDeviceReset reset is retained again. */
static cudaError_t context(void) {
    cudaError_t e = driver();
    if (e != cudaSuccess) return e;
    CUcontext ctx = NULL;
    CUresult r = drv.cuCtxGetCurrent(&ctx);
    if (r != CUDA_SUCCESS) return (cudaError_t)r;
    if (ctx) {
        for (int d = 0; d < MAX_DEVICES; d++)
            if (ctx == g_primary[d] && !__atomic_load_n(&g_retained[d], __ATOMIC_ACQUIRE))
                return retain_primary(d, &ctx);
        return cudaSuccess;
    }
    e = retain_primary(t_device, &ctx);
    if (e != cudaSuccess) return e;
    return (cudaError_t)drv.cuCtxSetCurrent(ctx);
}

/* Run `call` (a CUresult expression) after making a context current; the result becomes the
 * call's cudaError_t (and the thread's last error). */
#define WITH_CONTEXT(call) do { \
        cudaError_t e_ = context(); \
        if (e_ != cudaSuccess) return ret(e_); \
        return ret((int)(call)); \
    } while (0)

static int device_count(void) {
    int n = 0;
    if (driver() != cudaSuccess || drv.cuDeviceGetCount(&n) != CUDA_SUCCESS) return 0;
    return n;
}

static int current_device(void) {
    CUcontext ctx = NULL;
    CUdevice d = 0;
    if (driver() == cudaSuccess && drv.cuCtxGetCurrent(&ctx) == CUDA_SUCCESS && ctx &&
        drv.cuCtxGetDevice(&d) == CUDA_SUCCESS)
        return d;
    return t_device;
}

static CUdeviceptr dptr(const void *p) { return (CUdeviceptr)(uintptr_t)p; }

/* ----- memory ----- */

static cudaError_t rt_malloc(void **p, size_t size) {
    cudaError_t e = context();
    if (e != cudaSuccess) return ret(e);
    if (!p) return ret(cudaErrorInvalidValue);
    if (size == 0) { *p = NULL; return cudaSuccess; }
    CUdeviceptr d = 0;
    CUresult r = drv.cuMemAlloc_v2(&d, size);
    if (r == CUDA_SUCCESS) *p = (void *)(uintptr_t)d;
    return ret(r);
}

static cudaError_t rt_free(void *p) {
    cudaError_t e = context();
    if (e != cudaSuccess) return ret(e);
    if (!p) return cudaSuccess;
    return ret(drv.cuMemFree_v2(dptr(p)));
}

static cudaError_t rt_malloc_async(void **p, size_t size, cudaStream_t s) {
    cudaError_t e = context();
    if (e != cudaSuccess) return ret(e);
    if (!p) return ret(cudaErrorInvalidValue);
    if (size == 0) { *p = NULL; return cudaSuccess; }
    CUdeviceptr d = 0;
    CUresult r = drv.cuMemAllocAsync(&d, size, (CUstream)s);
    if (r == CUDA_SUCCESS) *p = (void *)(uintptr_t)d;
    return ret(r);
}

static cudaError_t rt_memset_async(void *p, int v, size_t n, cudaStream_t s) {
    WITH_CONTEXT(drv.cuMemsetD8Async(dptr(p), (unsigned char)v, n, (CUstream)s));
}

static cudaError_t rt_memcpy_async(void *d, const void *s, size_t n, enum cudaMemcpyKind k, cudaStream_t st) {
    cudaError_t e = context();
    if (e != cudaSuccess) return ret(e);
    switch (k) {
    case cudaMemcpyHostToDevice: return ret(drv.cuMemcpyHtoDAsync_v2(dptr(d), s, n, (CUstream)st));
    case cudaMemcpyDeviceToHost: return ret(drv.cuMemcpyDtoHAsync_v2(d, dptr(s), n, (CUstream)st));
    case cudaMemcpyDeviceToDevice: return ret(drv.cuMemcpyDtoDAsync_v2(dptr(d), dptr(s), n, (CUstream)st));
    default: return ret(drv.cuMemcpyAsync(dptr(d), dptr(s), n, (CUstream)st)); /* unified addressing */
    }
}

static cudaError_t rt_stream_synchronize(cudaStream_t s) { WITH_CONTEXT(drv.cuStreamSynchronize((CUstream)s)); }

RT_EXPORT cudaError_t cudaMalloc(void **p, size_t size) { return rt_malloc(p, size); }
RT_EXPORT cudaError_t cudaFree(void *p) { return rt_free(p); }
RT_EXPORT cudaError_t cudaMallocAsync(void **p, size_t size, cudaStream_t s) { return rt_malloc_async(p, size, s); }
RT_EXPORT cudaError_t cudaFreeAsync(void *p, cudaStream_t s) { WITH_CONTEXT(drv.cuMemFreeAsync(dptr(p), (CUstream)s)); }
RT_EXPORT cudaError_t cudaMemGetInfo(size_t *f, size_t *t) { WITH_CONTEXT(drv.cuMemGetInfo_v2(f, t)); }
RT_EXPORT cudaError_t cudaMemsetAsync(void *p, int v, size_t n, cudaStream_t s) { return rt_memset_async(p, v, n, s); }
RT_EXPORT cudaError_t cudaMemset(void *p, int v, size_t n) {
    cudaError_t e = rt_memset_async(p, v, n, 0);
    if (e != cudaSuccess) return e;
    return rt_stream_synchronize(0);
}
RT_EXPORT cudaError_t cudaMemcpyAsync(void *d, const void *s, size_t n, enum cudaMemcpyKind k, cudaStream_t st) {
    return rt_memcpy_async(d, s, n, k, st);
}
RT_EXPORT cudaError_t cudaMemcpy(void *d, const void *s, size_t n, enum cudaMemcpyKind k) {
    cudaError_t e = rt_memcpy_async(d, s, n, k, 0);
    if (e != cudaSuccess) return e;
    return rt_stream_synchronize(0);
}
RT_EXPORT cudaError_t cudaLaunchHostFunc(cudaStream_t s, cudaHostFn_t fn, void *arg) {
    WITH_CONTEXT(drv.cuLaunchHostFunc((CUstream)s, fn, arg));
}
RT_EXPORT cudaError_t cudaIpcGetMemHandle(cudaIpcMemHandle_t *h, void *p) {
    if (!h) return ret(cudaErrorInvalidValue);
    WITH_CONTEXT(drv.cuIpcGetMemHandle((CUipcMemHandle *)h, dptr(p)));
}
RT_EXPORT cudaError_t cudaIpcOpenMemHandle(void **p, cudaIpcMemHandle_t h, unsigned flags) {
    if (!p) return ret(cudaErrorInvalidValue);
    CUipcMemHandle handle;
    memcpy(handle.reserved, h.reserved, sizeof handle.reserved);
    WITH_CONTEXT(drv.cuIpcOpenMemHandle_v2((CUdeviceptr *)p, handle, flags));
}
RT_EXPORT cudaError_t cudaIpcCloseMemHandle(void *p) {
    WITH_CONTEXT(drv.cuIpcCloseMemHandle(dptr(p)));
}

/* ----- devices ----- */

RT_EXPORT cudaError_t cudaGetDeviceCount(int *n) {
    if (!n) return ret(cudaErrorInvalidValue);
    cudaError_t e = driver();
    if (e != cudaSuccess) return ret(e);
    return ret(drv.cuDeviceGetCount(n));
}
RT_EXPORT cudaError_t cudaGetDevice(int *d) {
    if (!d) return ret(cudaErrorInvalidValue);
    cudaError_t e = driver();
    if (e != cudaSuccess) return ret(e);
    *d = current_device();
    return cudaSuccess;
}
RT_EXPORT cudaError_t cudaSetDevice(int d) {
    cudaError_t e = driver();
    if (e != cudaSuccess) return ret(e);
    if (d < 0 || d >= device_count()) return ret(cudaErrorInvalidDevice);
    t_device = d;
    CUcontext ctx = NULL;
    e = retain_primary(d, &ctx);
    if (e != cudaSuccess) return ret(e);
    return ret(drv.cuCtxSetCurrent(ctx));
}
RT_EXPORT cudaError_t cudaDeviceSynchronize(void) { WITH_CONTEXT(drv.cuCtxSynchronize()); }
RT_EXPORT cudaError_t cudaDeviceCanAccessPeer(int *can, int device, int peer) {
    cudaError_t e = driver();
    if (e != cudaSuccess) return ret(e);
    return ret((int)drv.cuDeviceCanAccessPeer(can, device, peer));
}

/* The current device may use `peer`'s memory: the driver's call with the peer's primary
 * context (retained, as the real runtime does). */
RT_EXPORT cudaError_t cudaDeviceEnablePeerAccess(int peer, unsigned flags) {
    cudaError_t e = context();
    if (e != cudaSuccess) return ret(e);
    if (peer < 0 || peer >= device_count()) return ret(cudaErrorInvalidDevice);
    CUcontext peer_ctx = NULL;
    e = retain_primary(peer, &peer_ctx);
    if (e != cudaSuccess) return ret(e);
    return ret((int)drv.cuCtxEnablePeerAccess(peer_ctx, flags));
}

/* Resets the current device's primary context (all its memory goes); the next runtime call
 * retains it again. */
RT_EXPORT cudaError_t cudaDeviceReset(void) {
    cudaError_t e = driver();
    if (e != cudaSuccess) return ret(e);
    int d = current_device();
    if (d < 0 || d >= MAX_DEVICES) return ret(cudaErrorInvalidDevice);
    pthread_mutex_lock(&g_ctx_lock);
    CUresult r = drv.cuDevicePrimaryCtxReset_v2(d);
    if (r == CUDA_SUCCESS) __atomic_store_n(&g_retained[d], 0, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&g_ctx_lock);
    return ret(r);
}

/* ----- errors and versions ----- */

static const char *error_text(cudaError_t code) {
    switch ((int)code) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInitializationError: return "initialization error";
    case cudaErrorCudartUnloading: return "driver shutting down";
    case cudaErrorInsufficientDriver: return "CUDA driver version is insufficient for CUDA runtime version";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorDeviceUninitialized: return "invalid device context";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorSymbolNotFound: return "named symbol not found";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorNotSupported: return "operation not supported";
    case cudaErrorStreamCaptureUnsupported: return "operation not permitted when stream is capturing";
    case cudaErrorStreamCaptureInvalidated: return "operation failed due to a previous error during capture";
    case cudaErrorStreamCaptureImplicit: return "operation would make the legacy stream depend on a capturing blocking stream";
    default: return "unknown error";
    }
}

RT_EXPORT cudaError_t cudaGetLastError(void) { cudaError_t e = t_last_error; t_last_error = cudaSuccess; return e; }
RT_EXPORT cudaError_t cudaPeekAtLastError(void) { return t_last_error; }
RT_EXPORT const char *cudaGetErrorString(cudaError_t e) { return error_text(e); }
RT_EXPORT const char *cudaGetErrorName(cudaError_t e) { return error_text(e); }
RT_EXPORT cudaError_t cudaRuntimeGetVersion(int *v) {
    if (!v) return ret(cudaErrorInvalidValue);
    *v = RUNTIME_VERSION;
    return cudaSuccess;
}
RT_EXPORT cudaError_t cudaDriverGetVersion(int *v) {
    if (!v) return ret(cudaErrorInvalidValue);
    *v = 0; /* no driver */
    if (driver() == cudaSuccess) return ret(drv.cuDriverGetVersion(v));
    return cudaSuccess;
}

/* ----- streams and events ----- */

static cudaError_t rt_stream_create(cudaStream_t *s, unsigned flags) {
    WITH_CONTEXT(drv.cuStreamCreate((CUstream *)s, flags));
}
RT_EXPORT cudaError_t cudaStreamCreate(cudaStream_t *s) { return rt_stream_create(s, cudaStreamDefault); }
RT_EXPORT cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned f) { return rt_stream_create(s, f); }
RT_EXPORT cudaError_t cudaStreamCreateWithPriority(cudaStream_t *s, unsigned f, int p) {
    WITH_CONTEXT(drv.cuStreamCreateWithPriority((CUstream *)s, f, p));
}
RT_EXPORT cudaError_t cudaStreamDestroy(cudaStream_t s) { WITH_CONTEXT(drv.cuStreamDestroy_v2((CUstream)s)); }
RT_EXPORT cudaError_t cudaStreamSynchronize(cudaStream_t s) { return rt_stream_synchronize(s); }
RT_EXPORT cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned f) {
    (void)f;
    WITH_CONTEXT(drv.cuStreamWaitEvent((CUstream)s, (CUevent)e, 0));
}
static cudaError_t rt_event_create(cudaEvent_t *e, unsigned flags) {
    WITH_CONTEXT(drv.cuEventCreate((CUevent *)e, flags));
}
RT_EXPORT cudaError_t cudaEventCreate(cudaEvent_t *e) { return rt_event_create(e, cudaEventDefault); }
RT_EXPORT cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned f) { return rt_event_create(e, f); }
RT_EXPORT cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
    WITH_CONTEXT(drv.cuEventRecord((CUevent)e, (CUstream)s));
}
/* Not ready is a status, not an error: it does not become the last error. */
RT_EXPORT cudaError_t cudaEventQuery(cudaEvent_t e) {
    cudaError_t err = context();
    if (err != cudaSuccess) return ret(err);
    return (cudaError_t)drv.cuEventQuery((CUevent)e);
}
RT_EXPORT cudaError_t cudaEventSynchronize(cudaEvent_t e) { WITH_CONTEXT(drv.cuEventSynchronize((CUevent)e)); }
RT_EXPORT cudaError_t cudaEventDestroy(cudaEvent_t e) { WITH_CONTEXT(drv.cuEventDestroy_v2((CUevent)e)); }

/* ----- stream capture and graphs ----- */

RT_EXPORT cudaError_t cudaStreamBeginCapture(cudaStream_t s, enum cudaStreamCaptureMode m) {
    WITH_CONTEXT(drv.cuStreamBeginCapture_v2((CUstream)s, (CUstreamCaptureMode)m));
}
RT_EXPORT cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t *g) {
    if (!g) return ret(cudaErrorInvalidValue);
    WITH_CONTEXT(drv.cuStreamEndCapture((CUstream)s, (CUgraph *)g));
}
RT_EXPORT cudaError_t cudaStreamIsCapturing(cudaStream_t s, enum cudaStreamCaptureStatus *st) {
    if (!st) return ret(cudaErrorInvalidValue);
    cudaError_t e = context();
    if (e != cudaSuccess) return ret(e);
    CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
    CUresult r = drv.cuStreamIsCapturing((CUstream)s, &status);
    *st = (enum cudaStreamCaptureStatus)status;
    return ret(r);
}
RT_EXPORT cudaError_t cudaThreadExchangeStreamCaptureMode(enum cudaStreamCaptureMode *m) {
    if (!m) return ret(cudaErrorInvalidValue);
    cudaError_t e = driver();
    if (e != cudaSuccess) return ret(e);
    CUstreamCaptureMode mode = (CUstreamCaptureMode)*m;
    CUresult r = drv.cuThreadExchangeStreamCaptureMode(&mode);
    *m = (enum cudaStreamCaptureMode)mode;
    return ret(r);
}
RT_EXPORT cudaError_t cudaGraphInstantiate(cudaGraphExec_t *e, cudaGraph_t g, unsigned long long flags) {
    if (!e || !g) return ret(cudaErrorInvalidValue);
    WITH_CONTEXT(drv.cuGraphInstantiateWithFlags((CUgraphExec *)e, (CUgraph)g, flags));
}
RT_EXPORT cudaError_t cudaGraphInstantiateWithFlags(cudaGraphExec_t *e, cudaGraph_t g, unsigned long long flags) {
    return cudaGraphInstantiate(e, g, flags);
}
RT_EXPORT cudaError_t cudaGraphLaunch(cudaGraphExec_t e, cudaStream_t s) {
    WITH_CONTEXT(drv.cuGraphLaunch((CUgraphExec)e, (CUstream)s));
}
RT_EXPORT cudaError_t cudaGraphExecDestroy(cudaGraphExec_t e) { WITH_CONTEXT(drv.cuGraphExecDestroy((CUgraphExec)e)); }
RT_EXPORT cudaError_t cudaGraphDestroy(cudaGraph_t g) { WITH_CONTEXT(drv.cuGraphDestroy((CUgraph)g)); }

/* ----- memory pools: the driver's default pool per device ----- */

RT_EXPORT cudaError_t cudaDeviceGetDefaultMemPool(cudaMemPool_t *p, int device) {
    cudaError_t e = context();
    if (e != cudaSuccess) return ret(e);
    if (!p || device < 0 || device >= device_count()) return ret(cudaErrorInvalidValue);
    return ret(drv.cuDeviceGetDefaultMemPool((CUmemoryPool *)p, device));
}
RT_EXPORT cudaError_t cudaMemPoolGetAttribute(cudaMemPool_t p, enum cudaMemPoolAttr a, void *v) {
    WITH_CONTEXT(drv.cuMemPoolGetAttribute((CUmemoryPool)p, (CUmemPool_attribute)a, v));
}
RT_EXPORT cudaError_t cudaMemPoolSetAccess(cudaMemPool_t p, const struct cudaMemAccessDesc *d, size_t n) {
    WITH_CONTEXT(drv.cuMemPoolSetAccess((CUmemoryPool)p, (const CUmemAccessDesc *)d, n));
}
RT_EXPORT cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t p, enum cudaMemPoolAttr a, void *v) {
    WITH_CONTEXT(drv.cuMemPoolSetAttribute((CUmemoryPool)p, (CUmemPool_attribute)a, v));
}
RT_EXPORT cudaError_t cudaMemPoolTrimTo(cudaMemPool_t p, size_t keep) {
    WITH_CONTEXT(drv.cuMemPoolTrimTo((CUmemoryPool)p, keep));
}

/* ----- driver entry points ----- */

static cudaError_t rt_entry_point(const char *symbol, void **fn, unsigned version, unsigned long long flags,
                                  enum cudaDriverEntryPointQueryResult *status) {
    cudaError_t e = driver();
    if (e != cudaSuccess) return ret(e);
    if (!symbol || !fn) return ret(cudaErrorInvalidValue);
    if (!g_get_proc) return ret(cudaErrorNotSupported);
    CUdriverProcAddressQueryResult found = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    CUresult r = g_get_proc(symbol, fn, (int)version, flags, &found);
    if (r == CUDA_SUCCESS) {
        if (status) *status = cudaDriverEntryPointSuccess;
        return cudaSuccess;
    }
    *fn = NULL;
    if (r == CUDA_ERROR_NOT_FOUND) {
        if (status) *status = (enum cudaDriverEntryPointQueryResult)found;
        return ret(cudaErrorSymbolNotFound);
    }
    return ret(r);
}
RT_EXPORT cudaError_t cudaGetDriverEntryPoint(const char *symbol, void **fn, unsigned long long flags,
                                              enum cudaDriverEntryPointQueryResult *status) {
    return rt_entry_point(symbol, fn, RUNTIME_VERSION, flags, status);
}
RT_EXPORT cudaError_t cudaGetDriverEntryPointByVersion(const char *symbol, void **fn, unsigned int version,
                                                       unsigned long long flags,
                                                       enum cudaDriverEntryPointQueryResult *status) {
    return rt_entry_point(symbol, fn, version, flags, status);
}
