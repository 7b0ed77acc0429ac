/* Out of memory with cache release and retry. Run with a small device (fakecuda:
 * FAKECUDA_CAPACITY_MB=64) or a small limit (per_process_memory_fraction): fill it with 6 MiB
 * blocks, free everything, then ask for one block bigger than any cached one but smaller than
 * the total: the shim must release its cache and succeed. A request larger than the device must
 * fail cleanly, and allocation must work afterwards. */
#include "common.h"

int main(void) {
    size_t free_b, total;
    CHECK(cudaMemGetInfo(&free_b, &total));
    (void)free_b;
    void *blocks[64];
    int n = 0;
    while (n < 64) {
        if (cudaMalloc(&blocks[n], 6 << 20) != cudaSuccess) break;
        n++;
    }
    EXPECT(n > 2 && n < 64, "filled the device with %d blocks", n);
    for (int i = 0; i < n; i++) CHECK(cudaFree(blocks[i]));
    size_t big_bytes = (size_t)n * (6 << 20) / 10 * 8; /* 80% of what fitted */
    void *big = NULL;
    CHECK(cudaMalloc(&big, big_bytes));
    CHECK(cudaMemset(big, 1, big_bytes));
    CHECK(cudaFree(big));
    void *huge = NULL;
    cudaError_t e = cudaMalloc(&huge, total * 2);
    EXPECT(e == cudaErrorMemoryAllocation, "a request bigger than the device returned %d", (int)e);
    EXPECT(huge == NULL, "failed allocation did not set NULL");
    (void)cudaGetLastError();
    void *again = NULL;
    CHECK(cudaMalloc(&again, 4096));
    CHECK(cudaFree(again));
    printf("OK oom\n");
    return 0;
}
