/* Per-device pools: allocations on two devices, freed while the other device is current. */
#include "common.h"

int main(void) {
    int n = 0;
    CHECK(cudaGetDeviceCount(&n));
    if (n < 2) { printf("OK multi_gpu (skipped: %d device)\n", n); return 0; }
    void *p0, *p1;
    CHECK(cudaSetDevice(0));
    CHECK(cudaMalloc(&p0, 1 << 20));
    CHECK(cudaSetDevice(1));
    CHECK(cudaMalloc(&p1, 1 << 20));
    CHECK(cudaMemset(p1, 7, 1 << 20));
    CHECK(cudaFree(p0)); /* device 1 is current */
    CHECK(cudaSetDevice(0));
    CHECK(cudaFree(p1));
    void *q;
    CHECK(cudaMalloc(&q, 1 << 20));
    EXPECT(q == p0, "device 0's block was not reused on device 0");
    CHECK(cudaFree(q));
    printf("OK multi_gpu\n");
    return 0;
}
