/* Checkpoints of a private pool through the library's C API, as the Python integration's C++
 * allocator calls it for PyTorch's CUDA graph trees (getCheckpointState,
 * setCheckpointPoolState, checkPoolLiveAllocations; Note [Pool checkpoints]):
 *  - restoring frees every block the pool allocated since (each reported), and allocates the
 *    checkpoint's blocks again at their addresses (each reported with its size and stream);
 *  - the pool's live blocks are then exactly the checkpoint's, a restored block frees like any
 *    other, and a block the restore freed cannot be freed again;
 *  - no checkpoint of a pool that does not exist.
 * Runs under the shim only (it needs the C API). */
#include <dlfcn.h>
#include <stdint.h>

#include "common.h"

#define MIB ((size_t)1 << 20)

static void *api(const char *name) {
    void *f = dlsym(RTLD_DEFAULT, name);
    EXPECT(f != NULL, "the library does not export %s", name);
    return f;
}

typedef void (*on_address)(void *, uint64_t);
typedef void (*on_block)(void *, uint64_t, uint64_t, uint64_t);

struct seen {
    uint64_t addresses[64];
    uint64_t sizes[64];
    uint64_t streams[64];
    int n;
};

/* What one restore reported. */
struct delta {
    struct seen freed, allocated;
};

static void note_address(void *ctx, uint64_t address) {
    struct seen *s = (struct seen *)ctx;
    s->addresses[s->n++] = address;
}

static void note_freed(void *ctx, uint64_t address) {
    note_address(&((struct delta *)ctx)->freed, address);
}

static void note_allocated(void *ctx, uint64_t address, uint64_t size, uint64_t stream) {
    struct seen *s = &((struct delta *)ctx)->allocated;
    s->sizes[s->n] = size;
    s->streams[s->n] = stream;
    s->addresses[s->n++] = address;
}

static uint64_t size_of(const struct seen *s, const void *p) {
    for (int i = 0; i < s->n; i++)
        if (s->addresses[i] == (uint64_t)(uintptr_t)p) return s->sizes[i];
    return 0;
}

static int has(const struct seen *s, const void *p) {
    for (int i = 0; i < s->n; i++)
        if (s->addresses[i] == (uint64_t)(uintptr_t)p) return 1;
    return 0;
}

int main(void) {
    int (*retain)(int, uint64_t, unsigned, void *, void *) =
        (int (*)(int, uint64_t, unsigned, void *, void *))api("cachealloc_mem_pool_retain");
    int (*begin_thread)(int, uint64_t) = (int (*)(int, uint64_t))api("cachealloc_mem_pool_begin_thread");
    void (*end_thread)(int, uint64_t) = (void (*)(int, uint64_t))api("cachealloc_mem_pool_end_thread");
    void *(*checkpoint)(int, uint64_t) = (void *(*)(int, uint64_t))api("cachealloc_pool_checkpoint");
    void (*drop)(void *) = (void (*)(void *))api("cachealloc_pool_checkpoint_drop");
    int (*restore)(const void *, on_address, on_block, void *) =
        (int (*)(const void *, on_address, on_block, void *))api("cachealloc_pool_restore");
    int (*live)(int, uint64_t, on_address, void *) =
        (int (*)(int, uint64_t, on_address, void *))api("cachealloc_pool_live_blocks");
    enum { P = 21, NONE = 22 };
    cudaStream_t stream;
    CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

    void *ordinary;
    CHECK(cudaMalloc(&ordinary, MIB));
    EXPECT(checkpoint(0, NONE) == NULL, "a checkpoint of a pool that does not exist");
    EXPECT(retain(0, P, 0, NULL, NULL) == 1, "a new pool");
    EXPECT(begin_thread(0, P) == 0, "routing to the pool");
    void *a, *b, *small, *big;
    CHECK(cudaMallocAsync(&a, MIB, stream));
    CHECK(cudaMallocAsync(&b, 2 * MIB, stream));
    CHECK(cudaMallocAsync(&small, 4096, stream));
    CHECK(cudaMallocAsync(&big, 64 * MIB, stream));
    CHECK(cudaFreeAsync(b, stream));
    CHECK(cudaFreeAsync(big, stream));
    void *state = checkpoint(0, P);
    EXPECT(state != NULL, "no checkpoint of a live pool");

    /* After the checkpoint: replays made tensors live the books do not know of; the program
     * freed `a` and allocated `d` and `e`. */
    void *d, *e;
    CHECK(cudaFreeAsync(a, stream));
    CHECK(cudaMallocAsync(&d, 3 * MIB, stream));
    CHECK(cudaMallocAsync(&e, 512, stream));
    struct delta first = {0};
    struct seen alive = {0};
    CHECK((cudaError_t)restore(state, note_freed, note_allocated, &first));
    EXPECT(first.freed.n == 3 && has(&first.freed, small) && has(&first.freed, d) && has(&first.freed, e),
           "the restore freed %d blocks, not small, d and e", first.freed.n);
    EXPECT(first.allocated.n == 2 && size_of(&first.allocated, a) == MIB &&
               size_of(&first.allocated, small) == 4096,
           "the restore did not allocate a and small again (%d blocks)", first.allocated.n);
    for (int i = 0; i < first.allocated.n; i++)
        EXPECT(first.allocated.streams[i] == (uint64_t)(uintptr_t)stream,
               "a restored block belongs to another stream");
    EXPECT(live(0, P, note_address, &alive) == 2 && has(&alive, a) && has(&alive, small),
           "after the restore the pool's live blocks are not the checkpoint's (%d)", alive.n);

    /* Again: this time the checkpoint's own blocks, live again, are freed too. */
    struct delta second = {0};
    void *f;
    CHECK(cudaMallocAsync(&f, 5 * MIB, stream));
    end_thread(0, P);
    CHECK((cudaError_t)restore(state, note_freed, note_allocated, &second));
    EXPECT(second.freed.n == 3 && has(&second.freed, a) && has(&second.freed, small) &&
               has(&second.freed, f),
           "the second restore freed %d blocks, not a, small and f", second.freed.n);
    EXPECT(second.allocated.n == 2 && has(&second.allocated, a) && has(&second.allocated, small),
           "the second restore gave another layout");
    struct seen alive2 = {0};
    EXPECT(live(0, P, note_address, &alive2) == 2, "a second restore left %d live blocks", alive2.n);

    /* A restored block is an ordinary live block; a block the restore freed is not. */
    CHECK(cudaMemsetAsync(a, 0x3c, MIB, stream));
    CHECK(cudaStreamSynchronize(stream));
    EXPECT(first_wrong_byte(a, 0x3c, MIB) < 0, "a restored block's memory is not usable");
    CHECK(cudaFreeAsync(a, stream));
    EXPECT(cudaFreeAsync(d, stream) != cudaSuccess, "a block the restore freed was freed again");
    (void)cudaGetLastError();
    CHECK(cudaFreeAsync(small, stream));
    CHECK(cudaStreamSynchronize(stream));
    struct seen none = {0};
    EXPECT(live(0, P, note_address, &none) == 0, "blocks left after freeing all");
    drop(state);
    CHECK(cudaFree(ordinary));
    printf("OK pool_checkpoints\n");
    return 0;
}
