/* Load: THREADS threads × OPS operations with fixed seeds. Each thread keeps up to 16 live
 * blocks of random sizes, 1 B to 256 MiB (log-uniform: mostly small, a few huge), made with
 * cudaMalloc or with cudaMallocAsync on one of its two streams (one non-blocking, one blocking),
 * and freed the same way, sometimes on the other stream. Every block gets its own byte pattern,
 * written on its stream; at free the pattern is verified (whole block up to 1 MiB; beyond that,
 * its first, middle and last 64 KiB), so any overlap or early reuse shows as a foreign byte.
 * At the end everything is freed. Prints "allocations N" (successful, all freed) and, when
 * cachealloc is loaded, its stats JSON, for the test to compare with its own recount.
 * Usage: load [threads] [ops] [seed] */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include "common.h"

#define SLOTS 16
#define SAMPLE (64 << 10)

static int ops = 2000;
static unsigned base_seed = 1;
static long total_allocations;
static pthread_mutex_t count_lock = PTHREAD_MUTEX_INITIALIZER;

struct block {
    void *ptr;
    size_t size;
    unsigned char pattern;
    int stream; /* -1: cudaMalloc; else the index of the stream it was allocated on */
};

static unsigned next(unsigned *seed) { return (*seed = *seed * 1103515245u + 12345u) >> 8; }

/* A size from 1 B to 256 MiB, log-uniform. */
static size_t random_size(unsigned *seed) {
    unsigned bits = next(seed) % 28;  /* 2^0 .. 2^27, then up to twice that */
    size_t size = (size_t)1 << bits;
    return size + next(seed) % size;
}

static void check_range(const struct block *b, size_t offset, size_t n, unsigned tag) {
    unsigned char *host = malloc(n);
    CHECK(cudaMemcpy(host, (char *)b->ptr + offset, n, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < n; i++)
        EXPECT(host[i] == b->pattern, "thread %u: byte %zu of a %zu-byte block is %#x, not its pattern %#x",
               tag, offset + i, b->size, host[i], b->pattern);
    free(host);
}

static void verify(const struct block *b, unsigned tag, cudaStream_t stream) {
    if (stream) CHECK(cudaStreamSynchronize(stream));
    if (b->size <= (1 << 20)) {
        check_range(b, 0, b->size, tag);
        return;
    }
    check_range(b, 0, SAMPLE, tag);
    check_range(b, b->size / 2 - SAMPLE / 2, SAMPLE, tag);
    check_range(b, b->size - SAMPLE, SAMPLE, tag);
}

static void *worker(void *arg) {
    unsigned tag = (unsigned)(uintptr_t)arg;
    unsigned seed = base_seed * 2654435761u + tag * 40503u + 1;
    cudaStream_t streams[2];
    CHECK(cudaStreamCreateWithFlags(&streams[0], cudaStreamNonBlocking));
    CHECK(cudaStreamCreateWithFlags(&streams[1], cudaStreamDefault));
    struct block live[SLOTS] = {{0}};
    long allocations = 0;
    for (int i = 0; i < ops; i++) {
        struct block *b = &live[next(&seed) % SLOTS];
        if (b->ptr) {
            cudaStream_t own = b->stream < 0 ? 0 : streams[b->stream];
            verify(b, tag, own);
            if (b->stream < 0) {
                CHECK(cudaFree(b->ptr));
            } else {
                /* Usually on its own stream; sometimes on the other one (a cross-stream free). */
                int other = next(&seed) % 4 == 0;
                CHECK(cudaFreeAsync(b->ptr, streams[other ? 1 - b->stream : b->stream]));
            }
            b->ptr = NULL;
            continue;
        }
        b->size = random_size(&seed);
        b->pattern = (unsigned char)(1 + (tag * 31 + (unsigned)i) % 255);
        b->stream = (int)(next(&seed) % 3) - 1;
        cudaStream_t s = b->stream < 0 ? 0 : streams[b->stream];
        cudaError_t e = b->stream < 0 ? cudaMalloc(&b->ptr, b->size) : cudaMallocAsync(&b->ptr, b->size, s);
        if (e == cudaErrorMemoryAllocation) {  /* the device is full of other threads' blocks */
            cudaGetLastError();
            b->ptr = NULL;
            continue;
        }
        CHECK(e);
        allocations++;
        CHECK(cudaMemsetAsync(b->ptr, b->pattern, b->size, s));
        if (!s) CHECK(cudaStreamSynchronize(0));
    }
    for (int k = 0; k < SLOTS; k++) {
        struct block *b = &live[k];
        if (!b->ptr) continue;
        verify(b, tag, b->stream < 0 ? 0 : streams[b->stream]);
        CHECK(cudaFree(b->ptr));
    }
    CHECK(cudaStreamDestroy(streams[0]));
    CHECK(cudaStreamDestroy(streams[1]));
    pthread_mutex_lock(&count_lock);
    total_allocations += allocations;
    pthread_mutex_unlock(&count_lock);
    return NULL;
}

int main(int argc, char **argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 4;
    if (argc > 2) ops = atoi(argv[2]);
    if (argc > 3) base_seed = (unsigned)atoi(argv[3]);
    pthread_t t[64];
    for (int i = 0; i < threads && i < 64; i++) pthread_create(&t[i], NULL, worker, (void *)(uintptr_t)i);
    for (int i = 0; i < threads && i < 64; i++) pthread_join(t[i], NULL);
    CHECK(cudaDeviceSynchronize());
    printf("allocations %ld\n", total_allocations);
    size_t (*stats)(char *, size_t) = (size_t (*)(char *, size_t))dlsym(RTLD_DEFAULT, "cachealloc_stats_json");
    if (stats) {
        size_t n = stats(NULL, 0);
        char *json = malloc(n);
        stats(json, n);
        printf("stats %s\n", json);
        free(json);
    }
    printf("OK load\n");
    return 0;
}
