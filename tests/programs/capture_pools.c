/* CUDA graphs' memory, as PyTorch's graphs use it: what a capture allocates belongs to the graph.
 * A capture allocates scratch memory (freed inside the capture) and an output (kept), and the
 * graph is instantiated and its graph object destroyed (the executable keeps it). Then:
 *  - allocations made after the capture, on the same stream, never get the graph's memory, and
 *    replays of the graph never write into them;
 *  - the output freed outside the capture returns success (PyTorch frees graph outputs so);
 *  - under cachealloc: a second capture into the same pool (cachealloc_use_capture_pool, as the
 *    Python integration calls it for `torch.cuda.graph(pool=...)`) reuses the first capture's
 *    freed scratch, a capture into a pool of its own does not; destroying the executable graphs
 *    leaves the pools' memory reserved until empty_cache (cudaMemPoolTrimTo, as PyTorch's
 *    empty_cache on this route) gives it back (the device's reserved bytes, read as PyTorch
 *    reads them from the default memory pool); and a block of a destroyed graph's pool that a
 *    new capture writes and frees keeps its memory after that capture (PyTorch's reset() and
 *    recapture), until an allocation that needs it runs out of memory.
 * Usage: capture_pools */
#include <dlfcn.h>
#include <stdint.h>

#include "common.h"

#define MIB (1 << 20)

static uint64_t reserved(cudaMemPool_t pool) {
    uint64_t value = 0;
    CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &value));
    return value;
}

/* Capture one graph that allocates and frees `MIB` of scratch on `s` and writes `value` through
 * it into a new 4 KiB output; returns the executable, the scratch address and the output. */
static cudaGraphExec_t capture(cudaStream_t s, unsigned char value, void **scratch, void **out) {
    cudaGraph_t graph;
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    CHECK(cudaMallocAsync(scratch, MIB, s));
    CHECK(cudaMemsetAsync(*scratch, value, MIB, s));
    CHECK(cudaMallocAsync(out, 4096, s));
    CHECK(cudaMemcpyAsync(*out, *scratch, 4096, cudaMemcpyDeviceToDevice, s));
    CHECK(cudaFreeAsync(*scratch, s));
    CHECK(cudaStreamEndCapture(s, &graph));
    cudaGraphExec_t exec;
    CHECK(cudaGraphInstantiate(&exec, graph, 0));
    CHECK(cudaGraphDestroy(graph));
    return exec;
}

static int inside(const void *p, const void *base, size_t bytes) {
    return (const char *)p >= (const char *)base && (const char *)p < (const char *)base + bytes;
}

