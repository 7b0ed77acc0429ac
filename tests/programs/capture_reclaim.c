/* A block freed inside a CUDA graph capture after `record_stream` on streams that joined the
 * capture, as PyTorch's `test_graph_capture_reclaim_2_streams` and `_4_streams` free it
 * (cachealloc only: `record_stream` is its C API here, as the Python integration calls it):
 *  - with `graph_capture_record_stream_reuse:True`, the block is not reused by the freeing
 *    stream while a recorded stream's work may still run beside it in the graph (before the
 *    program joins that stream back, or only some of several), and is reused as soon as the
 *    capture has joined every recorded stream back into the freeing stream's work;
 *  - without it (the default, as PyTorch's), the block is not reused within the capture at all;
 *  - the graphs instantiate and replay.
 * Usage: capture_reclaim */
#include <dlfcn.h>
#include <stdint.h>

#include "common.h"

#define SMALL 512

typedef int (*record_stream_fn)(uint64_t address, void *stream);
typedef int (*settings_fn)(const char *settings);

static record_stream_fn record_stream;

static cudaStream_t new_stream(void) {
    cudaStream_t s;
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    return s;
}

/* `to` waits for the work enqueued so far on `from` (PyTorch's `to.wait_stream(from)`). */
static void wait_stream(cudaStream_t to, cudaStream_t from) {
    cudaEvent_t e;
    CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    CHECK(cudaEventRecord(e, from));
    CHECK(cudaStreamWaitEvent(to, e, 0));
    CHECK(cudaEventDestroy(e));
}

static void *alloc(cudaStream_t s) {
    void *p = NULL;
    CHECK(cudaMallocAsync(&p, SMALL, s));
    return p;
}

/* Work on `s` that uses `p`: a node of the graph. */
static void use(void *p, cudaStream_t s) { CHECK(cudaMemsetAsync(p, 1, SMALL, s)); }

static void replay(cudaGraph_t graph, cudaStream_t s) {
    cudaGraphExec_t exec;
    CHECK(cudaGraphInstantiateWithFlags(&exec, graph, 0));
    CHECK(cudaGraphLaunch(exec, s));
    CHECK(cudaGraphLaunch(exec, s));
    CHECK(cudaStreamSynchronize(s));
    CHECK(cudaGraphExecDestroy(exec));
    CHECK(cudaGraphDestroy(graph));
}

/* Two streams: data1 of s1, used on s2, freed on s1; s2 joined back later. Returns whether
 * the block was reused after the join (and checks it was not before). */
static int two_streams(void) {
    cudaStream_t s1 = new_stream(), s2 = new_stream();
    cudaGraph_t graph;
    CHECK(cudaStreamBeginCapture(s1, cudaStreamCaptureModeGlobal));
    void *sink = alloc(s1);
    void *data1 = alloc(s1);
    use(data1, s1);
    wait_stream(s2, s1); /* s2 joins the capture */
    void *buf2 = alloc(s2);
    use(buf2, s2); /* reads data1, in PyTorch's test */
    EXPECT(record_stream((uintptr_t)data1, s2) == 0, "record_stream refused a block of the capture");
    CHECK(cudaFreeAsync(data1, s1));
    void *before_join = alloc(s1);
    EXPECT(before_join != data1, "a block freed in the capture was reused while work on its recorded stream could run beside");
    wait_stream(s1, s2);
    use(sink, s1);
    void *after_join = alloc(s1);
    CHECK(cudaFreeAsync(before_join, s1));
    CHECK(cudaFreeAsync(after_join, s1));
    CHECK(cudaFreeAsync(sink, s1));
    CHECK(cudaFreeAsync(buf2, s2));
    CHECK(cudaStreamEndCapture(s1, &graph));
    replay(graph, s1);
    CHECK(cudaStreamDestroy(s1));
    CHECK(cudaStreamDestroy(s2));
    return after_join == data1;
}

/* Four streams: data1 used on s2, s3 and s4; s2 joined back to s1 and s4 to s3 first (no reuse
 * on s1 yet: s3's and s4's work may still run beside), then s3 to s1 (reuse). */
static void four_streams(void) {
    cudaStream_t s1 = new_stream(), s2 = new_stream(), s3 = new_stream(), s4 = new_stream();
    cudaGraph_t graph;
    CHECK(cudaStreamBeginCapture(s1, cudaStreamCaptureModeGlobal));
    void *data1 = alloc(s1);
    use(data1, s1);
    void *sink1 = alloc(s1), *sink3 = alloc(s1);
    cudaStream_t side[3] = {s2, s3, s4};
    void *bufs[3];
    for (int i = 0; i < 3; i++) {
        wait_stream(side[i], s1);
        bufs[i] = alloc(side[i]);
        use(bufs[i], side[i]);
        EXPECT(record_stream((uintptr_t)data1, side[i]) == 0, "record_stream refused a block of the capture");
    }
    CHECK(cudaFreeAsync(data1, s1));
    wait_stream(s1, s2);
    use(sink1, s1);
    wait_stream(s3, s4);
    use(sink3, s3);
    void *partial = alloc(s1);
    EXPECT(partial != data1, "a block was reused before every recorded stream was joined back");
    wait_stream(s1, s3);
    use(sink1, s1);
    void *joined = alloc(s1);
    EXPECT(joined == data1, "a block was not reused once the capture had joined every recorded stream back");
    void *mine[] = {partial, joined, sink1, sink3};
    for (int i = 0; i < 4; i++) CHECK(cudaFreeAsync(mine[i], s1));
    for (int i = 0; i < 3; i++) CHECK(cudaFreeAsync(bufs[i], side[i]));
    CHECK(cudaStreamEndCapture(s1, &graph));
    replay(graph, s1);
    for (int i = 0; i < 3; i++) CHECK(cudaStreamDestroy(side[i]));
    CHECK(cudaStreamDestroy(s1));
}

int main(void) {
    record_stream = (record_stream_fn)dlsym(RTLD_DEFAULT, "cachealloc_record_stream");
    settings_fn settings = (settings_fn)dlsym(RTLD_DEFAULT, "cachealloc_set_allocator_settings");
    if (!record_stream || !settings) {
        printf("OK capture_reclaim (not under cachealloc: nothing to check)\n");
        return 0;
    }
    void *ordinary = NULL; /* an allocation outside captures, from the ordinary pool */
    CHECK(cudaMalloc(&ordinary, SMALL));
    CHECK(cudaFree(ordinary));
    EXPECT(!two_streams(), "without graph_capture_record_stream_reuse, a block was reused within its capture");
    EXPECT(settings("graph_capture_record_stream_reuse:True") == 0, "the setting was refused");
    EXPECT(two_streams(), "a block was not reused once the capture had joined its recorded stream back");
    four_streams();
    EXPECT(settings("graph_capture_record_stream_reuse:False") == 0, "the setting was refused");
    EXPECT(!two_streams(), "with graph_capture_record_stream_reuse turned off again, a block was reused within its capture");
    printf("OK capture_reclaim\n");
    return 0;
}
