/* Shared by cachealloc's test programs. They build with gcc over fakecuda (tests/fakecuda) and
 * with `nvcc -cudart shared` on a GPU; each prints "OK <name>" and exits 0, or prints
 * "FAIL: <why>" and exits 1. */
#ifndef CACHEALLOC_TEST_COMMON_H
#define CACHEALLOC_TEST_COMMON_H
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define FAIL(...) do { printf("FAIL: "); printf(__VA_ARGS__); printf("\n"); fflush(stdout); exit(1); } while (0)
#define CHECK(call) do { cudaError_t e_ = (call); if (e_ != cudaSuccess) \
    FAIL("%s:%d: %s returned %d (%s)", __FILE__, __LINE__, #call, (int)e_, cudaGetErrorString(e_)); } while (0)
#define EXPECT(cond, ...) do { if (!(cond)) FAIL(__VA_ARGS__); } while (0)

#ifdef __cplusplus
extern "C" {
#endif
/* Enqueue on `stream` a slow write: wait about `ms` milliseconds on the device, then fill
 * `bytes` bytes at `ptr` with `value`. (fakecuda: a host function; GPU: a spinning kernel.) */
void slow_fill(void *ptr, unsigned char value, size_t bytes, int ms, cudaStream_t stream);
#ifdef __cplusplus
}
#endif

/* Copy `bytes` of device memory back and check every byte is `value`; returns the index of the
 * first wrong byte, or -1. */
static inline long first_wrong_byte(const void *dev, unsigned char value, size_t bytes) {
    unsigned char *host = (unsigned char *)malloc(bytes);
    CHECK(cudaMemcpy(host, dev, bytes, cudaMemcpyDeviceToHost));
    long bad = -1;
    for (size_t i = 0; i < bytes; i++) if (host[i] != value) { bad = (long)i; break; }
    free(host);
    return bad;
}
#endif
