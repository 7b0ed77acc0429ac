/* A training step's allocations as the allocator meets them in a real step: out of the caches.
 * STEPS steps of 16 stream-ordered allocations of a fixed sequence of sizes, then their 16 frees
 * (on the legacy stream, as PyTorch's), reading EVICT bytes between any two calls so that what
 * a call touches is cold. With TOUCH 0 the same loop makes no calls (the eviction alone).
 * Run by scripts/bench-cold-lines under cachegrind, over fakecuda:
 *   cold_pairs STEPS EVICT TOUCH */
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

static volatile char sink;
static char *evict_buf;
static size_t evict_bytes;

static void evict(void) {
    char s = 0;
    for (size_t i = 0; i < evict_bytes; i += 64) s += evict_buf[i];
    sink = s;
}

int main(int argc, char **argv) {
    int steps = argc > 1 ? atoi(argv[1]) : 100;
    evict_bytes = argc > 2 ? strtoull(argv[2], 0, 10) : 0;
    int touch = argc > 3 ? atoi(argv[3]) : 1;
    evict_buf = calloc(evict_bytes + 64, 1);
    static const size_t sizes[] = {65536,  262144, 1048576, 4194304, 512,   8192,
                                   2097152, 131072, 786432, 3145728, 16384, 1536,
                                   524288, 65536,  1048576, 24576};
    enum { LIVE = 16 };
    void *p[LIVE];
    void *warm;
    if (cudaMalloc(&warm, 1 << 20) != cudaSuccess) return 1;
    for (int st = 0; st < steps; st++) {
        for (int i = 0; i < LIVE; i++) {
            evict();
            if (touch && cudaMallocAsync(&p[i], sizes[i], 0) != cudaSuccess) return 1;
        }
        for (int i = 0; i < LIVE; i++) {
            evict();
            if (touch && cudaFreeAsync(p[i], 0) != cudaSuccess) return 1;
        }
    }
    cudaStreamSynchronize(0);
    printf("OK cold_pairs %d steps\n", steps);
    return 0;
}
