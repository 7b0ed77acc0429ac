/* The stream-ordered API as PyTorch's cudaMallocAsync backend uses it: allocations and frees on
 * the tensor's stream, statistics from the default memory pool's attributes, empty_cache as
 * cudaMemPoolTrimTo, an impossible request failing with cudaErrorMemoryAllocation.
 * Every data check must hold with or without cachealloc; the lines printed let the test check
 * what cachealloc did (same-stream reuse, statistics). */
#include "common.h"

#define MIB (1 << 20)

static unsigned long long attr(cudaMemPool_t pool, enum cudaMemPoolAttr a) {
    unsigned long long v = 0;
    CHECK(cudaMemPoolGetAttribute(pool, a, &v));
    return v;
}

int main(void) {
    cudaStream_t s1, s2;
    CHECK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
    CHECK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
    cudaMemPool_t pool;
    CHECK(cudaDeviceGetDefaultMemPool(&pool, 0));

    /* Same stream: the freed block is the next request's, and stream order keeps it correct. */
    void *p = NULL, *q = NULL;
    CHECK(cudaMallocAsync(&p, MIB, s1));
    slow_fill(p, 0xAA, MIB, 100, s1);
    CHECK(cudaFreeAsync(p, s1));
    CHECK(cudaMallocAsync(&q, MIB, s1));
    CHECK(cudaMemsetAsync(q, 0xBB, MIB, s1));
    CHECK(cudaStreamSynchronize(s1));
    EXPECT(first_wrong_byte(q, 0xBB, MIB) < 0, "same stream: the new data was overwritten");
    printf("same_stream_reuse %d\n", p == q);
    CHECK(cudaFreeAsync(q, s1));

    /* Another stream never gets a block whose old work may still run. */
    void *x = NULL, *y = NULL;
    CHECK(cudaMallocAsync(&x, MIB, s1));
    slow_fill(x, 0xCC, MIB, 150, s1);
    CHECK(cudaFreeAsync(x, s1));
    CHECK(cudaMallocAsync(&y, MIB, s2));
    CHECK(cudaMemsetAsync(y, 0xDD, MIB, s2));
    CHECK(cudaDeviceSynchronize());
    EXPECT(first_wrong_byte(y, 0xDD, MIB) < 0, "other stream: the new data was overwritten by the old work");
    printf("cross_stream_reuse %d\n", x == y);
    CHECK(cudaFreeAsync(y, s2));

    /* Used on s2, freed on s2 (as PyTorch frees a record_stream'd block): s1's next request
     * (of a size only that block fits) must not use it before s2's work is done. */
    void *z = NULL, *w = NULL;
    CHECK(cudaMallocAsync(&z, 12 * MIB, s1));
    CHECK(cudaStreamSynchronize(s1));
    slow_fill(z, 0xEE, 12 * MIB, 150, s2);
    CHECK(cudaFreeAsync(z, s2));
    CHECK(cudaMallocAsync(&w, 12 * MIB, s1));
    CHECK(cudaMemsetAsync(w, 0x11, 12 * MIB, s1));
    CHECK(cudaDeviceSynchronize());
    EXPECT(first_wrong_byte(w, 0x11, 12 * MIB) < 0, "freed on another stream: reused before that stream's work ended");
    printf("adopted %d\n", z == w);
    CHECK(cudaFreeAsync(w, s1));
    CHECK(cudaDeviceSynchronize());

    /* Statistics, as torch.cuda.memory_allocated()/max_memory_allocated()/reset read them. */
    void *big = NULL;
    unsigned long long used0 = attr(pool, cudaMemPoolAttrUsedMemCurrent);
    CHECK(cudaMallocAsync(&big, 3 * MIB, s1));
    unsigned long long used1 = attr(pool, cudaMemPoolAttrUsedMemCurrent);
    unsigned long long reserved1 = attr(pool, cudaMemPoolAttrReservedMemCurrent);
    CHECK(cudaFreeAsync(big, s1));
    unsigned long long used2 = attr(pool, cudaMemPoolAttrUsedMemCurrent);
    unsigned long long peak2 = attr(pool, cudaMemPoolAttrUsedMemHigh);
    unsigned long long zero = 0;
    CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &zero));
    CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReservedMemHigh, &zero));
    unsigned long long peak3 = attr(pool, cudaMemPoolAttrUsedMemHigh);
    printf("used %llu %llu %llu peak %llu reset %llu reserved %llu\n", used0, used1, used2, peak2, peak3, reserved1);
    CHECK(cudaDeviceSynchronize());
    CHECK(cudaMemPoolTrimTo(pool, 0));
    printf("reserved_after_trim %llu\n", attr(pool, cudaMemPoolAttrReservedMemCurrent));

    /* An impossible request fails as the runtime's own would. */
    size_t free_bytes = 0, total = 0;
    CHECK(cudaMemGetInfo(&free_bytes, &total));
    void *huge = NULL;
    cudaError_t e = cudaMallocAsync(&huge, total * 4, s1);
    EXPECT(e == cudaErrorMemoryAllocation && huge == NULL, "impossible request: error %d", (int)e);
    (void)cudaGetLastError();
    void *after = NULL;
    CHECK(cudaMallocAsync(&after, MIB, s1));
    CHECK(cudaFreeAsync(after, s1));

    CHECK(cudaStreamSynchronize(s1));
    CHECK(cudaStreamDestroy(s1));
    CHECK(cudaStreamDestroy(s2));
    printf("OK stream_ordered\n");
    return 0;
}
