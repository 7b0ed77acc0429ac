/* CUDA graph capture with allocations around it, as C programs do it. The main thread captures,
 * in global mode, a graph that allocates scratch memory on the capturing stream, writes its
 * result through it and frees it. Meanwhile another thread, also in global mode, allocates,
 * writes and frees memory on its own stream with the stream-ordered calls (which a capture
 * allows); its synchronizing checks wait until no capture is under way, as a real program's
 * must. The capture must succeed (the allocator's own event and memory calls must not break it),
 * and graph replays must never write into memory handed out since.
 * Usage: graph_capture [replays] */
#include <pthread.h>
#include <unistd.h>

#include "common.h"

#define MIB (1 << 20)

/* Held while a capture is under way: the other thread's synchronizing calls take it. */
static pthread_mutex_t no_capture = PTHREAD_MUTEX_INITIALIZER;
static volatile int done = 0;

static void *other_thread(void *arg) {
    (void)arg;
    cudaStream_t s;
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    for (int round = 0; !done || round < 40; round++) {
        /* Sizes no cached block fits, for a while: new segments, during the capture too. */
        size_t bytes = (size_t)(10 + round % 24) * MIB;
        void *a = NULL;
        CHECK(cudaMallocAsync(&a, bytes, s));
        CHECK(cudaMemsetAsync(a, 0x5A, bytes, s));
        pthread_mutex_lock(&no_capture);
        void *b = NULL;
        CHECK(cudaMalloc(&b, 4096));
        CHECK(cudaStreamSynchronize(s));
        EXPECT(first_wrong_byte(a, 0x5A, bytes) < 0, "round %d: this thread's data was overwritten", round);
        CHECK(cudaFree(b));
        pthread_mutex_unlock(&no_capture);
        CHECK(cudaFreeAsync(a, s));
        usleep(200);
    }
    pthread_mutex_lock(&no_capture);
    CHECK(cudaStreamSynchronize(s));
    CHECK(cudaStreamDestroy(s));
    pthread_mutex_unlock(&no_capture);
    return NULL;
}

int main(int argc, char **argv) {
    int replays = argc > 1 ? atoi(argv[1]) : 50;
    cudaStream_t s;
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    void *out = NULL, *warm = NULL;
    CHECK(cudaMalloc(&out, 4096));
    CHECK(cudaMallocAsync(&warm, MIB, s)); /* a cached block on the capturing stream */
    CHECK(cudaFreeAsync(warm, s));
    CHECK(cudaStreamSynchronize(s));
    pthread_t t;
    pthread_create(&t, NULL, other_thread, NULL);
    usleep(5000);

    pthread_mutex_lock(&no_capture);
    cudaGraph_t graph;
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    void *scratch = NULL;
    CHECK(cudaMallocAsync(&scratch, MIB, s));
    CHECK(cudaMemsetAsync(scratch, 0x77, MIB, s));
    CHECK(cudaMemcpyAsync(out, scratch, 4096, cudaMemcpyDeviceToDevice, s));
    usleep(30000); /* the other thread allocates and frees during the capture */
    CHECK(cudaFreeAsync(scratch, s));
    CHECK(cudaStreamEndCapture(s, &graph));
    pthread_mutex_unlock(&no_capture);

    /* Memory handed out on the capturing stream after the capture (enough to take every cached
     * block of the stream): never the graph's scratch. */
    CHECK(cudaStreamSynchronize(s));
    enum { MINE = 24 };
    void *mine[MINE];
    for (int i = 0; i < MINE; i++) {
        CHECK(cudaMallocAsync(&mine[i], MIB, s));
        CHECK(cudaMemsetAsync(mine[i], 0x33, MIB, s));
    }
    cudaGraphExec_t exec;
    CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int i = 0; i < replays; i++) {
        CHECK(cudaMemsetAsync(out, 0, 4096, s));
        CHECK(cudaGraphLaunch(exec, s));
        if (i % 10 == 0) usleep(1000);
    }
    CHECK(cudaStreamSynchronize(s));
    EXPECT(first_wrong_byte(out, 0x77, 4096) < 0, "the graph's result is wrong");
    for (int i = 0; i < MINE; i++)
        EXPECT(first_wrong_byte(mine[i], 0x33, MIB) < 0, "a graph replay wrote into memory allocated after the capture (block %d at %p, out %p, byte %ld)", i, mine[i], out, first_wrong_byte(mine[i], 0x33, MIB));
    done = 1;
    pthread_join(t, NULL);
    for (int i = 0; i < MINE; i++) CHECK(cudaFreeAsync(mine[i], s));
    CHECK(cudaGraphExecDestroy(exec));
    CHECK(cudaGraphDestroy(graph));
    CHECK(cudaFree(out));
    CHECK(cudaStreamDestroy(s));
    printf("OK graph_capture\n");
    return 0;
}
