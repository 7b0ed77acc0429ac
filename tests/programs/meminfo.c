/* cudaMemGetInfo counts the pool's cached free bytes as free: after freeing, "free" is back to
 * what it was before the allocation, although the memory is still held by the pool. */
#include "common.h"

int main(void) {
    size_t before, after_alloc, after_free, total;
    void *warm;
    CHECK(cudaMalloc(&warm, 512));
    CHECK(cudaFree(warm));
    CHECK(cudaMemGetInfo(&before, &total));
    void *p;
    CHECK(cudaMalloc(&p, 40 << 20));
    CHECK(cudaMemGetInfo(&after_alloc, &total));
    CHECK(cudaFree(p));
    CHECK(cudaMemGetInfo(&after_free, &total));
    printf("before %zu after_alloc %zu after_free %zu total %zu\n", before, after_alloc, after_free, total);
    EXPECT(after_alloc + (40 << 20) <= before, "allocation not visible in free memory");
    EXPECT(after_free == before, "cached bytes not reported as free");
    printf("OK meminfo\n");
    return 0;
}
