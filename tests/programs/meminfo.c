/* cudaMemGetInfo counts the pool's cached free bytes as free: after freeing, "free" is back to
 * what it was before the allocation, although the memory is still held by the pool.
 * "free" is the device's: another process allocating meanwhile moves it (on a GPU shared with
 * other work), so a round that sees any other change is tried again, up to five rounds, each
 * with a larger block than the last (the cached one cannot serve it: each round's allocation
 * is new device memory). */
#include "common.h"

int main(void) {
    size_t before = 0, after_alloc = 0, after_free = 0, total, bytes = 0;
    void *warm;
    CHECK(cudaMalloc(&warm, 512));
    CHECK(cudaFree(warm));
    for (int round = 0; round < 5; round++) {
        bytes = (size_t)(40 + 2 * round) << 20;
        CHECK(cudaMemGetInfo(&before, &total));
        void *p;
        CHECK(cudaMalloc(&p, bytes));
        CHECK(cudaMemGetInfo(&after_alloc, &total));
        CHECK(cudaFree(p));
        CHECK(cudaMemGetInfo(&after_free, &total));
        printf("before %zu after_alloc %zu after_free %zu total %zu\n", before, after_alloc,
               after_free, total);
        if (after_alloc + bytes <= before && after_free == before) break;
    }
    EXPECT(after_alloc + bytes <= before, "allocation not visible in free memory");
    EXPECT(after_free == before, "cached bytes not reported as free");
    printf("OK meminfo\n");
    return 0;
}
