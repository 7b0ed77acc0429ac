/* A segment tracker (PyTorch's `attachAllocatorTraceTracker`, as NCCL registers segments with
 * it) hears of exactly the memory the pools take from the device and give back (Note [Segment
 * trackers]): a segment after it was allocated and before it is freed, with its pool's id; the
 * mapped memory of an expandable segment; and never a segment made by an allocation inside the
 * tracker itself (nor, later, its release), which would otherwise call the tracker again on
 * its own thread.
 *
 * Run with the shim's default configuration: synchronous allocations in fixed segments,
 * stream-ordered ones in expandable segments, private pools in fixed segments.
 * Usage: segment_trackers */
#include <dlfcn.h>
#include <stdint.h>
#include <sys/types.h>

#include "common.h"

#define MiB (1ull << 20)
#define ALLOC 1
#define FREE 2
#define MAP 3
#define UNMAP 4

typedef void (*tracker_fn)(int, int, uint64_t, uint64_t, uint64_t);

static struct {
    int action, device;
    uint64_t address, size, pool;
    int still_allocated; /* a FREE: whether the device still had the segment when told */
} heard[1024];
static int count;
static void *made_inside;

/* A MemPool's own allocator with a context (as the C++ allocator for PyTorch hands over the
 * process group's NCCL allocator): counts its calls in its context. */
struct counted { int allocs, frees; };
static void *counted_alloc(void *context, ssize_t size, int device, cudaStream_t stream) {
    (void)device, (void)stream;
    void *p = NULL;
    ((struct counted *)context)->allocs++;
    return cudaMalloc(&p, (size_t)size) == cudaSuccess ? p : NULL;
}
static void counted_free(void *context, void *p, ssize_t size, int device, cudaStream_t stream) {
    (void)size, (void)device, (void)stream;
    ((struct counted *)context)->frees++;
    CHECK(cudaFree(p));
}
typedef int (*address_range_fn)(uint64_t *, size_t *, uint64_t);
static address_range_fn address_range; /* the driver's cuMemGetAddressRange_v2 */

/* Whether the device holds an allocation that starts at `address` and is `size` bytes long. */
static int allocated(uint64_t address, uint64_t size) {
    uint64_t base = 0;
    size_t length = 0;
    return address_range(&base, &length, address) == 0 && base == address && length == size;
}

static void tracker(int action, int device, uint64_t address, uint64_t size, uint64_t pool) {
    if (count == 1024) FAIL("too many events");
    heard[count].action = action;
    heard[count].device = device;
    heard[count].address = address;
    heard[count].size = size;
    heard[count].pool = pool;
    heard[count].still_allocated = action == FREE && allocated(address, size);
    count++;
    /* The first segment: allocate enough inside the tracker to make another one. */
    if (action == ALLOC && made_inside == NULL) CHECK(cudaMalloc(&made_inside, 96 * MiB));
}

/* The events from `from` on of `action` that cover `p`: how many, and the bytes of all events
 * of that action from `from` on. */
static int covering(int from, int action, const void *p, uint64_t *bytes) {
    int n = 0;
    *bytes = 0;
    for (int i = from; i < count; i++) {
        if (heard[i].action != action) continue;
        *bytes += heard[i].size;
        uint64_t a = (uint64_t)(uintptr_t)p;
        if (a >= heard[i].address && a < heard[i].address + heard[i].size) n++;
    }
    return n;
}

