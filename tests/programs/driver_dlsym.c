/* The driver as cuBLAS and JAX's XLA plugin reach it: not linked, but
 * dlopen("libcuda.so.1", RTLD_LOCAL) and dlsym of each versioned symbol (cuMemAlloc_v2, ...).
 * 1000 alloc/free pairs of one size and a small cross-stream reuse race through those pointers;
 * then the resolver's edge cases through the dlsym'd cuGetProcAddress_v2: an old version gets
 * the v1 cuMemAlloc (a different ABI: it must refuse and write nothing), an unknown name and a
 * too old version are not found, and cuMemAllocAsync resolves with and without the per-thread
 * flag to working functions. Prints "OK driver_dlsym". */
#include <cuda.h>
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define FAIL(...) do { printf("FAIL: "); printf(__VA_ARGS__); printf("\n"); fflush(stdout); exit(1); } while (0)
#define CU(call) do { CUresult r_ = (call); if (r_ != CUDA_SUCCESS) \
    FAIL("%s:%d: %s returned %d", __FILE__, __LINE__, #call, (int)r_); } while (0)
#define EXPECT(cond, ...) do { if (!(cond)) FAIL(__VA_ARGS__); } while (0)

#define MIB ((size_t)1 << 20)

/* The functions, by their exported (ABI) names. */
static CUresult (*p_cuInit)(unsigned int);
static CUresult (*p_cuDeviceGet)(CUdevice *, int);
static CUresult (*p_cuDevicePrimaryCtxRetain)(CUcontext *, CUdevice);
static CUresult (*p_cuCtxSetCurrent)(CUcontext);
static CUresult (*p_cuMemAlloc_v2)(CUdeviceptr *, size_t);
static CUresult (*p_cuMemFree_v2)(CUdeviceptr);
static CUresult (*p_cuMemsetD8Async)(CUdeviceptr, unsigned char, size_t, CUstream);
static CUresult (*p_cuMemcpyDtoHAsync_v2)(void *, CUdeviceptr, size_t, CUstream);
static CUresult (*p_cuStreamSynchronize)(CUstream);
static CUresult (*p_cuStreamCreate)(CUstream *, unsigned int);
static CUresult (*p_cuLaunchHostFunc)(CUstream, CUhostFn, void *);
static CUresult (*p_cuMemAllocAsync)(CUdeviceptr *, size_t, CUstream);
static CUresult (*p_cuMemFreeAsync)(CUdeviceptr, CUstream);
static CUresult (*p_cuGetProcAddress_v2)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);

/* The v1 cuMemAlloc: 32-bit device pointer and size. */
typedef CUresult (*mem_alloc_v1_fn)(unsigned int *, unsigned int);
typedef CUresult (*mem_alloc_async_fn)(CUdeviceptr *, size_t, CUstream);
typedef CUresult (*mem_free_async_fn)(CUdeviceptr, CUstream);

static void *driver;

static void *symbol(const char *name) {
    void *p = dlsym(driver, name);
    EXPECT(p != NULL, "libcuda.so.1 has no %s", name);
    return p;
}
#define LOAD(name) memcpy(&p_##name, &(void *){symbol(#name)}, sizeof(void *))

static long first_wrong_byte(CUdeviceptr dev, unsigned char value, size_t bytes, CUstream stream) {
    unsigned char *host = malloc(bytes);
    CU(p_cuMemcpyDtoHAsync_v2(host, dev, bytes, stream));
    CU(p_cuStreamSynchronize(stream));
    long bad = -1;
    for (size_t i = 0; i < bytes; i++) if (host[i] != value) { bad = (long)i; break; }
    free(host);
    return bad;
}

static void sleep_ms(void *arg) { usleep((useconds_t)(size_t)arg * 1000); }

/* Resolve `name` at `version` with `flags`; returns the pointer (NULL when not found). */
static void *resolve(const char *name, int version, cuuint64_t flags, CUresult *result,
                     CUdriverProcAddressQueryResult *status) {
    void *fn = (void *)&resolve; /* a sentinel the call must overwrite */
    *status = (CUdriverProcAddressQueryResult)-1;
    *result = p_cuGetProcAddress_v2(name, &fn, version, flags, status);
    return fn;
}

