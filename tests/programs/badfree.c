/* Bad frees are refused and change nothing: a double free and an interior pointer return
 * cudaErrorInvalidValue; a pointer the shim did not hand out (from cudaMallocAsync) is freed by
 * the runtime; everything keeps working. */
#include "common.h"

int main(void) {
    void *a = NULL, *b = NULL, *foreign = NULL;
    CHECK(cudaMalloc(&a, 8192));
    CHECK(cudaMalloc(&b, 8192));
    CHECK(cudaMemset(b, 0x42, 8192));
    EXPECT(cudaFree((char *)a + 512) == cudaErrorInvalidValue, "interior pointer was accepted");
    CHECK(cudaFree(a));
    EXPECT(cudaFree(a) == cudaErrorInvalidValue, "double free was accepted");
    EXPECT(first_wrong_byte(b, 0x42, 8192) < 0, "a neighbour was corrupted");
    CHECK(cudaMallocAsync(&foreign, 4096, 0));
    CHECK(cudaStreamSynchronize(0));
    CHECK(cudaFree(foreign));
    CHECK(cudaFree(b));
    void *c = NULL;
    CHECK(cudaMalloc(&c, 8192));
    CHECK(cudaFree(c));
    printf("OK badfree\n");
    return 0;
}
