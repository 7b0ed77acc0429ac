// slow_fill on a real GPU: one kernel spins for about `ms` milliseconds, then fills the bytes.
#include "common.h"

__global__ void spin_then_fill(unsigned char *ptr, unsigned char value, size_t bytes, long long cycles) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        long long start = clock64();
        while (clock64() - start < cycles) {}
    }
    __syncthreads();
    for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < bytes; i += (size_t)gridDim.x * blockDim.x)
        ptr[i] = value;
}

extern "C" void slow_fill(void *ptr, unsigned char value, size_t bytes, int ms, cudaStream_t stream) {
    int rate_khz = 0;
    cudaDeviceGetAttribute(&rate_khz, cudaDevAttrClockRate, 0);
    long long cycles = (long long)rate_khz * ms;
    spin_then_fill<<<1, 256, 0, stream>>>((unsigned char *)ptr, value, bytes, cycles);
    CHECK(cudaGetLastError());
}
