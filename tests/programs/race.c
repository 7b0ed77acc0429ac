/* The cross-stream reuse race: slow work on stream A writes X; X is freed; a new allocation of
 * the same size (which a naive cache hands X back for) is written on stream B. After a device
 * sync every byte must be B's value. With "late", blocks are cached before the first stream
exists (the shim then fences them all at the stream's creation).
Usage: race [blocking|nonblocking] [late] */
#include "common.h"

#define BYTES (1 << 20)

int main(int argc, char **argv) {
    unsigned flags = (argc > 1 && strcmp(argv[1], "blocking") == 0) ? cudaStreamDefault : cudaStreamNonBlocking;
    if (argc > 2 && strcmp(argv[2], "late") == 0) {
        void *early[2];
        CHECK(cudaMalloc(&early[0], BYTES));
        CHECK(cudaMalloc(&early[1], BYTES));
        CHECK(cudaMemset(early[0], 0x11, BYTES));
        CHECK(cudaFree(early[0]));
        CHECK(cudaFree(early[1]));
    }
    cudaStream_t a, b;
    CHECK(cudaStreamCreateWithFlags(&a, flags));
    CHECK(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
    int same = 0;
    for (int round = 0; round < 3; round++) {
        void *x = NULL, *y = NULL, *filler = NULL;
        CHECK(cudaMalloc(&x, BYTES));
        /* Fill the rest of x's segment, so that x is the only cached block that fits. */
        CHECK(cudaMalloc(&filler, BYTES));
        slow_fill(x, 0xAA, BYTES, 150, a);
        CHECK(cudaFree(x));
        CHECK(cudaMalloc(&y, BYTES));
        same += (x == y);
        CHECK(cudaMemsetAsync(y, 0xBB, BYTES, b));
        CHECK(cudaDeviceSynchronize());
        long bad = first_wrong_byte(y, 0xBB, BYTES);
        EXPECT(bad < 0, "round %d: byte %ld of the new allocation was overwritten by the old work (reused=%d)", round, bad, x == y);
        CHECK(cudaFree(y));
        CHECK(cudaFree(filler));
    }
    printf("reused %d\n", same);
    CHECK(cudaStreamDestroy(a));
    CHECK(cudaStreamDestroy(b));
    printf("OK race\n");
    return 0;
}
