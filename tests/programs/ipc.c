/* IPC handles never map the wrong bytes: a pointer inside a pooled segment is refused; a block
 * that is a whole segment (its base) gets a handle. */
#include "common.h"

int main(void) {
    void *small1, *small2, *whole;
    cudaIpcMemHandle_t h;
    CHECK(cudaMalloc(&small1, 4096));
    CHECK(cudaMalloc(&small2, 4096));
    EXPECT(cudaIpcGetMemHandle(&h, small2) == cudaErrorInvalidValue, "handle given for a pointer inside a segment");
    (void)cudaGetLastError();
    CHECK(cudaMalloc(&whole, 64 << 20));
    CHECK(cudaIpcGetMemHandle(&h, whole));
    CHECK(cudaFree(small1));
    CHECK(cudaFree(small2));
    CHECK(cudaFree(whole));
    printf("OK ipc\n");
    return 0;
}
