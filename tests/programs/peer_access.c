/* Peer access to pooled memory, as cudaMalloc's memory has it: once device 1 enables peer
 * access to device 0, device 1 may read and write device 0's allocations, those made before
 * and those made after; device 0 gets no access to device 1's memory until it enables peer
 * access the other way, through the driver's cuCtxEnablePeerAccess this time. Access is read
 * with cuMemGetAccess (through dlsym on libcuda.so.1), which answers for memory mapped with
 * cuMemMap: run under the shim with expandable_segments:True (under fixed segments, or
 * without the shim, cuMemGetAccess refuses cudaMalloc's memory and the program says so).
 *
 * Argument "pool": device 1 is given access to device 0's default memory pool instead
 * (cudaMemPoolSetAccess, PyTorch's way on its cudaMallocAsync route), which must give it the
 * pooled memory just the same. "pool-fixed" (under fixed segments): the same call must enable
 * the contexts' peer access, which cudaMalloc's memory needs, so that device 1's own
 * cudaDeviceEnablePeerAccess(0) then answers "already enabled". "race [THREADS]": two threads
 * (or THREADS) allocate and free on device 0 (maps, moved memory, flips) while the main thread
 * enables peer access from device 1; every free must find its block (another thread's
 * allocation may have mapped the memory and not returned yet); afterwards every live block,
 * and every block the threads allocate next (some on memory parked before), must be device 1's
 * to use. "mempool": device 0's blocks come from a MemPool (a private pool, mapped under
 * expandable_segments:True): device 1 gets access to those mapped before peer access and after.
 * Needs 2 devices (fakecuda: FAKECUDA_DEVICES=2); prints "OK peer_access". */
#include <cuda.h>
#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include "common.h"

static CUresult (*get_access)(unsigned long long *, const CUmemLocation *, CUdeviceptr);
static CUresult (*enable_peer)(CUcontext, unsigned);
static CUresult (*primary_retain)(CUcontext *, CUdevice);

/* Device `device`'s access to the memory at `p`: CU_MEM_ACCESS_FLAGS_PROT_*, or -1 when the
 * driver answers nothing for it (memory not mapped with cuMemMap). */
static long access_of(int device, void *p) {
    CUmemLocation where = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = device};
    unsigned long long flags = 0;
    if (get_access(&flags, &where, (CUdeviceptr)(uintptr_t)p) != CUDA_SUCCESS) return -1;
    return (long)flags;
}

static void *alloc_on(int device, size_t bytes) {
    void *p;
    CHECK(cudaSetDevice(device));
    CHECK(cudaMalloc(&p, bytes));
    return p;
}

