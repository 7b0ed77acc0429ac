/* A block freed while work on another stream still uses it (`record_stream`, as PyTorch's
 * `Tensor.record_stream` reaches the library): it is held from reuse until that work is done,
 * so a request meanwhile takes another cached block, and the next one after the work takes it
 * (cachealloc only: `record_stream` is its C API here, as the Python integration calls it).
 *
 * Laid out so that holding changes what a request gets: A (2 MiB) is held while a free 3 MiB
 * block B sits between live blocks; a 2 MiB request takes B whole (too little would be left to
 * split) instead of A. A replay that did not hold A would hand out A there.
 *
 * Then PyTorch's `empty_cache` (`cudaMemPoolTrimTo` on the device's default pool, as its
 * `cudaMallocAsync` backend and the C++ allocator for PyTorch call it) waits for the recorded
 * work and lets the held block go, as the native allocator's `empty_cache` does: the block stops
 * counting as active with no allocation after it (PyTorch's `test_memory_stats` reads it so).
 * Usage: held_free */
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
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

/* A stat of device 0 by PyTorch's name, from the library's C API. */
static long device_stat(const char *key) {
    static char buf[1 << 16];
    size_t (*stats)(int, char *, size_t) =
        (size_t (*)(int, char *, size_t))dlsym(RTLD_DEFAULT, "cachealloc_device_stats_json");
    EXPECT(stats != NULL && stats(0, buf, sizeof buf) <= sizeof buf, "no stats");
    char needle[128];
    snprintf(needle, sizeof needle, "\"%s\":", key);
    const char *at = strstr(buf, needle);
    EXPECT(at != NULL, "no stat %s", key);
    return strtol(at + strlen(needle), NULL, 10);
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

    /* empty_cache lets a held block go once its recorded work is done, waiting for it. */
    released = 0;
    void *d = alloc(2 * MiB, own);
    CHECK(cudaLaunchHostFunc(user, hold, NULL));
    EXPECT(record_stream((uintptr_t)d, user) == 0, "record_stream refused a block of the pool");
    CHECK(cudaStreamSynchronize(own));
    long active = device_stat("active_bytes.all.current");
    CHECK(cudaFreeAsync(d, own));
    EXPECT(device_stat("active_bytes.all.current") == active,
           "a block freed while its recorded stream's work runs stopped counting as active");
    released = 1;
    cudaMemPool_t pool;
    CHECK(cudaDeviceGetDefaultMemPool(&pool, 0));
    CHECK(cudaMemPoolTrimTo(pool, 0));
    EXPECT(device_stat("active_bytes.all.current") == active - 2 * MiB,
           "empty_cache left a held block active after its recorded work (%ld bytes active, %ld before the free)",
           device_stat("active_bytes.all.current"), active);
    void *mine[] = {while_busy, after, c};
    for (int i = 0; i < 3; i++) CHECK(cudaFreeAsync(mine[i], own));
    CHECK(cudaStreamSynchronize(own));
    CHECK(cudaStreamDestroy(user));
    CHECK(cudaStreamDestroy(own));
    printf("OK held_free\n");
    return 0;
}
