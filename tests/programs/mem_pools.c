/* PyTorch's MemPools through the library's C API, as the Python integration's MemPool and
 * use_mem_pool call it (Note [PyTorch MemPools] in the shim's process/private_pools/mem_pools.rs):
 *  - a pool's use count is its references; routing the thread adds one, releasing takes it;
 *  - while a thread allocates to a pool, its stream-ordered allocations on the pool's device
 *    come from the pool (innermost of nested pools), its synchronous ones (a library's own
 *    cudaMalloc) and other threads' do not, and the pool's snapshot lists exactly its blocks;
 *  - a pool with the program's own allocator gets its segments from it, the allocator's own
 *    cudaMalloc/cudaFree reach CUDA, and the segment goes back through the allocator when the
 *    pool is deleted and its last block freed (not before);
 *  - when the ordinary pool runs out of device memory, a live use_on_oom pool lends a cached
 *    block; a pool without use_on_oom does not, nor a deleted one;
 *  - the device's stats count the pools' memory and blocks, per kind of pool (small, large);
 *  - a memory fraction (cachealloc_set_memory_fraction, as PyTorch's
 *    set_per_process_memory_fraction) limits the ordinary pool and the MemPools together, and
 *    the use_on_oom lending works under it as under a full device.
 * Runs under the shim only (it needs the C API). Usage: mem_pools (FAKECUDA_CAPACITY_MB=100). */
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <sys/types.h>

#include "common.h"

#define MIB ((size_t)1 << 20)

static int (*retain)(int, uint64_t, unsigned, void *, void *);
static int (*release_pool)(int, uint64_t);
static int (*use_count)(int, uint64_t);
static int (*begin_thread)(int, uint64_t);
static void (*end_thread)(int, uint64_t);
static size_t (*snapshot)(int, uint64_t, char *, size_t);

static void *api(const char *name) {
    void *f = dlsym(RTLD_DEFAULT, name);
    EXPECT(f != NULL, "the library does not export %s", name);
    return f;
}

/* Whether the pool's snapshot lists a block at `p`. */
static int pool_has(uint64_t pool, const void *p) {
    static char buf[1 << 16];
    size_t need = snapshot(0, pool, buf, sizeof buf);
    EXPECT(need <= sizeof buf, "snapshot of %zu bytes", need);
    char needle[64];
    snprintf(needle, sizeof needle, "\"address\":%llu,\"size\"", (unsigned long long)(uintptr_t)p);
    return strstr(buf, needle) != NULL;
}

static int segments_of(uint64_t pool) {
    static char buf[1 << 16];
    snapshot(0, pool, buf, sizeof buf);
    int n = 0;
    for (char *at = buf; (at = strstr(at, "\"segment_type\"")) != NULL; at++) n++;
    return n;
}

/* A stat of device 0, PyTorch's name: the device's pools and its private pools together. */
static long device_stat(const char *key) {
    static char buf[1 << 16];
    size_t (*stats)(int, char *, size_t) =
        (size_t (*)(int, char *, size_t))api("cachealloc_device_stats_json");
    EXPECT(stats(0, buf, sizeof buf) <= sizeof buf, "stats do not fit");
    char needle[128];
    snprintf(needle, sizeof needle, "\"%s\":", key);
    const char *at = strstr(buf, needle);
    EXPECT(at != NULL, "no stat %s", key);
    return strtol(at + strlen(needle), NULL, 10);
}

static cudaStream_t stream;

static void *side_thread(void *out) {
    CHECK(cudaMallocAsync((void **)out, MIB, stream));
    return NULL;
}

/* The program's own allocator (PyTorch's CUDAPluggableAllocator signature). */
static int foreign_allocs, foreign_frees;
static void *foreign_base;
static void *foreign_alloc(ssize_t size, int device, cudaStream_t s) {
    (void)device, (void)s;
    foreign_allocs++;
    void *p = NULL;
    if (cudaMalloc(&p, (size_t)size) != cudaSuccess) return NULL; /* reaches CUDA, not the pools */
    foreign_base = p;
    return p;
}
static void foreign_free(void *p, ssize_t size, int device, cudaStream_t s) {
    (void)size, (void)device, (void)s;
    foreign_frees++;
    CHECK(cudaFree(p));
}

