/* Many allocation/free pairs of varied small sizes, nothing else: a lot of trace in little
 * time. Usage: churn [pairs] */
#include "common.h"

int main(int argc, char **argv) {
    long pairs = argc > 1 ? atol(argv[1]) : 100000;
    void *keep[16] = {0};
    for (long i = 0; i < pairs; i++) {
        void *p;
        CHECK(cudaMalloc(&p, 512 + (size_t)(i % 13) * 512));
        int slot = (int)(i % 16);
        if (keep[slot]) CHECK(cudaFree(keep[slot]));
        keep[slot] = p;
    }
    for (int s = 0; s < 16; s++) if (keep[s]) CHECK(cudaFree(keep[s]));
    printf("OK churn\n");
    return 0;
}