/* Allocate, write, check and free through a resolved cuMemAllocAsync/cuMemFreeAsync pair. */
static void use_async(mem_alloc_async_fn alloc, mem_free_async_fn release, CUstream s, unsigned char value,
                      const char *what) {
    CUdeviceptr p = 0;
    CU(alloc(&p, MIB, s));
    EXPECT(p != 0, "%s gave no pointer", what);
    CU(p_cuMemsetD8Async(p, value, MIB, s));
    EXPECT(first_wrong_byte(p, value, MIB, s) < 0, "%s: data lost", what);
    CU(release(p, s));
    CU(p_cuStreamSynchronize(s));
}

int main(void) {
    driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    EXPECT(driver != NULL, "dlopen(libcuda.so.1): %s", dlerror());
    LOAD(cuInit);
    LOAD(cuDeviceGet);
    LOAD(cuDevicePrimaryCtxRetain);
    LOAD(cuCtxSetCurrent);
    LOAD(cuMemAlloc_v2);
    LOAD(cuMemFree_v2);
    LOAD(cuMemsetD8Async);
    LOAD(cuMemcpyDtoHAsync_v2);
    LOAD(cuStreamSynchronize);
    LOAD(cuStreamCreate);
    LOAD(cuLaunchHostFunc);
    LOAD(cuMemAllocAsync);
    LOAD(cuMemFreeAsync);
    LOAD(cuGetProcAddress_v2);

    CUdevice dev;
    CUcontext ctx;
    CU(p_cuInit(0));
    CU(p_cuDeviceGet(&dev, 0));
    CU(p_cuDevicePrimaryCtxRetain(&ctx, dev));
    CU(p_cuCtxSetCurrent(ctx));

    for (int i = 0; i < 1000; i++) {
        CUdeviceptr t;
        CU(p_cuMemAlloc_v2(&t, 256 << 10));
        CU(p_cuMemFree_v2(t));
    }

    /* The reuse race: slow work on a non-blocking stream writes x, x is freed, the next
     * allocation of its size is written on the legacy stream. */
    CUstream a, b;
    CU(p_cuStreamCreate(&a, CU_STREAM_NON_BLOCKING));
    CU(p_cuStreamCreate(&b, CU_STREAM_NON_BLOCKING));
    int same = 0;
    for (int round = 0; round < 2; round++) {
        CUdeviceptr x, y, filler;
        CU(p_cuMemAlloc_v2(&x, MIB));
        CU(p_cuMemAlloc_v2(&filler, MIB));
        CU(p_cuLaunchHostFunc(a, sleep_ms, (void *)(size_t)150));
        CU(p_cuMemsetD8Async(x, 0xAA, MIB, a));
        CU(p_cuMemFree_v2(x));
        CU(p_cuMemAlloc_v2(&y, MIB));
        same += x == y;
        CU(p_cuMemsetD8Async(y, 0xBB, MIB, CU_STREAM_LEGACY));
        CU(p_cuStreamSynchronize(CU_STREAM_LEGACY));
        CU(p_cuStreamSynchronize(a));
        long bad = first_wrong_byte(y, 0xBB, MIB, CU_STREAM_LEGACY);
        EXPECT(bad < 0, "round %d: byte %ld of the new allocation was overwritten by the old work (reused=%d)", round, bad,
               x == y);
        CU(p_cuMemFree_v2(y));
        CU(p_cuMemFree_v2(filler));
    }
    printf("reused %d\n", same);
    use_async(p_cuMemAllocAsync, p_cuMemFreeAsync, a, 0x31, "dlsym'd cuMemAllocAsync");

    /* "cuMemAlloc" before CUDA 3.2 is the v1 function: another ABI, which must not be handed
     * the 64-bit arguments of cuMemAlloc_v2. */
    CUresult r;
    CUdriverProcAddressQueryResult status;
    void *v1 = resolve("cuMemAlloc", 2000, CU_GET_PROC_ADDRESS_DEFAULT, &r, &status);
    EXPECT(r == CUDA_SUCCESS && status == CU_GET_PROC_ADDRESS_SUCCESS && v1 != NULL,
           "cuMemAlloc at 2000: result %d, status %d, %p", (int)r, (int)status, v1);
    void *v2 = resolve("cuMemAlloc", 3020, CU_GET_PROC_ADDRESS_DEFAULT, &r, &status);
    EXPECT(r == CUDA_SUCCESS && status == CU_GET_PROC_ADDRESS_SUCCESS && v2 != NULL && v2 != v1,
           "cuMemAlloc at 3020: result %d, status %d, %p (v1 %p)", (int)r, (int)status, v2, v1);
    unsigned int small = 0xdeadbeef;
    mem_alloc_v1_fn alloc_v1;
    memcpy(&alloc_v1, &v1, sizeof v1);
    r = alloc_v1(&small, 4096);
    EXPECT(r == CUDA_ERROR_NOT_SUPPORTED && small == 0xdeadbeef,
           "the v1 cuMemAlloc returned %d and wrote %#x (a substituted cuMemAlloc_v2?)", (int)r, small);
    CUdeviceptr via_v2 = 0;
    CUresult (*alloc_v2)(CUdeviceptr *, size_t);
    memcpy(&alloc_v2, &v2, sizeof v2);
    CU(alloc_v2(&via_v2, 4096));
    CU(p_cuMemFree_v2(via_v2));

    /* Not there at all, and not in the version asked for. */
    void *none = resolve("cuNoSuchFunction", 13000, CU_GET_PROC_ADDRESS_DEFAULT, &r, &status);
    EXPECT(r == CUDA_ERROR_NOT_FOUND && status == CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND && none == NULL,
           "cuNoSuchFunction: result %d, status %d, %p", (int)r, (int)status, none);
    void *early = resolve("cuMemAllocAsync", 11000, CU_GET_PROC_ADDRESS_DEFAULT, &r, &status);
    EXPECT(r == CUDA_ERROR_NOT_FOUND && status == CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT && early == NULL,
           "cuMemAllocAsync at 11000: result %d, status %d, %p", (int)r, (int)status, early);

    /* cuMemAllocAsync with the per-thread default stream flag and without: both work. */
    const cuuint64_t flags[2] = {CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, CU_GET_PROC_ADDRESS_DEFAULT};
    for (int i = 0; i < 2; i++) {
        void *alloc = resolve("cuMemAllocAsync", 11020, flags[i], &r, &status);
        EXPECT(r == CUDA_SUCCESS && status == CU_GET_PROC_ADDRESS_SUCCESS && alloc != NULL,
               "cuMemAllocAsync (flags %llu): result %d, status %d", (unsigned long long)flags[i], (int)r, (int)status);
        void *release = resolve("cuMemFreeAsync", 11020, flags[i], &r, &status);
        EXPECT(r == CUDA_SUCCESS && status == CU_GET_PROC_ADDRESS_SUCCESS && release != NULL,
               "cuMemFreeAsync (flags %llu): result %d, status %d", (unsigned long long)flags[i], (int)r, (int)status);
        mem_alloc_async_fn alloc_fn;
        mem_free_async_fn release_fn;
        memcpy(&alloc_fn, &alloc, sizeof alloc);
        memcpy(&release_fn, &release, sizeof release);
        use_async(alloc_fn, release_fn, b, (unsigned char)(0x40 + i), flags[i] ? "per-thread cuMemAllocAsync" : "cuMemAllocAsync");
    }

    /* The resolver resolves itself: "cuGetProcAddress" at 12000 is cuGetProcAddress_v2. */
    void *self = resolve("cuGetProcAddress", 12000, CU_GET_PROC_ADDRESS_DEFAULT, &r, &status);
    EXPECT(r == CUDA_SUCCESS && self != NULL, "cuGetProcAddress at 12000: result %d", (int)r);
    CUresult (*get_proc)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);
    memcpy(&get_proc, &self, sizeof self);
    void *free_fn = NULL;
    CU(get_proc("cuMemFree", &free_fn, 3020, CU_GET_PROC_ADDRESS_DEFAULT, &status));
    EXPECT(free_fn != NULL && status == CU_GET_PROC_ADDRESS_SUCCESS, "cuMemFree through the resolved resolver");

    printf("OK driver_dlsym\n");
    return 0;
}
