// The driver's doors on a real GPU: allocations through cuMemAlloc_v2/cuMemFree_v2 reached
// through the symbols of libcuda the program links ("symbols"), through dlsym on the program's
// own handle of libcuda ("dlsym", as cuBLAS and XLA do), or through the runtime's
// cudaGetDriverEntryPoint, which resolves them with cuGetProcAddress ("entry": the door every
// runtime uses, timed here without the runtime's own cudaMalloc around it). Checks, then prints
// "OK driver_doors MODE pair_p50_ns=N":
//  - 20000 warm alloc/free pairs of 1 MiB, each timed (minus the timer's own cost);
//  - cuMemGetAddressRange_v2 and cuPointerGetAttribute's range of an interior pointer are the
//    allocation's own (base = the pointer, size >= the request), and two live allocations'
//    ranges do not overlap;
//  - the reuse race across a stream created with cuStreamCreate: a slow kernel writes a freed
//    block; the next allocation of its size, written on the legacy stream, must keep its bytes.
// Usage: driver_doors symbols|dlsym|entry
#include <cuda.h>
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <algorithm>
#include <vector>

#define FAIL(...) do { printf("FAIL: "); printf(__VA_ARGS__); printf("\n"); exit(1); } while (0)
#define CU(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) FAIL("%s:%d: %s returned %d", __FILE__, __LINE__, #x, (int)r_); } while (0)
#define RT(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) FAIL("%s:%d: %s returned %d", __FILE__, __LINE__, #x, (int)e_); } while (0)

typedef CUresult (*alloc_fn)(CUdeviceptr *, size_t);
typedef CUresult (*free_fn)(CUdeviceptr);
typedef CUresult (*range_fn)(CUdeviceptr *, size_t *, CUdeviceptr);
typedef CUresult (*attr_fn)(void *, CUpointer_attribute, CUdeviceptr);
typedef CUresult (*stream_fn)(CUstream *, unsigned);

__global__ void spin_then_fill(unsigned char *ptr, unsigned char value, size_t bytes, long long cycles) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        long long start = clock64();
        while (clock64() - start < cycles) {}
    }
    __syncthreads();
    for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < bytes; i += (size_t)gridDim.x * blockDim.x) ptr[i] = value;
}

static uint64_t now_ns() {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "symbols";
    bool by_dlsym = strcmp(mode, "dlsym") == 0, by_entry = strcmp(mode, "entry") == 0;
    RT(cudaFree(0));  // the runtime makes the primary context current
    alloc_fn mem_alloc = cuMemAlloc_v2;
    free_fn mem_free = cuMemFree_v2;
    range_fn range = cuMemGetAddressRange_v2;
    attr_fn attr = cuPointerGetAttribute;
    stream_fn stream_create = cuStreamCreate;
    if (by_dlsym) {
        void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
        if (!h) FAIL("dlopen libcuda: %s", dlerror());
        mem_alloc = (alloc_fn)dlsym(h, "cuMemAlloc_v2");
        mem_free = (free_fn)dlsym(h, "cuMemFree_v2");
        range = (range_fn)dlsym(h, "cuMemGetAddressRange_v2");
        attr = (attr_fn)dlsym(h, "cuPointerGetAttribute");
        stream_create = (stream_fn)dlsym(h, "cuStreamCreate");
        if (!mem_alloc || !mem_free || !range || !attr || !stream_create) FAIL("dlsym");
    }
    if (by_entry) {
        cudaDriverEntryPointQueryResult q;
        void *f[5] = {0};
        const char *names[5] = {"cuMemAlloc", "cuMemFree", "cuMemGetAddressRange", "cuPointerGetAttribute", "cuStreamCreate"};
        for (int i = 0; i < 5; i++) {
            RT(cudaGetDriverEntryPointByVersion(names[i], &f[i], 12000, cudaEnableDefault, &q));
            if (!f[i] || q != cudaDriverEntryPointSuccess) FAIL("no entry point for %s", names[i]);
        }
        mem_alloc = (alloc_fn)f[0];
        mem_free = (free_fn)f[1];
        range = (range_fn)f[2];
        attr = (attr_fn)f[3];
        stream_create = (stream_fn)f[4];
    }

    // Pairs.
    const int n = 20000;
    std::vector<uint64_t> lat(n);
    for (int i = 0; i < n; i++) { uint64_t t0 = now_ns(); lat[i] = now_ns() - t0; }
    std::sort(lat.begin(), lat.end());
    uint64_t timer = lat[n / 2];
    for (int i = 0; i < 1000; i++) { CUdeviceptr p; CU(mem_alloc(&p, 1 << 20)); CU(mem_free(p)); }
    for (int i = 0; i < n; i++) {
        CUdeviceptr p;
        uint64_t t0 = now_ns();
        CU(mem_alloc(&p, 1 << 20));
        CU(mem_free(p));
        lat[i] = now_ns() - t0;
    }
    std::sort(lat.begin(), lat.end());
    long long p50 = (long long)lat[n / 2] - (long long)timer;

    // Ranges.
    CUdeviceptr a, b;
    CU(mem_alloc(&a, 1000));
    CU(mem_alloc(&b, 1000));
    CUdeviceptr base_a, base_b, start;
    size_t size_a, size_b, size;
    CU(range(&base_a, &size_a, a + 100));
    CU(range(&base_b, &size_b, b));
    if (base_a != a || size_a < 1000) FAIL("range of a: base %llx (a %llx) size %zu", base_a, a, size_a);
    if (base_b != b || size_b < 1000) FAIL("range of b: base %llx (b %llx) size %zu", base_b, b, size_b);
    if (base_a < base_b + size_b && base_b < base_a + size_a) FAIL("the ranges of two live allocations overlap");
    CU(attr(&start, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, a + 999));
    CU(attr(&size, CU_POINTER_ATTRIBUTE_RANGE_SIZE, a + 999));
    if (start != a || size != size_a) FAIL("pointer attributes of a: start %llx size %zu", start, size);
    CU(mem_free(a));
    CU(mem_free(b));

    // The race, on a stream created through the driver.
    CUstream s;
    CU(stream_create(&s, CU_STREAM_NON_BLOCKING));
    int rate_khz = 0;
    RT(cudaDeviceGetAttribute(&rate_khz, cudaDevAttrClockRate, 0));
    const size_t bytes = 1 << 20;
    int reused = 0;
    for (int round = 0; round < 3; round++) {
        CUdeviceptr x, filler, y;
        CU(mem_alloc(&x, bytes));
        CU(mem_alloc(&filler, bytes));
        spin_then_fill<<<1, 256, 0, (cudaStream_t)s>>>((unsigned char *)x, 0xAA, bytes, (long long)rate_khz * 150);
        RT(cudaGetLastError());
        CU(mem_free(x));
        CU(mem_alloc(&y, bytes));
        reused += x == y;
        RT(cudaMemsetAsync((void *)y, 0xBB, bytes, 0));
        RT(cudaDeviceSynchronize());
        std::vector<unsigned char> host(bytes);
        RT(cudaMemcpy(host.data(), (void *)y, bytes, cudaMemcpyDeviceToHost));
        for (size_t i = 0; i < bytes; i++)
            if (host[i] != 0xBB) FAIL("round %d: byte %zu of the new allocation was overwritten by the old work", round, i);
        CU(mem_free(y));
        CU(mem_free(filler));
    }
    printf("reused %d\n", reused);
    printf("OK driver_doors %s pair_p50_ns=%lld\n", mode, p50);
    return 0;
}
