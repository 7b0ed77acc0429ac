/* A graph pool held by the program's references, as PyTorch's CUDAGraph holds one (Note [The
 * program's graph references] in the shim's `process`): the C++ allocator for PyTorch passes
 * `beginAllocateToPool` (capture_begin) and `releasePool` (reset) on as
 * cachealloc_graph_pool_retain and _release. Under PyTorch's `enable_debug_mode()` a graph
 * object is never destroyed; the pool must still go when the program lets go of it:
 *  - a capture into a retained pool, instantiated, its executable destroyed and its graph object
 *    kept (debug mode): the pool's memory stays while the program holds it, and goes at
 *    empty_cache (cudaMemPoolTrimTo) once it has released it;
 *  - `keep_graph=True`: a graph kept and not yet instantiated holds nothing but the program's
 *    reference, which keeps its memory through empty_cache; instantiated later it replays
 *    right; released and destroyed, its memory goes;
 *  - a pool two graphs share stays until both have let go.
 * Usage: graph_pool_refs (under the shim only) */
#include <dlfcn.h>
#include <stdint.h>

#include "common.h"

#define MIB (1 << 20)

static uint64_t reserved(cudaMemPool_t pool) {
    uint64_t value = 0;
    CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &value));
    return value;
}

/* Capture into pool `id`: 1 MiB of scratch written with `value` and freed, copied into a 4 KiB
 * output (kept); returns the graph object. */
static cudaGraph_t capture(cudaStream_t s, void (*use_pool)(uint64_t), uint64_t id, unsigned char value,
                           void **out) {
    void *scratch;
    cudaGraph_t graph;
    use_pool(id);
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    CHECK(cudaMallocAsync(&scratch, MIB, s));
    CHECK(cudaMemsetAsync(scratch, value, MIB, s));
    CHECK(cudaMallocAsync(out, 4096, s));
    CHECK(cudaMemcpyAsync(*out, scratch, 4096, cudaMemcpyDeviceToDevice, s));
    CHECK(cudaFreeAsync(scratch, s));
    CHECK(cudaStreamEndCapture(s, &graph));
    return graph;
}

int main(void) {
    void (*use_pool)(uint64_t) = (void (*)(uint64_t))dlsym(RTLD_DEFAULT, "cachealloc_use_capture_pool");
    int (*retain)(int, uint64_t) = (int (*)(int, uint64_t))dlsym(RTLD_DEFAULT, "cachealloc_graph_pool_retain");
    int (*release)(int, uint64_t) = (int (*)(int, uint64_t))dlsym(RTLD_DEFAULT, "cachealloc_graph_pool_release");
    EXPECT(use_pool && retain && release, "the shim's graph pool entry points are missing");
    cudaStream_t s;
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cudaMemPool_t pool;
    CHECK(cudaDeviceGetDefaultMemPool(&pool, 0));
    CHECK(cudaMemPoolTrimTo(pool, 0));
    uint64_t before = reserved(pool);

    /* Debug mode: the graph object outlives the program's reference. */
    EXPECT(retain(0, 7) == 1, "the program's first reference to pool 7");
    void *out;
    cudaGraph_t kept = capture(s, use_pool, 7, 0x11, &out);
    cudaGraphExec_t exec;
    CHECK(cudaGraphInstantiate(&exec, kept, 0));
    CHECK(cudaGraphLaunch(exec, s));
    CHECK(cudaStreamSynchronize(s));
    EXPECT(first_wrong_byte(out, 0x11, 4096) < 0, "the graph's result is wrong");
    CHECK(cudaFreeAsync(out, s));
    CHECK(cudaGraphExecDestroy(exec));
    CHECK(cudaMemPoolTrimTo(pool, 0));
    uint64_t held = reserved(pool);
    EXPECT(held > before, "the pool keeps its memory while the program holds it (%llu, before %llu)",
           (unsigned long long)held, (unsigned long long)before);
    EXPECT(release(0, 7) == 0, "the program let go of pool 7");
    CHECK(cudaMemPoolTrimTo(pool, 0));
    EXPECT(reserved(pool) == before,
           "a pool the program let go of keeps its memory through empty_cache because of a graph object "
           "(reserved %llu, %llu before the capture)",
           (unsigned long long)reserved(pool), (unsigned long long)before);

    /* keep_graph=True: captured now, instantiated later. */
    EXPECT(retain(0, 8) == 1, "the program's first reference to pool 8");
    cudaGraph_t later = capture(s, use_pool, 8, 0x22, &out);
    CHECK(cudaMemPoolTrimTo(pool, 0));
    EXPECT(reserved(pool) > before, "a graph not yet instantiated lost its pool's memory to empty_cache");
    CHECK(cudaGraphInstantiate(&exec, later, 0));
    CHECK(cudaMemsetAsync(out, 0, 4096, s));
    CHECK(cudaGraphLaunch(exec, s));
    CHECK(cudaStreamSynchronize(s));
    EXPECT(first_wrong_byte(out, 0x22, 4096) < 0, "the graph instantiated later replays wrong");
    CHECK(cudaFreeAsync(out, s));
    EXPECT(release(0, 8) == 0, "the program let go of pool 8");
    CHECK(cudaMemPoolTrimTo(pool, 0));
    EXPECT(reserved(pool) > before, "an executable graph's pool lost its memory to empty_cache");
    CHECK(cudaGraphExecDestroy(exec));
    CHECK(cudaGraphDestroy(later));
    CHECK(cudaMemPoolTrimTo(pool, 0));
    EXPECT(reserved(pool) == before, "the released pool's memory did not go (reserved %llu, %llu before)",
           (unsigned long long)reserved(pool), (unsigned long long)before);

    /* A pool two graphs share (make_graphed_callables, graph trees): it stays until both let go. */
    EXPECT(retain(0, 9) == 1 && retain(0, 9) == 2, "two references to pool 9");
    void *first_out, *second_out;
    cudaGraph_t first = capture(s, use_pool, 9, 0x33, &first_out);
    cudaGraph_t second = capture(s, use_pool, 9, 0x44, &second_out);
    CHECK(cudaFreeAsync(first_out, s));
    CHECK(cudaFreeAsync(second_out, s));
    EXPECT(release(0, 9) == 1, "one of pool 9's graphs let go");
    CHECK(cudaMemPoolTrimTo(pool, 0));
    EXPECT(reserved(pool) > before, "a shared pool lost its memory while one of its graphs holds it");
    EXPECT(release(0, 9) == 0, "both of pool 9's graphs let go");
    CHECK(cudaMemPoolTrimTo(pool, 0));
    EXPECT(reserved(pool) == before, "the shared pool's memory did not go (reserved %llu, %llu before)",
           (unsigned long long)reserved(pool), (unsigned long long)before);

    CHECK(cudaGraphDestroy(first));
    CHECK(cudaGraphDestroy(second));
    CHECK(cudaGraphDestroy(kept));
    CHECK(cudaStreamDestroy(s));
    printf("OK graph_pool_refs\n");
    return 0;
}
