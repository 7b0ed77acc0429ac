/* Allocations are served from the pool: a freed block is reused, data round-trips, sizes from 0
 * to 64 MiB work. */
#include "common.h"

int main(void) {
    void *a = NULL, *b = NULL;
    CHECK(cudaMalloc(&a, 4096));
    EXPECT(a != NULL, "cudaMalloc returned NULL");
    CHECK(cudaMemset(a, 0x5c, 4096));
    EXPECT(first_wrong_byte(a, 0x5c, 4096) < 0, "memset data did not round-trip");
    CHECK(cudaFree(a));
    CHECK(cudaMalloc(&b, 4000));
    printf("reused %d\n", a == b);
    CHECK(cudaFree(b));
    size_t sizes[] = {0, 1, 512, 1 << 20, (1 << 20) + 1, 10 << 20, 64 << 20};
    void *ptrs[7];
    for (int i = 0; i < 7; i++) CHECK(cudaMalloc(&ptrs[i], sizes[i]));
    for (int i = 0; i < 7; i++) {
        if (sizes[i] == 0) continue;
        CHECK(cudaMemset(ptrs[i], i + 1, sizes[i]));
    }
    for (int i = 0; i < 7; i++) {
        if (sizes[i] == 0) continue;
        EXPECT(first_wrong_byte(ptrs[i], (unsigned char)(i + 1), sizes[i]) < 0, "block %d was overwritten", i);
    }
    for (int i = 0; i < 7; i++) CHECK(cudaFree(ptrs[i]));
    CHECK(cudaFree(NULL));
    printf("OK basic\n");
    return 0;
}