int main(void) {
    int (*attach)(tracker_fn) = (int (*)(tracker_fn))dlsym(RTLD_DEFAULT, "cachealloc_attach_segment_tracker");
    int (*empty_cache)(void) = (int (*)(void))dlsym(RTLD_DEFAULT, "cachealloc_empty_cache");
    int (*retain)(int, uint64_t, unsigned, void *, void *) =
        (int (*)(int, uint64_t, unsigned, void *, void *))dlsym(RTLD_DEFAULT, "cachealloc_mem_pool_retain");
    int (*release)(int, uint64_t) = (int (*)(int, uint64_t))dlsym(RTLD_DEFAULT, "cachealloc_mem_pool_release");
    int (*begin)(int, uint64_t) = (int (*)(int, uint64_t))dlsym(RTLD_DEFAULT, "cachealloc_mem_pool_begin_thread");
    void (*end)(int, uint64_t) = (void (*)(int, uint64_t))dlsym(RTLD_DEFAULT, "cachealloc_mem_pool_end_thread");
    typedef void *(*ctx_alloc_fn)(void *, ssize_t, int, cudaStream_t);
    typedef void (*ctx_free_fn)(void *, void *, ssize_t, int, cudaStream_t);
    int (*retain_with)(int, uint64_t, unsigned, ctx_alloc_fn, ctx_free_fn, void *) =
        (int (*)(int, uint64_t, unsigned, ctx_alloc_fn, ctx_free_fn, void *))dlsym(
            RTLD_DEFAULT, "cachealloc_mem_pool_retain_with_context");
    address_range = (address_range_fn)dlsym(RTLD_DEFAULT, "cuMemGetAddressRange_v2");
    if (!attach) {
        printf("OK segment_trackers (not under cachealloc: nothing to check)\n");
        return 0;
    }
    EXPECT(address_range && retain_with && empty_cache && retain && release && begin && end, "C API missing");
    EXPECT(attach(tracker) == 0, "attach refused");
    EXPECT(attach(NULL) != 0, "a null tracker was taken");

    /* A fixed segment: told once it is made, before anything of it is handed out. */
    void *a = NULL;
    CHECK(cudaMalloc(&a, 64 * MiB));
    uint64_t bytes;
    EXPECT(count == 1 && covering(0, ALLOC, a, &bytes) == 1, "segment of a: %d events", count);
    EXPECT(heard[0].device == 0 && heard[0].pool == 0, "device %d pool %llu", heard[0].device,
           (unsigned long long)heard[0].pool);
    EXPECT(made_inside != NULL && covering(0, ALLOC, made_inside, &bytes) == 0,
           "the segment made inside the tracker was told");

    /* Its release: told before the device frees it; the one made inside is never told. */
    CHECK(cudaFree(a));
    CHECK(cudaFree(made_inside));
    CHECK(cudaDeviceSynchronize());
    int before = count;
    EXPECT(empty_cache() == 0, "empty_cache");
    EXPECT(covering(before, FREE, a, &bytes) == 1 && count == before + 1,
           "release of a: %d events", count - before);
    EXPECT(heard[before].size == heard[0].size && heard[before].address == heard[0].address,
           "released another segment than was made");
    EXPECT(heard[before].still_allocated, "told after the segment was freed");
    EXPECT(!allocated(heard[before].address, heard[before].size), "the segment was not freed");

    /* Stream-ordered memory: mapped into an expandable segment, then unmapped. */
    cudaStream_t s;
    CHECK(cudaStreamCreate(&s));
    void *b = NULL;
    before = count;
    CHECK(cudaMallocAsync(&b, 40 * MiB, s));
    EXPECT(covering(before, MAP, b, &bytes) == 1 && bytes >= 40 * MiB, "maps of b: %d events", count - before);
    uint64_t mapped = bytes;
    EXPECT(covering(before, ALLOC, b, &bytes) == 0, "an expandable segment told as a fixed one");
    CHECK(cudaFreeAsync(b, s));
    CHECK(cudaStreamSynchronize(s));
    before = count;
    EXPECT(empty_cache() == 0, "empty_cache");
    EXPECT(covering(before, UNMAP, b, &bytes) == 1 && bytes == mapped,
           "unmaps of b: %llu of %llu bytes", (unsigned long long)bytes, (unsigned long long)mapped);

    /* A private pool (a MemPool): its segment is told with the pool's id, and its release when
     * the pool's last user goes. */
    const uint64_t id = (7ull << 32) | 3;
    EXPECT(retain(0, id, 0, NULL, NULL) >= 1, "retain");
    EXPECT(begin(0, id) == 0, "begin");
    void *c = NULL;
    before = count;
    CHECK(cudaMallocAsync(&c, 8 * MiB, s));
    end(0, id);
    EXPECT(covering(before, ALLOC, c, &bytes) == 1, "segment of c: %d events", count - before);
    EXPECT(heard[count - 1].pool == id, "pool %llx", (unsigned long long)heard[count - 1].pool);
    CHECK(cudaFreeAsync(c, s));
    CHECK(cudaStreamSynchronize(s));
    before = count;
    release(0, id); /* begin's reference */
    release(0, id); /* the MemPool's */
    EXPECT(empty_cache() == 0, "empty_cache");
    EXPECT(covering(before, FREE, c, &bytes) == 1, "release of c: %d events", count - before);
    EXPECT(heard[count - 1].pool == id, "released from pool %llx", (unsigned long long)heard[count - 1].pool);
    EXPECT(heard[count - 1].still_allocated, "the pool's segment was told after it was freed");

    /* A pool over the program's own allocator, with a context: its segments come from it and go
     * back to it, told with the pool's id. */
    struct counted calls = {0, 0};
    const uint64_t own = (9ull << 32) | 4;
    EXPECT(retain_with(0, own, 0, NULL, counted_free, &calls) < 0, "a pool without alloc was taken");
    EXPECT(retain_with(0, own, 0, counted_alloc, counted_free, &calls) >= 1, "retain_with");
    EXPECT(begin(0, own) == 0, "begin");
    void *d = NULL;
    before = count;
    CHECK(cudaMallocAsync(&d, 8 * MiB, s));
    end(0, own);
    EXPECT(calls.allocs == 1, "the pool's allocator made %d segments", calls.allocs);
    EXPECT(covering(before, ALLOC, d, &bytes) == 1 && heard[count - 1].pool == own, "segment of d");
    CHECK(cudaFreeAsync(d, s));
    CHECK(cudaStreamSynchronize(s));
    before = count;
    release(0, own);
    release(0, own);
    EXPECT(empty_cache() == 0, "empty_cache");
    EXPECT(calls.frees == 1, "the pool's allocator took back %d segments", calls.frees);
    EXPECT(covering(before, FREE, d, &bytes) == 1 && heard[count - 1].still_allocated, "release of d");
    CHECK(cudaStreamDestroy(s));
    printf("OK segment_trackers (%d events)\n", count);
    return 0;
}
