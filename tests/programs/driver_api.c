/* The driver API as a program linked with -lcuda uses it (cuda.h turns cuMemAlloc into
 * cuMemAlloc_v2 and so on): blocks of mixed sizes with their own data; the allocation each
 * pointer lies in (cuMemGetAddressRange, cuPointerGetAttribute), never overlapping another;
 * plausible memory info; the cross-stream reuse race of race.c with cuMemAlloc/cuMemFree; the
 * stream-ordered calls; a non-primary context; 1000 alloc/free pairs of one size (which a pool
 * serves with few device allocations). Every check must hold with or without an allocator in
 * between. Prints "OK driver_api". */
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define FAIL(...) do { printf("FAIL: "); printf(__VA_ARGS__); printf("\n"); fflush(stdout); exit(1); } while (0)
#define CU(call) do { CUresult r_ = (call); if (r_ != CUDA_SUCCESS) { const char *s_ = NULL; \
    cuGetErrorName(r_, &s_); FAIL("%s:%d: %s returned %d (%s)", __FILE__, __LINE__, #call, (int)r_, s_ ? s_ : "?"); } } while (0)
#define EXPECT(cond, ...) do { if (!(cond)) FAIL(__VA_ARGS__); } while (0)

#define KIB ((size_t)1 << 10)
#define MIB ((size_t)1 << 20)

/* Copy `bytes` of device memory back (on `stream`) and check every byte is `value`; returns the
 * index of the first wrong byte, or -1. */
static long first_wrong_byte(CUdeviceptr dev, unsigned char value, size_t bytes, CUstream stream) {
    unsigned char *host = malloc(bytes);
    CU(cuMemcpyDtoHAsync(host, dev, bytes, stream));
    CU(cuStreamSynchronize(stream));
    long bad = -1;
    for (size_t i = 0; i < bytes; i++) if (host[i] != value) { bad = (long)i; break; }
    free(host);
    return bad;
}

/* A slow write on `stream`: the stream waits about `ms` milliseconds (a host function), then a
 * memset fills the bytes. */
static void sleep_ms(void *arg) { usleep((useconds_t)(size_t)arg * 1000); }
static void slow_fill(CUdeviceptr ptr, unsigned char value, size_t bytes, int ms, CUstream stream) {
    CU(cuLaunchHostFunc(stream, sleep_ms, (void *)(size_t)ms));
    CU(cuMemsetD8Async(ptr, value, bytes, stream));
}

/* The allocation containing p, both ways. */
static void range_of(CUdeviceptr p, CUdeviceptr *base, size_t *size) {
    CU(cuMemGetAddressRange(base, size, p));
    CUdeviceptr start = 0;
    size_t length = 0;
    CU(cuPointerGetAttribute(&start, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, p));
    CU(cuPointerGetAttribute(&length, CU_POINTER_ATTRIBUTE_RANGE_SIZE, p));
    EXPECT(start == *base && length == *size, "pointer attributes (%llx, %zu) differ from the address range (%llx, %zu)",
           (unsigned long long)start, length, (unsigned long long)*base, *size);
    /* cuPointerGetAttributes answers the same, among attributes the driver answers. */
    unsigned int type = 0;
    unsigned long long id = 0, id_alone = 0;
    start = 0;
    length = 0;
    CUpointer_attribute asked[] = {CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
                                   CU_POINTER_ATTRIBUTE_RANGE_SIZE, CU_POINTER_ATTRIBUTE_BUFFER_ID};
    void *slots[] = {&type, &start, &length, &id};
    CU(cuPointerGetAttributes(4, asked, slots, p));
    CU(cuPointerGetAttribute(&id_alone, CU_POINTER_ATTRIBUTE_BUFFER_ID, p));
    EXPECT(type == CU_MEMORYTYPE_DEVICE && start == *base && length == *size && id == id_alone,
           "cuPointerGetAttributes: type %u, range (%llx, %zu), buffer id %llu; the address range (%llx, %zu), "
           "buffer id %llu",
           type, (unsigned long long)start, length, id, (unsigned long long)*base, *size, id_alone);
}

int main(void) {
    CUdevice dev;
    CUcontext primary;
    CU(cuInit(0));
    CU(cuDeviceGet(&dev, 0));
    CU(cuDevicePrimaryCtxRetain(&primary, dev));
    CU(cuCtxSetCurrent(primary));
    unsigned flags = 0;
    int active = 0;
    CU(cuDevicePrimaryCtxGetState(dev, &flags, &active));
    EXPECT(active, "the retained primary context is not active");

    /* Blocks of mixed sizes, each with its own pattern. */
    enum { N = 3 };
    const size_t sizes[N] = {1000, 4 * KIB, 3 * MIB};
    CUdeviceptr block[N];
    size_t free_before = 0, total = 0;
    CU(cuMemGetInfo(&free_before, &total));
    for (int i = 0; i < N; i++) {
        CU(cuMemAlloc(&block[i], sizes[i]));
        CU(cuMemsetD8Async(block[i], (unsigned char)(0x10 + i), sizes[i], 0));
    }
    CU(cuStreamSynchronize(0));
    for (int i = 0; i < N; i++)
        EXPECT(first_wrong_byte(block[i], (unsigned char)(0x10 + i), sizes[i], 0) < 0, "block %d lost its data", i);

    /* Each block is (in) an allocation of its own: found from an interior pointer, at least as
     * big as asked, overlapping no other. */
    CUdeviceptr base[N];
    size_t extent[N];
    unsigned long long id[N];
    for (int i = 0; i < N; i++) {
        range_of(block[i] + sizes[i] / 2, &base[i], &extent[i]);
        EXPECT(base[i] <= block[i] && block[i] + sizes[i] <= base[i] + extent[i],
               "block %d [%llx, +%zu) is not inside its range [%llx, +%zu)", i, (unsigned long long)block[i], sizes[i],
               (unsigned long long)base[i], extent[i]);
        unsigned int type = 0;
        int ordinal = -1;
        CUcontext owner = NULL;
        CUdeviceptr same = 0;
        CU(cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, block[i]));
        CU(cuPointerGetAttribute(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, block[i]));
        CU(cuPointerGetAttribute(&owner, CU_POINTER_ATTRIBUTE_CONTEXT, block[i]));
        CU(cuPointerGetAttribute(&same, CU_POINTER_ATTRIBUTE_DEVICE_POINTER, block[i]));
        CU(cuPointerGetAttribute(&id[i], CU_POINTER_ATTRIBUTE_BUFFER_ID, block[i]));
        EXPECT(type == CU_MEMORYTYPE_DEVICE && ordinal == 0 && owner == primary && same == block[i],
               "block %d: memory type %u, device %d, context %p (primary %p), device pointer %llx", i, type, ordinal,
               (void *)owner, (void *)primary, (unsigned long long)same);
    }
    for (int i = 0; i < N; i++)
        for (int j = i + 1; j < N; j++)
            EXPECT(base[i] + extent[i] <= base[j] || base[j] + extent[j] <= base[i],
                   "the ranges of blocks %d and %d overlap", i, j);
    /* Distinct allocations have distinct buffer ids (blocks inside one shared range share it). */
    for (int i = 0; i < N; i++)
        for (int j = i + 1; j < N; j++)
            EXPECT(id[i] != id[j] || base[i] == base[j], "blocks %d and %d have buffer id %llu", i, j, id[i]);

    /* Memory info: the live blocks are used. */
    size_t free_now = 0;
    CU(cuMemGetInfo(&free_now, &total));
    size_t live = sizes[0] + sizes[1] + sizes[2];
    EXPECT(total > 0 && free_now <= total && total - free_now >= live,
           "memory info: free %zu of %zu with %zu bytes live (free before: %zu)", free_now, total, live, free_before);
    for (int i = 0; i < N; i++) CU(cuMemFree(block[i]));

    /* The reuse race: slow work on a non-blocking stream writes x; x is freed; a new allocation of
     * the same size (which a naive cache hands x back for) is written on the legacy stream. */
    CUstream a, b;
    CU(cuStreamCreate(&a, CU_STREAM_NON_BLOCKING));
    CU(cuStreamCreate(&b, CU_STREAM_NON_BLOCKING));
    int same = 0;
    for (int round = 0; round < 3; round++) {
        CUdeviceptr x, y, filler;
        CU(cuMemAlloc(&x, MIB));
        CU(cuMemAlloc(&filler, MIB)); /* the rest of x's segment, if there is one */
        slow_fill(x, 0xAA, MIB, 150, a);
        CU(cuMemFree(x));
        CU(cuMemAlloc(&y, MIB));
        same += x == y;
        CU(cuMemsetD8Async(y, 0xBB, MIB, CU_STREAM_LEGACY));
        CU(cuCtxSynchronize());
        long bad = first_wrong_byte(y, 0xBB, MIB, 0);
        EXPECT(bad < 0, "round %d: byte %ld of the new allocation was overwritten by the old work (reused=%d)", round, bad,
               x == y);
        CU(cuMemFree(y));
        CU(cuMemFree(filler));
    }
    printf("reused %d\n", same);

    /* Stream-ordered: reuse on the same stream is ordered; another stream must not see the old
     * work. */
    CUdeviceptr p, q, r;
    CU(cuMemAllocAsync(&p, MIB, a));
    slow_fill(p, 0xCC, MIB, 100, a);
    CU(cuMemFreeAsync(p, a));
    CU(cuMemAllocAsync(&q, MIB, a));
    CU(cuMemsetD8Async(q, 0xDD, MIB, a));
    EXPECT(first_wrong_byte(q, 0xDD, MIB, a) < 0, "same stream: the new data was overwritten");
    CU(cuMemFreeAsync(q, a));
    CU(cuMemAllocAsync(&p, MIB, a));
    slow_fill(p, 0xEE, MIB, 150, a);
    CU(cuMemFreeAsync(p, a));
    CU(cuMemAllocAsync(&r, MIB, b));
    CU(cuMemsetD8Async(r, 0x11, MIB, b));
    CU(cuCtxSynchronize());
    EXPECT(first_wrong_byte(r, 0x11, MIB, b) < 0, "other stream: the new data was overwritten by the old work");
    CU(cuMemFreeAsync(r, b));
    CU(cuStreamSynchronize(b));

    /* A non-primary context: its own memory. */
    CUcontext own;
    CU(cuCtxCreate(&own, NULL, 0, dev));
    CUdeviceptr o;
    CU(cuMemAlloc(&o, 64 * KIB));
    CU(cuMemsetD8Async(o, 0x5A, 64 * KIB, 0));
    EXPECT(first_wrong_byte(o, 0x5A, 64 * KIB, 0) < 0, "non-primary context: data lost");
    CUcontext owner = NULL;
    CU(cuPointerGetAttribute(&owner, CU_POINTER_ATTRIBUTE_CONTEXT, o));
    EXPECT(owner == own && own != primary, "memory of the non-primary context %p belongs to %p", (void *)own, (void *)owner);
    CU(cuMemFree(o));
    CU(cuCtxDestroy(own));
    CU(cuCtxSetCurrent(primary));

    /* Many pairs of one size. */
    for (int i = 0; i < 1000; i++) {
        CUdeviceptr t;
        CU(cuMemAlloc(&t, 64 * KIB));
        CU(cuMemFree(t));
    }

    CU(cuStreamDestroy(a));
    CU(cuStreamDestroy(b));
    printf("OK driver_api\n");
    return 0;
}