int main(void) {
    retain = (int (*)(int, uint64_t, unsigned, void *, void *))api("cachealloc_mem_pool_retain");
    release_pool = (int (*)(int, uint64_t))api("cachealloc_mem_pool_release");
    use_count = (int (*)(int, uint64_t))api("cachealloc_mem_pool_use_count");
    begin_thread = (int (*)(int, uint64_t))api("cachealloc_mem_pool_begin_thread");
    end_thread = (void (*)(int, uint64_t))api("cachealloc_mem_pool_end_thread");
    snapshot = (size_t (*)(int, uint64_t, char *, size_t))api("cachealloc_mem_pool_snapshot_json");
    CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    enum { A = 7, B = 8, F = 9, USE = 10, DONT = 11 };

    /* References and routing. */
    EXPECT(retain(0, A, 0, NULL, NULL) == 1, "a new pool's use count is 1");
    EXPECT(begin_thread(0, A) == 0 && use_count(0, A) == 2, "routing adds a reference");
    void *in_a, *other, *in_b, *in_a2;
    /* Reserved bytes, not segments: with expandable segments a pool's memory is a mapped run,
     * which PyTorch does not count as a segment. */
    long small_reserved = device_stat("reserved_bytes.small_pool.current");
    long small_active = device_stat("active.small_pool.current");
    CHECK(cudaMallocAsync(&in_a, MIB, stream));
    EXPECT(device_stat("reserved_bytes.small_pool.current") >= small_reserved + (long)MIB &&
               device_stat("active.small_pool.current") == small_active + 1,
           "the device's small-pool stats do not count the MemPool's memory and block (%ld -> %ld, %ld -> %ld)", small_reserved, device_stat("reserved_bytes.small_pool.current"), small_active, device_stat("active.small_pool.current"));
    void *library_buffer; /* a library's own cudaMalloc (cuBLAS's handle buffers): never routed */
    CHECK(cudaMalloc(&library_buffer, MIB));
    EXPECT(!pool_has(A, library_buffer), "a cudaMalloc went to the thread's MemPool");
    CHECK(cudaFree(library_buffer));
    pthread_t t;
    pthread_create(&t, NULL, side_thread, &other);
    pthread_join(t, NULL);
    EXPECT(retain(0, B, 0, NULL, NULL) == 1, "second pool");
    EXPECT(begin_thread(0, B) == 0, "nested routing");
    CHECK(cudaMallocAsync(&in_b, MIB, stream));
    end_thread(0, B);
    release_pool(0, B);
    CHECK(cudaMallocAsync(&in_a2, MIB, stream));
    end_thread(0, A);
    EXPECT(release_pool(0, A) == 1 && use_count(0, A) == 1, "releasing takes the routing's reference");
    void *outside;
    CHECK(cudaMallocAsync(&outside, MIB, stream));
    EXPECT(pool_has(A, in_a) && pool_has(A, in_a2), "pool A lacks its blocks");
    EXPECT(!pool_has(A, other), "another thread's allocation went to the pool");
    EXPECT(!pool_has(A, outside), "an allocation after the context went to the pool");
    EXPECT(pool_has(B, in_b) && !pool_has(A, in_b), "the innermost pool did not get the block");
    CHECK(cudaMemsetAsync(in_a, 0x5a, MIB, stream));
    CHECK(cudaStreamSynchronize(stream));
    EXPECT(first_wrong_byte(in_a, 0x5a, MIB) < 0, "a pool's memory is not usable");
    /* Freed blocks return to their pool, which keeps its memory while it lives. */
    CHECK(cudaFreeAsync(in_a, stream));
    CHECK(cudaFreeAsync(in_a2, stream));
    CHECK(cudaFreeAsync(other, stream));
    CHECK(cudaFreeAsync(outside, stream));
    CHECK(cudaStreamSynchronize(stream));
    CHECK(cudaDeviceSynchronize());
    EXPECT(segments_of(A) == 1, "a live pool lost its memory (%d segments)", segments_of(A));
    EXPECT(release_pool(0, A) == 0, "deleting the pool");
    EXPECT(segments_of(A) == 0, "a deleted pool kept its free memory");
    EXPECT(release_pool(0, B) == 0 && segments_of(B) == 1, "a deleted pool gave back a live block's memory");
    CHECK(cudaFreeAsync(in_b, stream)); /* a block outliving its pool goes back when freed */
    CHECK(cudaStreamSynchronize(stream));
    EXPECT(segments_of(B) == 0, "a deleted pool kept its last block's memory after its free");

    /* The program's allocator. */
    EXPECT(retain(0, F, 0, (void *)foreign_alloc, (void *)foreign_free) == 1, "foreign pool");
    begin_thread(0, F);
    void *f1;
    CHECK(cudaMallocAsync(&f1, MIB, stream));
    end_thread(0, F);
    release_pool(0, F);
    EXPECT(foreign_allocs == 1 && f1 == foreign_base, "the pool's segment did not come from its allocator");
    EXPECT(pool_has(F, f1), "the foreign pool lacks its block");
    EXPECT(release_pool(0, F) == 0 && foreign_frees == 0, "a segment with a live block was freed");
    CHECK(cudaFreeAsync(f1, stream));
    CHECK(cudaStreamSynchronize(stream));
    EXPECT(foreign_frees == 1, "the segment did not go back through its allocator (%d frees)", foreign_frees);

    /* use_on_oom: 100 MB of device memory; a pool holding 40 MB free lends it. */
    retain(0, USE, 1, NULL, NULL);
    retain(0, DONT, 0, NULL, NULL);
    void *u, *d;
    begin_thread(0, USE);
    CHECK(cudaMallocAsync(&u, 40 * MIB, stream));
    end_thread(0, USE);
    release_pool(0, USE);
    begin_thread(0, DONT);
    CHECK(cudaMallocAsync(&d, 40 * MIB, stream));
    end_thread(0, DONT);
    release_pool(0, DONT);
    CHECK(cudaFreeAsync(d, stream));
    CHECK(cudaFreeAsync(u, stream));
    CHECK(cudaStreamSynchronize(stream));
    void *big, *lent, *more;
    CHECK(cudaMallocAsync(&big, 19 * MIB, stream));
    CHECK(cudaMallocAsync(&lent, 30 * MIB, stream));
    EXPECT(lent == u, "the use_on_oom pool did not lend its block (%p, its block %p)", lent, u);
    EXPECT(cudaMallocAsync(&more, 30 * MIB, stream) == cudaErrorMemoryAllocation,
           "a pool without use_on_oom lent its memory");
    (void)cudaGetLastError();
    CHECK(cudaFreeAsync(lent, stream));
    CHECK(cudaStreamSynchronize(stream));
    EXPECT(pool_has(USE, lent), "the lent block did not return to its pool");
    release_pool(0, USE);
    CHECK(cudaFreeAsync(big, stream));
    release_pool(0, DONT);
    CHECK(cudaStreamSynchronize(stream));

    /* set_per_process_memory_fraction limits every pool of the device together (PyTorch's
     * test_mempool_limited_memory_with_allocator): a limit 50 MiB above what is held now, well
     * below the device's 100 MB, so that only the limit can refuse. Requests of whole 20 MiB,
     * so that fixed segments and mapped pages (Note [Kept maps]) hold the same. A library's
     * own cudaMalloc (cuBLAS's workspace) is served by the pools but is not PyTorch's memory:
     * PyTorch's limit neither counts it nor refuses it (Note [Whose memory a limit counts]). */
    int (*set_fraction)(int, double) = (int (*)(int, double))api("cachealloc_set_memory_fraction");
    cudaMemPool_t device_pool;
    CHECK(cudaDeviceGetDefaultMemPool(&device_pool, 0));
    CHECK(cudaMemPoolTrimTo(device_pool, 0));
    void *library, *library_later;
    CHECK(cudaMalloc(&library, 12 * MIB));
    uint64_t held = 0;
    CHECK(cudaMemPoolGetAttribute(device_pool, cudaMemPoolAttrReservedMemCurrent, &held));
    size_t free_bytes, total;
    CHECK(cudaMemGetInfo(&free_bytes, &total));
    EXPECT(set_fraction(0, 2.0) == cudaErrorInvalidValue, "a fraction of 2 was taken");
    EXPECT(set_fraction(0, (double)(held + 50 * MIB) / (double)total) == 0, "setting the fraction");
    enum { USE2 = 0x44, DONT2 = 0x45 };
    retain(0, USE2, 1, NULL, NULL);
    retain(0, DONT2, 0, NULL, NULL);
    void *pa, *pb, *c, *e, *refused;
    begin_thread(0, DONT2);
    CHECK(cudaMallocAsync(&pa, 20 * MIB, stream));
    end_thread(0, DONT2);
    begin_thread(0, USE2);
    CHECK(cudaMallocAsync(&pb, 20 * MIB, stream));
    end_thread(0, USE2);
    EXPECT(cudaMallocAsync(&refused, 30 * MIB, stream) == cudaErrorMemoryAllocation,
           "the ordinary pool went past the fraction that the MemPools' memory filled");
    (void)cudaGetLastError();
    EXPECT(cudaMalloc(&library_later, 12 * MIB) == cudaSuccess,
           "PyTorch's memory fraction refused a library's own cudaMalloc");
    CHECK(cudaFree(library_later));
    CHECK(cudaFreeAsync(pa, stream));
    CHECK(cudaFreeAsync(pb, stream));
    CHECK(cudaStreamSynchronize(stream));
    CHECK(cudaMallocAsync(&c, 20 * MIB, stream));
    EXPECT(c == pb, "under the fraction the use_on_oom pool did not lend its block (%p, its block %p)", c, pb);
    EXPECT(cudaMallocAsync(&refused, 20 * MIB, stream) == cudaErrorMemoryAllocation,
           "the pool without use_on_oom lent its memory, or the fraction was passed");
    (void)cudaGetLastError();
    CHECK(cudaFreeAsync(c, stream));
    CHECK(cudaStreamSynchronize(stream));
    begin_thread(0, USE2);
    CHECK(cudaMallocAsync(&e, 10 * MIB, stream));
    end_thread(0, USE2);
    EXPECT(e == c, "the lent block did not return to its pool (%p, lent %p)", e, c);
    CHECK(cudaFreeAsync(e, stream));
    CHECK(cudaStreamSynchronize(stream));
    release_pool(0, USE2);
    release_pool(0, DONT2);
    EXPECT(set_fraction(0, 1.0) == 0, "lifting the fraction");
    CHECK(cudaFree(library));
    printf("OK mem_pools\n");
    return 0;
}
