/* What a memory fraction given at start counts (Note [Whose memory a limit counts]): from
 * PYTORCH_CUDA_ALLOC_CONF, PyTorch's memory, the stream-ordered requests, and never the
 * synchronous API's (a library's own cudaMalloc, as PyTorch's fraction never sees cuBLAS's);
 * from CACHEALLOC_CONF, everything. Run with a fraction of 0.25 of a 100 MiB device (25 MiB).
 * Usage: fraction_scope pytorch|cachealloc */
#include "common.h"

#define MIB (1 << 20)

int main(int argc, char **argv) {
    EXPECT(argc == 2, "usage: fraction_scope pytorch|cachealloc");
    int pytorchs = strcmp(argv[1], "pytorch") == 0;
    cudaStream_t stream;
    CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    void *library = NULL, *tensor, *more;
    cudaError_t e = cudaMalloc(&library, 40 * MIB);
    if (pytorchs) {
        EXPECT(e == cudaSuccess, "PyTorch's fraction refused a library's own 40 MiB (error %d)", (int)e);
    } else {
        EXPECT(e == cudaErrorMemoryAllocation, "cachealloc's fraction of 25 MiB let 40 MiB through");
        (void)cudaGetLastError();
    }
    CHECK(cudaMallocAsync(&tensor, 20 * MIB, stream));
    EXPECT(cudaMallocAsync(&more, 10 * MIB, stream) == cudaErrorMemoryAllocation,
           "30 MiB of stream-ordered memory passed the fraction's 25 MiB");
    (void)cudaGetLastError();
    CHECK(cudaFreeAsync(tensor, stream));
    CHECK(cudaStreamSynchronize(stream));
    if (library) CHECK(cudaFree(library));
    CHECK(cudaStreamDestroy(stream));
    printf("OK fraction_scope\n");
    return 0;
}
