/* A CUDA graph captured on two streams, as PyTorch programs capture with side streams: the
 * capture begins on s1, and s2 joins it by waiting on an event recorded in it
 * (`s2.wait_stream(s1)`), then s1 joins s2's work back. What s2 allocates during the capture
 * belongs to the graph as much as what s1 allocates:
 *  - the capture succeeds; under cachealloc also when blocks freed synchronously during the
 *    capture and an allocation on a third stream make it record a fence (an event recorded on, or a query of, the joined stream
 *    would break the capture; a cudaFree in a global capture is illegal natively, so natively
 *    the program does not free there);
 *  - under cachealloc, s2's allocation in the capture is not the block s2 had cached before it,
 *    a block s2 frees in the capture is reused by s2's next allocation there (as on s1) but not
 *    by s1's, a concurrent branch of the graph;
 *  - no block allocated on s2 after the capture is memory of the graph's, and replays never
 *    write into those blocks; every replay's results are right.
 * Usage: capture_streams */
#include <dlfcn.h>
#include <stdint.h>

#include "common.h"

#define MIB (1 << 20)
#define OUT 4096

static int inside(const void *p, const void *base, size_t bytes) {
    return (const char *)p >= (const char *)base && (const char *)p < (const char *)base + bytes;
}

int main(void) {
    int shim = dlsym(RTLD_DEFAULT, "cachealloc_use_capture_pool") != NULL;
    cudaStream_t s1, s2, s3;
    CHECK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
    CHECK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
    CHECK(cudaStreamCreateWithFlags(&s3, cudaStreamNonBlocking)); /* never captures */
    cudaEvent_t forked, joined;
    CHECK(cudaEventCreateWithFlags(&forked, cudaEventDisableTiming));
    CHECK(cudaEventCreateWithFlags(&joined, cudaEventDisableTiming));

    void *warm = NULL; /* s2's cached block of the size it allocates in the capture */
    CHECK(cudaMallocAsync(&warm, MIB, s2));
    CHECK(cudaFreeAsync(warm, s2));
    enum { SYNC_BLOCKS = 80 }; /* more than one fence batch of synchronous frees */
    void *sync_blocks[SYNC_BLOCKS];
    if (shim)
        for (int i = 0; i < SYNC_BLOCKS; i++) CHECK(cudaMalloc(&sync_blocks[i], 4096));
    CHECK(cudaDeviceSynchronize());

    void *a, *b, *b2, *c, *out1, *out2, *out3;
    cudaGraph_t graph;
    CHECK(cudaStreamBeginCapture(s1, cudaStreamCaptureModeGlobal));
    CHECK(cudaMallocAsync(&a, MIB, s1));
    CHECK(cudaMemsetAsync(a, 0x11, MIB, s1));
    CHECK(cudaEventRecord(forked, s1));
    CHECK(cudaStreamWaitEvent(s2, forked, 0)); /* s2 joins the capture */
    void *elsewhere = NULL;
    if (shim) {
        for (int i = 0; i < SYNC_BLOCKS; i++) CHECK(cudaFree(sync_blocks[i]));
        /* An ordinary allocation, which closes those frees' batch with a fence. */
        CHECK(cudaMallocAsync(&elsewhere, 4096, s3));
    }
    CHECK(cudaMallocAsync(&b, MIB, s2));
    EXPECT(!shim || b != warm, "s2's allocation in the capture got s2's cached block %p", warm);
    CHECK(cudaMemcpyAsync(b, a, MIB, cudaMemcpyDeviceToDevice, s2));
    CHECK(cudaMallocAsync(&out2, OUT, s2));
    CHECK(cudaMemcpyAsync(out2, b, OUT, cudaMemcpyDeviceToDevice, s2));
    CHECK(cudaFreeAsync(b, s2));
    CHECK(cudaMallocAsync(&c, MIB, s1));
    EXPECT(!inside(b, c, MIB), "s1 got the block %p that s2 freed in the capture: a concurrent branch", b);
    CHECK(cudaMallocAsync(&b2, MIB, s2));
    EXPECT(!shim || b2 == b, "s2's block freed in the capture is not reused on s2 (%p, freed %p)", b2, b);
    CHECK(cudaMemsetAsync(b2, 0x22, MIB, s2));
    CHECK(cudaMallocAsync(&out3, OUT, s2));
    CHECK(cudaMemcpyAsync(out3, b2, OUT, cudaMemcpyDeviceToDevice, s2));
    CHECK(cudaFreeAsync(b2, s2));
    CHECK(cudaEventRecord(joined, s2));
    CHECK(cudaStreamWaitEvent(s1, joined, 0)); /* s2's work joins back */
    CHECK(cudaMemsetAsync(c, 0x33, MIB, s1));
    CHECK(cudaMallocAsync(&out1, OUT, s1));
    CHECK(cudaMemcpyAsync(out1, c, OUT, cudaMemcpyDeviceToDevice, s1));
    CHECK(cudaFreeAsync(c, s1));
    CHECK(cudaFreeAsync(a, s1));
    CHECK(cudaStreamEndCapture(s1, &graph));
    cudaGraphExec_t exec;
    CHECK(cudaGraphInstantiate(&exec, graph, 0));
    CHECK(cudaGraphDestroy(graph));

    enum { MINE = 16 };
    void *mine[MINE];
    const void *graphs[] = {a, b, c, out1, out2, out3};
    const size_t sizes[] = {MIB, MIB, MIB, OUT, OUT, OUT};
    for (int i = 0; i < MINE; i++) {
        CHECK(cudaMallocAsync(&mine[i], MIB, s2));
        for (int g = 0; g < 6; g++)
            EXPECT(!(shim && inside(graphs[g], mine[i], MIB)) && !(shim && inside(mine[i], graphs[g], sizes[g])),
                   "block %d at %p allocated on s2 after the capture holds the graph's memory %p", i, mine[i],
                   graphs[g]);
        CHECK(cudaMemsetAsync(mine[i], 0x44, MIB, s2));
    }
    CHECK(cudaStreamSynchronize(s2));
    for (int r = 0; r < 3; r++) {
        CHECK(cudaMemsetAsync(out1, 0, OUT, s1));
        CHECK(cudaMemsetAsync(out2, 0, OUT, s1));
        CHECK(cudaMemsetAsync(out3, 0, OUT, s1));
        CHECK(cudaGraphLaunch(exec, s1));
        CHECK(cudaStreamSynchronize(s1));
        EXPECT(first_wrong_byte(out1, 0x33, OUT) < 0, "replay %d: s1's result is wrong", r);
        EXPECT(first_wrong_byte(out2, 0x11, OUT) < 0, "replay %d: s2's first result is wrong", r);
        EXPECT(first_wrong_byte(out3, 0x22, OUT) < 0, "replay %d: s2's second result is wrong", r);
    }
    for (int i = 0; i < MINE; i++)
        EXPECT(first_wrong_byte(mine[i], 0x44, MIB) < 0, "a replay wrote into block %d", i);

    /* PyTorch frees a graph's outputs outside the capture: that is no error. */
    CHECK(cudaFreeAsync(out1, s1));
    CHECK(cudaFreeAsync(out2, s1));
    CHECK(cudaFreeAsync(out3, s1));
    CHECK(cudaGraphExecDestroy(exec));
    for (int i = 0; i < MINE; i++) CHECK(cudaFreeAsync(mine[i], s2));
    if (elsewhere) CHECK(cudaFreeAsync(elsewhere, s3));
    CHECK(cudaDeviceSynchronize());
    CHECK(cudaEventDestroy(forked));
    CHECK(cudaEventDestroy(joined));
    CHECK(cudaStreamDestroy(s1));
    CHECK(cudaStreamDestroy(s2));
    CHECK(cudaStreamDestroy(s3));
    printf("OK capture_streams\n");
    return 0;
}
