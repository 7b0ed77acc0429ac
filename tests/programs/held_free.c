/* A block freed while work on another stream still uses it (`record_stream`, as PyTorch's
 * `Tensor.record_stream` reaches the library): it is held from reuse until that work is done,
 * so a request meanwhile takes another cached block, and the next one after the work takes it
 * (cachealloc only: `record_stream` is its C API here, as the Python integration calls it).
 *
 * Laid out so that holding changes what a request gets: A (2 MiB) is held while a free 3 MiB
 * block B sits between live blocks; a 2 MiB request takes B whole (too little would be left to
 * split) instead of A. A replay that did not hold A would hand out A there.
 * Usage: held_free */
#include <dlfcn.h>
#include <stdint.h>
#include <unistd.h>

#include "common.h"

#define MiB (1 << 20)

typedef int (*record_stream_fn)(uint64_t address, void *stream);

static volatile int released;

/* Work on the recorded stream that lasts until the program says so. */
static void hold(void *unused) {
    (void)unused;
    while (!released) usleep(100);
}

static void *alloc(size_t bytes, cudaStream_t s) {
    void *p = NULL;
    CHECK(cudaMallocAsync(&p, bytes, s));
    return p;
}

int main(void) {
    record_stream_fn record_stream =
        (record_stream_fn)dlsym(RTLD_DEFAULT, "cachealloc_record_stream");
    if (!record_stream) {
        printf("OK held_free (not under cachealloc: nothing to check)\n");
        return 0;
    }
    cudaStream_t own, user;
    CHECK(cudaStreamCreateWithFlags(&own, cudaStreamNonBlocking));
    CHECK(cudaStreamCreateWithFlags(&user, cudaStreamNonBlocking));
    void *a = alloc(2 * MiB, own);
    void *b = alloc(3 * MiB, own);
    void *c = alloc(2 * MiB, own); /* keeps B from joining the segment's free rest */
    CHECK(cudaFreeAsync(b, own));
    CHECK(cudaLaunchHostFunc(user, hold, NULL));
    EXPECT(record_stream((uintptr_t)a, user) == 0, "record_stream refused a block of the pool");
    CHECK(cudaFreeAsync(a, own));
    void *while_busy = alloc(2 * MiB, own);
    EXPECT(while_busy != a, "a block was reused while work on its recorded stream could use it");
    EXPECT(while_busy == b, "the request while A was held did not take the free 3 MiB block");
    released = 1;
    CHECK(cudaStreamSynchronize(user));
    void *after = alloc(2 * MiB, own);
    EXPECT(after == a, "a block was not reused once the work on its recorded stream was done");
    void *mine[] = {while_busy, after, c};
    for (int i = 0; i < 3; i++) CHECK(cudaFreeAsync(mine[i], own));
    CHECK(cudaStreamSynchronize(own));
    CHECK(cudaStreamDestroy(user));
    CHECK(cudaStreamDestroy(own));
    printf("OK held_free\n");
    return 0;
}
