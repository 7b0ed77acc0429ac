/* Driver functions from the runtime (cudaGetDriverEntryPoint[ByVersion]), used next to the
 * runtime's own: memory from cuMemAlloc freed with cudaFree and the other way round (legal in
 * CUDA: both are in the primary context), stream-ordered memory from the per-thread
 * cuMemAllocAsync; a name the driver lacks, and a version too old, are not found.
 * Prints "OK entry_point". */
#include <cuda.h>
#include <stdint.h>
#include "common.h"

#define MIB ((size_t)1 << 20)

typedef CUresult (*mem_alloc_fn)(CUdeviceptr *, size_t);
typedef CUresult (*mem_free_fn)(CUdeviceptr);
typedef CUresult (*mem_alloc_async_fn)(CUdeviceptr *, size_t, CUstream);
typedef CUresult (*mem_free_async_fn)(CUdeviceptr, CUstream);

#define CU(call) do { CUresult r_ = (call); if (r_ != CUDA_SUCCESS) \
    FAIL("%s:%d: %s returned %d", __FILE__, __LINE__, #call, (int)r_); } while (0)

/* A driver function found through the runtime, with its query result checked. */
static void *entry(const char *name, int version, unsigned long long flags) {
    void *fn = NULL;
    enum cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
    if (version == 0)
        CHECK(cudaGetDriverEntryPoint(name, &fn, flags, &status));
    else
        CHECK(cudaGetDriverEntryPointByVersion(name, &fn, (unsigned)version, flags, &status));
    EXPECT(status == cudaDriverEntryPointSuccess && fn != NULL, "%s: status %d, %p", name, (int)status, fn);
    return fn;
}

static void *ptr(CUdeviceptr p) { return (void *)(uintptr_t)p; }
static CUdeviceptr dptr(void *p) { return (CUdeviceptr)(uintptr_t)p; }

int main(void) {
    CHECK(cudaFree(0)); /* the runtime's context, current on this thread, for the driver calls too */
    mem_alloc_fn mem_alloc;
    mem_free_fn mem_free;
    mem_alloc_async_fn alloc_async;
    mem_free_async_fn free_async;
    void *fn = entry("cuMemAlloc", 0, cudaEnableDefault);
    memcpy(&mem_alloc, &fn, sizeof fn);
    fn = entry("cuMemFree", 0, cudaEnableDefault);
    memcpy(&mem_free, &fn, sizeof fn);
    fn = entry("cuMemAllocAsync", 12000, cudaEnablePerThreadDefaultStream);
    memcpy(&alloc_async, &fn, sizeof fn);
    fn = entry("cuMemFreeAsync", 12000, cudaEnablePerThreadDefaultStream);
    memcpy(&free_async, &fn, sizeof fn);

    /* Driver allocations freed by the runtime and runtime allocations freed by the driver,
     * interleaved, each with its own data. */
    for (int round = 0; round < 4; round++) {
        size_t bytes = (size_t)(round + 1) * 8192;
        CUdeviceptr d = 0;
        void *r = NULL;
        CU(mem_alloc(&d, bytes));
        CHECK(cudaMalloc(&r, bytes));
        EXPECT(ptr(d) != r, "round %d: the same memory twice", round);
        CHECK(cudaMemset(ptr(d), 0x21 + round, bytes));
        CHECK(cudaMemset(r, 0x61 + round, bytes));
        EXPECT(first_wrong_byte(ptr(d), (unsigned char)(0x21 + round), bytes) < 0, "round %d: driver block lost its data", round);
        EXPECT(first_wrong_byte(r, (unsigned char)(0x61 + round), bytes) < 0, "round %d: runtime block lost its data", round);
        CHECK(cudaFree(ptr(d)));
        CU(mem_free(dptr(r)));
    }

    /* Stream-ordered, per-thread variant: on a stream and on the per-thread default stream
     * (the NULL stream of a _ptsz function). */
    cudaStream_t s;
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CUdeviceptr a = 0, b = 0;
    CU(alloc_async(&a, MIB, (CUstream)s));
    CHECK(cudaMemsetAsync(ptr(a), 0x3c, MIB, s));
    CHECK(cudaStreamSynchronize(s));
    EXPECT(first_wrong_byte(ptr(a), 0x3c, MIB) < 0, "stream-ordered block lost its data");
    CU(free_async(a, (CUstream)s));
    CU(alloc_async(&b, MIB, NULL));
    CHECK(cudaMemsetAsync(ptr(b), 0x3d, MIB, cudaStreamPerThread));
    CHECK(cudaStreamSynchronize(cudaStreamPerThread));
    EXPECT(first_wrong_byte(ptr(b), 0x3d, MIB) < 0, "per-thread stream block lost its data");
    CU(free_async(b, NULL));
    CHECK(cudaStreamSynchronize(cudaStreamPerThread));
    CHECK(cudaStreamSynchronize(s));
    CHECK(cudaStreamDestroy(s));

    /* Not found: no such name, and a version older than the function. */
    fn = (void *)&entry;
    enum cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSuccess;
    cudaError_t e = cudaGetDriverEntryPoint("cuNoSuchFunction", &fn, cudaEnableDefault, &status);
    EXPECT((e == cudaSuccess || e == cudaErrorSymbolNotFound) && status == cudaDriverEntryPointSymbolNotFound && fn == NULL,
           "cuNoSuchFunction: error %d, status %d, %p", (int)e, (int)status, fn);
    fn = (void *)&entry;
    status = cudaDriverEntryPointSuccess;
    e = cudaGetDriverEntryPointByVersion("cuMemAllocAsync", &fn, 11000, cudaEnableDefault, &status);
    EXPECT((e == cudaSuccess || e == cudaErrorSymbolNotFound) && status == cudaDriverEntryPointVersionNotSufficent && fn == NULL,
           "cuMemAllocAsync at 11000: error %d, status %d, %p", (int)e, (int)status, fn);
    (void)cudaGetLastError();

    printf("OK entry_point\n");
    return 0;
}
