/* cudaDeviceReset drops the device's pools without freeing (the context is gone); allocation
 * works again afterwards. */
#include "common.h"

int main(void) {
    void *a, *b;
    CHECK(cudaMalloc(&a, 4096));
    CHECK(cudaFree(a));
    CHECK(cudaMalloc(&a, 4096));
    CHECK(cudaDeviceReset());
    CHECK(cudaMalloc(&b, 4096));
    CHECK(cudaMemset(b, 3, 4096));
    EXPECT(first_wrong_byte(b, 3, 4096) < 0, "memory after reset is broken");
    CHECK(cudaFree(b));
    printf("OK device_reset\n");
    return 0;
}
