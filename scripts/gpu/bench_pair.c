/* Latency of one cudaMalloc + cudaFree pair (or cudaMallocAsync + cudaFreeAsync on a warm pool),
 * each pair timed on its own, by size: median and 99th percentile in ns, minus the timer's own
 * cost. With "paced", the pairs come in bursts of 1000 with 2 ms pauses (a consumer of the
 * pairs' side effects, such as cachealloc's trace writer, then keeps up, and the figure is the
 * cost per call rather than the consumer's throughput).
 * Usage: bench_pair sync|async [pairs per size] [paced] */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define CK(x) do { cudaError_t e = (x); if (e) { printf("error %d at line %d\n", (int)e, __LINE__); return 1; } } while (0)

static inline uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static int cmp(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
    int async = argc > 1 && strcmp(argv[1], "async") == 0;
    int n = argc > 2 ? atoi(argv[2]) : 100000;
    int paced = argc > 3 && strcmp(argv[3], "paced") == 0;
    uint64_t *lat = malloc(sizeof *lat * (size_t)n);
    CK(cudaFree(0));
    for (int i = 0; i < n; i++) { uint64_t t0 = now_ns(); lat[i] = now_ns() - t0; }
    qsort(lat, (size_t)n, sizeof *lat, cmp);
    double timer = (double)lat[n / 2];
    cudaStream_t st = 0;
    if (async) {
        CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
        cudaMemPool_t pool;
        CK(cudaDeviceGetDefaultMemPool(&pool, 0));
        unsigned long long threshold = ~0ull;
        CK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold));
    }
    size_t sizes[] = {512, 4096, 1 << 20, 8 << 20, 64 << 20};
    for (int k = 0; k < 5; k++) {
        size_t s = sizes[k];
        for (int i = 0; i < 1000 && i < n; i++) {
            void *p;
            if (async) { CK(cudaMallocAsync(&p, s, st)); CK(cudaFreeAsync(p, st)); }
            else { CK(cudaMalloc(&p, s)); CK(cudaFree(p)); }
        }
        for (int i = 0; i < n; i++) {
            void *p;
            uint64_t t0 = now_ns();
            if (async) { CK(cudaMallocAsync(&p, s, st)); CK(cudaFreeAsync(p, st)); }
            else { CK(cudaMalloc(&p, s)); CK(cudaFree(p)); }
            lat[i] = now_ns() - t0;
            if (paced && i % 1000 == 999) usleep(2000);
        }
        if (async) CK(cudaStreamSynchronize(st));
        qsort(lat, (size_t)n, sizeof *lat, cmp);
        printf("mode=%s%s size=%zu pairs=%d p50_ns=%.0f p99_ns=%.0f timer_ns=%.0f\n", async ? "async" : "sync", paced ? "-paced" : "", s, n,
               (double)lat[n / 2] - timer, (double)lat[(size_t)n * 99 / 100] - timer, timer);
        fflush(stdout);
    }
    return 0;
}