#define EXPECT_ACCESS(device, p, want, what) do { long a_ = access_of(device, p); \
    EXPECT(a_ == (want), "%s: device %d's access is %ld, not %s", what, device, a_, #want); } while (0)

#define RACE_SLOTS 24
#define RACE_BEFORE 200 /* rounds each thread runs before peer access is enabled */
#define RACE_AFTER 300  /* and after */
#define RACE_MAX_THREADS 16
static int race_rounds_done[RACE_MAX_THREADS], race_enabled;

/* One racing thread: a ring of blocks of changing sizes on device 0, freed and replaced, from
 * before peer access is enabled until well after; then each live block and each new one is
 * checked for device 1's access. */
static void *race_worker(void *arg) {
    int id = (int)(uintptr_t)arg;
    unsigned seed = 12345u + (unsigned)id;
    void *slot[RACE_SLOTS] = {0};
    CHECK(cudaSetDevice(0));
    int after = 0;
    for (int round = 0; after < RACE_AFTER; round++) {
        EXPECT(round < 1000000, "peer access was never enabled");
        int i = (int)(rand_r(&seed) % RACE_SLOTS);
        if (slot[i]) {
            cudaError_t e = cudaFree(slot[i]);
            EXPECT(e == cudaSuccess, "thread %d, round %d: cudaFree(%p) returned %d (%s)", id, round, slot[i],
                   (int)e, cudaGetErrorString(e));
        }
        size_t kib = 1 + rand_r(&seed) % (rand_r(&seed) % 4 == 0 ? 48 * 1024 : 900);
        CHECK(cudaMalloc(&slot[i], kib << 10));
        __atomic_store_n(&race_rounds_done[id], round + 1, __ATOMIC_RELEASE);
        if (__atomic_load_n(&race_enabled, __ATOMIC_ACQUIRE)) after++;
    }
    for (int i = 0; i < RACE_SLOTS; i++)
        if (slot[i]) EXPECT_ACCESS(1, slot[i], CU_MEM_ACCESS_FLAGS_PROT_READWRITE, "a live block after the race");
    for (int i = 0; i < RACE_SLOTS; i++) {
        if (slot[i]) CHECK(cudaFree(slot[i]));
        CHECK(cudaMalloc(&slot[i], ((size_t)1 + rand_r(&seed) % (32 * 1024)) << 10));
        EXPECT_ACCESS(1, slot[i], CU_MEM_ACCESS_FLAGS_PROT_READWRITE, "a block allocated after the race");
    }
    for (int i = 0; i < RACE_SLOTS; i++) CHECK(cudaFree(slot[i]));
    return NULL;
}

static void race(int threads) {
    if (threads < 1 || threads > RACE_MAX_THREADS) FAIL("race: 1 to %d threads", RACE_MAX_THREADS);
    pthread_t t[RACE_MAX_THREADS];
    for (int i = 0; i < threads; i++) pthread_create(&t[i], NULL, race_worker, (void *)(uintptr_t)i);
    /* Enable peer access while every thread is in the middle of its rounds (they go on until
     * they have seen it enabled for RACE_AFTER rounds). */
    for (int i = 0; i < threads; i++)
        while (__atomic_load_n(&race_rounds_done[i], __ATOMIC_ACQUIRE) < RACE_BEFORE) sched_yield();
    CHECK(cudaSetDevice(1));
    CHECK(cudaDeviceEnablePeerAccess(0, 0));
    __atomic_store_n(&race_enabled, 1, __ATOMIC_RELEASE);
    for (int i = 0; i < threads; i++) pthread_join(t[i], NULL);
    printf("OK peer_access\n");
}

/* Give `accessor` read and write access to `owner`'s default memory pool. */
static void pool_access(int owner, int accessor) {
    cudaMemPool_t pool;
    CHECK(cudaDeviceGetDefaultMemPool(&pool, owner));
    struct cudaMemAccessDesc desc = {
        .location = {.type = cudaMemLocationTypeDevice, .id = accessor},
        .flags = cudaMemAccessFlagsProtReadWrite,
    };
    CHECK(cudaMemPoolSetAccess(pool, &desc, 1));
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "runtime";
    int n = 0;
    CHECK(cudaGetDeviceCount(&n));
    if (n < 2) { printf("OK peer_access (skipped: %d device)\n", n); return 0; }
    void *libcuda = dlopen("libcuda.so.1", RTLD_NOW);
    EXPECT(libcuda, "dlopen(libcuda.so.1): %s", dlerror());
    *(void **)&get_access = dlsym(libcuda, "cuMemGetAccess");
    *(void **)&enable_peer = dlsym(libcuda, "cuCtxEnablePeerAccess");
    *(void **)&primary_retain = dlsym(libcuda, "cuDevicePrimaryCtxRetain");
    EXPECT(get_access && enable_peer && primary_retain, "libcuda lacks a function: %s", dlerror());
    int can = 0;
    CHECK(cudaDeviceCanAccessPeer(&can, 1, 0));
    if (!can) { printf("OK peer_access (skipped: no peer access between devices 0 and 1)\n"); return 0; }

    if (strcmp(mode, "race") == 0) {
        race(argc > 2 ? atoi(argv[2]) : 2);
        return 0;
    }
    if (strcmp(mode, "mempool") == 0) {
        int (*retain)(int, uint64_t, unsigned, void *, void *) =
            (int (*)(int, uint64_t, unsigned, void *, void *))dlsym(RTLD_DEFAULT, "cachealloc_mem_pool_retain");
        int (*begin_thread)(int, uint64_t) = (int (*)(int, uint64_t))dlsym(RTLD_DEFAULT, "cachealloc_mem_pool_begin_thread");
        void (*end_thread)(int, uint64_t) = (void (*)(int, uint64_t))dlsym(RTLD_DEFAULT, "cachealloc_mem_pool_end_thread");
        EXPECT(retain && begin_thread && end_thread, "the library lacks the MemPool functions");
        CHECK(cudaSetDevice(0));
        cudaStream_t s;
        CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
        EXPECT(retain(0, 41, 0, NULL, NULL) == 1 && begin_thread(0, 41) == 0, "a MemPool on device 0");
        void *before, *after;
        CHECK(cudaMallocAsync(&before, 30 << 20, s));
        EXPECT(access_of(0, before) != -1, "the MemPool's memory is not mapped: run with expandable_segments:True");
        EXPECT_ACCESS(1, before, CU_MEM_ACCESS_FLAGS_PROT_NONE, "MemPool block before peer access");
        CHECK(cudaSetDevice(1));
        CHECK(cudaDeviceEnablePeerAccess(0, 0));
        EXPECT_ACCESS(1, before, CU_MEM_ACCESS_FLAGS_PROT_READWRITE, "MemPool block mapped before");
        CHECK(cudaSetDevice(0));
        CHECK(cudaMallocAsync(&after, 50 << 20, s));
        EXPECT_ACCESS(1, after, CU_MEM_ACCESS_FLAGS_PROT_READWRITE, "MemPool block mapped after");
        end_thread(0, 41);
        CHECK(cudaFreeAsync(before, s));
        CHECK(cudaFreeAsync(after, s));
        CHECK(cudaStreamSynchronize(s));
        printf("OK peer_access\n");
        return 0;
    }
    if (strcmp(mode, "pool-fixed") == 0) {
        void *p = alloc_on(0, 30 << 20);
        CHECK(cudaSetDevice(1));
        pool_access(0, 1);
        EXPECT(cudaDeviceEnablePeerAccess(0, 0) == cudaErrorPeerAccessAlreadyEnabled,
               "access to the pool did not enable peer access to cudaMalloc's memory");
        (void)cudaGetLastError();
        CHECK(cudaSetDevice(0));
        CHECK(cudaFree(p));
        printf("OK peer_access\n");
        return 0;
    }
    void *small = alloc_on(0, 4096), *large = alloc_on(0, 30 << 20);
    EXPECT(access_of(0, large) != -1,
           "cuMemGetAccess knows nothing of the pool's memory: run with expandable_segments:True");
    EXPECT_ACCESS(0, small, CU_MEM_ACCESS_FLAGS_PROT_READWRITE, "own small block");
    EXPECT_ACCESS(0, large, CU_MEM_ACCESS_FLAGS_PROT_READWRITE, "own large block");
    /* The control: no access before peer access is enabled. */
    EXPECT_ACCESS(1, small, CU_MEM_ACCESS_FLAGS_PROT_NONE, "small block before peer access");
    EXPECT_ACCESS(1, large, CU_MEM_ACCESS_FLAGS_PROT_NONE, "large block before peer access");

    /* Device 1 enables peer access to device 0 (the runtime's call), or is given access to its
     * default pool. */
    CHECK(cudaSetDevice(1));
    if (strcmp(mode, "pool") == 0) {
        pool_access(0, 1);
        EXPECT_ACCESS(1, small, CU_MEM_ACCESS_FLAGS_PROT_READWRITE, "small block, pool access");
        EXPECT_ACCESS(1, large, CU_MEM_ACCESS_FLAGS_PROT_READWRITE, "large block, pool access");
        /* Mapped memory needs no context peer access: the shim enabled none. */
        CHECK(cudaDeviceEnablePeerAccess(0, 0));
    } else {
        CHECK(cudaDeviceEnablePeerAccess(0, 0));
        EXPECT(cudaDeviceEnablePeerAccess(0, 0) == cudaErrorPeerAccessAlreadyEnabled,
               "enabling peer access twice must fail as without the shim");
        (void)cudaGetLastError();
    }
    EXPECT_ACCESS(1, small, CU_MEM_ACCESS_FLAGS_PROT_READWRITE, "small block mapped before");
    EXPECT_ACCESS(1, large, CU_MEM_ACCESS_FLAGS_PROT_READWRITE, "large block mapped before");
    void *later = alloc_on(0, 100 << 20);
    EXPECT_ACCESS(1, later, CU_MEM_ACCESS_FLAGS_PROT_READWRITE, "block mapped after");
    EXPECT_ACCESS(1, (char *)later + (99 << 20), CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
                  "end of the block mapped after");

    /* Device 1's memory: device 0 has not enabled peer access to it. */
    void *other = alloc_on(1, 30 << 20);
    EXPECT_ACCESS(0, other, CU_MEM_ACCESS_FLAGS_PROT_NONE, "device 1's block");
    /* Device 0 enables it through the driver (current: device 0's primary context). */
    CHECK(cudaSetDevice(0));
    CHECK(cudaFree(0)); /* the runtime makes device 0's context current */
    CUcontext ctx1 = NULL;
    EXPECT(primary_retain(&ctx1, 1) == CUDA_SUCCESS, "cuDevicePrimaryCtxRetain(1)");
    CUresult r = enable_peer(ctx1, 0);
    EXPECT(r == CUDA_SUCCESS, "cuCtxEnablePeerAccess returned %d", (int)r);
    EXPECT_ACCESS(0, other, CU_MEM_ACCESS_FLAGS_PROT_READWRITE, "device 1's block, after");
    void *other_later = alloc_on(1, 50 << 20);
    EXPECT_ACCESS(0, other_later, CU_MEM_ACCESS_FLAGS_PROT_READWRITE, "device 1's later block");

    /* Data through the peer: device 1 copies device 0's bytes. */
    CHECK(cudaSetDevice(0));
    CHECK(cudaMemset(large, 0x5A, 30 << 20));
    CHECK(cudaDeviceSynchronize());
    CHECK(cudaSetDevice(1));
    CHECK(cudaMemcpy(other, large, 30 << 20, cudaMemcpyDeviceToDevice));
    EXPECT(first_wrong_byte(other, 0x5A, 30 << 20) == -1, "device 1's copy of device 0's bytes");

    CHECK(cudaFree(other));
    CHECK(cudaFree(other_later));
    CHECK(cudaSetDevice(0));
    CHECK(cudaFree(small));
    CHECK(cudaFree(large));
    CHECK(cudaFree(later));
    printf("OK peer_access\n");
    return 0;
}