int main(void) {
    void (*use_pool)(uint64_t) = (void (*)(uint64_t))dlsym(RTLD_DEFAULT, "cachealloc_use_capture_pool");
    int shim = use_pool != NULL;
    cudaStream_t s;
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cudaMemPool_t pool;
    CHECK(cudaDeviceGetDefaultMemPool(&pool, 0));
    void *warm = NULL; /* a cached block on the stream, of the scratch's size */
    CHECK(cudaMallocAsync(&warm, MIB, s));
    CHECK(cudaFreeAsync(warm, s));
    CHECK(cudaStreamSynchronize(s));
    uint64_t before = reserved(pool);

    if (shim) use_pool(42);
    void *scratch, *out;
    cudaGraphExec_t first = capture(s, 0x11, &scratch, &out);
    EXPECT(!shim || reserved(pool) > before, "the capture's memory counts as reserved");

    enum { MINE = 16 };
    void *mine[MINE];
    for (int i = 0; i < MINE; i++) {
        CHECK(cudaMallocAsync(&mine[i], MIB, s));
        EXPECT(!inside(scratch, mine[i], MIB) && !inside(out, mine[i], MIB),
               "block %d at %p holds the graph's memory (scratch %p, output %p)", i, mine[i], scratch, out);
        CHECK(cudaMemsetAsync(mine[i], 0x33, MIB, s));
    }
    for (int r = 0; r < 5; r++) {
        CHECK(cudaMemsetAsync(out, 0, 4096, s));
        CHECK(cudaGraphLaunch(first, s));
    }
    CHECK(cudaStreamSynchronize(s));
    EXPECT(first_wrong_byte(out, 0x11, 4096) < 0, "the graph's result is wrong");
    for (int i = 0; i < MINE; i++)
        EXPECT(first_wrong_byte(mine[i], 0x33, MIB) < 0, "a replay wrote into block %d", i);
    /* PyTorch frees a graph's output outside the capture: that is no error. */
    CHECK(cudaFreeAsync(out, s));

    if (shim) {
        void *shared_scratch, *shared_out, *own_scratch, *own_out;
        use_pool(42);
        cudaGraphExec_t second = capture(s, 0x22, &shared_scratch, &shared_out);
        EXPECT(shared_scratch == scratch, "a capture into the same pool reuses its free memory (%p, first %p)",
               shared_scratch, scratch);
        use_pool(0);
        cudaGraphExec_t third = capture(s, 0x44, &own_scratch, &own_out);
        EXPECT(!inside(own_scratch, scratch, MIB) && own_scratch != shared_scratch,
               "a capture into a pool of its own gets memory of its own (%p, shared pool's %p)",
               own_scratch, scratch);
        CHECK(cudaGraphLaunch(third, s));
        CHECK(cudaGraphLaunch(second, s));
        CHECK(cudaStreamSynchronize(s));
        EXPECT(first_wrong_byte(own_out, 0x44, 4096) < 0, "the third graph's result is wrong");
        EXPECT(first_wrong_byte(shared_out, 0x22, 4096) < 0, "the second graph's result is wrong");
        CHECK(cudaFreeAsync(shared_out, s));
        CHECK(cudaFreeAsync(own_out, s));
        uint64_t with_graphs = reserved(pool);
        CHECK(cudaGraphExecDestroy(second));
        CHECK(cudaGraphExecDestroy(third));
        CHECK(cudaGraphExecDestroy(first));
        uint64_t after = reserved(pool);
        EXPECT(after == with_graphs,
               "the graphs' pools keep their memory until empty_cache, as PyTorch's (reserved %llu with the "
               "graphs, %llu after)",
               (unsigned long long)with_graphs, (unsigned long long)after);
        CHECK(cudaMemPoolTrimTo(pool, 0)); /* PyTorch's empty_cache on this route */
        uint64_t trimmed = reserved(pool);
        EXPECT(trimmed + 2 * 2 * MIB <= with_graphs,
               "empty_cache gives the destroyed graphs' pools' memory back (reserved %llu with them, %llu after)",
               (unsigned long long)with_graphs, (unsigned long long)trimmed);

        /* PyTorch's graph.reset() then a new capture that writes into the old graph's output (still
         * held) and frees it: that memory is the new graph's now, and must outlive the capture. */
        use_pool(0);
        void *old_scratch, *old_out;
        cudaGraphExec_t old = capture(s, 0x55, &old_scratch, &old_out);
        CHECK(cudaGraphExecDestroy(old));
        uint64_t held = reserved(pool);
        cudaGraph_t graph;
        CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
        CHECK(cudaMemsetAsync(old_out, 0x66, 4096, s));
        CHECK(cudaFreeAsync(old_out, s));
        CHECK(cudaStreamEndCapture(s, &graph));
        EXPECT(reserved(pool) == held,
               "the memory of an old graph's block, freed in a new capture, was released under the new "
               "graph (reserved %llu before the capture, %llu after)",
               (unsigned long long)held, (unsigned long long)reserved(pool));
        cudaGraphExec_t recaptured;
        CHECK(cudaGraphInstantiate(&recaptured, graph, 0));
        CHECK(cudaGraphDestroy(graph));
        CHECK(cudaGraphLaunch(recaptured, s));
        CHECK(cudaStreamSynchronize(s));
        CHECK(cudaGraphExecDestroy(recaptured));

        /* An allocation that only fits in the memory the unused graph pools still hold gets it:
         * the out-of-memory ladder releases them, as PyTorch frees released graph pools. (With
         * EXACT_FREE=1 only: it needs a device whose free memory is exact to the byte, as
         * fakecuda's is; a GPU's driver keeps some for itself.) */
        if (getenv("EXACT_FREE")) {
            size_t free_bytes, total;
            CHECK(cudaMemGetInfo(&free_bytes, &total));
            void *big;
            CHECK(cudaMallocAsync(&big, free_bytes + MIB / 2, s));
            CHECK(cudaFreeAsync(big, s));
            CHECK(cudaMemPoolTrimTo(pool, 0));
        }
    } else {
        CHECK(cudaGraphExecDestroy(first));
    }
    for (int i = 0; i < MINE; i++) CHECK(cudaFreeAsync(mine[i], s));
    CHECK(cudaStreamSynchronize(s));
    CHECK(cudaStreamDestroy(s));
    printf("OK capture_pools\n");
    return 0;
}
